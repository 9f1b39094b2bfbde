"""One CPU-kernel library per suite run: the tests that use the kernels (not the ones that test building
them) share a $HOTSTART_HOME, built once under a lock, across pytest-xdist workers (a g++ build of the
library costs ~10 s of a core)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest


def shared_kernels_home(tmp_path_factory) -> Path:
    """A $HOTSTART_HOME holding the built library (the caller sets HOTSTART_HOME to it)."""
    from hotstart.model import cpu_kernels

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's, across workers
    home = root / "kernels-home"
    with open(root / "kernels-home.lock", "w") as lock, pytest.MonkeyPatch.context() as mp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mp.setenv("HOTSTART_HOME", str(home))
        cpu_kernels.build()
    return home
