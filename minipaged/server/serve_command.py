"""`minipaged serve`: its flags and its run function (`minipaged.__main__` registers them).

The engine flags are the other subcommands' (the caller passes its `add_engine_flags`, so the
two stay one list); the server's own are `--host`, `--port`, `--served-model-name`,
`--shutdown-timeout` and `--max-request-body-bytes`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'minipaged[serve]'"


def add_serve_parser(
    subparsers: Any, add_engine_flags: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"
    )
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument(
        "--served-model-name",
        help="the name clients pass as `model` (default: the model file's or folder's name)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests may run on after SIGINT/SIGTERM before being aborted",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=int,
        help="larger request bodies are refused with HTTP 413 (default: 4 MiB)",
    )
    add_engine_flags(serve)
    return serve


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        return Path(args.model).stem if Path(args.model).is_file() else Path(args.model).name
    from minipaged.models.checkpoint.loader import DEFAULT_MODEL_FILE

    return Path(DEFAULT_MODEL_FILE).stem


def run_serve(args: argparse.Namespace, load_engine: Callable[[], Any]) -> None:
    """Check the server's flags, load the engine (`load_engine()`, the command line's own
    loader, so the engine flags mean what they mean elsewhere), serve it until SIGINT /
    SIGTERM, then stop cleanly."""
    if not 0 < args.port < 65536:
        raise ValueError(f"port must be in 1..65535, got {args.port}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    body_limit = args.max_request_body_bytes
    if body_limit is not None and body_limit < 1:
        raise ValueError(f"max-request-body-bytes must be >= 1, got {body_limit}")
    try:
        from minipaged.server.app import build_app
        from minipaged.server.launch import serve
        from minipaged.server.preprocess import DEFAULT_MAX_REQUEST_BODY_BYTES
    except ModuleNotFoundError as exc:
        raise ValueError(f"`minipaged serve` needs {exc.name}: {INSTALL_HINT}") from None
    body_limit = DEFAULT_MAX_REQUEST_BODY_BYTES if body_limit is None else body_limit
    app = build_app(load_engine(), served_model_name(args), body_limit)
    serve(app, args.host, args.port, args.shutdown_timeout)
