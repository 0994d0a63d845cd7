"""The UI server answers only requests that name it, and wrong logins back off (no browser needed)."""

import pytest

pytest.importorskip("gradio")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.routing import Route, WebSocketRoute  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from starlette.websockets import WebSocketDisconnect  # noqa: E402

from ui.guard import MAX_FAILURES, Guard, allowed_hosts, allowed_origins  # noqa: E402


def app():
    async def ok(request):
        return PlainTextResponse("ok")

    async def login(request):
        form = await request.form()
        return PlainTextResponse("in" if form.get("password") == "right" else "no",
                                 status_code=200 if form.get("password") == "right" else 400)

    async def ws(websocket):
        await websocket.accept()
        await websocket.send_text("ok")
        await websocket.close()

    inner = Starlette(routes=[Route("/gradio_api/call/x", ok, methods=["GET", "POST"]),
                              Route("/login", login, methods=["POST"]), WebSocketRoute("/ws", ws)])
    return TestClient(Guard(inner, allowed_hosts("127.0.0.1"), allowed_origins()), base_url="http://127.0.0.1:7860")


def test_dns_rebinding_is_refused_by_the_host_header():
    client = app()
    assert client.post("/gradio_api/call/x").status_code == 200
    assert client.post("/gradio_api/call/x", headers={"host": "evil.example"}).status_code == 403
    assert client.post("/gradio_api/call/x", headers={"host": "localhost:7860"}).status_code == 200
    assert client.get("/gradio_api/call/x", headers={"host": "[::1]:7860"}).status_code == 200


def test_cross_site_origins_are_refused():
    client = app()
    assert client.post("/gradio_api/call/x", headers={"origin": "http://evil.example"}).status_code == 403
    assert client.post("/gradio_api/call/x", headers={"origin": "http://127.0.0.1:7860"}).status_code == 200


def test_wrong_logins_back_off_and_a_right_one_resets():
    client = app()
    for _ in range(MAX_FAILURES - 1):
        assert client.post("/login", data={"password": "wrong"}).status_code == 400
    assert client.post("/login", data={"password": "wrong"}).status_code == 400  # the fifth: locks
    locked = client.post("/login", data={"password": "right"})
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1


def test_a_wildcard_bind_allows_the_machines_own_names(monkeypatch):
    import socket

    monkeypatch.setenv("WORKBENCH_UI_ALLOWED_HOSTS", "proxy.example")
    names = allowed_hosts("0.0.0.0")
    assert {"127.0.0.1", "localhost", socket.gethostname().lower(), "proxy.example"} <= names
    assert "0.0.0.0" not in names


def test_a_sandboxed_frames_null_origin_is_refused():
    assert app().post("/gradio_api/call/x", headers={"origin": "null"}).status_code == 403


def test_parallel_guesses_count_each_one():
    """Guesses in flight at once each take a place in the count (no lost updates)."""
    import asyncio

    from ui.guard import Guard

    async def slow_wrong(scope, receive, send):
        await asyncio.sleep(0.05)
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})

    guard = Guard(slow_wrong, {"127.0.0.1"})

    async def one():
        codes = []

        async def send(message):
            if message["type"] == "http.response.start":
                codes.append(message["status"])

        scope = {"type": "http", "method": "POST", "path": "/login", "client": ("test-client", 1),
                 "headers": [(b"host", b"127.0.0.1")]}
        await guard(scope, None, send)
        return codes[0]

    async def burst():
        return await asyncio.gather(*(one() for _ in range(40)))

    codes = asyncio.run(burst())
    assert codes.count(400) == MAX_FAILURES and codes.count(429) == 40 - MAX_FAILURES


# -- found by a third attack (issue 34) ------------------------------------------------------------------------


def test_another_port_or_scheme_on_this_machine_is_another_origin():
    client = app()  # reached as http://127.0.0.1:7860
    for origin in ("http://127.0.0.1:1", "https://127.0.0.1:7860", "http://127.0.0.1", "http://localhost:8080",
                   "http://127.0.0.1:7860.evil.example", "http://127.0.0.1:notaport", "ftp://127.0.0.1:7860"):
        assert client.get("/gradio_api/call/x", headers={"origin": origin}).status_code == 403, origin
    for origin in ("http://127.0.0.1:7860", "HTTP://127.0.0.1:7860"):
        assert client.get("/gradio_api/call/x", headers={"origin": origin}).status_code == 200, origin
    assert client.get("/gradio_api/call/x", headers={"origin": "HTTP://LOCALHOST:7860",
                                                      "host": "localhost:7860"}).status_code == 200
    with client.websocket_connect("ws://127.0.0.1:7860/ws", headers={"origin": "http://127.0.0.1:7860"}) as ws:
        assert ws.receive_text() == "ok"
    with pytest.raises(WebSocketDisconnect):
        with client.websocket_connect("ws://127.0.0.1:7860/ws", headers={"origin": "http://127.0.0.1:1"}) as ws:
            ws.receive_text()


