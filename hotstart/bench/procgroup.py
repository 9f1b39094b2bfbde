"""What of a launched server is left (its process group, and its tree) and ending it; a server tree as
psutil Processes for the benchmarks' per-process figures. The walking and the liveness rule are
hotstart/procs.py's (/proc: nothing is imported after a cold eviction); psutil only where figures are
read."""

from __future__ import annotations

import os
import signal

from hotstart.procs import alive, descendants, group_pids


def group_members(pgid: int, root_pid: int) -> set[int]:
    """Live pids in process group `pgid` plus the descendants of `root_pid` (which may have left the
    group)."""
    return {p for p in [*group_pids(pgid), *descendants(root_pid)] if alive(p)}


def kill(pids: set[int], pgid: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def processes(pid: int) -> list:
    """psutil Processes of PID and its descendants, each after its parent (those gone meanwhile left
    out). psutil.NoSuchProcess if PID itself is gone."""
    import psutil

    out = [psutil.Process(pid)]
    for p in descendants(pid):
        try:
            out.append(psutil.Process(p))
        except psutil.NoSuchProcess:
            pass
    return out
