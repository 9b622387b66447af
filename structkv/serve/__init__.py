"""`structkv serve`: an OpenAI-compatible HTTP server that compresses a long context once and answers
many questions from the compressed cache (docs/serve.md).

Pieces: `protocol` (requests and errors as OpenAI's API has them), `engine` (the model, a worker
thread and the queue), `context_cache` (compressed contexts, LRU by bytes), `text` (token deltas
and stop strings), `metrics` (Prometheus text), `app` (the routes), `launch` (uvicorn).
Needs the `serve` extra: pip install "structkv[serve]".
"""
from __future__ import annotations


def app_for(model, settings, *, max_request_bytes: int = 16 << 20, api_key: str | None = None, allowed_hosts=None,
            allowed_origins=(), body_timeout_s: float = 30.0):
    """An ASGI app serving `model` with `settings` (an `engine.Settings`); `api_key`,
    `allowed_hosts` (None: any), `allowed_origins`: who may call it (`structkv.serve.guard`)."""
    from .app import make_app
    from .engine import Engine

    return make_app(Engine(model, settings), max_request_bytes=max_request_bytes, api_key=api_key,
                    allowed_hosts=allowed_hosts, allowed_origins=allowed_origins, body_timeout_s=body_timeout_s)