def test_a_reverse_proxys_origin_is_allowed_only_as_configured(monkeypatch):
    monkeypatch.setenv("WORKBENCH_UI_ALLOWED_HOSTS", "https://wb.example, https://alt.example:8443, plain.example")
    client = app()
    ok = {"https://wb.example": "wb.example", "https://wb.example:443": "wb.example",
          "https://alt.example:8443": "alt.example", "http://plain.example:7860": "plain.example:7860"}
    for origin, host in ok.items():
        assert client.get("/gradio_api/call/x", headers={"origin": origin, "host": host}).status_code == 200, origin
    for origin, host in {"http://wb.example": "wb.example", "https://wb.example:8443": "wb.example",
                         "https://alt.example": "alt.example", "https://plain.example": "plain.example"}.items():
        assert client.get("/gradio_api/call/x", headers={"origin": origin, "host": host}).status_code == 403, origin


def login_through(guard, peer: str, password: str, forwarded: str | None = None, path: str = "/login") -> int:
    """The status a POST /login from `peer` gets through `guard` (an ASGI call, as uvicorn makes it)."""
    import asyncio

    codes = []

    async def send(message):
        if message["type"] == "http.response.start":
            codes.append(message["status"])

    async def receive():
        return {"type": "http.request", "body": f"password={password}".encode(), "more_body": False}

    headers = [(b"host", b"127.0.0.1:7860"), (b"content-type", b"application/x-www-form-urlencoded")]
    if forwarded is not None:
        headers.append((b"x-forwarded-for", forwarded.encode()))
    scope = {"type": "http", "method": "POST", "path": path, "scheme": "http", "client": (peer, 5000),
             "server": ("127.0.0.1", 7860), "headers": headers, "query_string": b"", "root_path": ""}
    asyncio.run(guard(scope, receive, send))
    return codes[0]


def test_forwarded_for_is_believed_only_from_the_configured_proxy():
    inner = app().app.app  # the Starlette app behind the guard
    guard = Guard(inner, {"127.0.0.1"}, proxy="10.0.0.1")
    # from the proxy: each client (the address the proxy appended, last) has its own count
    for i in range(MAX_FAILURES):
        assert login_through(guard, "10.0.0.1", "wrong", f"6.6.6.{i}, 1.1.1.1") == 400
    assert login_through(guard, "10.0.0.1", "right", "1.1.1.1") == 429
    assert login_through(guard, "10.0.0.1", "right", "2.2.2.2") == 200
    # from anyone else the header is words: a new value per guess changes nothing
    for i in range(MAX_FAILURES):
        assert login_through(guard, "10.0.0.9", "wrong", f"3.3.3.{i}") == 400
    assert login_through(guard, "10.0.0.9", "right", "4.4.4.4") == 429
    assert login_through(Guard(inner, {"127.0.0.1"}), "10.0.0.1", "wrong", "5.5.5.5") == 400


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path, monkeypatch):
    """The UI as `workbench ui` serves it (Gradio on uvicorn), with a login, on a free local port."""
    from ui.app import launch

    monkeypatch.delenv("WORKBENCH_UI_TRUSTED_PROXY", raising=False)
    demo = launch("127.0.0.1", free_port(), ("ann", "secret"), tmp_path, block=False)
    yield f"http://127.0.0.1:{demo.server_port}"
    demo.close()


@pytest.mark.slow
def test_the_served_ui_locks_out_a_guesser_whatever_forwarded_for_says(served):
    import httpx

    with httpx.Client(base_url=served) as client:
        codes = [client.post("/login", data={"username": "ann", "password": f"wrong{i}"},
                             headers={"x-forwarded-for": f"203.0.113.{i}"}).status_code for i in range(12)]
        assert codes[:MAX_FAILURES] == [400] * MAX_FAILURES and set(codes[MAX_FAILURES:]) == {429}, codes
        right = client.post("/login", data={"username": "ann", "password": "secret"},
                            headers={"x-forwarded-for": "198.51.100.7"})
        assert right.status_code == 429


