"""The engine core: a plain class with step() (schedule -> forward -> sample -> outputs).

The process shell (worker.py) and the offline `hotstart generate` both drive it; tests call it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hotstart.config import EngineConfig, ModelConfig, load_model_config
from hotstart.engine.block_manager import BlockManager, blocks_for
from hotstart.engine.model_runner import ModelRunner, kv_bytes_per_token
from hotstart.engine.sampler import sample
from hotstart.engine.scheduler import Scheduler
from hotstart.engine.sequence import Sequence
from hotstart.errors import HotstartError
from hotstart.messages import EngineRequest, EngineStats, Span, TokenOutput
from hotstart.model.files import weight_files

SpanHook = Callable[[Span], None]  # told of each startup phase as it ends

CPU_KV_CACHE_CAP = 4 << 30


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
        if device.type == "cpu" and name != "float32" and name not in _native_cpu_dtypes():
            name = "float32"
    else:
        name = cfg.dtype
    if name not in ("float32", "float16", "bfloat16"):
        raise HotstartError(f"--dtype {name}: expected auto, bfloat16, float16 or float32")
    return Placement(device, getattr(torch, name))


def _native_cpu_dtypes() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return set()
    native = set()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        native.add("bfloat16")
    if "avx512_fp16" in flags or "amx_fp16" in flags:
        native.add("float16")
    return native


def max_model_len_for(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
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


def kv_cache_blocks(cfg: EngineConfig, per_token: int, max_model_len: int, device: torch.device) -> int:
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used
    else:
        budget = min(CPU_KV_CACHE_CAP, cfg.max_num_seqs * max_model_len * per_token)
    blocks = budget // (per_token * cfg.block_size)
    if blocks < blocks_for(max_model_len, cfg.block_size):
        raise HotstartError(
            f"not enough memory for the KV cache: {max(budget, 0) / 2**20:.0f} MiB holds {max(blocks, 0) * cfg.block_size} "
            f"tokens, one sequence of --max-model-len {max_model_len} needs {max_model_len}; lower --max-model-len "
            "or give more memory (--kv-cache-memory / --gpu-memory-utilization)"
        )
    return int(blocks)


class EngineCore:
    def __init__(self, runner: ModelRunner, cfg: EngineConfig, model_cfg: ModelConfig, num_blocks: int,
                 max_model_len: int, placement: Placement):
        self.runner, self.cfg, self.model_cfg = runner, cfg, model_cfg
        self.max_model_len, self.placement = max_model_len, placement
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.seqs: dict[str, Sequence] = {}
        self.default_generator = torch.Generator().manual_seed(cfg.seed)

    @classmethod
    def build(cls, cfg: EngineConfig, on_span: SpanHook | None = None,
              on_progress: Callable[[int], None] | None = None) -> EngineCore:
        """Load config, weights and KV cache; report each phase through on_span."""
        from hotstart.model.loader import load_model  # noqa: PLC0415

        def phase(name: str, start: float, detail: str = "") -> None:
            if on_span is not None:
                on_span(Span(name, start, time.time(), "engine", detail))

        t = time.time()
        model_cfg = load_model_config(cfg.model_path)
        placement = resolve_placement(cfg, model_cfg)
        max_len = max_model_len_for(cfg, model_cfg)
        files = [p for p in cfg.weight_files] or [str(p) for p in weight_files(cfg.model_path)]
        phase("engine config", t, f"{model_cfg.architecture} on {placement.device} {str(placement.dtype)[6:]}")

        t = time.time()
        model = load_model(model_cfg, files, placement.device, placement.dtype, max_len, on_progress=on_progress)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        phase("weights loaded", t, f"{nbytes / 1e6:.0f} MB in {len(files)} file(s)")

        t = time.time()
        per_token = kv_bytes_per_token(model, placement.dtype)
        num_blocks = kv_cache_blocks(cfg, per_token, max_len, placement.device)
        runner = ModelRunner(model, num_blocks, cfg.block_size, placement.device, placement.dtype)
        phase("KV cache allocated", t, f"{num_blocks} blocks x {cfg.block_size} tokens")
        return cls(runner, replace(cfg, weight_files=tuple(files)), model_cfg, num_blocks, max_len, placement)

    # --- requests -------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> TokenOutput | None:
        """Queue REQ; returns an error output instead if it can never run."""
        n_prompt = len(req.prompt_token_ids)
        total = n_prompt + req.params.max_tokens
        error = None
        if req.request_id in self.seqs:
            error = f"duplicate request id {req.request_id}"
        elif n_prompt == 0:
            error = "the prompt is empty"
        elif total > self.max_model_len:
            error = (f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                     f"{total} ({n_prompt} in the prompt + {req.params.max_tokens} to generate)")
        elif blocks_for(total, self.blocks.block_size) > self.blocks.num_blocks:
            error = f"the request needs {total} tokens of KV cache, the engine holds {self.blocks.num_blocks * self.blocks.block_size}"
        elif any(t < 0 or t >= self.model_cfg.vocab_size for t in req.prompt_token_ids):
            error = f"prompt token ids must be in [0, {self.model_cfg.vocab_size})"
        if error:
            return TokenOutput(req.request_id, [], "error", error)
        gen = None
        if req.params.seed is not None:
            gen = torch.Generator().manual_seed(req.params.seed)
        elif req.params.temperature > 0:
            gen = self.default_generator
        seq = Sequence(req.request_id, list(req.prompt_token_ids), n_prompt, req.params, gen)
        self.seqs[req.request_id] = seq
        self.scheduler.add(seq)
        return None

    def abort(self, request_ids: list[str]) -> list[TokenOutput]:
        out = []
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.scheduler.remove(seq)
                out.append(TokenOutput(rid, seq.token_ids[seq.prompt_len + seq.num_sent:], "abort"))
        return out

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used, kv_blocks_total=self.blocks.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
        )

    # --- the step -------------------------------------------------------------------------
    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.model_cfg.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if seq.num_generated >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[TokenOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        # a sequence samples once all its tokens are computed (end of prefill, or a decode)
        sampling = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in batch]
        logits = self.runner.forward(batch, sampling)
        for seq, n in batch:
            seq.num_computed_tokens += n
        sampled = [seq for (seq, _), s in zip(batch, sampling) if s]
        outputs = []
        if logits is not None:
            for seq, token in zip(sampled, sample(logits, sampled)):
                seq.token_ids.append(token)
                seq.finish_reason = self._finish_reason(seq, token)
                new = seq.token_ids[seq.prompt_len + seq.num_sent:]
                seq.num_sent += len(new)
                outputs.append(TokenOutput(seq.request_id, new, seq.finish_reason))
                if seq.finished:
                    self.scheduler.remove(seq)
                    del self.seqs[seq.request_id]
        return outputs
