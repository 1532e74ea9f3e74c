"""Layer 14 -- `minipaged serve`: an OpenAI-compatible HTTP server on top of `LLMEngine`.

Modules, one job each, in the order a request meets them:

* `protocol` -- request bodies, their validation and their `SamplingParams`; the error shape;
* `preprocess` -- the body's size cap; the worker pool that parses, templates and tokenizes;
* `engine_loop` -- the thread that owns the engine, and the queues between it and the handlers;
* `responses` -- OpenAI's response, chunk, log-probability and usage shapes;
* `metrics` -- the Prometheus registry behind `GET /metrics`;
* `app` -- the FastAPI routes and Server-Sent Events;
* `launch` -- uvicorn in the foreground (with clean SIGINT / SIGTERM) or on a thread;
* `serve_command` -- the `serve` subcommand's flags.

FastAPI, uvicorn and prometheus_client come with the `serve` extra:
`pip install 'minipaged[serve]'`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use: `minipaged generate` needs none of the `serve` extra's packages.
_FACE = {
    "EngineLoop": "minipaged.server.engine_loop",
    "Server": "minipaged.server.launch",
    "ServerThread": "minipaged.server.launch",
    "build_app": "minipaged.server.app",
    "serve": "minipaged.server.launch",
}

__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    if name in _FACE:
        return getattr(importlib.import_module(_FACE[name]), name)
    raise AttributeError(f"module 'minipaged.server' has no attribute {name!r}")
