"""Engine liveness (hotstart/heartbeat.py, frontend/supervisor.py): an engine that stops without dying
(SIGSTOP) fails its streams, is SIGKILLed and replaced; a long step beats on and trips nothing, unless
it passes --engine-step-timeout; a forkserver that stops answering is replaced. Real servers on the
default model; the frozen processes are stopped with SIGSTOP, the real thing."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from contextlib import contextmanager

import httpx
import psutil
import torch
from helpers.server import Server

from hotstart import heartbeat
from hotstart.procs import alive

QUESTION = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 16,
}
# token ids: one prefill step of 1,900 tokens (under the 2,048-token step budget): 2-5 s on the 2-core dev
# machines (900 tokens took 2 s in float32 on an AVX2 host but 1.4 s in bfloat16 on an AVX512-BF16 one)
LONG_PROMPT = [1000 + i % 5000 for i in range(1900)]


def _forkserver(s: Server) -> psutil.Process:
    return next(p for p in psutil.Process(s.proc.pid).children() if "forkserver" in " ".join(p.cmdline()))


@contextmanager
def _continued_afterwards(*procs: psutil.Process):
    """Afterwards SIGCONT whatever of PROCS (stopped by the test) still lives, though none should: a
    stopped leftover would never run its own exit."""
    try:
        yield
    finally:
        for p in procs:
            if p.is_running():
                p.resume()


def _stream_until_error(s: Server, freeze) -> tuple[list[str], float]:
    """A long stream; FREEZE() after its first chunk; (the remaining data lines, seconds from the freeze
    to the end of the stream)."""
    with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
            **QUESTION, "stream": True, "max_tokens": 440, "ignore_eos": True}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        assert "chatcmpl" in next(line for line in lines if line.startswith("data:"))
        freeze()
        t = time.monotonic()
        rest = [line for line in lines if line.startswith("data:")]
    return rest, time.monotonic() - t


def _answers_again(s: Server, since: float, within: float) -> tuple[float, float]:
    """Seconds from SINCE until /health said ready again, and until a new request was answered correctly
    (within WITHIN)."""
    ready = None
    while (took := time.monotonic() - since) < within:
        if ready is None:
            if httpx.get(s.url + "/health").status_code != 200:
                time.sleep(0.05)
                continue
            ready = took
        r = httpx.post(s.url + "/v1/chat/completions", json=QUESTION, timeout=within - took)
        if r.status_code == 503 and r.json()["error"]["code"] == "engine_dead":
            ready = None  # sent to the frozen engine before its silence was noticed: failed with it
            continue
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        answered = time.monotonic() - since
        assert answered < within, (ready, answered)
        return ready, answered
    raise AssertionError(f"not ready again within {within} s\n{s.output[-3000:]}")


def _gone(pid: int, within: float = 5.0) -> bool:
    """PID exited and was reaped (a zombie left by its parent counts as there) within WITHIN seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_stopped_engine_fails_its_stream_and_is_replaced_at_the_defaults(default_model_dir):
    """The defaults: the stream's error event within 20 s of the SIGSTOP, an answer again within 40 s."""
    s = Server("--max-model-len", "512")
    try:
        engine = _forkserver(s).children()[0]
        with _continued_afterwards(engine):
            rest, took = _stream_until_error(s, engine.suspend)
            frozen_at = time.monotonic() - took
            assert any('"engine_dead"' in line for line in rest) and rest[-1] == "data: [DONE]", rest[-3:]
            error = json.loads(next(line for line in rest if '"engine_dead"' in line).removeprefix("data: "))
            assert f"engine pid {engine.pid} sent no heartbeat for" in error["error"]["message"], error
            assert took < 20, took
            ready, again = _answers_again(s, frozen_at, 40)
            assert _gone(engine.pid), "the frozen engine is still there"
        line = next(x for x in s.lines if "sent no heartbeat" in x).strip()
        assert re.fullmatch(rf"hotstart: engine pid {engine.pid} sent no heartbeat for [5-9]\.\d s: killed, "
                            r"restarting", line), line
        print(f"SIGSTOP -> stream error {took:.2f} s, ready again {ready:.2f} s, answered {again:.2f} s")
    finally:
        s.stop()
    assert "Traceback" not in s.output, s.output[-3000:]


def _watch_beats(file_of, stop: threading.Event, seen: list) -> None:
    """Read the engine's heartbeat file (FILE_OF() finds it) until STOP: (time, count, step seconds)."""
    while not stop.is_set():
        if (record := heartbeat.read(file_of())) is not None:
            seen.append((time.monotonic(), *record))
        time.sleep(0.02)


