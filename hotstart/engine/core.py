"""The engine core: a plain class with step() (schedule -> forward -> sample -> outputs).

The process shell (worker.py) and the offline `hotstart generate` both drive it; tests call it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from hotstart.config import EngineConfig, ModelConfig, load_model_config
from hotstart.engine.block_manager import BlockManager, blocks_for
from hotstart.engine.grammar import WAIT_S, Grammars, grammar_finish
from hotstart.engine.model_runner import ModelRunner, kv_bytes_per_token
from hotstart.engine.sampler import Sampler, prompt_logprobs
from hotstart.engine.scheduler import Scheduler
from hotstart.engine.sequence import Sequence
from hotstart.errors import HotstartError
from hotstart.messages import EngineRequest, EngineStats, SamplingParams, Span, TokenOutput
from hotstart.model.files import weight_files
from hotstart.system import cpu_flags, mem_available

if TYPE_CHECKING:
    from hotstart.engine.distributed import Group

SpanHook = Callable[[Span], None]  # told of each startup phase as it ends

CPU_KV_CACHE_CAP = 4 << 30  # the CPU KV cache where MemAvailable is unknown
CPU_KV_MEMORY_FRACTION = 0.5  # of what MemAvailable leaves beside the weights (activations, other processes)
PROMPT_LOGPROBS_CHUNK = 256  # prompt tokens per step of a request with prompt logprobs ([chunk, V] logits)
MAX_LOGPROBS = 20
UINT64 = 1 << 64


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
    flags = cpu_flags()
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


def cpu_kv_budget(need: int, one_seq: int, mem_available: int | None, weight_bytes: int) -> tuple[int, str]:
    """(bytes, why) of a CPU KV cache: NEED (max_num_seqs x max_model_len), capped at
    CPU_KV_MEMORY_FRACTION of what MemAvailable leaves beside the weights, never below ONE_SEQ (one
    max_model_len sequence). WEIGHT_BYTES: the weights living in the page cache (zero-copy views):
    MemAvailable counts page-cache pages as available, mapped or not, so they are taken out of it
    (mlocked ones, as a zygote's --keep, are not in MemAvailable: then this is conservative).
    MemAvailable unknown: CPU_KV_CACHE_CAP. HotstartError when not even ONE_SEQ fits."""
    if mem_available is None:
        return max(one_seq, min(need, CPU_KV_CACHE_CAP)), f"MemAvailable unknown: at most {_gib(CPU_KV_CACHE_CAP)}"
    free = mem_available - weight_bytes
    beside = f"MemAvailable {_gib(mem_available)}" + (f" - weights {_gib(weight_bytes)}" if weight_bytes else "")
    if one_seq > free:
        raise HotstartError(
            f"not enough memory for the KV cache: one sequence of --max-model-len needs {_gib(one_seq)}, "
            f"{beside} leaves {_gib(max(free, 0))}; lower --max-model-len, free memory, or set --kv-cache-memory")
    cap = int(free * CPU_KV_MEMORY_FRACTION)
    if need <= cap:
        return need, beside
    if one_seq > cap:
        return one_seq, f"one sequence: {CPU_KV_MEMORY_FRACTION:.0%} of {beside} holds less"
    return cap, f"{CPU_KV_MEMORY_FRACTION:.0%} of {beside}; max-num-seqs x max-model-len would take {_gib(need)}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def kv_cache_blocks(cfg: EngineConfig, per_token: int, max_model_len: int, device: torch.device,
                    weight_bytes: int = 0) -> tuple[int, str]:
    """(blocks, why) of the paged KV cache. WEIGHT_BYTES: weights held in the page cache (CPU zero-copy)."""
    block_bytes = per_token * cfg.block_size
    one_seq = blocks_for(max_model_len, cfg.block_size) * block_bytes
    if cfg.kv_cache_memory is not None:
        budget, why = cfg.kv_cache_memory, "--kv-cache-memory"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used
        why = f"--gpu-memory-utilization {cfg.gpu_memory_utilization} of {_gib(total)}, {_gib(used)} in use"
    else:
        need = blocks_for(cfg.max_num_seqs * max_model_len, cfg.block_size) * block_bytes
        budget, why = cpu_kv_budget(need, one_seq, mem_available(), weight_bytes)
    blocks = budget // block_bytes
    if blocks < blocks_for(max_model_len, cfg.block_size):
        raise HotstartError(
            f"not enough memory for the KV cache: {max(budget, 0) / 2**20:.0f} MiB holds {max(blocks, 0) * cfg.block_size} "
            f"tokens, one sequence of --max-model-len {max_model_len} needs {max_model_len}; lower --max-model-len "
            "or give more memory (--kv-cache-memory / --gpu-memory-utilization)"
        )
    seqs = min(cfg.max_num_seqs, blocks * cfg.block_size // max_model_len)
    return int(blocks), f"{_gib(blocks * block_bytes)}: {seqs} seqs x {max_model_len} tokens; {why}"


def choice_seed(seed: int, index: int) -> int:
    """Choice INDEX of a seeded request samples with seed + index (wrapped to torch's seed range)."""
    s = seed + index
    return s - UINT64 if s >= UINT64 else s


class EngineCore:
    def __init__(self, runner: ModelRunner, cfg: EngineConfig, model_cfg: ModelConfig, num_blocks: int,
                 max_model_len: int, placement: Placement):
        self.runner, self.cfg, self.model_cfg = runner, cfg, model_cfg
        self.max_model_len, self.placement = max_model_len, placement
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.sampler = Sampler(model_cfg.vocab_size, placement.device, model_cfg.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its live choices
        self.default_generator = torch.Generator().manual_seed(cfg.seed)
        self.prompt_tokens_computed = 0
        self._num_prompt_logprobs = 0  # live sequences still collecting prompt logprobs
        self.grammars: Grammars | None = None  # built by the first constrained request (engine/grammar.py)

    @classmethod
    def build(cls, cfg: EngineConfig, on_span: SpanHook | None = None,
              on_progress: Callable[[int], None] | None = None, group: Group | None = None) -> EngineCore:
        """Load config, weights and KV cache; report each phase through on_span. With GROUP (tensor
        parallel, engine/distributed.py): this rank's part of the model and of the KV cache."""
        from hotstart.model.loader import load_model  # noqa: PLC0415

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
        phase("engine config", t, f"{model_cfg.architecture} on {placement.device} {str(placement.dtype)[6:]}{tp}")

        t = time.time()
        model = load_model(model_cfg, files, placement.device, placement.dtype, max_len, on_progress=on_progress,
                           tp=group.tp if group is not None else None)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        phase("weights loaded", t, f"{nbytes / 1e6:.0f} MB in {len(files)} file(s){tp}")

        t = time.time()
        per_token = kv_bytes_per_token(model, placement.dtype)
        zero_copy = placement.device.type == "cpu" and str(placement.dtype)[6:] == model_cfg.torch_dtype
        num_blocks, kv_why = kv_cache_blocks(cfg, per_token, max_len, placement.device, nbytes if zero_copy else 0)
        if group is not None:
            num_blocks = group.min_over_ranks(num_blocks)  # every rank holds its heads of the same blocks
        runner = ModelRunner(model, num_blocks, cfg.block_size, placement.device, placement.dtype)
        if group is not None and group.rank == 0:
            runner.peers = group
        phase("KV cache allocated", t, f"{num_blocks} blocks x {cfg.block_size} tokens ({kv_why})")
        return cls(runner, replace(cfg, weight_files=tuple(files)), model_cfg, num_blocks, max_len, placement)

    # --- requests -------------------------------------------------------------------------
    def _check(self, req: EngineRequest) -> str | None:
        """Why REQ can never run, or None."""
        p, n_prompt, vocab = req.params, len(req.prompt_token_ids), self.model_cfg.vocab_size
        total = n_prompt + p.max_tokens
        if req.request_id in self.requests:
            return f"duplicate request id {req.request_id}"
        if n_prompt == 0:
            return "the prompt is empty"
        if total > self.max_model_len:
            return (f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                    f"{total} ({n_prompt} in the prompt + {p.max_tokens} to generate)")
        if blocks_for(total, self.blocks.block_size) > self.blocks.num_blocks:
            return f"the request needs {total} tokens of KV cache, the engine holds {self.blocks.num_blocks * self.blocks.block_size}"
        if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
            return f"prompt token ids must be in [0, {vocab})"
        if not 1 <= p.n <= self.cfg.max_num_seqs:
            return f"n must be in [1, {self.cfg.max_num_seqs}] (the engine's max_num_seqs), got {p.n}"
        if any(t < 0 or t >= vocab for t in p.logit_bias):
            return f"logit_bias token ids must be in [0, {vocab})"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                return f"{name} must be in [0, {MAX_LOGPROBS}], got {k}"
        return None

    def add_request(self, req: EngineRequest) -> TokenOutput | None:
        """Queue REQ; returns an error output instead if it can never run."""
        error = self._check(req)
        if error:
            return TokenOutput(req.request_id, [], "error", error)
        n_prompt = len(req.prompt_token_ids)
        seq = Sequence(req.request_id, list(req.prompt_token_ids), n_prompt, req.params,
                       self._generator(req.params, 0), forks_pending=req.params.n - 1)
        if req.params.prompt_logprobs is not None and n_prompt > 1:
            seq.skip_prefix_cache, seq.max_chunk, seq.prompt_logprobs = True, PROMPT_LOGPROBS_CHUNK, []
            self._num_prompt_logprobs += 1
        self.sampler.register(seq)
        self.requests[req.request_id] = [seq]
        if req.params.grammar is None:
            self.scheduler.add(seq)
        else:  # scheduled once its matcher is compiled (off this loop); other streams step meanwhile
            if self.grammars is None:
                self.grammars = Grammars(self.sampler, self.cfg.model_path, self.model_cfg.vocab_size,
                                         self.model_cfg.eos_token_ids, self.placement.device)
                self.sampler.transforms.insert(0, self.grammars.mask)
            self.grammars.submit(seq)
        return None

    def _generator(self, p: SamplingParams, index: int) -> torch.Generator | None:
        if p.seed is not None:
            return torch.Generator().manual_seed(choice_seed(p.seed, index))
        return self.default_generator if p.temperature > 0 else None

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Choices 1..n-1 of PARENT's request, at its first sample: they share its blocks."""
        children = []
        for index in range(1, parent.forks_pending + 1):
            child = Sequence(parent.request_id, list(parent.token_ids), parent.prompt_len, parent.params,
                             self._generator(parent.params, index), index=index)
            self.blocks.fork(parent, child)
            self.sampler.register(child, like=parent)
            self.scheduler.add_running(child)
            children.append(child)
        parent.forks_pending = 0
        self.requests[parent.request_id].extend(children)
        return children

    def _drop(self, seq: Sequence) -> None:
        if self.grammars is not None:
            self.grammars.cancel(seq)
        self.scheduler.remove(seq)
        self.sampler.release(seq)
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs = None
            self._num_prompt_logprobs -= 1
        group = self.requests.get(seq.request_id)
        if group is not None:
            group.remove(seq)
            if not group:
                del self.requests[seq.request_id]

    def abort(self, request_ids: list[str], index: int | None = None) -> list[TokenOutput]:
        """Abort every choice of REQUEST_IDS; with INDEX only that choice, silently (the API process ended
        it: a stop string)."""
        out = []
        for rid in request_ids:
            for seq in list(self.requests.get(rid, ())):
                if index is not None:
                    if seq.index == index:
                        self._drop(seq)
                    continue
                self._drop(seq)
                out.append(TokenOutput(rid, seq.token_ids[seq.prompt_len + seq.num_sent:], "abort", index=seq.index))
        return out

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.grammars is not None and self.grammars.pending)

    def _admit_compiled(self, wait: float) -> list[TokenOutput]:
        """Schedule the sequences whose grammar is compiled; error outputs for those that failed."""
        errors = []
        for seq, error in self.grammars.ready(wait):
            if error is None:
                self.scheduler.add(seq)
            else:
                self._drop(seq)
                errors.append(TokenOutput(seq.request_id, [], "error", error, index=seq.index))
        return errors

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used, kv_blocks_total=self.blocks.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.blocks.cache_queries, prefix_cache_hits=self.blocks.cache_hits,
            prompt_tokens_computed=self.prompt_tokens_computed,
        )

    # --- the step -------------------------------------------------------------------------
    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.model_cfg.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if (grammar := grammar_finish(seq)) is not None:
            return grammar
        if seq.num_generated >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _prompt_positions(seq: Sequence, n: int) -> range:
        """Prompt tokens j (1..P-1) whose logprob this step's chunk of SEQ yields (from the logits at j-1)
        and that it has not collected yet (a recomputation after preemption yields none)."""
        if seq.prompt_logprobs is None:
            return range(0)
        start = seq.num_computed_tokens
        return range(max(start + 1, len(seq.prompt_logprobs) + 1), min(start + n, seq.prompt_len - 1) + 1)

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        errors = []
        if self.grammars is not None and self.grammars.pending:
            errors = self._admit_compiled(0.0 if self.scheduler.has_work() else WAIT_S)
        batch = self.scheduler.schedule()
        if not batch:
            return errors
        copies = self.blocks.take_copies()
        if copies:
            self.runner.copy_blocks(copies)
        # a sequence samples once all its tokens are computed (end of prefill, or a decode)
        sampling = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in batch]
        wanted = None
        if self._num_prompt_logprobs:
            wanted = [self._prompt_positions(seq, n) for seq, n in batch]
        logits = self.runner.forward(batch, sampling, [bool(w) for w in wanted] if wanted else None)
        if wanted:
            self._collect_prompt_logprobs(batch, wanted, logits, sum(sampling))
        for seq, n in batch:
            self.prompt_tokens_computed += max(0, min(seq.num_computed_tokens + n, seq.prompt_len)
                                               - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.blocks.cache_full_blocks(seq)
        sampled = [seq for (seq, _), s in zip(batch, sampling) if s]
        if not sampled:
            return errors
        logits = logits[:len(sampled)]
        if any(seq.forks_pending for seq in sampled):
            rows, expanded = [], []
            for i, seq in enumerate(sampled):
                group = [seq, *self._fork(seq)] if seq.forks_pending else [seq]
                rows += [i] * len(group)
                expanded += group
            logits = logits[torch.tensor(rows, device=logits.device)]
            sampled = expanded
        tokens, logprobs = self.sampler.sample(logits, sampled)
        if self.sampler.num_constrained:
            self.grammars.consume(sampled, tokens)
        outputs = errors
        for i, (seq, token) in enumerate(zip(sampled, tokens)):
            seq.token_ids.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            new = seq.token_ids[seq.prompt_len + seq.num_sent:]
            seq.num_sent += len(new)
            out = TokenOutput(seq.request_id, new, seq.finish_reason, index=seq.index)
            if logprobs is not None and logprobs[i] is not None:
                out.logprobs = [logprobs[i]]
            if seq.prompt_logprobs is not None:  # complete now: sent once, with the first token
                out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
                self._num_prompt_logprobs -= 1
            outputs.append(out)
            if seq.finished:
                self._drop(seq)
        return outputs

    def _collect_prompt_logprobs(self, batch: list[tuple[Sequence, int]], wanted: list[range],
                                 logits: torch.Tensor, offset: int) -> None:
        """Prompt logprobs from the rows after the first OFFSET (the sampling rows) of LOGITS."""
        for (seq, n), positions in zip(batch, wanted, strict=True):
            if not positions:
                continue
            start = seq.num_computed_tokens
            chunk = logits[offset:offset + n]  # logits at positions start .. start+n-1
            rows = torch.tensor([j - 1 - start for j in positions], device=chunk.device)
            seq.prompt_logprobs += prompt_logprobs(chunk[rows], [seq.token_ids[j] for j in positions],
                                                   seq.params.prompt_logprobs)
            offset += n
