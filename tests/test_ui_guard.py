"""The UI server answers only requests that name it, and wrong logins back off (no browser needed)."""

import pytest

pytest.importorskip("gradio")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from ui.guard import MAX_FAILURES, Guard, allowed_hosts  # noqa: E402


def app():
    async def ok(request):
        return PlainTextResponse("ok")

    async def login(request):
        form = await request.form()
        return PlainTextResponse("in" if form.get("password") == "right" else "no",
                                 status_code=200 if form.get("password") == "right" else 400)

    inner = Starlette(routes=[Route("/gradio_api/call/x", ok, methods=["GET", "POST"]),
                              Route("/login", login, methods=["POST"])])
    return TestClient(Guard(inner, allowed_hosts("127.0.0.1")), base_url="http://127.0.0.1:7860")


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