@pytest.mark.slow
def test_the_served_ui_refuses_other_local_origins_with_the_session_cookie(served):
    import httpx

    port = served.rsplit(":", 1)[1]
    with httpx.Client(base_url=served) as client:
        assert client.post("/login", data={"username": "ann", "password": "secret"}).status_code == 200
        assert client.cookies  # the session
        assert client.get("/config", headers={"origin": served}).status_code == 200
        for origin in ("http://127.0.0.1:1", f"https://127.0.0.1:{port}", f"http://localhost:{port}",
                       f"http://[::1]:{port}", f"http://127.0.0.2:{port}"):
            assert client.get("/config", headers={"origin": origin}).status_code == 403, origin
        # a forwarded scheme from a direct peer changes nothing either
        spoofed = {"origin": f"https://127.0.0.1:{port}", "x-forwarded-proto": "https"}
        assert client.get("/config", headers=spoofed).status_code == 403


# -- found by a fourth review ----------------------------------------------------------------------------------


def any_login(codes: list[int]):
    """An ASGI app answering every POST as Gradio's login does (it serves /login and /login/): 400 for a wrong
    password, 200 for the right one; the paths it was called with are kept in `codes`."""
    async def inner(scope, receive, send):
        body = (await receive())["body"]
        code = 200 if body == b"password=right" else 400
        codes.append(scope["path"])
        await send({"type": "http.response.start", "status": code, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    return inner


@pytest.mark.parametrize("path", ["/login/", "//login", "/login//", "/app/login/", "/%6Cogin", "/login%2F",
                                  "/LOGIN", "/%2Flogin"])
def test_every_spelling_of_the_login_path_is_counted(path):
    seen = []
    guard = Guard(any_login(seen), {"127.0.0.1"})
    for _ in range(MAX_FAILURES):
        assert login_through(guard, "10.0.0.9", "wrong", path=path) == 400
    assert login_through(guard, "10.0.0.9", "right", path=path) == 429
    assert login_through(guard, "10.0.0.9", "right", path="/login") == 429


def test_a_redirect_from_the_login_route_does_not_reset_the_count():
    async def redirect(scope, receive, send):
        await send({"type": "http.response.start", "status": 307, "headers": [(b"location", b"/login")]})
        await send({"type": "http.response.body", "body": b""})

    guard = Guard(redirect, {"127.0.0.1"})
    for _ in range(MAX_FAILURES):
        assert login_through(guard, "10.0.0.9", "wrong") == 307
    assert login_through(guard, "10.0.0.9", "wrong") == 429


def test_another_loopback_name_on_the_same_port_is_another_origin():
    """Any program can bind [::1]:PORT or 127.0.0.2:PORT and serve a page there: the Origin's host must be the
    Host header's."""
    client = app()  # reached as http://127.0.0.1:7860
    for origin in ("http://[::1]:7860", "http://127.0.0.2:7860", "http://localhost:7860", "http://127.1:7860"):
        assert client.get("/gradio_api/call/x", headers={"origin": origin}).status_code == 403, origin
    for host, origin in {"[::1]:7860": "http://[::1]:7860", "[::1]:7860 ": "http://[0:0::1]:7860",
                         "localhost:7860": "http://localhost:7860"}.items():
        assert client.get("/gradio_api/call/x", headers={"origin": origin, "host": host.strip()}).status_code == 200
    assert client.get("/gradio_api/call/x", headers={"origin": "http://localhost:7860",
                                                      "host": "[::1]:7860"}).status_code == 403


def test_a_trusted_proxy_must_be_an_address(monkeypatch):
    from ui.guard import trusted_proxy
    from workbench.base.errors import WorkbenchError

    monkeypatch.setenv("WORKBENCH_UI_TRUSTED_PROXY", "localhost")
    with pytest.raises(WorkbenchError, match="WORKBENCH_UI_TRUSTED_PROXY.*address"):
        trusted_proxy()
    with pytest.raises(WorkbenchError, match="address"):
        Guard(app().app.app, {"127.0.0.1"}, proxy="proxy.lan")
    monkeypatch.setenv("WORKBENCH_UI_TRUSTED_PROXY", " 0:0::1 ")
    assert trusted_proxy() == "::1"
    monkeypatch.delenv("WORKBENCH_UI_TRUSTED_PROXY")
    assert trusted_proxy() is None
