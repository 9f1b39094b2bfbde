"""Loading never starves serving (engine/cpu_share.py): the load's helper thread runs at the low priority
and thread count asked for, the fast path's pieces with fewer threads, and the main thread keeps both."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from hotstart.engine.cpu_share import Background


def _mine() -> tuple[int, int]:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), torch.get_num_threads()


def test_the_helper_is_lowered_and_the_main_thread_is_not():
    before = _mine()
    bg = Background(nice=19, threads=1)
    try:
        assert bg.run(_mine) == (19, 1)
        assert _mine() == before
        with bg.few_threads():
            assert _mine() == (before[0], 1)
        assert _mine() == before
        with pytest.raises(ZeroDivisionError):  # the helper's exception is the caller's
            bg.run(lambda: 1 / 0)
        assert bg.run(_mine) == (19, 1)  # and the helper goes on
    finally:
        bg.close()


def test_a_main_thread_that_never_computed_keeps_its_count():
    """An engine's main thread computes nothing before the helper loads the model; torch hands a thread
    the process-wide count at its first parallel op, which the helper's set_num_threads(1) had lowered:
    the main thread must still serve on every core (a fresh interpreter: nothing computed before)."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from hotstart.engine.cpu_share import Background\n"
            "bg = Background(nice=0, threads=1)\n"
            "assert bg.run(torch.get_num_threads) == 1\n"
            "torch.ones(64).sum()\n"
            "print(torch.get_num_threads())\n")
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if default == "1":
        pytest.skip("torch runs one thread here: nothing to lose")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert got.stdout.strip() == default
