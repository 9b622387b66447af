"""Run the server: in the foreground (`structkv serve`) or on a loopback thread (tests, the load test)."""
from __future__ import annotations

import os
import socket
import threading
import time

try:
    import uvicorn
except ImportError:  # the serve extra is missing: `structkv serve` says so before anything here is used
    uvicorn = None


class Server(uvicorn.Server if uvicorn is not None else object):
    """uvicorn's server, except that a second SIGINT or SIGTERM during the graceful shutdown exits
    at once with status 128 + signal: the user asked twice, so nothing more is waited for (uvicorn
    would go on waiting and then raise the signals again at the interpreter's exit while the model
    thread may still be inside a torch call, which ended in SIGABRT)."""

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            os._exit(128 + sig)
        super().handle_exit(sig, frame)


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   max_connections: int = 64, grace_s: float = 120.0, head_timeout_s: float = 10.0,
                   per_client: int | None = None):
    # Graceful shutdown: on SIGINT/SIGTERM uvicorn stops accepting, lets running requests finish
    # (up to `grace_s`), cancels the rest (their jobs stop at the next token), then the app's
    # lifespan closes the engine, dropping what is still queued. Beyond `max_connections`
    # requests in flight new ones get 503 at once (`connections.RequestLimit`; idle sockets do not
    # count); idle keep-alive connections close after 5 s; a connection without a request head
    # after `head_timeout_s` closes, and beyond twice `max_connections` open ones a new connection
    # takes the place of the oldest one still waiting for its head; one client address holds at most
    # `per_client` open connections (default 1.5 x `max_connections`) (`connections.protocol`).
    # asyncio accepts up to `backlog` sockets per loop turn before any of them is seen (and closed):
    # uvicorn's 2048 let a flood take every descriptor in one turn, so it is BACKLOG here.
    from .connections import BACKLOG, RequestLimit, protocol

    return uvicorn.Config(RequestLimit(app, max_connections), host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=grace_s, lifespan="on", timeout_keep_alive=5,
                          http=protocol(head_timeout_s, 2 * max_connections, per_client), backlog=BACKLOG)


class Background:
    """A server on 127.0.0.1 in a daemon thread, on a free port; `url`, `stop()`; a context manager."""

    def __init__(self, app, *, log_level: str = "warning", start_timeout: float = 30.0, grace_s: float = 120.0,
                 **limits):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = Server(uvicorn_config(app, log_level=log_level, grace_s=grace_s, **limits))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
