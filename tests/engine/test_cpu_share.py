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
