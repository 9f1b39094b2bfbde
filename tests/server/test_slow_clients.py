"""Clients that stop reading, and one client's many connections, against the real uvicorn server with
hotstart's protocol (server/connections.py): real sockets on 127.0.0.1, the server in a thread of this
process, an app that streams as a generation does. Against `hotstart serve`:
tests/server/test_limits_e2e.py."""

from __future__ import annotations

import asyncio
import resource
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn import Server as UvicornServer  # (the name: this starts no process, see conftest.py)

from hotstart.errors import HotstartError
from hotstart.server.connections import (
    FILES_BESIDE_CONNECTIONS,
    ConnectionLimits,
    open_files_for,
    protocol_class,
)

WRITE_S, PER_CLIENT = 2.0, 4  # 2 s: a reader descheduled in a loaded suite (1 s cut one) is not stalled
streams: dict[str, dict] = {}  # ?id= -> what the app saw: chunks sent, when it ended, whether cancelled


async def app(scope, receive, send) -> None:
    """Streams 16 KiB chunks every 5 ms until the client goes (as a generation streams tokens); ?id= names
    the stream in STREAMS. Starlette's StreamingResponse listens for the disconnect the same way."""
    while (await receive()).get("more_body"):
        pass
    seen = streams.setdefault(scope["query_string"].decode(),
                              {"chunks": 0, "ended": None, "cancelled": False})
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})

    async def stream() -> None:
        for _ in range(100_000):
            await send({"type": "http.response.body", "body": b"x" * 16384, "more_body": True})
            seen["chunks"] += 1
            await asyncio.sleep(0.005)

    task = asyncio.ensure_future(stream())
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()
    seen["cancelled"], seen["ended"] = True, time.monotonic()


@pytest.fixture(scope="module")
def url():
    limits = ConnectionLimits(max_connections=64, write_timeout=WRITE_S, max_per_client=PER_CLIENT)
    config = uvicorn.Config(app, http=protocol_class(limits), lifespan="off", log_level="error")
    server = UvicornServer(config)
    sock = socket.socket()
    # a fixed send buffer, inherited by the accepted sockets: loopback's autotuned one grows to megabytes,
    # and the kernel wakes a writer only when a third of it is free, so a slow reader's drain reached the
    # server's transport in bursts (writes paused 0.7-0.9 s on a loaded machine; with this, <= 55 ms)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 17)
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


def non_reader(url: str, name: str) -> socket.socket:
    """A client that asks for a stream and never reads it. A small receive buffer and segment size keep the
    kernel from absorbing megabytes first (as a slow link would)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    s.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    s.sendall(b"GET /?%s HTTP/1.1\r\nHost: x\r\n\r\n" % name.encode())
    return s


def test_a_stream_nobody_reads_is_cut_at_the_write_deadline(url):
    s = non_reader(url, "stalled")
    t = time.monotonic()
    while not (streams.get("stalled") or {}).get("cancelled"):
        assert time.monotonic() - t < 10, streams.get("stalled")
        time.sleep(0.05)
    seen = streams["stalled"]
    # the app was stopped soon after its writes stopped draining: a few hundred KiB were buffered
    assert seen["ended"] - t < WRITE_S + 3 and seen["chunks"] < 200, seen
    s.settimeout(5)
    try:
        while s.recv(65536):  # what was buffered, then EOF or a reset: the server dropped it
            pass
    except ConnectionResetError:
        pass
    s.close()


def test_a_slow_reader_that_keeps_reading_is_not_cut(url):
    with httpx.stream("GET", url + "/?slow", timeout=10) as r:
        t, got, cut = time.monotonic(), 0, None
        for chunk in r.iter_raw(16384):
            got += len(chunk)
            if time.monotonic() - t > 3 * WRITE_S:
                # read now: leaving the loop closes the stream (the iterator is released), and the server's
                # thread can see that disconnect before this one reads the flag (a loaded run did)
                cut = streams["slow"]["cancelled"]
                break
            time.sleep(0.01)  # slower than the app writes: the buffer stays full, but it drains
    assert cut is False and got > 1 << 20, (cut, got)


def test_past_the_per_client_cap_a_request_gets_an_openai_429(url):
    held = [socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) for _ in range(PER_CLIENT)]
    time.sleep(0.1)
    r = httpx.get(url + "/?capped", timeout=10)
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    err = r.json()["error"]
    assert err["code"] == "too_many_connections"
    assert f"--max-connections-per-client {PER_CLIENT}" in err["message"]
    for s in held:
        s.close()
    deadline = time.monotonic() + 5
    while True:  # the closes are counted: the same client is served again
        with httpx.stream("GET", url + "/?after", timeout=10) as r:
            if r.status_code == 200 or time.monotonic() > deadline:
                break
        time.sleep(0.05)
    assert r.status_code == 200


def test_the_open_files_limit_fits_max_connections():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert open_files_for(8) == soft  # enough already: unchanged
    if hard != resource.RLIM_INFINITY:
        with pytest.raises(HotstartError, match="ulimit -Hn"):
            open_files_for(hard)  # the hard limit cannot fit it beside FILES_BESIDE_CONNECTIONS
        want = min(hard, soft + 64) - FILES_BESIDE_CONNECTIONS
        if want > soft - FILES_BESIDE_CONNECTIONS:
            assert open_files_for(want) >= want + FILES_BESIDE_CONNECTIONS  # the soft limit raised
