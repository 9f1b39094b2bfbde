"""The warm forkserver: imports torch and the engine once, then forks engine processes on demand.

Started by the API process at t=0 (`python -m hotstart.engine.forkserver FD`), it talks over a
socketpair with newline-delimited JSON:
  API -> server:  {"cmd": "spawn", "config": {...EngineConfig}, "in": ADDR, "out": ADDR}
  server -> API:  {"event": "preloaded", "start": T, "end": T}    (torch + engine imported)
                  {"event": "spawned", "pid": N, "start": T, "time": T}
                  {"event": "exited", "pid": N, "code": C}         (C < 0: killed by signal -C)
The server forks only from its single main thread, before any torch op ran, so the child is safe.
It dies with the API process (PR_SET_PDEATHSIG) and kills its engines when the socket closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time

T_IMPORT = time.time()

from hotstart.procs import die_with_parent  # noqa: E402

if __name__ == "__main__":
    # Before the heavy preload: if the API process dies while torch imports, so do we.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the API process, which stops us
    die_with_parent(signal.SIGKILL)

import msgspec  # noqa: E402

from hotstart.config import EngineConfig  # noqa: E402
from hotstart.engine import worker  # noqa: E402 - the preload: torch and the whole engine

T_PRELOADED = time.time()
KILL_GRACE_S = 2.0


def _send(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _fork_engine(sock: socket.socket, cmd: dict) -> int:
    cfg = msgspec.convert(cmd["config"], EngineConfig)
    pid = os.fork()
    if pid == 0:  # the engine process
        code = 1
        try:
            sock.close()
            die_with_parent(signal.SIGKILL)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = worker.run_engine(cfg, cmd["in"], cmd["out"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            try:
                _send(sock, {"event": "exited", "pid": pid, "code": code})
            except OSError:
                pass


def _kill_all(children: set[int]) -> None:
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + KILL_GRACE_S
    while children and time.monotonic() < deadline:
        for pid in list(children):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    children.discard(pid)
            except ChildProcessError:
                children.discard(pid)
        time.sleep(0.02)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def serve(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    try:
        _send(sock, {"event": "preloaded", "start": T_IMPORT, "end": T_PRELOADED})
    except OSError:
        return 0  # the API process went away while we imported torch
    children: set[int] = set()
    buf = b""
    stopping = False

    def on_term(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        while not stopping:
            ready, _, _ = select.select([sock], [], [], 0.1)
            _reap(sock, children)
            if not ready:
                continue
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break  # the API process is gone or closed us
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                if cmd.get("cmd") == "spawn":
                    start = time.time()
                    pid = _fork_engine(sock, cmd)
                    children.add(pid)
                    try:
                        _send(sock, {"event": "spawned", "pid": pid, "start": start, "time": time.time()})
                    except OSError:
                        break  # the API process is gone: stop the engine too
                elif cmd.get("cmd") == "stop":
                    stopping = True
    finally:
        _kill_all(children)
    return 0


def main() -> None:
    os._exit(serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
