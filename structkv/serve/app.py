"""The HTTP side: OpenAI routes on Starlette, served by uvicorn.

Every error leaves as an OpenAI error object with its 4xx/5xx code; nothing a client sends can
make a route raise past `_answer`, so the server keeps serving. Streams are server-sent events
(`data: {json}` per chunk, `data: [DONE]` at the end); a client that goes away cancels its job.
"""
from __future__ import annotations

import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine
from .guard import Guard
from .protocol import APIError, chunk, parse, response

POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


def make_app(engine: Engine, max_request_bytes: int = 16 << 20, *, api_key: str | None = None,
             allowed_hosts=None, allowed_origins=(), body_timeout_s: float = 30.0) -> Starlette:
    """The server's ASGI app around a running `Engine` (closed when the app shuts down), behind
    `Guard` (API key, Host, Origin, content type: structkv.serve.guard). A request body not
    received whole within `body_timeout_s` is answered 408 and its connection freed (a client that
    sends half a body and waits holds nothing for long)."""

    limits = (max_request_bytes, body_timeout_s)

    async def chat(request):
        return await _answer(engine, request, "chat", "/v1/chat/completions", limits)

    async def completions(request):
        return await _answer(engine, request, "completion", "/v1/completions", limits)

    async def models(request):
        engine.metrics.request("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [
            {"id": engine.settings.model_name, "object": "model", "created": 0, "owned_by": "structkv"}]})

    async def health(request):
        return JSONResponse({"status": "ok", "queued": engine.queued()})

    async def metrics(request):
        cache = engine.cache
        gauges = {"context_cache_bytes": ("bytes held by cached compressed contexts", cache.nbytes),
                  "context_cache_entries": ("compressed contexts cached", len(cache)),
                  "context_cache_evictions": ("contexts dropped to stay under --cache-bytes", cache.evictions),
                  "context_cache_oversized": ("contexts not cached: alone over --cache-bytes", cache.oversized),
                  **{f"context_cache_{k}": (f"cached contexts' {k.replace('_', ' ')} (hot sets and archives apart)", v)
                     for k, v in cache.split().items()},
                  "queue_depth": ("requests waiting or running", engine.queued())}
        return PlainTextResponse(engine.metrics.text(gauges), media_type="text/plain; version=0.0.4")

    async def shutdown():
        await run_in_threadpool(engine.close)

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    guard = Middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                       refused=engine.metrics.request)
    app = Starlette(routes=routes, lifespan=_lifespan(shutdown), middleware=[guard],
                    exception_handlers={404: _not_found, 405: _not_allowed, ClientDisconnect: _client_gone,
                                        500: _internal})
    app.state.engine = engine
    return app


def _lifespan(shutdown):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        await shutdown()  # after uvicorn has let running requests finish

    return lifespan


async def _answer(engine: Engine, request: HTTPRequest, kind: str, endpoint: str, limits: tuple) -> Response:
    t0 = time.perf_counter()
    try:
        req = parse(await _json(request, *limits), kind)
        job = await run_in_threadpool(engine.prepare, req, asyncio.get_running_loop())
        engine.submit(job)
    except APIError as e:
        engine.metrics.request(endpoint, e.status)
        return _error(e)
    if req.stream:
        engine.metrics.request(endpoint, 200)
        return StreamingResponse(_events(engine, job, t0), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        kind_, payload = await _result(job, request)
    except asyncio.CancelledError:  # the server's grace period ended: the job stops at its next token
        job.cancel()
        engine.metrics.request(endpoint, 503)
        return _error(_shutdown())
    if kind_ == "done":
        engine.metrics.request(endpoint, 200)
        engine.metrics.observe("request_seconds", time.perf_counter() - t0)
        return JSONResponse(response(req, payload["text"], payload["finish_reason"], payload["usage"],
                                     payload["stats"]))
    if kind_ == "error":
        error = payload
    elif job.cancelled.is_set():  # its client left
        error = APIError(499, "the client went away", code="cancelled")
    else:  # the engine closed under it (shutdown), before this handler's own cancellation
        error = _shutdown()
    engine.metrics.request(endpoint, error.status)
    return _error(error)


async def _json(request: HTTPRequest, limit: int, timeout_s: float):
    try:
        async with asyncio.timeout(timeout_s):
            body = await _body(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (structkv serve --body-timeout)",
                       code="request_timeout", headers={"connection": "close"}) from None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and integers over Python's 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply to be a request", code="invalid_json") from None


async def _body(request: HTTPRequest, limit: int) -> bytearray:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body ({int(declared)} bytes) is over this server's limit of {limit} bytes "
                       "(structkv serve --max-request-bytes)", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"the request body is over this server's limit of {limit} bytes "
                           "(structkv serve --max-request-bytes)", code="request_too_large")
    return body


async def _result(job, request: HTTPRequest):
    """The job's last event ("done", "error" or "cancelled"), cancelling it if the client leaves."""
    while True:
        try:
            kind, payload = await asyncio.wait_for(job.events.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                return "cancelled", None
            continue
        if kind != "delta":
            return kind, payload


async def _events(engine: Engine, job, t0: float):
    req = job.req
    try:
        if req.kind == "chat":
            yield _sse(chunk(req, role=True))
        while True:
            try:
                kind, payload = await job.events.get()
            except asyncio.CancelledError:  # the grace period ended: tell the client, then stop
                job.cancel()
                kind, payload = "error", _shutdown()
            if kind == "delta":
                yield _sse(chunk(req, payload))
                continue
            if kind == "done":
                yield _sse(chunk(req, None, payload["finish_reason"], stats=payload["stats"]))
                if req.include_usage:
                    yield _sse(chunk(req, usage_=payload["usage"], choices=False))
                engine.metrics.observe("request_seconds", time.perf_counter() - t0)
            elif kind == "error":
                yield _sse(payload.body())
            yield "data: [DONE]\n\n"
            return
    finally:
        job.cancel()  # no-op once done; frees the model when the client went away mid-stream


def _shutdown() -> APIError:
    return APIError(503, "the server is shutting down and its grace period (structkv serve --shutdown-grace) ended "
                    "before this answer; retry on another server", type="server_error", code="server_shutdown")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _not_found(request, exc):
    path = request.url.path if len(request.url.path) <= 80 else request.url.path[:80] + "..."  # never echo 100 KB
    return _error(APIError(404, f"no route {path}; this server has /v1/chat/completions, "
                           "/v1/completions, /v1/models, /health, /metrics", code="not_found"))


async def _not_allowed(request, exc):
    return _error(APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"))


async def _client_gone(request, exc):
    """The client left before its body arrived: nobody to answer and nothing wrong with the server,
    so no traceback (a client leaving mid-body on purpose could fill the disk with them); counted
    as nginx's 499 (client closed request) in /metrics."""
    request.app.state.engine.metrics.request(request.url.path, 499)
    return Response(status_code=400, headers={"connection": "close"})


async def _internal(request, exc):
    return _error(APIError(500, "internal error; the server logged it and keeps serving", type="server_error",
                           code="internal_error"))
