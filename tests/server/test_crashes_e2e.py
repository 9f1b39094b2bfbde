"""A request never kills the engine; a crash loop never kills the server (engine/step_guard.py,
frontend/crashes.py, frontend/supervisor.py), against real servers: requests that raise inside the engine
(--debug-fault) fail alone while the others get their answers from the same engine process; a request that
kills the engine is refused on its third try (a poison request); six engine SIGKILLs within a minute leave
the server alive, backing off with 503 + Retry-After, then serving again."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest
from helpers.models import make_tiny
from helpers.server import Server, serving

STEP, ADD, CRASH = 49100, 49101, 49102  # token ids --debug-fault acts on; no prompt below holds them
GOOD = {f"g{i}": [100 + 37 * i + 11 * j for j in range(5 + 9 * i)] for i in range(3)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("crash-model") / "m")


@pytest.fixture(scope="module")
def faulty(model):
    yield from serving(str(model), "--served-model-name", "m", "--max-model-len", "256",
                       "--debug-fault", f"step@{STEP},add@{ADD},crash@{CRASH}")


def _engine(srv: Server, other_than: int | None = None, timeout: float = 60.0) -> psutil.Process:
    """The engine process the server's forkserver forked (one other than OTHER_THAN)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for fs in psutil.Process(srv.proc.pid).children():
            if "hotstart.forkserver" in " ".join(fs.cmdline()):
                engines = [p for p in fs.children() if p.pid != other_than and p.status() != "zombie"]
                if engines:
                    return engines[0]
        time.sleep(0.02)
    raise AssertionError(f"no engine process within {timeout} s")


def _complete(srv: Server, prompt: list[int], stream: bool = False) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)


def _healthy(srv: Server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(srv.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, srv.output[-2000:]
        time.sleep(0.05)


def test_requests_that_raise_in_the_engine_fail_alone(faulty):
    engine = _engine(faulty)
    alone = {rid: _complete(faulty, ids).json()["choices"][0]["text"] for rid, ids in GOOD.items()}
    bad = {"step": ([5, STEP, 6, 7], False), "step-stream": ([8, 9, STEP], True), "add": ([ADD, 10], False)}
    got: dict[str, httpx.Response] = {}

    def send(name: str, prompt: list[int], stream: bool = False) -> None:
        got[name] = _complete(faulty, prompt, stream)

    threads = [threading.Thread(target=send, args=(rid, ids)) for rid, ids in GOOD.items()]
    threads += [threading.Thread(target=send, args=(name, *args)) for name, args in bad.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for rid, text in alone.items():  # the same engine, the same answers as alone
        assert got[rid].status_code == 200 and got[rid].json()["choices"][0]["text"] == text
    for name, where in (("step", "in the forward"), ("add", "while it was added")):
        err = got[name].json()["error"]
        assert got[name].status_code == 500 and err["code"] == "engine_error", got[name].text
        assert where in err["message"] and "--debug-fault" in err["message"], err
    events = [json.loads(x[6:]) for x in got["step-stream"].text.splitlines() if x.startswith("data: {")]
    assert got["step-stream"].status_code == 200 and events[-1]["error"]["code"] == "engine_error", events
    assert got["step-stream"].text.rstrip().endswith("data: [DONE]")
    assert _engine(faulty).pid == engine.pid and engine.is_running()  # never restarted
    assert "Traceback" not in faulty.output


def test_a_poison_request_is_refused_on_its_third_try(faulty):
    poison = [11, 12, CRASH, 13]
    for attempt in (1, 2):  # each try kills the engine (SIGKILL inside its step), in flight at the death
        r = _complete(faulty, poison)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", (attempt, r.text)
        _healthy(faulty)
    for stream in (False, True):
        r = _complete(faulty, poison, stream=stream)
        err = r.json()["error"]
        assert r.status_code == 422 and err["code"] == "poison_request", r.text
        assert "2 engine deaths in a row" in err["message"] and "fingerprint" in err["message"], err
    assert _complete(faulty, GOOD["g1"]).status_code == 200  # everything else is served
    deaths = [line for line in faulty.lines if "engine death" in line]
    assert len(deaths) == 2 and all("1 requests in flight: cmpl-" in line for line in deaths), deaths
    assert "poison" in deaths[-1]


def test_six_engine_kills_within_a_minute_back_off_then_serve_again(model):
    srv = Server(str(model), "--served-model-name", "m", "--max-model-len", "256",
                 "--engine-restart-backoff", "3")
    try:
        killed = None
        for _ in range(6):
            engine = _engine(srv, other_than=killed)
            killed = engine.pid
            engine.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "backoff" not in (health := httpx.get(srv.url + "/health", timeout=5)).text:
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.output[-3000:]
            time.sleep(0.05)
        assert health.status_code == 503 and 1 <= int(health.headers["Retry-After"]) <= 3, health.headers
        assert httpx.get(srv.url + "/live", timeout=5).status_code == 200
        refused = _complete(srv, GOOD["g0"])
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_not_ready"
        assert "backoff" in refused.json()["error"]["message"] and "Retry-After" in refused.headers
        _healthy(srv)  # the backoff over, the engine starts again
        assert _complete(srv, GOOD["g0"]).status_code == 200
        assert srv.proc.poll() is None and "hotstart: error" not in srv.output
        assert "engine crash loop: backing off" in srv.output
        _engine(srv).send_signal(signal.SIGKILL)  # within a minute of the backoff: the loop goes on, longer
        deadline = time.monotonic() + 30
        while "backoff" not in (health := httpx.get(srv.url + "/health", timeout=5)).text:
            assert time.monotonic() < deadline, srv.output[-3000:]
            time.sleep(0.05)
        assert 4 <= int(health.headers["Retry-After"]) <= 6, health.headers
        srv.stop()  # SIGTERM while backing off: a clean exit, nothing left
    finally:
        if srv.proc.poll() is None:
            srv.kill()
