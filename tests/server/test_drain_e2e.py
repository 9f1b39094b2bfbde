"""SIGTERM on a real `hotstart serve` with 3 streams in flight: every stream ends normally ([DONE], no
error), new requests get 503 at once, the process tree exits soon after the last stream ends."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from helpers.server import Server, Stream, deploy_metric_names

pytestmark = pytest.mark.e2e
BODY = {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "ignore_eos": True, "stream": True,
        "temperature": 0, "messages": [{"role": "user", "content": "Tell me a long story about a cat."}]}


def test_sigterm_drains_streams_refuses_new_requests_and_exits(default_model_dir):
    s = Server("--max-model-len", "512", "--shutdown-timeout", "120")
    live = httpx.get(s.url + "/metrics").text  # every metric name deploy/ uses is served
    names = {x.split("{")[0].split(" ")[0] for x in live.splitlines() if x and not x.startswith("#")}
    assert deploy_metric_names() <= names, deploy_metric_names() - names
    streams = [Stream(s.url, BODY) for _ in range(3)]
    for t in streams:
        t.start()
    for t in streams:
        assert t.started.wait(60), "a stream did not start"
    assert all(t.is_alive() for t in streams), "the streams ended before SIGTERM: make them longer"
    stop: dict = {}
    t_sig = time.perf_counter()
    stopper = threading.Thread(target=lambda: stop.update(s=s.stop(timeout=150)), daemon=True)
    stopper.start()
    refused_after = health_after = None
    with httpx.Client(timeout=5) as c:
        while refused_after is None or health_after is None:
            if health_after is None and c.get(s.url + "/health").status_code == 503:
                health_after = time.perf_counter() - t_sig
            if refused_after is None:
                r = c.post(s.url + "/v1/chat/completions", json={**BODY, "stream": False, "max_tokens": 1})
                if r.status_code == 503:
                    assert r.headers["retry-after"] and r.json()["error"]["code"] == "server_draining"
                    refused_after = time.perf_counter() - t_sig
            assert time.perf_counter() - t_sig < 5, "no 503 within 5 s of SIGTERM"
        assert c.get(s.url + "/live").status_code == 200
    for t in streams:
        t.join(120)
    stopper.join(120)
    for t in streams:
        assert t.error is None, t.error
        assert t.lines[-1] == "data: [DONE]", t.lines[-3:]
        events = t.events()
        assert not any("error" in e for e in events), events[-2:]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    last_stream = max(t.ended for t in streams)
    exit_after = t_sig + stop["s"] - last_stream
    print(f"\nSIGTERM: /health 503 after {health_after * 1e3:.0f} ms, new request 503 after "
          f"{refused_after * 1e3:.0f} ms; streams ended {last_stream - t_sig:.2f} s after it; everything "
          f"exited {exit_after:.2f} s after the last stream")
    assert refused_after < 1.0 and health_after < 1.0  # the goal is 100 ms: a loaded CI box gets slack
    assert exit_after < 5.0
    assert s.proc.returncode == 0


def test_second_sigterm_ends_streams_with_an_error_event(default_model_dir):
    s = Server("--max-model-len", "512", "--shutdown-timeout", "60")
    t = Stream(s.url, BODY)
    t.start()
    assert t.started.wait(60)
    stop: dict = {}
    stopper = threading.Thread(target=lambda: stop.update(s=s.stop(timeout=30)), daemon=True)
    stopper.start()
    time.sleep(0.3)
    s.proc.send_signal(15)  # the second: end what is left now
    t.join(30)
    stopper.join(60)
    assert t.lines[-1] == "data: [DONE]", t.lines[-3:]
    errors = [json.loads(x[6:]) for x in t.lines[:-1] if '"error"' in x]
    assert errors and errors[0]["error"]["code"] == "engine_dead", t.lines[-3:]
    assert stop["s"] < 10


def test_a_sigterm_swallowed_during_startup_still_stops_the_server(default_model_dir, tmp_path):
    """SIGTERM while the server still imports can land in an importlib lock callback, where Python only
    prints its SystemExit ("Exception ignored in") and startup carries on (seen once in the suite: the
    server then served on). The handler also records the signal, and the event loop acts on it when it
    takes the signals over: here the record is set before `serve` starts, as a swallowed one leaves it."""
    import os
    import subprocess
    import sys

    import psutil

    code = ("import sys, signal, hotstart.procs as p; p._exit_signal = signal.SIGTERM; "
            "from hotstart.cli import main; "
            f"sys.exit(main(['serve', {str(default_model_dir)!r}, '--port', '0', '--max-model-len', '512']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, cwd=tmp_path)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "signal 15 arrived while starting: stopping" in out, out[-3000:]
    def in_its_session(p: psutil.Process) -> bool:
        try:
            return os.getsid(p.pid) == proc.pid
        except OSError:
            return False

    assert not [p for p in psutil.process_iter() if in_its_session(p)]  # forkserver, engine: gone too
