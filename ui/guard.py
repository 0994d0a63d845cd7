"""Who may talk to the UI server: an ASGI middleware in front of every route.

- The Host header must name this server. A page on another site can make a browser send requests to
  127.0.0.1 through a domain it controls (DNS rebinding); such requests carry that domain as Host.
- An Origin header, when a browser sends one, must be the origin the browser reached (no cross-site requests):
  the scheme it was reached by and the Host header's name and port; or an origin listed in full in
  WORKBENCH_UI_ALLOWED_HOSTS (a reverse proxy's public address). Another port, scheme or name on the same
  machine is another site, loopback names included: any local program can bind [::1]:PORT or 127.0.0.2:PORT
  and serve a page there.
- Wrong logins back off: after MAX_FAILURES in a row from one client, each further try waits longer
  (429 with Retry-After), doubling up to MAX_LOCKOUT_S. The client is the connection's peer. X-Forwarded-For
  names it only when that peer is the reverse proxy named in WORKBENCH_UI_TRUSTED_PROXY: from anyone else the
  header holds whatever a guesser writes, a new address per guess. Every spelling of the login path that
  reaches Gradio's login route (/login/, //login, a root path before it, percent-encoded letters) is counted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import re
import time
from urllib.parse import unquote, urlsplit

from workbench.base.errors import WorkbenchError

LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}
WILDCARDS = {"0.0.0.0", "::", ""}
MAX_FAILURES = 5
FIRST_LOCKOUT_S = 2.0
MAX_LOCKOUT_S = 300.0
DEFAULT_PORTS = {"http": 80, "https": 443}
ALLOWED_HOSTS_ENV = "WORKBENCH_UI_ALLOWED_HOSTS"  # extra names or origins (a reverse proxy's), comma-separated
TRUSTED_PROXY_ENV = "WORKBENCH_UI_TRUSTED_PROXY"  # the address a reverse proxy in front of the server connects from


def _extra() -> list[str]:
    return [n.strip().lower() for n in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if n.strip()]


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
    names |= {_hostname(n) for n in _extra()}
    return names - WILDCARDS


def allowed_origins() -> set[tuple[str, str, int]]:
    """The origins listed in full (scheme://name[:port]) in WORKBENCH_UI_ALLOWED_HOSTS: a reverse proxy's."""
    return {o for o in map(_origin, (n for n in _extra() if "://" in n)) if o}


def trusted_proxy() -> str | None:
    """The reverse proxy's address from WORKBENCH_UI_TRUSTED_PROXY; a name (not an address) is refused at start:
    a connection's peer is an address, which a name would never equal."""
    value = os.environ.get(TRUSTED_PROXY_ENV, "").strip()
    return _proxy_address(value) if value else None


def _proxy_address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise WorkbenchError(f"{TRUSTED_PROXY_ENV}={value!r}: must be the IP address the reverse proxy connects "
                             "from (e.g. 127.0.0.1 or ::1), not a name") from None


@contextlib.contextmanager
def no_forwarded_headers():
    """While the server starts: uvicorn believes X-Forwarded-For and -Proto from 127.0.0.1 by default
    (FORWARDED_ALLOW_IPS) and rewrites the client and scheme before the guard sees them. It is told to believe
    no one; the guard decides."""
    previous = os.environ.get("FORWARDED_ALLOW_IPS")
    os.environ["FORWARDED_ALLOW_IPS"] = ""
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("FORWARDED_ALLOW_IPS", None)
        else:
            os.environ["FORWARDED_ALLOW_IPS"] = previous


def _hostname(value: str) -> str:
    """The host part of a Host header or an origin URL, without port or IPv6 brackets."""
    host = urlsplit(value if "//" in value else f"//{value}").hostname or ""
    return host.lower()


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin; None for "null" (a sandboxed frame) or anything malformed."""
    parts = urlsplit(url.strip().lower())
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return parts.scheme, parts.hostname, port or DEFAULT_PORTS[parts.scheme]


def is_login(path: str) -> bool:
    """Whether a request path reaches the login route, however it is spelled: percent-encoding undone, duplicate
    and trailing slashes dropped, any root path before it."""
    for _ in range(5):  # %256C -> %6C -> l
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    parts = [p for p in re.split(r"/+", path.lower()) if p]
    return bool(parts) and parts[-1] == "login"


def _address(text: str) -> str:
    try:  # one spelling per address (::1 and 0:0::1 are the same peer)
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        return text.strip().lower()


class Guard:
    def __init__(self, app, hosts: set[str], origins: set[tuple[str, str, int]] = frozenset(),
                 proxy: str | None = None):
        self.app = app
        self.hosts = {h.lower() for h in hosts}
        self.origins = set(origins)
        self.proxy = _proxy_address(proxy) if proxy else None
        self.failures: dict[str, tuple[int, float]] = {}  # client -> (failures in a row, locked until)

    def _allowed(self, host: str) -> bool:
        if host in self.hosts:
            return True
        try:  # any loopback address is this machine
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def _same_origin(self, origin: str, scope, host: str) -> bool:
        seen = _origin(origin)
        if seen is None or seen in self.origins:
            return seen is not None
        if seen[1] in {name for _, name, _ in self.origins}:  # a proxy's name: only as listed (https, say)
            return False
        scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
        # the origin the browser reached: the Host header's name and port (a port mapping may change the port
        # before the socket); another loopback name is another site, which any local program may serve
        own = _origin(f"{scheme}://{host}")
        return own is not None and (seen[0], _address(seen[1]), seen[2]) == (own[0], _address(own[1]), own[2])

    def _client(self, scope, headers: dict[str, str]) -> str:
        peer = _address((scope.get("client") or ("?",))[0])
        if self.proxy is None or peer != self.proxy:
            return peer
        # the last address is the one the proxy added; earlier ones came with the request
        forwarded = headers.get("x-forwarded-for", "").split(",")[-1]
        return _address(forwarded) if forwarded.strip() else peer

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        if not self._allowed(_hostname(host)):
            return await _refuse(scope, send, 403, "host not allowed")
        origin = headers.get("origin")
        if origin is not None and not self._same_origin(origin, scope, host):
            return await _refuse(scope, send, 403, "origin not allowed")
        if scope["type"] == "http" and scope.get("method") == "POST" and is_login(scope.get("path", "")):
            return await self._login(scope, receive, send, self._client(scope, headers))
        return await self.app(scope, receive, send)

    async def _login(self, scope, receive, send, client: str):
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
        if 200 <= status.get("code", 500) < 300:  # a login that succeeded (a redirect is no success)
            self.failures.pop(client, None)


async def _refuse(scope, send, code: int, text: str, retry_after: float | None = None):
    if scope["type"] == "websocket":
        return await send({"type": "websocket.close", "code": 1008})
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": text.encode()})
