"""An unloaded model's files are read back into the page cache where memory allows (frontend/keep_warm.py),
and only then: real files on this disk, their pages dropped (posix_fadvise) and checked with mincore."""

from __future__ import annotations

import os

from hotstart.frontend.keep_warm import KeepWarm
from hotstart.frontend.router import ModelRecord, ModelRouter, State
from hotstart.residency import evict, resident_bytes


def router_of(folder) -> ModelRouter:
    rec = ModelRecord("m", str(folder), loads=1, last_used=1.0)  # served before, unloaded now
    never = ModelRecord("n", str(folder))  # never loaded: nothing to keep warm
    return ModelRouter([rec, never], None, None, max_loaded=1, budget=1 << 40, keep_alive=None, max_waiting=1)


def test_an_unloaded_models_pages_come_back_where_memory_allows(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(8 << 20))
    evict(weights)
    assert resident_bytes(weights)[0] < 8 << 20
    router = router_of(tmp_path)
    assert router.records["m"].state is State.UNLOADED
    assert KeepWarm(router, free_memory=lambda: 0).check() == []  # no room: nothing read
    warm = KeepWarm(router, free_memory=lambda: 1 << 50)
    started = warm.check()
    assert len(started) == 1 and all(p.wait(30) for p in started)
    assert resident_bytes(weights) == (8 << 20, 8 << 20) and warm.read_back > 0
    assert warm.check() == []  # resident: nothing to do
