"""Where the engine runs and how big it is: device and dtype, context length, KV-cache size (the
KV sizing rule: docs/design.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotstart.config import EngineConfig, ModelConfig
from hotstart.engine.block_manager import blocks_for
from hotstart.errors import HotstartError
from hotstart.system import available_memory_detail, native_cpu_dtypes

CPU_KV_CACHE_CAP = 4 << 30  # the CPU KV cache where available memory is unknown
CPU_KV_MEMORY_FRACTION = 0.5  # of what available memory leaves beside the weights (activations, others)


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype


def resolve_placement(cfg: EngineConfig, model_cfg: ModelConfig) -> Placement:
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise HotstartError("--device cuda: no CUDA device is available")
    if cfg.dtype == "auto":
        # The checkpoint's own dtype wherever the hardware computes it natively: then CPU weights are
        # zero-copy views of the page cache. Else float32.
        name = model_cfg.torch_dtype
        if device.type == "cpu" and name != "float32" and name not in native_cpu_dtypes():
            name = "float32"
    else:
        name = cfg.dtype
    if name not in ("float32", "float16", "bfloat16"):
        raise HotstartError(f"--dtype {name}: expected auto, bfloat16, float16 or float32")
    return Placement(device, getattr(torch, name))


def max_model_len_for(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """The context the engine serves: --max-model-len, else the model's max_position_embeddings."""
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len is None:
        return limit
    if cfg.max_model_len > limit:
        raise HotstartError(
            f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings ({limit})"
        )
    if cfg.max_model_len < 1:
        raise HotstartError(f"--max-model-len must be >= 1, got {cfg.max_model_len}")
    return cfg.max_model_len


def cpu_kv_budget(need: int, one_seq: int, available: int | None, weight_bytes: int,
                  source: str = "MemAvailable") -> tuple[int, str]:
    """(bytes, why) of a CPU KV cache: NEED (max_num_seqs x max_model_len), capped at
    CPU_KV_MEMORY_FRACTION of what AVAILABLE (system.available_memory(): MemAvailable, or a cgroup's
    limit minus its working set; SOURCE says which) leaves beside the weights, never below ONE_SEQ (one
    max_model_len sequence). WEIGHT_BYTES: the weights living in the page cache (zero-copy views): both
    figures count page-cache pages as available (MemAvailable: mapped or not; a cgroup: while inactive),
    so they are taken out of it (mlocked or active ones are not counted: then this is conservative).
    AVAILABLE unknown: CPU_KV_CACHE_CAP. HotstartError when not even ONE_SEQ fits."""
    if available is None:
        return max(one_seq, min(need, CPU_KV_CACHE_CAP)), \
            f"available memory unknown: at most {_gib(CPU_KV_CACHE_CAP)}"
    free = available - weight_bytes
    beside = f"{source} {_gib(available)}"
    if weight_bytes:
        beside += f" - weights {_gib(weight_bytes)}"
    if one_seq > free:
        raise HotstartError(
            f"not enough memory for the KV cache: one sequence of --max-model-len needs {_gib(one_seq)}, "
            f"{beside} leaves {_gib(max(free, 0))}; lower --max-model-len, free memory, or set "
            "--kv-cache-memory")
    cap = int(free * CPU_KV_MEMORY_FRACTION)
    if need <= cap:
        return need, beside
    if one_seq > cap:
        return one_seq, f"one sequence: {CPU_KV_MEMORY_FRACTION:.0%} of {beside} holds less"
    return cap, (f"{CPU_KV_MEMORY_FRACTION:.0%} of {beside}; max-num-seqs x max-model-len would take "
                 f"{_gib(need)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def kv_cache_blocks(cfg: EngineConfig, per_token: int, max_model_len: int, device: torch.device,
                    weight_bytes: int = 0) -> tuple[int, str]:
    """(blocks, why) of the paged KV cache. WEIGHT_BYTES: weights held in the page cache (CPU zero-copy)."""
    block_bytes = per_token * cfg.block_size
    one_seq = blocks_for(max_model_len, cfg.block_size) * block_bytes
    if cfg.kv_cache_memory is not None:
        budget, why = cfg.kv_cache_memory, "--kv-cache-memory"
        available, source = available_memory_detail() if device.type == "cpu" else (None, "")
        if available is not None and budget > available - weight_bytes:  # allocated lazily: it may still run
            left = _gib(max(0, available - weight_bytes))
            why += f" (more than the {left} that {source} leaves beside the weights)"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used
        why = f"--gpu-memory-utilization {cfg.gpu_memory_utilization} of {_gib(total)}, {_gib(used)} in use"
    else:
        need = blocks_for(cfg.max_num_seqs * max_model_len, cfg.block_size) * block_bytes
        available, source = available_memory_detail()
        budget, why = cpu_kv_budget(need, one_seq, available, weight_bytes, source)
    blocks = budget // block_bytes
    if blocks < blocks_for(max_model_len, cfg.block_size):
        raise HotstartError(
            f"not enough memory for the KV cache: {max(budget, 0) / 2**20:.0f} MiB holds "
            f"{max(blocks, 0) * cfg.block_size} tokens, one sequence of --max-model-len {max_model_len} "
            f"needs {max_model_len}; lower --max-model-len or give more memory (--kv-cache-memory / "
            "--gpu-memory-utilization)"
        )
    seqs = min(cfg.max_num_seqs, blocks * cfg.block_size // max_model_len)
    return int(blocks), f"{_gib(blocks * block_bytes)}: {seqs} seqs x {max_model_len} tokens; {why}"
