"""Start each peer once, ask one greedy chat completion, stop it: a check that it serves, not a benchmark.

    python benchmarks/peers/smoke.py --model MODEL_DIR --peer 'NAME=CMD' [--timeout NAME=SECS] ...

CMD is a `hotstart bench startup --peer` command line: leading VAR=value words are its environment,
{port} is a free loopback port, {model} is --model. For each peer: launch it in its own session, poll
/health (or /v1/models where /health is 404) until it answers 200, POST one /v1/chat/completions
(temperature 0), print the answer, SIGTERM the whole process group (SIGKILL after 30 s) and check that
no process of its session is left and its port is free. Stdlib only: it runs on any python3.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

POLL = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 5.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def split_env(cmd: str) -> tuple[dict, list[str]]:
    """The way `hotstart bench startup --peer` reads a command line: leading VAR=value is environment."""
    words, env = shlex.split(cmd), {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if not words:
        raise SystemExit(f"smoke.py: {cmd!r}: no command")
    return env, words


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (the peer was started with start_new_session: sid == its pid)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(d.name))
    return pids


def stop(proc: subprocess.Popen) -> list[int]:
    """SIGTERM the process group, SIGKILL it after 30 s; return what of the session is still alive."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        proc.poll()
        if not session_pids(proc.pid):
            break
        time.sleep(POLL)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in session_pids(proc.pid):  # in the session but another group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    return session_pids(proc.pid)


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def vllm_cache_note(env: dict) -> str:
    root = Path(
        env.get("VLLM_CACHE_ROOT") or os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm"
    )
    cache = root / "torch_compile_cache"
    return "compile cache present (a cached start)" if cache.is_dir() and any(cache.iterdir()) else \
        f"no compile cache in {root} yet (a first start: it compiles)"


def smoke(name: str, cmd: str, model: str, prompt: str, max_tokens: int, timeout: float, logs: Path) -> bool:
    env_extra, words = split_env(cmd)
    port = free_port()
    argv = [w.replace("{port}", str(port)).replace("{model}", model) for w in words]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    log = logs / f"{name}-smoke.log"
    note = f" [{vllm_cache_note(env_extra)}]" if "vllm" in os.path.basename(words[0]) else ""
    print(f"{name}: starting on port {port}{note} (log: {log})", flush=True)
    with open(log, "wb") as out:
        out.write(("+ " + shlex.join([f"{k}={v}" for k, v in env_extra.items()] + argv) + "\n").encode())
        out.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        served = _serve(name, proc, port, model, prompt, max_tokens, t0, t0 + timeout, log)
    finally:
        left = stop(proc)
    clean = not left and port_free(port)
    if left:
        print(f"{name}: FAILED: processes left after stop: {left}")
    elif not clean:
        print(f"{name}: FAILED: port {port} still taken after stop")
    else:
        print(f"{name}: stopped, nothing left", flush=True)
    return served and clean


def _serve(name: str, proc: subprocess.Popen, port: int, model: str, prompt: str, max_tokens: int,
           t0: float, deadline: float, log: Path) -> bool:
    """Wait for a 200 from /health (or /v1/models), then one chat completion; print what it took."""
    health, t_ready = "/health", None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"{name}: FAILED: exited with {proc.returncode} before answering {health}\n{tail(log)}")
            return False
        try:
            status, _ = request(port, "GET", health, timeout=2)
        except (OSError, http.client.HTTPException):
            status = None
        if status == 404 and health == "/health":
            health = "/v1/models"
            continue
        if status == 200:
            t_ready = time.monotonic() - t0
            break
        time.sleep(POLL)
    if t_ready is None:
        print(f"{name}: FAILED: no 200 from {health} within {deadline - t0:.0f} s\n{tail(log)}")
        return False
    print(f"{name}: {health} 200 after {t_ready:.1f} s", flush=True)

    model_id = model
    try:
        status, body = request(port, "GET", "/v1/models")
        ids = [m.get("id") for m in json.loads(body).get("data", [])] if status == 200 else []
        if ids and model not in ids:
            model_id = ids[0]
    except (OSError, ValueError, http.client.HTTPException, AttributeError):
        pass
    payload = {"model": model_id, "messages": [{"role": "user", "content": prompt}],
               "temperature": 0, "max_tokens": max_tokens, "stream": False}
    try:
        status, body = request(port, "POST", "/v1/chat/completions", payload,
                               timeout=max(deadline - time.monotonic(), 30))
    except (OSError, http.client.HTTPException) as e:
        print(f"{name}: FAILED: chat completion: {e!r}\n{tail(log)}")
        return False
    t_answer = time.monotonic() - t0
    if status != 200:
        print(f"{name}: FAILED: chat completion HTTP {status}: {body[:500]!r}\n{tail(log)}")
        return False
    try:
        answer = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        print(f"{name}: FAILED: unexpected chat completion body: {body[:500]!r}")
        return False
    print(f"{name}: answer after {t_answer:.1f} s (model {model_id!r}): {answer!r}", flush=True)
    if not (answer and answer.strip()):
        print(f"{name}: FAILED: empty answer")
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="what {model} stands for")
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=CMD", help="repeatable")
    ap.add_argument("--timeout", action="append", default=[], metavar="NAME=SECS",
                    help="launch -> answer limit for one peer (default 180)")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--logs", default=".", help="folder for NAME-smoke.log")
    args = ap.parse_args()
    timeouts = {k: float(v) for k, v in (t.split("=", 1) for t in args.timeout)}
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    failed = []
    for spec in args.peer:
        name, sep, cmd = spec.partition("=")
        if not sep or not cmd:
            ap.error(f"--peer {spec!r}: must be NAME=CMD")
        if not smoke(name, cmd, args.model, args.prompt, args.max_tokens, timeouts.get(name, 180.0), logs):
            failed.append(name)
    if failed:
        print(f"smoke: FAILED: {', '.join(failed)}")
        return 1
    print(f"smoke: all {len(args.peer)} peer(s) served")
    return 0


if __name__ == "__main__":
    sys.exit(main())
