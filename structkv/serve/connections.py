"""Bounded connections: what uvicorn's own settings leave open, closed at the socket.

uvicorn's `limit_concurrency` answers 503 to a *request* over the limit, but a connection that never
sends one (an idle socket, a header block sent halfway) is held until the client leaves: 1030 idle
sockets against a 1024-file limit used to exhaust the process's descriptors, so `/health` timed
out for everyone and asyncio logged "socket.accept() out of system resource" thousands of times a
second. `protocol(...)` makes uvicorn's HTTP protocol with two more rules:

- a connection must finish its first request head within `head_timeout_s`, or it is closed;
- connections beyond `hard_limit` are closed as soon as they are accepted (the 503 of
  `limit_concurrency` needs a request to answer; these never get that far), with one warning in
  the log per `WARN_EVERY_S`, not one per connection;
- and the listen backlog is `BACKLOG`, since asyncio accepts up to the backlog's count of sockets
  in one loop turn before any of them reaches `connection_made`.
"""
from __future__ import annotations

import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("structkv.serve")
WARN_EVERY_S = 10.0
BACKLOG = 128  # the listen queue, and the most sockets asyncio accepts in one loop turn


def protocol(head_timeout_s: float, hard_limit: int) -> type:
    """An H11Protocol class with the rules above (pass it as uvicorn's `http=`); its settings live on
    the class it returns, one class per server."""

    class BoundedH11(H11Protocol):
        closed_over_limit = 0
        _warned = 0.0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            cls = type(self)
            if len(self.connections) > hard_limit:
                cls.closed_over_limit += 1
                if time.monotonic() - cls._warned > WARN_EVERY_S:
                    cls._warned = time.monotonic()
                    log.warning("%d connections open, over the limit of %d: new ones are closed at once "
                                "(%d so far)", len(self.connections), hard_limit, cls.closed_over_limit)
                transport.abort()
                return
            self._head_deadline = self.loop.call_later(head_timeout_s, self._head_expired)

        def _head_expired(self) -> None:
            """No request head arrived in time: close (after one, uvicorn's keep-alive rules apply)."""
            if self.cycle is None and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            deadline = getattr(self, "_head_deadline", None)
            if deadline is not None:
                deadline.cancel()
            super().connection_lost(exc)

    return BoundedH11
