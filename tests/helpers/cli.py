"""Running `hotstart ...` as a user does: in its own session, every descendant tagged, nothing left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import psutil

from helpers.procs import tagged

READY = re.compile(r"hotstart: ready in")


@dataclass
class Run:
    rc: int | None  # None: it was still running (it became ready, or hit the timeout) and was killed
    stdout: str
    stderr: str

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("hotstart: error:")]


class Pending:
    """`hotstart ARGS` started in its own session; finish() waits for it (see hotstart())."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.args, self.tag = args, uuid.uuid4().hex
        self.proc = subprocess.Popen([sys.executable, "-m", "hotstart", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     env={**os.environ, **(env or {}), "HOTSTART_TEST_TAG": self.tag})
        self.err: list[str] = []
        self.out: list[str] = []
        self.became_ready = threading.Event()

        def pump_err():
            for line in self.proc.stderr:
                self.err.append(line)
                if READY.search(line):
                    self.became_ready.set()

        self.threads = [threading.Thread(target=pump_err, daemon=True),
                        threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True)]
        for t in self.threads:
            t.start()

    def finish(self, timeout: float) -> Run:
        """Wait until it exits; kill it if it becomes ready (a fault must stop startup) or outlives
        TIMEOUT; fail if any process it started is left afterwards."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and not self.became_ready.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        rc = self.proc.poll()
        if rc is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for t in self.threads:
            t.join(10)
        gone, alive = psutil.wait_procs(tagged(self.tag), timeout=5)
        for p in alive:
            p.kill()
        assert not alive, f"processes left behind by `hotstart {' '.join(self.args)}`: " \
                          f"{[(p.pid, p.name()) for p in alive]}\n{''.join(self.err)}"
        return Run(rc, "".join(self.out), "".join(self.err))


def hotstart(*args: str, env: dict | None = None, timeout: float = 120.0) -> Run:
    """Run `hotstart ARGS` (see Pending.finish)."""
    return Pending(*args, env=env).finish(timeout)


def assert_fails_with(run: Run, *needles: str) -> str:
    assert run.rc is not None, f"still running (it should have stopped):\n{run.stderr[-3000:]}"
    assert run.rc != 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.error_lines()
    assert len(lines) == 1, f"expected one `hotstart: error:` line:\n{run.stderr[-3000:]}"
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]
    return lines[0]
