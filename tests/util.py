"""Helpers shared by tests (importable as `util`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def no_torch_in(module: str) -> tuple[bool, str]:
    """Import MODULE in a fresh interpreter; report whether torch/transformers got imported."""
    code = (f"import {module}, sys, json; "
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    heavy = json.loads(out.stdout.strip().splitlines()[-1])
    return not heavy, ",".join(heavy)


def tagged(tag: str) -> list:
    """Live processes whose environment carries HOTSTART_TEST_TAG=TAG (inherited by every descendant,
    so leftovers are found even after they were re-parented)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("HOTSTART_TEST_TAG") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


class Server:
    """A real `hotstart serve` subprocess on a free port; stop() checks that nothing is left behind."""

    def __init__(self, *args: str, env: dict | None = None, ready_timeout: float = 120.0, wait_ready: bool = True):
        import re
        import threading
        import time

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hotstart", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        found = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"on (http://[\d.]+:\d+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        if not found.wait(ready_timeout) or self.url is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        if wait_ready:
            import httpx

            while time.monotonic() < deadline:
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
            self.kill()
            raise RuntimeError("server never became healthy:\n" + "".join(self.lines))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def descendants(self) -> list[int]:
        import psutil

        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = 15, timeout: float = 10.0) -> float:
        """Send SIG; return seconds until the server and all its descendants are gone."""
        import time

        import psutil

        kids = self.descendants()
        t = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(timeout)
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in kids if psutil.pid_exists(p)],
                                        timeout=max(0.1, timeout - (time.monotonic() - t)))
        assert not alive, f"orphans left: {[p.pid for p in alive]}"
        return time.monotonic() - t

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
