"""Engine liveness: every engine process (every tensor-parallel rank) beats into a small file that the
API process's supervisor reads (frontend/supervisor.py). Torch-free, stdlib only: both sides import it.

A daemon thread of the engine rewrites its file every period() seconds: [beat count, seconds the
current step has run (0: between steps)], one pwrite of RECORD (I/O only; it never imports). The
heartbeat is not the step: the thread needs only a moment of the GIL, which torch ops release, so a 20 s
prefill beats on; a stopped process (SIGSTOP), a dead one, or one whose main thread holds the GIL in a
hang does not. The reader compares beat counts on its own clock (no clock is shared), so a busy API event
loop never reads as a silent engine. Files live beside the generation's zmq sockets (the server's
private ipc folder), one per rank: a new generation never reads its predecessor's beats.
"""

from __future__ import annotations

import os
import struct
import threading
import time

RECORD = struct.Struct("<qd")  # beat count, seconds in the current step (0.0: not stepping)
MAX_PERIOD_S = 0.5


def path(requests_address: str, rank: int) -> str:
    """The heartbeat file of RANK of the engine generation whose request socket is REQUESTS_ADDRESS."""
    sock = requests_address.removeprefix("ipc://")
    return os.path.join(os.path.dirname(sock), f"hb-{os.path.basename(sock)}-{rank}")


def period(timeout: float) -> float:
    """Seconds between beats for a watchdog of TIMEOUT seconds: several beats per timeout, at most 0.5 s."""
    return max(0.01, min(MAX_PERIOD_S, timeout / 5))


class Heart:
    """The engine's side: a daemon thread writing FILE every EVERY seconds (no FILE: nothing, the
    watchdog is off); step_began / step_ended (main thread, no syscall) say whether a step runs, for the
    optional step timeout."""

    def __init__(self, file: str | None, every: float = MAX_PERIOD_S):
        self.every, self.count, self.step_since = every, 0, 0.0
        if file is None:
            return
        self.fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._beat()  # the file is never empty
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def step_began(self) -> None:
        self.step_since = time.monotonic()

    def step_ended(self) -> None:
        self.step_since = 0.0

    def _beat(self) -> None:
        self.count += 1
        since = self.step_since
        os.pwrite(self.fd, RECORD.pack(self.count, time.monotonic() - since if since else 0.0), 0)

    def _run(self) -> None:
        while True:
            time.sleep(self.every)
            try:
                self._beat()
            except OSError:  # the file cannot be written: silence, which the supervisor acts on
                return


def start(requests_address: str, rank: int, timeout: float) -> Heart:
    """Beat for RANK of the generation at REQUESTS_ADDRESS; a silent Heart where the watchdog is off
    (TIMEOUT 0) or the file cannot be made (nor then the zmq sockets beside it: the engine fails on those)."""
    if timeout > 0:
        try:
            return Heart(path(requests_address, rank), period(timeout))
        except OSError:
            pass
    return Heart(None)


def remove(requests_address: str, ranks: int) -> None:
    """Remove the heartbeat files of a generation that is gone (its RANKS ranks)."""
    for rank in range(ranks):
        try:
            os.unlink(path(requests_address, rank))
        except OSError:
            pass


def read(file: str) -> tuple[int, float] | None:
    """(beat count, seconds in the current step) from FILE, or None if it is missing or short."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.pread(fd, RECORD.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return RECORD.unpack(data) if len(data) == RECORD.size else None
