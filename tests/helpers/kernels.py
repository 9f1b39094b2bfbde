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


def load_shared_kernels(tmp_path_factory, monkeypatch) -> None:
    """Skip where the engine would serve with torch's ops (no compiler, no AVX2 + FMA); else point
    HOTSTART_HOME at the shared home and load its library."""
    import torch

    from hotstart.model import cpu_kernels

    if cpu_kernels.compiler() is None:
        pytest.skip("no C++ compiler: the engine serves with the torch ops")
    if not cpu_kernels.attention_supported(torch.float32):
        pytest.skip("this CPU lacks AVX2 + FMA (the engine says so and serves with the torch ops)")
    monkeypatch.setenv("HOTSTART_HOME", str(shared_kernels_home(tmp_path_factory)))
    cpu_kernels.load(cpu_kernels.build())
