"""Start the engine process as early as possible, without importing torch here.

With pre-spawn (the default) the API process starts the warm forkserver at t=0; it imports torch and
the engine while the API process resolves the model, prefetches weights and imports its web stack,
then forks the engine the moment it has both the preload done and the engine config. Without it
(--no-prespawn, or where os.fork is missing) the engine is spawned directly as a fresh interpreter.
A crashed engine is replaced the same way: a fork from the still-warm server, in milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hotstart.config import EngineConfig

STOP_GRACE_S = 3.0


def _raise_exit(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Until the event loop takes over: SIGTERM unwinds through `finally` blocks, which stop the
    forkserver and remove temporary folders (the default action would just vanish)."""
    import signal  # noqa: PLC0415

    signal.signal(signal.SIGTERM, _raise_exit)


def serial_baseline() -> bool:
    """HOTSTART_SERIAL=1: every fast-start mechanism off (the baseline the benchmarks compare to)."""
    return os.environ.get("HOTSTART_SERIAL", "").lower() in ("1", "true", "yes")


class EngineLauncher:
    """Owns the forkserver (or the directly spawned engine) and reports process events."""

    def __init__(self, use_forkserver: bool = True):
        self.use_forkserver = use_forkserver and hasattr(os, "fork")
        # Private folder for the engine's zmq ipc sockets: unique per server, so two run side by side.
        self.ipc_dir = tempfile.mkdtemp(prefix="hotstart-ipc-")
        self.generation = 0  # bumped per engine: a replacement never sees its predecessor's sockets
        self.server: subprocess.Popen | None = None
        self.direct: subprocess.Popen | None = None
        self.engine_pid: int | None = None
        self._sock: socket.socket | None = None
        self._buf = b""
        self.started_at: float | None = None

    def start(self) -> None:
        """Start the forkserver (no-op without pre-spawn)."""
        if not self.use_forkserver:
            return
        ours, theirs = socket.socketpair()
        self.started_at = time.time()
        self.server = subprocess.Popen(
            [sys.executable, "-m", "hotstart.engine.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        )
        theirs.close()
        ours.setblocking(False)
        self._sock = ours

    def addresses(self) -> tuple[str, str]:
        """(requests in, outputs out) zmq addresses of the current engine generation."""
        return (f"ipc://{self.ipc_dir}/in-{self.generation}", f"ipc://{self.ipc_dir}/out-{self.generation}")

    def spawn(self, cfg: EngineConfig, new_generation: bool = False) -> None:
        """Ask for an engine process. With the forkserver this returns at once (it forks when ready)."""
        if new_generation:
            self.generation += 1
        import msgspec  # noqa: PLC0415 - not needed to start the forkserver, which is the t=0 step

        in_addr, out_addr = self.addresses()
        payload = msgspec.to_builtins(cfg)
        if self._sock is not None:
            line = json.dumps({"cmd": "spawn", "config": payload, "in": in_addr, "out": out_addr}) + "\n"
            self._sock.setblocking(True)
            try:
                self._sock.sendall(line.encode())
            finally:
                self._sock.setblocking(False)
            return
        self.direct = subprocess.Popen(
            [sys.executable, "-m", "hotstart.engine.worker", json.dumps(payload), in_addr, out_addr],
            stdin=subprocess.DEVNULL,
        )
        self.engine_pid = self.direct.pid

    def fileno(self) -> int | None:
        """Readable when forkserver events arrive (for an event loop's add_reader)."""
        return self._sock.fileno() if self._sock is not None else None

    def poll_events(self) -> list[dict]:
        """Non-blocking: forkserver events, or an "exited" event for a directly spawned engine."""
        events: list[dict] = []
        if self._sock is not None:
            while True:
                try:
                    chunk = self._sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    events.append({"event": "server-exited"})
                    self._sock.close()
                    self._sock = None
                    break
                self._buf += chunk
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                events.append(json.loads(line))
        if self.direct is not None and self.direct.poll() is not None:
            events.append({"event": "exited", "pid": self.direct.pid, "code": self.direct.returncode})
            self.direct = None
        for ev in events:
            if ev.get("event") == "spawned":
                self.engine_pid = ev["pid"]
            elif ev.get("event") == "exited" and ev.get("pid") == self.engine_pid:
                self.engine_pid = None
        return events

    def kill_engine(self) -> None:
        if self.engine_pid is not None:
            try:
                os.kill(self.engine_pid, 9)
            except ProcessLookupError:
                pass

    def shutdown(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop the forkserver (it stops its engines) or the direct engine; SIGKILL past TIMEOUT.
        Idempotent. A forkserver still importing torch dies at once (SIGTERM's default action)."""
        procs = [p for p in (self.server, self.direct) if p is not None]
        self.server = self.direct = None
        if self._sock is not None:
            try:
                self._sock.close()  # EOF: the forkserver terminates its engines and exits
            except OSError:
                pass
            self._sock = None
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.engine_pid is not None:  # an engine the forkserver could not reap
            self.kill_engine()
            self.engine_pid = None
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
