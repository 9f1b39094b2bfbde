"""The one EngineCore setup of `hotstart bench step`: a core for a model, dtype, fast path and batch,
and the loop that brings a batch of sequences to steady decoding.

No process, no HTTP: the engine's own code path (scheduler, metadata, forward, sampler), in this
process, so a profile or a timing shows the step alone.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from hotstart.errors import HotstartError

FAST_PATHS = ("off", "packed")


@dataclass
class BenchCore:
    core: object  # hotstart.engine.core.EngineCore
    model_dir: Path
    dtype: str  # what the engine runs: "bfloat16", "float32", ...
    fast_path: str  # FAST_PATHS
    build_s: float
    pack_s: float | None


def build_core(model: str | None, dtype: str = "auto", fast_path: str = "off", batch: int = 16,
               max_model_len: int = 1024, device: str = "cpu") -> BenchCore:
    """EngineCore on MODEL (a folder or hub id; None: the default model) for BATCH sequences.

    fast_path "packed": every linear weight and the LM head packed for oneDNN first, as the engine's
    fast path does behind READY with --compile eager-only|auto; "off": the plain eager path."""
    if fast_path not in FAST_PATHS:
        raise HotstartError(f"--fast-path {fast_path!r}: one of {', '.join(FAST_PATHS)}")
    from hotstart.boot.resolve import resolve_model
    from hotstart.config import EngineConfig
    from hotstart.engine.core import EngineCore
    from hotstart.model.files import weight_files

    path = resolve_model(model).path
    cfg = EngineConfig(model_path=str(path), weight_files=tuple(map(str, weight_files(path))), device=device,
                       dtype=dtype, max_model_len=max_model_len, max_num_seqs=batch,
                       max_num_batched_tokens=max(2048, max_model_len), compile="off")
    t = time.perf_counter()
    core = EngineCore.build(cfg)
    build_s = time.perf_counter() - t
    pack_s = None
    if fast_path == "packed":
        pack_s = _pack(core)
    return BenchCore(core, path, str(core.placement.dtype).removeprefix("torch."), fast_path, build_s, pack_s)


def _pack(core) -> float:
    from hotstart.engine.fastpath import pack_model
    from hotstart.engine.fastpath.pack import install_kernels
    from hotstart.engine.fastpath.plan import kernel_plans, packing_plan
    from hotstart.messages import FastPathState as S
    from hotstart.model import cpu_kernels

    state, why, _ = packing_plan(core, "eager-only")  # as the engine plans it: copies where they fit
    if state is not S.PLANNED:
        raise HotstartError(f"--fast-path packed: {why}")
    copies = not why  # PLANNED with a why: the CPU kernels over the checkpoint's weights, no copies
    t = time.perf_counter()
    pack_model(core.runner.model, copies)  # the engine's own loop (engine/fastpath/pack.py)
    whys = kernel_plans(core)  # the CPU kernels where the engine runs them
    if not all(whys):
        install_kernels(core.runner.model, cpu_kernels.build(), whys, copies)
    return time.perf_counter() - t


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    """A distinct, deterministic prompt per sequence (no prefix shared between sequences)."""
    return [(7 * index + 13 * j) % (vocab - 20) + 10 for j in range(length)]


def start_batch(core, tag: str, count: int, context: int, params) -> list[str]:
    """Add COUNT requests of CONTEXT prompt tokens and step until every one has its first token
    (prefill done, chunked or not); their ids."""
    from hotstart.messages import EngineRequest

    vocab = core.model_cfg.vocab_size
    ids = [f"{tag}-{i}" for i in range(count)]
    offset = zlib.crc32(tag.encode()) % 1000
    for i, rid in enumerate(ids):
        core.add_request(EngineRequest(rid, prompt_ids(offset + i, context, vocab), params))
    started: set[str] = set()
    while len(started) < count and core.has_work():
        started.update(o.request_id for o in core.step())
    if len(started) < count:
        raise HotstartError(f"bench step: only {len(started)} of {count} sequences started")
    return ids


def drain(core) -> None:
    while core.has_work():
        core.step()


def timed_steps(core, steps: int, width: int | None = None) -> list[float]:
    """Seconds of each of STEPS steps; with WIDTH, only steps that returned WIDTH outputs (every
    sequence decoding) are kept."""
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t
        if width is None or len(outs) == width:
            out.append(dt)
    return out
