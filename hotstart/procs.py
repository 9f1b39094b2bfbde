"""Process helpers shared by the API process, the forkserver and the benchmarks (torch-free, stdlib only)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator

PR_SET_PDEATHSIG = 1
POLL_S = 0.01


def die_with_parent(sig: int) -> None:
    """Linux: deliver SIG to this process when its parent dies, so nothing is orphaned."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the running program, libc included
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...); None where
    it cannot be read (no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ")"
    except (OSError, IndexError):
        return None
    return fields or None


def alive(pid: int) -> bool:
    """Whether PID is a process that still runs (or is stopped). The one rule: a zombie (exited, not yet
    reaped by its parent) is NOT alive: it runs no code and holds no memory. Reaping a child of ours is
    the parent's job (terminate_then_kill reaps). A process of another user is alive (signal 0: EPERM)."""
    if pid <= 0:  # signal 0 to 0 or -1 would test a whole group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat(pid)
    if fields is None:  # reaped since the signal (Linux); elsewhere the signal is all there is to go on
        return not os.path.isdir("/proc/self")
    return fields[0] not in ("Z", "X")


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to TIMEOUT for PIDS (not necessarily children of ours) to exit; the ones still alive after
    it. Woken by each exit itself (a pidfd turns readable when its process exits: Linux 5.3+), so an
    engine stopped for a swap is waited for as long as its exit takes, not to the next poll; elsewhere
    polled every POLL_S."""
    import select  # noqa: PLC0415 - stdlib, used by the stops only

    fds: dict[int, int] = {}
    left = [p for p in pids if alive(p)]
    try:
        if hasattr(os, "pidfd_open") and hasattr(select, "poll"):
            for p in left:
                try:
                    fds[os.pidfd_open(p)] = p
                except ProcessLookupError:  # gone (and reaped) since alive()
                    pass
                except OSError:  # no pidfds here (old kernel, seccomp): polled below
                    break
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            if len(fds) == len(left):
                poller = select.poll()
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                poller.poll(max(1, int((deadline - time.monotonic()) * 1000)))
            else:
                time.sleep(POLL_S)
            left = [p for p in left if alive(p)]
            for fd in [fd for fd, p in fds.items() if p not in left]:
                del fds[fd]
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return left


def _all_stats() -> dict[int, list[str]]:
    """pid -> its /proc/PID/stat fields, for every process there is now ({} without /proc)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    out = {}
    for entry in entries:
        if entry.isdigit() and (fields := _stat(entry)) is not None:
            out[int(entry)] = fields
    return out


def tree(pid: int) -> dict[int, int]:
    """Linux: the descendants of PID, each mapped to its parent, from /proc ({} elsewhere). Order: every
    pid comes after its parent (a parent's children together, then depth first). Zombies are included:
    alive() tells them apart."""
    children: dict[int, list[int]] = {}
    for p, fields in _all_stats().items():
        children.setdefault(int(fields[1]), []).append(p)
    out, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for kid in children.get(parent, []):
            if kid not in out and kid != pid:  # pids reused while /proc was read: no cycle walked
                out[kid] = parent
                todo.append(kid)
    return out


def descendants(pid: int) -> list[int]:
    """tree(PID)'s pids, each after its parent. For a child that runs children of its own in our process
    group (g++ runs cc1plus and as): signalling it alone would leave them running."""
    return list(tree(pid))


def group_pids(pgid: int) -> list[int]:
    """Linux: the pids of process group PGID, zombies included, from /proc ([] elsewhere)."""
    return [p for p, fields in _all_stats().items() if int(fields[2]) == pgid]


def _signal(target: subprocess.Popen | int, sig: int, group: bool) -> None:
    pid = target.pid if isinstance(target, subprocess.Popen) else target
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _exited(target: subprocess.Popen | int) -> bool:
    """Whether TARGET is gone. A Popen or a child pid of ours is reaped here (no zombie left)."""
    if isinstance(target, subprocess.Popen):
        return target.poll() is not None
    try:
        pid, _ = os.waitpid(target, os.WNOHANG)
        return pid != 0
    except ChildProcessError:  # not our child (or already reaped): its parent (or init) reaps it
        return not alive(target)


def terminate_then_kill(targets: Iterable[subprocess.Popen | int], grace: float, *, group: bool = False,
                        others_alive: Callable[[], bool] | None = None) -> bool:
    """SIGTERM every target (its process group with GROUP), wait up to GRACE seconds for all of them
    (and for OTHERS_ALIVE() to turn False), then SIGKILL what is left and reap it.

    Targets are Popen objects or pids (children of ours are reaped). Bounded: returns within about
    GRACE + 1 s whatever the targets do. Returns True if SIGKILL was needed."""
    targets = list(targets)
    for t in targets:
        _signal(t, signal.SIGTERM, group)
    deadline = time.monotonic() + max(0.0, grace)
    left = [t for t in targets if not _exited(t)]
    while (left or (others_alive is not None and others_alive())) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        left = [t for t in left if not _exited(t)]
    pending = left or (others_alive is not None and others_alive())
    if not pending:
        return False
    for t in targets:  # the group may hold members besides its (exited) leader
        _signal(t, signal.SIGKILL, group)
    deadline = time.monotonic() + 1.0
    while left and time.monotonic() < deadline:
        left = [t for t in left if not _exited(t)]
        if left:
            time.sleep(POLL_S)
    return True


_exit_signal: int | None = None  # the signal _raise_exit saw, in case its SystemExit was swallowed


def _raise_exit(signum, frame):  # noqa: ARG001
    global _exit_signal
    _exit_signal = signum
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Until an event loop takes over: SIGTERM unwinds through `finally` blocks, which stop the
    forkserver and remove temporary folders (the default action would just vanish)."""
    signal.signal(signal.SIGTERM, _raise_exit)


def exit_requested() -> int | None:
    """A signal exit_on_sigterm's handler took whose SystemExit may never have unwound: raised while
    Python ran an importlib lock callback or a finaliser, it is only printed ("Exception ignored in")
    and startup carries on. Whoever takes the signals over next acts on it (server/launch.py)."""
    return _exit_signal


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """A start's imports and loads without the cyclic garbage collector, and what they built frozen out of
    its sight afterwards (gc.freeze; a fork then starts with nothing old to traverse). Imports grow the heap
    by ~170K long-lived objects, and the collector's passes over it, one each time it grew by a quarter,
    took 0.12 s of the forkserver's 1.4 s preload and 0.03 s of the API process's 0.33 s web stack."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
