"""Who may talk to the UI server: an ASGI middleware in front of every route.

- The Host header must name this server. A page on another site can make a browser send requests to
  127.0.0.1 through a domain it controls (DNS rebinding); such requests carry that domain as Host.
- An Origin header, when a browser sends one, must name this server too (no cross-site requests).
- Wrong logins back off: after MAX_FAILURES in a row from one client, each further try waits longer
  (429 with Retry-After), doubling up to MAX_LOCKOUT_S.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from urllib.parse import urlsplit

LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}
WILDCARDS = {"0.0.0.0", "::", ""}
MAX_FAILURES = 5
FIRST_LOCKOUT_S = 2.0
MAX_LOCKOUT_S = 300.0
ALLOWED_HOSTS_ENV = "WORKBENCH_UI_ALLOWED_HOSTS"  # extra names (a reverse proxy's, say), comma-separated


def allowed_hosts(bind: str) -> set[str]:
    """Names a browser may use to reach a server bound to `bind`."""
    names = set(LOOPBACK_NAMES) | {bind.lower()}
    if bind in WILDCARDS:  # every interface: the machine's own names and addresses
        hostname = socket.gethostname()
        names |= {hostname.lower(), socket.getfqdn().lower()}
        try:
            names |= set(socket.gethostbyname_ex(hostname)[2])
        except OSError:
            pass
    names |= {n.strip().lower() for n in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if n.strip()}
    return names - WILDCARDS


def _hostname(value: str) -> str:
    """The host part of a Host header or an origin URL, without port or IPv6 brackets."""
    host = urlsplit(value if "//" in value else f"//{value}").hostname or ""
    return host.lower()


class Guard:
    def __init__(self, app, hosts: set[str]):
        self.app = app
        self.hosts = {h.lower() for h in hosts}
        self.failures: dict[str, tuple[int, float]] = {}  # client -> (failures in a row, locked until)

    def _allowed(self, host: str) -> bool:
        if host in self.hosts:
            return True
        try:  # any loopback address is this machine
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not self._allowed(_hostname(headers.get("host", ""))):
            return await _refuse(scope, send, 403, "host not allowed")
        origin = headers.get("origin")
        if origin is not None and not self._allowed(_hostname(origin)):  # "null": a sandboxed frame, refused
            return await _refuse(scope, send, 403, "origin not allowed")
        if scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path", "").endswith("/login"):
            return await self._login(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _login(self, scope, receive, send):
        client = (scope.get("client") or ("?",))[0]
        count, until = self.failures.get(client, (0, 0.0))
        wait = until - time.monotonic()
        if wait > 0:
            return await _refuse(scope, send, 429, "too many failed logins", retry_after=wait)
        # counted as a failure before the password is checked (no await in between): parallel guesses
        # each take a place in the count, and the ones past the limit wait
        count += 1
        lockout = min(FIRST_LOCKOUT_S * 2 ** (count - MAX_FAILURES), MAX_LOCKOUT_S) if count >= MAX_FAILURES else 0
        self.failures[client] = (count, time.monotonic() + lockout)
        status = {}

        async def watch(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, receive, watch)
        if status.get("code", 500) < 400:
            self.failures.pop(client, None)


async def _refuse(scope, send, code: int, text: str, retry_after: float | None = None):
    if scope["type"] == "websocket":
        return await send({"type": "websocket.close", "code": 1008})
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": text.encode()})
