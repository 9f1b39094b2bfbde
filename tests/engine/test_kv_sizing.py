"""The CPU KV cache is sized from available memory (engine/placement.py cpu_kv_budget / kv_cache_blocks):
pure functions fed fake numbers."""

import pytest

from hotstart.config import EngineConfig
from hotstart.engine import placement
from hotstart.engine.placement import CPU_KV_CACHE_CAP, CPU_KV_MEMORY_FRACTION, cpu_kv_budget, kv_cache_blocks
from hotstart.errors import HotstartError

GiB = 1 << 30
MiB = 1 << 20


def test_fits_when_the_config_needs_less_than_the_cap():
    budget, why = cpu_kv_budget(2 * GiB, 64 * MiB, 22 * GiB, 14 * GiB)
    assert budget == 2 * GiB and "MemAvailable 22.0 GiB - weights 14.0 GiB" in why


def test_capped_at_a_fraction_of_what_the_weights_leave():
    budget, why = cpu_kv_budget(16 * GiB, 64 * MiB, 22 * GiB, 14 * GiB)
    assert budget == int(8 * GiB * CPU_KV_MEMORY_FRACTION)
    assert "would take 16.0 GiB" in why and f"{CPU_KV_MEMORY_FRACTION:.0%}" in why


def test_never_less_than_one_sequence():
    budget, why = cpu_kv_budget(16 * GiB, 5 * GiB, 22 * GiB, 14 * GiB)  # 50% of 8 GiB < 5 GiB <= 8 GiB
    assert budget == 5 * GiB and why.startswith("one sequence")


def test_error_when_not_even_one_sequence_fits():
    with pytest.raises(HotstartError) as e:
        cpu_kv_budget(16 * GiB, 9 * GiB, 22 * GiB, 14 * GiB)
    msg = str(e.value)
    assert "\n" not in msg and "one sequence" in msg and "9.0 GiB" in msg and "leaves 8.0 GiB" in msg
    assert "--max-model-len" in msg


def test_unknown_memory_keeps_the_fixed_cap():
    assert cpu_kv_budget(16 * GiB, MiB, None, 0)[0] == CPU_KV_CACHE_CAP
    assert cpu_kv_budget(MiB, MiB, None, 0)[0] == MiB


def test_kv_cache_blocks_from_memory(monkeypatch):
    import torch

    per_token = 57344  # Qwen2.5-7B bf16: 2 x 28 layers x 4 KV heads x 128 x 2 bytes
    cfg = EngineConfig(model_path="x", max_num_seqs=64)
    monkeypatch.setattr(placement, "available_memory_detail", lambda: (23 * GiB, "MemAvailable"))
    blocks, why = kv_cache_blocks(cfg, per_token, 2048, torch.device("cpu"), weight_bytes=int(13.76e9))
    cap = int((23 * GiB - int(13.76e9)) * CPU_KV_MEMORY_FRACTION)
    assert blocks == cap // (per_token * 16)
    assert f"seqs x 2048 tokens; {CPU_KV_MEMORY_FRACTION:.0%} of MemAvailable 23.0 GiB" in why
    # plenty: what 64 x 2048 tokens need
    monkeypatch.setattr(placement, "available_memory_detail", lambda: (64 * GiB, "MemAvailable"))
    blocks, why = kv_cache_blocks(cfg, per_token, 2048, torch.device("cpu"), weight_bytes=int(13.76e9))
    assert blocks == 64 * 2048 // 16 and why.startswith(
        "7.0 GiB: 64 seqs x 2048 tokens; MemAvailable 64.0 GiB"
    )
    explicit = EngineConfig(model_path="x", kv_cache_memory=GiB)
    assert kv_cache_blocks(explicit, per_token, 2048, torch.device("cpu"))[1].endswith("--kv-cache-memory")
    monkeypatch.setattr(placement, "available_memory_detail", lambda: (14 * GiB, "MemAvailable"))
    with pytest.raises(HotstartError, match="not enough memory for the KV cache"):
        kv_cache_blocks(cfg, per_token, 32768, torch.device("cpu"), weight_bytes=int(13.76e9))


def test_a_cgroup_room_is_named_and_an_explicit_size_above_it_is_flagged(monkeypatch):
    import torch

    room = "cgroup /pod's room (v2 limit 8.00 GiB - working set 2.00 GiB)"
    monkeypatch.setattr(placement, "available_memory_detail", lambda: (6 * GiB, room))
    cfg = EngineConfig(model_path="x", max_num_seqs=64)
    blocks, why = kv_cache_blocks(cfg, 65536, 4096, torch.device("cpu"), weight_bytes=2 * GiB)
    assert blocks * 16 * 65536 <= 2 * GiB and f"50% of {room} 6.0 GiB - weights 2.0 GiB" in why
    explicit = EngineConfig(model_path="x", kv_cache_memory=5 * GiB)
    why = kv_cache_blocks(explicit, 65536, 4096, torch.device("cpu"), weight_bytes=2 * GiB)[1]
    assert why.endswith(f"--kv-cache-memory (more than the 4.0 GiB that {room} leaves beside the weights)")
