"""Which processes a launched server's process group still holds, and ending them (psutil, imported
lazily: the startup benchmark imports it before it evicts anything)."""

from __future__ import annotations

import os
import signal


def group_members(pgid: int, root_pid: int) -> set[int]:
    """Live pids in process group `pgid` plus the descendants of `root_pid` (which may have left the
    group)."""
    try:
        import psutil  # noqa: PLC0415 - imported before any eviction by the harness (see startup.py)
    except ImportError:
        return set()
    found: set[int] = set()
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                found.add(p.pid)
        except (OSError, psutil.Error):
            continue
    try:
        found.update(c.pid for c in psutil.Process(root_pid).children(recursive=True)
                     if c.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        pass
    return found


def alive(pids: set[int]) -> set[int]:
    try:
        import psutil  # noqa: PLC0415
    except ImportError:
        return set()
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:  # a zombie is dead, only unreaped
                out.add(pid)
        except psutil.Error:
            continue
    return out


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
