"""The fast-start system end to end: light CLI, no imports off the main thread, no torch in the API
process, clean SIGTERM in every startup phase, the startup timeline, and engine replacement."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from helpers.procs import tagged
from helpers.server import Server

from hotstart.procs import descendants

QUESTION = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 16,
}


def _timed(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "hotstart", *args], capture_output=True, text=True, timeout=30
    )
    return time.perf_counter() - t, out


@pytest.mark.parametrize("args,code,needle", [
    (["--help"], 0, "serve"),
    (["serve", "--help"], 0, "--no-prespawn"),
    (["serve", "--port", "abc"], 2, "argument --port: expected an integer"),
    (["serve", "--device", "tpu"], 2, "invalid choice"),
    (["nonsense"], 2, "invalid choice"),
])
def test_cli_is_light(args, code, needle, tmp_path):
    audit = tmp_path / "audit.json"
    times = []
    for _ in range(3):
        took, out = _timed(*args)
        times.append(took)
    assert out.returncode == code
    assert needle in out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert statistics.median(times) < 0.3, times  # includes the interpreter's own start
    tag = f"cli-light-{os.getpid()}-{time.monotonic_ns()}"  # inherited by anything the command starts
    env = {**os.environ, "HOTSTART_AUDIT_IMPORTS": str(audit), "HOTSTART_TEST_TAG": tag}
    subprocess.run([sys.executable, "-m", "hotstart", *args], capture_output=True, timeout=30, env=env)
    report = json.loads(audit.read_text())
    assert not report["torch_imported"]
    assert not tagged(tag)


def test_api_process_imports_only_on_main_thread_and_never_torch(default_model_dir, tmp_path):
    audit = tmp_path / "audit.json"
    s = Server("--max-model-len", "512", env={"HOTSTART_AUDIT_IMPORTS": str(audit)})
    r = httpx.post(s.url + "/v1/chat/completions", json=QUESTION, timeout=60)
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    s.stop()
    report = json.loads(audit.read_text())
    assert report["off_main_thread"] == [], report["off_main_thread"]
    assert report["torch_imported"] is False


def test_startup_timeline_trace_and_png(default_model_dir, tmp_path):
    trace = tmp_path / "trace.json"
    s = Server("--max-model-len", "512", "--startup-trace", str(trace))
    httpx.post(s.url + "/v1/chat/completions", json=QUESTION, timeout=60)
    startup = httpx.get(s.url + "/startup").json()
    s.stop()
    phases = {p["name"]: p for p in startup["phases"]}
    order = [
        "forkserver launched",
        "model resolved",
        "engine config sent",
        "forkserver up (torch + engine imported)",
        "engine forked",
        "engine config",
        "weights loaded",
        "KV cache allocated",
        "engine ready",
        "first request served",
    ]
    for name in order + ["prefetch started", "web stack imported", "tokenizer loaded", "socket bound"]:
        assert name in phases, (name, list(phases))
    ends = [phases[n]["end_s"] for n in order]  # starts overlap by design (processes run in parallel)
    assert ends == sorted(ends), list(zip(order, ends))
    assert {p["process"] for p in startup["phases"]} >= {"api", "forkserver", "engine"}
    assert startup["prefetch"]["bytes_total"] > 0
    # phases are logged as they happen, one line each
    for name in ("model resolved", "weights loaded", "engine ready"):
        assert any(name in line for line in s.lines), s.output
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("ph") == "X" and e.get("name") == "weights loaded" for e in events)
    png = tmp_path / "startup.png"
    out = subprocess.run([sys.executable, "-m", "hotstart", "timeline", str(trace), "-o", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.8, 1.5, 2.5])
def test_sigterm_in_every_startup_phase_leaves_nothing(default_model_dir, delay):
    proc = subprocess.Popen(
        [sys.executable, "-m", "hotstart", "serve", "--port", "0", "--max-model-len", "512"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    time.sleep(delay)
    family = [proc.pid, *descendants(proc.pid)]
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = proc.stdout.read().decode()
    procs = [psutil.Process(p) for p in family[1:] if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=max(0.1, 3 - (time.monotonic() - t)))
    assert not alive, f"left after SIGTERM at {delay}s: {[p.pid for p in alive]}"
    assert time.monotonic() - t < 3.5
    assert "Traceback" not in out, out


def test_killed_engine_fails_streams_and_is_replaced(default_model_dir):
    s = Server("--max-model-len", "512")
    try:
        forkserver = [
            p for p in psutil.Process(s.proc.pid).children() if "forkserver" in " ".join(p.cmdline())
        ][0]
        recoveries = []
        for round_ in range(3):  # each replacement is itself replaceable
            engine = forkserver.children()[0]
            replacements = sum("engine replaced" in line for line in s.lines)
            # another request each round: one in flight at two deaths in a row is refused (a poison request)
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
                **QUESTION, "stream": True, "max_tokens": 400 + round_, "ignore_eos": True}) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                assert "chatcmpl" in first
                engine.kill()
                killed_at = time.monotonic()
                rest = [line for line in lines if line.startswith("data:")]
            assert any('"engine_dead"' in line for line in rest), rest[-3:]
            assert rest[-1] == "data: [DONE]"
            # /health says 503 until a new engine serves; a replacement quicker than this loop's first look
            # is told by the server's "engine replaced" line instead
            saw_503 = recovered = replaced = False
            while time.monotonic() - killed_at < 30:
                code = httpx.get(s.url + "/health").status_code
                saw_503 |= code == 503
                replaced = sum("engine replaced" in line for line in s.lines) > replacements
                if code == 200 and (saw_503 or replaced):
                    recovered = True
                    break
                time.sleep(0.02)
            assert recovered, (round_, saw_503, replaced)
            recoveries.append(time.monotonic() - killed_at)
            ok = httpx.post(s.url + "/v1/chat/completions", json=QUESTION, timeout=60)
            assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"]
            assert engine.pid not in [p.pid for p in forkserver.children()]
        assert max(recoveries) < 10, recoveries
        print(f"engine recovery seconds: {recoveries}")
    finally:
        s.stop()


@pytest.mark.parametrize(
    "args,env", [(["--no-prespawn", "--no-prefetch"], {}), ([], {"HOTSTART_SERIAL": "1"})]
)
def test_ablations_still_serve(default_model_dir, args, env):
    """The switches that turn fast start off (for measuring it) leave a working server."""
    s = Server("--max-model-len", "512", *args, env=env)
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json=QUESTION, timeout=60)
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        names = [p["name"] for p in httpx.get(s.url + "/startup").json()["phases"]]
        assert "forkserver up (torch + engine imported)" not in names and "engine spawned" in names
        assert "prefetch started" not in names
    finally:
        s.stop()


def _stream_then(s: Server, kill) -> tuple[list[str], float]:
    """Start a long streaming request, call KILL() after its first chunk; (the remaining data lines,
    seconds from the kill to the end of the stream)."""
    with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
            **QUESTION, "stream": True, "max_tokens": 400, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert "chatcmpl" in next(line for line in lines if line.startswith("data:"))
        kill()
        t = time.monotonic()
        rest = [line for line in lines if line.startswith("data:")]
    return rest, time.monotonic() - t


def _kill_tree(forkserver: psutil.Process) -> None:
    """SIGKILL the forkserver and its engines at once, as an OOM kill of the process tree would."""
    for p in [*forkserver.children(recursive=True), forkserver]:
        p.kill()


def test_killed_process_tree_fails_streams_and_is_replaced(default_model_dir):
    s = Server("--max-model-len", "512")
    try:
        forkserver = [
            p for p in psutil.Process(s.proc.pid).children() if "forkserver" in " ".join(p.cmdline())
        ][0]
        rest, took = _stream_then(s, lambda: _kill_tree(forkserver))
        assert took < 2.0, took
        assert any('"engine_dead"' in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        saw_503 = recovered = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = httpx.get(s.url + "/health")
            saw_503 |= r.status_code == 503
            if r.status_code == 200 and saw_503:
                recovered = True
                break
            time.sleep(0.05)
        assert saw_503 and recovered
        ok = httpx.post(s.url + "/v1/chat/completions", json=QUESTION, timeout=60)
        assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"]
        fresh = [p for p in psutil.Process(s.proc.pid).children() if "forkserver" in " ".join(p.cmdline())]
        assert len(fresh) == 1 and fresh[0].pid != forkserver.pid
    finally:
        s.stop()
    assert "Traceback" not in s.output, s.output


def test_killed_process_tree_without_restart_exits_with_one_error_line(default_model_dir):
    s = Server("--max-model-len", "512", "--no-restart")
    forkserver = [p for p in psutil.Process(s.proc.pid).children() if "forkserver" in " ".join(p.cmdline())][
        0
    ]
    rest, took = _stream_then(s, lambda: _kill_tree(forkserver))
    assert took < 2.0 and any('"engine_dead"' in line for line in rest), (took, rest[-3:])
    t = time.monotonic()
    assert s.proc.wait(10) != 0
    assert time.monotonic() - t < 5
    time.sleep(0.2)  # the pump thread reads the last lines
    errors = [line for line in s.lines if line.startswith("hotstart: error:")]
    assert len(errors) == 1 and "forkserver exited" in errors[0], s.output
    assert "Traceback" not in s.output, s.output
