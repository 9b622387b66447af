"""Bounded connections: what uvicorn's own settings leave open, closed at the socket.

uvicorn's `limit_concurrency` answers 503 to a *request* over the limit, but a connection that never
sends one (an idle socket, a header block sent halfway) is held until the client leaves: 1030 idle
sockets against a 1024-file limit used to exhaust the process's descriptors, so `/health` timed
out for everyone and asyncio logged "socket.accept() out of system resource" thousands of times a
second. `protocol(...)` makes uvicorn's HTTP protocol with two more rules:

- a connection must finish its first request head within `head_timeout_s`, or it is closed;
- beyond `hard_limit` open connections, a new one takes the place of an old connection still
  waiting for a request head (an idle or half-sent socket, closed): a client holding hundreds of
  idle sockets and reopening each one closed (slowloris) no longer crowds out a client that sends
  its request at once (it took `/health` to 1 answer in 56). Only when every connection is busy
  with a request is the new one closed as soon as it is accepted (the 503 of `limit_concurrency`
  needs a request to answer; these never get that far). One warning in the log per
  `WARN_EVERY_S`, not one per connection;
- one client address holds at most `per_client` open connections (default: three quarters of
  `hard_limit`): past it, a new one from that address takes the place of that address's own
  oldest connection waiting for a request head, or is closed if all of them are busy; and past
  `hard_limit`, the connection closed is the oldest waiting one of the address holding the most.
  One flooding address then never takes another address's waiting connection, whatever it
  reopens; clients behind one proxy share its address (raise the limit there, or bound clients
  at the proxy);
- and the listen backlog is `BACKLOG`, since asyncio accepts up to the backlog's count of sockets
  in one loop turn before any of them reaches `connection_made`.

`RequestLimit` bounds the requests in flight (503 beyond it). uvicorn's own `limit_concurrency`
counted open connections too, so idle sockets alone made every new request a 503.
"""
from __future__ import annotations

import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("structkv.serve")
WARN_EVERY_S = 10.0
BACKLOG = 128  # the listen queue, and the most sockets asyncio accepts in one loop turn


def protocol(head_timeout_s: float, hard_limit: int, per_client: int | None = None) -> type:
    """An H11Protocol class with the rules above (pass it as uvicorn's `http=`); its settings live on
    the class it returns, one class per server."""
    per_client = per_client or max(1, 3 * hard_limit // 4)

    class BoundedH11(H11Protocol):
        closed_over_limit = 0  # new connections closed: every open one was busy with a request
        evicted = 0  # waiting connections closed to make room for a new one
        closed_per_client = 0  # connections closed (new or waiting) past their address's share
        _warned = 0.0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._made_at = time.monotonic()
            self._host = (transport.get_extra_info("peername") or ("?",))[0]
            mine = [c for c in self.connections  # closing ones stay in the set until their loss is seen
                    if getattr(c, "_host", None) == self._host and not c.transport.is_closing()]
            if len(mine) > per_client:
                victim = self._oldest_waiting(mine)
                type(self).closed_per_client += 1
                self._warn(f"one address ({self._host}) holds {len(mine)} of them, over its share of {per_client}")
                if victim is None:
                    transport.abort()
                    return
                victim.transport.abort()
            if sum(not c.transport.is_closing() for c in self.connections) > hard_limit:
                victim = self._oldest_waiting(self._largest_holder())
                if victim is None:
                    type(self).closed_over_limit += 1
                    self._warn("new ones are closed at once: every open one is busy")
                    transport.abort()
                    return
                type(self).evicted += 1
                self._warn("the oldest waiting for a request head are closed to make room")
                victim.transport.abort()
            self._head_deadline = self.loop.call_later(head_timeout_s, self._head_expired)

        def _waiting(self) -> bool:
            """Open, and no request head received yet (idle, or a head sent halfway)."""
            return self.cycle is None and self.conn.their_state is h11.IDLE and not self.transport.is_closing()

        def _largest_holder(self) -> list:
            """The open connections of the address that holds the most waiting ones."""
            by_host: dict = {}
            for c in self.connections:
                if c is not self and hasattr(c, "_made_at") and c._waiting():
                    by_host.setdefault(c._host, []).append(c)
            return max(by_host.values(), key=len, default=[])

        def _oldest_waiting(self, among=None):
            others = [c for c in (self.connections if among is None else among)
                      if c is not self and hasattr(c, "_made_at") and c._waiting()]
            return min(others, key=lambda c: c._made_at, default=None)

        def _warn(self, what: str) -> None:
            cls = type(self)
            if time.monotonic() - cls._warned > WARN_EVERY_S:
                cls._warned = time.monotonic()
                log.warning("%d connections open (limit %d): %s (%d closed, %d made room, %d past an address's "
                            "share so far)", len(self.connections), hard_limit, what, cls.closed_over_limit,
                            cls.evicted, cls.closed_per_client)

        def _head_expired(self) -> None:
            """No request head arrived in time: close (after one, uvicorn's keep-alive rules apply)."""
            if self._waiting():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            deadline = getattr(self, "_head_deadline", None)
            if deadline is not None:
                deadline.cancel()
            super().connection_lost(exc)

    return BoundedH11


class RequestLimit:
    """ASGI middleware: at most `limit` HTTP requests in flight (a streamed answer counts until it
    ends); beyond, 503 at once. Idle connections do not count (they are bounded by `protocol`)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.in_flight = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            body = (b'{"error": {"message": "the server has as many requests in flight as it takes '
                    b'(structkv serve --max-connections); retry shortly", "type": "server_error", '
                    b'"code": "server_busy"}}')
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