def _long_prefill(s: Server) -> tuple[httpx.Response, list]:
    """One request whose prefill is one long step, and the engine's beats meanwhile."""
    engine = _forkserver(s).children()[0]
    file = next(f.path for f in engine.open_files() if os.path.basename(f.path).startswith("hb-"))
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_watch_beats, args=(lambda: file, stop, seen))
    watcher.start()
    try:
        r = httpx.post(s.url + "/v1/completions", timeout=120, json={
            "model": QUESTION["model"], "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0})
    finally:
        stop.set()
        watcher.join()
    return r, seen


def test_a_long_step_beats_on_and_trips_nothing(default_model_dir):
    """A 1,900-token prefill is one step several heartbeat timeouts long: the engine's beats go on
    during it (its heartbeat file says so), nothing is killed, the request succeeds."""
    timeout = 0.5
    s = Server("--max-model-len", "2048", "--engine-heartbeat-timeout", str(timeout))
    try:
        engine = _forkserver(s).children()[0]
        r, seen = _long_prefill(s)
        assert r.status_code == 200, r.text
        longest = max(step for _, _, step in seen)
        assert longest > 3 * timeout, f"the step took {longest:.2f} s: too short to show anything"
        during = [(t, count) for t, count, step in seen if step > 0]
        gaps = [b[0] - a[0] for a, b in zip(during, during[1:]) if b[1] == a[1]]
        assert during[-1][1] - during[0][1] >= longest / heartbeat.period(timeout) / 2, during  # it beat on
        assert sum(gaps) < longest, gaps
        assert alive(engine.pid)
        assert "no heartbeat" not in s.output, s.output[-3000:]
        print(f"one step of {longest:.2f} s under a {timeout} s heartbeat timeout: "
              f"{during[-1][1] - during[0][1]} beats during it")
    finally:
        s.stop()


def test_a_step_longer_than_the_step_timeout_is_killed(default_model_dir):
    """The opt-in step timeout: a prefill step past it reads as a hang; the engine is killed, replaced."""
    s = Server("--max-model-len", "2048", "--engine-step-timeout", "0.5")
    try:
        engine = _forkserver(s).children()[0]
        r, _ = _long_prefill(s)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert "in one step for" in r.json()["error"]["message"]
        assert _gone(engine.pid)
        assert any(f"engine pid {engine.pid} has been in one step for" in x and x.strip().endswith(
            "(--engine-step-timeout 0.5): killed, restarting") for x in s.lines), s.output[-3000:]
        deadline = time.monotonic() + 40  # replaced (a request now would be killed too: its steps pass 0.5 s
        while httpx.get(s.url + "/health").status_code != 200:  # on this loaded machine)
            assert time.monotonic() < deadline, s.output[-3000:]
            time.sleep(0.05)
    finally:
        s.stop()


def test_a_stopped_forkserver_and_engine_are_replaced(default_model_dir):
    """SIGSTOP the forkserver and its engine: the engine is killed for its silence, the forkserver for
    forking no replacement, and a fresh forkserver serves again."""
    s = Server("--max-model-len", "512", "--engine-heartbeat-timeout", "1")
    try:
        forkserver = _forkserver(s)
        engine = forkserver.children()[0]
        with _continued_afterwards(forkserver, engine):
            t = time.monotonic()
            forkserver.suspend()
            engine.suspend()
            ready, again = _answers_again(s, t, 90)  # 1 + 10 s, then a fresh forkserver imports torch
            assert _gone(forkserver.pid) and _gone(engine.pid)
        assert _forkserver(s).pid != forkserver.pid
        assert any(f"the forkserver (pid {forkserver.pid}) forked no engine within 10 s" in x
                   for x in s.lines), s.output[-3000:]
        print(f"forkserver + engine stopped -> ready again {ready:.2f} s, answered again {again:.2f} s")
    finally:
        s.stop()
    assert "Traceback" not in s.output, s.output[-3000:]


def test_the_heart_beats_while_the_main_thread_computes(tmp_path):
    """In this process: the beating thread writes while torch computes on the main thread, and reports
    how long the step has run."""
    file = heartbeat.path(f"ipc://{tmp_path}/in-1", 0)
    heart = heartbeat.Heart(file, 0.02)
    a = torch.randn(512, 512)
    heart.step_began()
    t = time.monotonic()
    first = heartbeat.read(file)
    while time.monotonic() - t < 0.5:
        a = torch.tanh(a @ a)
    count, step_s = heartbeat.read(file)
    heart.step_ended()
    assert count - first[0] >= 10 and step_s > 0.3, (first, count, step_s)
    time.sleep(0.1)
    assert heartbeat.read(file)[1] == 0.0
