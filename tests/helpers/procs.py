"""Processes the tests start: a command in a session of its own, a fresh interpreter's imports, the
processes a test tagged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers import REPO


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


def run_session(cmd: list[str], timeout: float, env: dict | None = None, merge_stderr: bool = False,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run CMD in its own session; past TIMEOUT the whole group is killed (nothing outlives a test) and
    TimeoutExpired is raised."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "" if merge_stderr else err)
