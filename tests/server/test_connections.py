"""Slow and idle clients against the real uvicorn server with hotstart's protocol (server/connections.py):
real sockets on 127.0.0.1, the server in a thread of this process. The e2e test against `hotstart serve`
is tests/server/test_pressure_e2e.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn import Server as UvicornServer  # (the name: this starts no process, see conftest.py)

from hotstart.server.connections import OVER_CAP_HEADER_S, ConnectionLimits, protocol_class

HEADER_S, BODY_S, CAP = 0.5, 0.5, 8


async def app(scope, receive, send) -> None:
    """Reads the whole body, sleeps ?sleep= seconds (a long generation), answers its length."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    qs = scope["query_string"].decode()
    if qs.startswith("sleep="):
        await asyncio.sleep(float(qs[6:]))
    out = json.dumps({"bytes": len(body)}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def url():
    # every socket here is one client's: the per-client cap is tests/server/test_slow_clients.py's
    limits = ConnectionLimits(max_connections=CAP, header_timeout=HEADER_S, body_timeout=BODY_S,
                              max_per_client=0)
    config = uvicorn.Config(app, http=protocol_class(limits), lifespan="off", log_level="error")
    server = UvicornServer(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield "http://127.0.0.1:%d" % sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def connect(url: str, send: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    if send:
        s.sendall(send)
    return s


def closed_after(s: socket.socket) -> float:
    """Seconds until the server closes S (reads whatever it sends first)."""
    t = time.monotonic()
    while s.recv(4096):
        pass
    s.close()
    return time.monotonic() - t


def test_idle_partial_and_dribbling_connections_are_closed_at_the_header_deadline(url):
    idle = connect(url)
    partial = connect(url, b"POST / HTTP/1.1\r\nHost: x\r\n")
    dribble = connect(url, b"P")
    t = time.monotonic()
    for ch in b"OST / HTTP/1.1\r\nHost: x":  # a byte every 0.1 s: the deadline does not move
        try:
            dribble.sendall(bytes([ch]))
        except OSError:
            break
        time.sleep(0.1)
    assert time.monotonic() - t < HEADER_S + 2
    for s in (idle, partial):
        assert closed_after(s) < HEADER_S + 1
    closed_after(dribble)
    assert httpx.post(url, content=b"abc").json() == {"bytes": 3}  # the server is fine


def test_a_body_that_stops_coming_is_cut_at_the_body_deadline(url):
    slow = connect(url, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    took = closed_after(slow)
    assert BODY_S - 0.2 < took < BODY_S + 1


def test_a_long_response_and_keep_alive_are_not_cut(url):
    with httpx.Client(base_url=url) as c:
        assert c.post("/?sleep=1.2", content=b"x" * 1000).json() == {"bytes": 1000}  # > both deadlines
        time.sleep(0.2)
        assert c.post("/", content=b"y").json() == {"bytes": 1}  # the same connection, kept alive


def test_past_the_cap_a_request_gets_an_openai_503_and_idle_sockets_are_shed(url):
    idle = [connect(url) for _ in range(CAP + 4)]
    time.sleep(0.1)
    r = httpx.post(url, content=b"abc")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "too_many_connections" and err["type"] == "server_error"
    assert f"--max-connections {CAP}" in err["message"]
    for s in idle:
        assert closed_after(s) < max(HEADER_S, OVER_CAP_HEADER_S) + 1
    assert httpx.post(url, content=b"abc").json() == {"bytes": 3}
