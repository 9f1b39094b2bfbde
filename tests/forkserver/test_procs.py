"""hotstart/procs.py's one liveness rule (a zombie is not alive) and its /proc walker, on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from hotstart.procs import alive, descendants, group_pids, terminate_then_kill, tree, wait_gone


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_this_process_is_alive_and_no_group_is_a_process():
    assert alive(os.getpid())
    assert os.getpid() in group_pids(os.getpgid(0))
    assert not alive(0) and not alive(-1)  # signal 0 to these would test a group
    assert not alive(2**22 + 1)  # above any pid_max


def test_a_zombie_is_not_alive_and_reaping_leaves_nothing():
    proc = subprocess.Popen(["sleep", "0"])
    deadline = time.monotonic() + 10
    while _state(proc.pid) != "Z" and time.monotonic() < deadline:  # exited, not reaped: we have not waited
        time.sleep(0.01)
    assert _state(proc.pid) == "Z"
    assert not alive(proc.pid)
    assert proc.wait(5) == 0
    assert not alive(proc.pid) and _state(proc.pid) is None


def test_descendants_come_after_their_parents():
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(descendants(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        parents = tree(proc.pid)
        assert len(parents) == 2 and set(parents.values()) == {proc.pid}, parents
        assert all(alive(p) for p in parents) and set(group_pids(proc.pid)) == {proc.pid, *parents}
        ours = descendants(os.getpid())
        assert all(ours.index(proc.pid) < ours.index(p) for p in parents)  # a parent before its children
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        terminate_then_kill([proc], 1.0)
    assert not alive(proc.pid)


def test_wait_gone_wakes_on_the_exit_and_returns_what_outlives_the_timeout():
    quick = subprocess.Popen(["sleep", "0.3"])
    slow = subprocess.Popen(["sleep", "30"])
    try:
        t = time.monotonic()
        assert wait_gone([quick.pid], 20) == []  # woken by the exit (a zombie until reaped: gone)
        assert 0.2 < time.monotonic() - t < 5
        t = time.monotonic()
        assert wait_gone([slow.pid, quick.pid], 0.3) == [slow.pid]  # the bound: only the live one is left
        assert 0.25 < time.monotonic() - t < 5
        assert wait_gone([], 10) == [] and wait_gone([2**22 + 1], 10) == []  # nothing to wait for: at once
    finally:
        slow.kill()
        slow.wait(5)
        quick.wait(5)


def test_a_start_runs_without_the_collector_and_freezes_what_it_built():
    """collector_paused(): the collector is off inside, back on after (left off where it was off), and what
    was built inside is frozen; the forkserver's preload (torch and the engine) runs that way, so an engine
    forked from it starts with nothing old for a full collection to traverse."""
    code = textwrap.dedent("""
        import gc
        from hotstart.procs import collector_paused
        with collector_paused():
            assert not gc.isenabled()
            kept = [[i] for i in range(5000)]
        assert gc.isenabled() and gc.get_freeze_count() >= 5000, gc.get_freeze_count()
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()
        gc.enable()
        gc.unfreeze()
        from hotstart.forkserver.server import preload
        preload()
        assert gc.isenabled() and gc.get_freeze_count() > 50000, gc.get_freeze_count()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
