"""A real `hotstart serve` under pressure: 150 idle and half-open sockets do not starve a real request, past
--max-connections a request gets OpenAI's 503 with Retry-After, the idle sockets are shed at the header
deadline; an engine killed by SIGKILL is replaced and the death explained; below --min-free-memory new
requests get 503 with Retry-After while the probes answer."""

from __future__ import annotations

import signal
import socket
import time

import httpx
import psutil
import pytest
from helpers.server import Server

pytestmark = pytest.mark.e2e
CHAT = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


def idle_sockets(url: str, n: int) -> list[socket.socket]:
    """N connections that send nothing, or half a request header (a client that stalled or vanished)."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    for i in range(n):
        s = socket.create_connection((host, int(port)), timeout=30)
        if i % 2:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        out.append(s)
    return out


def chat(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=120)


def test_idle_connections_the_cap_and_an_engine_sigkill(default_model_dir):
    s = Server(
        *"--served-model-name m --max-model-len 256 --max-connections 200".split(),
        *"--header-timeout 5 --body-timeout 2".split(),
        *"--max-connections-per-client 0".split(),  # every socket is this one client's: the cap in all here
    )
    try:
        idle = idle_sockets(s.url, 150)
        t = time.monotonic()
        assert httpx.get(s.url + "/v1/models").status_code == 200
        assert time.monotonic() - t < 3.0  # (a chat's time is the CPU's: not timed on a shared machine)
        idle += idle_sockets(s.url, 60)  # 210 open: past the cap
        r = chat(s.url)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "too_many_connections"
        for sock in idle:  # every idle socket is closed by the server by its header deadline
            while sock.recv(4096):
                pass
            sock.close()
        assert chat(s.url).status_code == 200
        [slow_body] = idle_sockets(s.url, 1)
        slow_body.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 500\r\n\r\n{"model": '
        )
        t = time.monotonic()
        while slow_body.recv(4096):  # cut at --body-timeout, quietly (a 499 in /metrics, no error line)
            pass
        assert time.monotonic() - t < 2 + 2
        assert "internal error" not in s.output, s.output[-2000:]

        [engine] = [e for fs in psutil.Process(s.proc.pid).children() for e in fs.children()]
        engine.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "engine replaced in" not in s.output:
            assert time.monotonic() < deadline, s.output[-3000:]
            time.sleep(0.1)
        died = [line for line in s.output.splitlines() if "engine process exited (code -9)" in line]
        assert len(died) == 1 and "OOM killer" in died[0], s.output[-3000:]
        assert chat(s.url).status_code == 200
    finally:
        s.stop()


def test_below_min_free_memory_new_requests_get_503_and_the_probes_answer(default_model_dir):
    s = Server(
        "--served-model-name", "m", "--max-model-len", "256", "--min-free-memory", "100%"
    )  # MemAvailable is always below MemTotal
    try:
        t = time.monotonic()
        r = chat(s.url)
        assert time.monotonic() - t >= 1.0  # it waited for memory first
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        err = r.json()["error"]
        assert err["code"] == "insufficient_memory" and "--min-free-memory" in err["message"]
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 200
        metrics = httpx.get(s.url + "/metrics").text  # the refusal is counted by the gate
        assert 'hotstart_http_requests_total{endpoint="/v1/chat/completions",status="503"} 1.0' in metrics
    finally:
        s.stop()
