"""Building an engine: config, placement, weights, KV cache sizing, the executor (EngineCore.build).

Each phase is reported as a startup Span. With a tensor-parallel group each rank loads its part of the
model and of the KV cache (the same number of blocks on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from hotstart.config import EngineConfig, ModelConfig, load_model_config
from hotstart.engine.executor import Executor, executor_for
from hotstart.engine.model_runner import ModelRunner, kv_bytes_per_token
from hotstart.engine.placement import Placement, kv_cache_blocks, max_model_len_for, resolve_placement
from hotstart.messages import Span
from hotstart.model.files import weight_files
from hotstart.model.loader import load_model  # with the engine: the forkserver's preload, not each fork's

if TYPE_CHECKING:
    from hotstart.engine.distributed import Group

SpanHook = Callable[[Span], None]  # told of each startup phase as it ends


def load(cfg: EngineConfig, on_span: SpanHook | None = None, on_progress: Callable[[int], None] | None = None,
         group: Group | None = None) -> tuple[Executor, EngineConfig, ModelConfig, int, int, Placement]:
    """(executor, cfg with its weight files, model config, KV blocks, max model length, placement): the
    EngineCore's arguments. ON_PROGRESS: told of the loader's progress (model/cursor.py)."""
    def phase(name: str, start: float, detail: str = "") -> None:
        if on_span is not None:
            on_span(Span(name, start, time.time(), "engine", detail))

    t = time.time()
    model_cfg = load_model_config(cfg.model_path)
    placement = resolve_placement(cfg, model_cfg)
    if group is not None:
        placement = replace(placement, device=group.device)  # cuda:rank
    max_len = max_model_len_for(cfg, model_cfg)
    files = [p for p in cfg.weight_files] or [str(p) for p in weight_files(cfg.model_path)]
    tp = f", rank {group.rank} of {group.world_size}" if group is not None else ""
    phase(
        "engine config",
        t,
        f"{model_cfg.architecture} on {placement.device} {str(placement.dtype)[6:]}{tp}",
    )

    t = time.time()
    model = load_model(
        model_cfg,
        files,
        placement.device,
        placement.dtype,
        max_len,
        on_progress=on_progress,
        tp=group.tp if group is not None else None,
    )
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    phase("weights loaded", t, f"{nbytes / 1e6:.0f} MB in {len(files)} file(s){tp}")

    t = time.time()
    per_token = kv_bytes_per_token(model, placement.dtype)
    zero_copy = placement.device.type == "cpu" and str(placement.dtype)[6:] == model_cfg.torch_dtype
    num_blocks, kv_why = kv_cache_blocks(
        cfg, per_token, max_len, placement.device, nbytes if zero_copy else 0
    )
    if group is not None:
        num_blocks = group.min_over_ranks(num_blocks)  # every rank holds its heads of the same blocks
    runner = ModelRunner(model, num_blocks, cfg.block_size, placement.device, placement.dtype)
    phase("KV cache allocated", t, f"{num_blocks} blocks x {cfg.block_size} tokens ({kv_why})")
    cfg = replace(cfg, weight_files=tuple(files))
    return executor_for(runner, group), cfg, model_cfg, num_blocks, max_len, placement
