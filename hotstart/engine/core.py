"""The engine core: a plain class with step() (schedule -> forward -> sample -> outputs).

The process shell (worker.py) and the offline `hotstart generate` both drive it; tests call it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from hotstart.config import EngineConfig, ModelConfig, load_model_config
from hotstart.engine.block_manager import BlockManager, blocks_for
from hotstart.engine.grammar import WAIT_S, Grammars, grammar_finish
from hotstart.engine.model_runner import ModelRunner, kv_bytes_per_token
from hotstart.engine.placement import Placement, kv_cache_blocks, max_model_len_for, resolve_placement
from hotstart.engine.sampler import Sampler, prompt_logprobs
from hotstart.engine.scheduler import Scheduler
from hotstart.engine.sequence import Sequence
from hotstart.messages import EngineRequest, EngineStats, SamplingParams, Span, TokenOutput
from hotstart.model.files import weight_files

if TYPE_CHECKING:
    from hotstart.engine.distributed import Group

SpanHook = Callable[[Span], None]  # told of each startup phase as it ends

PROMPT_LOGPROBS_CHUNK = 256  # prompt tokens per step of a request with prompt logprobs ([chunk, V] logits)
MAX_LOGPROBS = 20
UINT64 = 1 << 64


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
            return (
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{total} ({n_prompt} in the prompt + {p.max_tokens} to generate)"
            )
        if blocks_for(total, self.blocks.block_size) > self.blocks.num_blocks:
            held = self.blocks.num_blocks * self.blocks.block_size
            return f"the request needs {total} tokens of KV cache, the engine holds {held}"
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
                out.append(
                    TokenOutput(rid, seq.token_ids[seq.prompt_len + seq.num_sent :], "abort", index=seq.index)
                )
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
