"""`minipaged serve`: an OpenAI-compatible HTTP server on top of `LLMEngine` (the top layer).

Modules, one job each, in the order a request meets them:

* `protocol` -- request bodies, their validation and their `SamplingParams`; the error shape;
* `engine_loop` -- the thread that owns the engine, and the queues between it and the handlers;
* `responses` -- OpenAI's response, chunk, log-probability and usage shapes;
* `metrics` -- the Prometheus registry behind `GET /metrics`;
* `app` -- the FastAPI routes and Server-Sent Events;
* `launch` -- uvicorn in the foreground (with clean SIGINT / SIGTERM) or on a thread;
* `cli` -- the `serve` subcommand's flags.

FastAPI, uvicorn and prometheus_client come with the `serve` extra:
`pip install 'minipaged[serve]'`.
"""
