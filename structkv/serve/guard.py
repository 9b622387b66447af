"""Who may call the server: an API key, the Host and Origin a request names, and its content type.

A local model server is reachable from every web page open in the user's browser: a page can post
to http://127.0.0.1:8000 (a "simple" request: `text/plain`, no preflight), and through DNS
rebinding (a hostile name that resolves to 127.0.0.1) read the answers. `Guard` wraps the app
and refuses, before any route runs, with OpenAI error objects:
- a POST whose body is not declared `application/json` (415): browsers cannot send that
  cross-origin without a CORS preflight, which this server never grants;
- a Host header outside `allowed_hosts` (400; by default, when bound to loopback, only
  localhost, 127.0.0.1 and [::1]): a rebound name never reaches a route;
- an Origin header (sent by browsers) other than the server's own or one in `allowed_origins`
  (403);
- with `api_key`, a request without `Authorization: Bearer <key>` (401; `/health` stays open for
  load balancers), compared in constant time.
"""
from __future__ import annotations

import hmac
import json
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health",)


def check_api_key(key: str | None) -> None:
    """A key a client can send: printable ASCII without spaces (a header carries ASCII; any other
    key could never match, so every request would be refused)."""
    if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
        raise ValueError("the API key must be printable ASCII without spaces (an HTTP header carries no other "
                         "characters, so this key could never match); choose another --api-key")


def loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


class Guard:
    """ASGI middleware around the server's app (see the module docstring). `allowed_hosts`: host
    names (no port) a request may name, None for any; `refused(path, status)` records each refusal
    (the server's metrics)."""

    def __init__(self, app, *, api_key: str | None = None, allowed_hosts=None, allowed_origins=(), refused=None):
        check_api_key(api_key)
        self.app, self.api_key = app, api_key
        self.allowed_hosts = None if allowed_hosts is None else {h.lower().strip("[]") for h in allowed_hosts}
        self.allowed_origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.refused = refused or (lambda path, status: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        problem = self.check(scope["method"], scope["path"], headers)
        if problem is None:
            return await self.app(scope, receive, send)
        status, message, code, extra = problem
        self.refused(scope["path"], status)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *extra]})
        await send({"type": "http.response.body", "body": body})

    def check(self, method: str, path: str, headers: dict) -> tuple | None:
        """(status, message, code, extra headers) of the first rule the request breaks, or None."""
        host = _host_name(headers.get("host", ""))
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return (400, f"the Host header {_short(headers.get('host', ''))!r} is not one this server answers to "
                    f"({', '.join(sorted(self.allowed_hosts))}); add it with structkv serve --allowed-host",
                    "invalid_host", [])
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, headers.get("host", "")):
            return (403, f"cross-origin requests are refused (Origin {_short(origin)!r}); allow a web app's origin "
                    "with structkv serve --allow-origin", "origin_not_allowed", [])
        if self.api_key is not None and path not in OPEN_PATHS:
            scheme, _, given = headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
                return (401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' (the key "
                        "given to structkv serve --api-key)", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        if method == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return (415, f"the request body must be sent as 'Content-Type: application/json', got "
                        f"{_short(kind or 'none')!r}", "unsupported_media_type", [])
        return None

    def _origin_ok(self, origin: str, host_header: str) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        return bool(parts.netloc) and parts.netloc == host_header.lower()  # the server's own pages


def _host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8000" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _short(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[:limit] + "..."
