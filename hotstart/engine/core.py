"""The engine core: a plain class whose step() is schedule -> execute -> update.

schedule picks this step's sequences and token counts, execute runs the forward through the executor
(engine/executor.py: this process, or a tensor-parallel group), update advances the sequences' counters,
samples and builds the outputs. With --speculative-config, decoding sequences may carry a draft that
the step verifies (engine/spec_decode.py: drafted before scheduling, verified in _verify). The process
shell (worker.py) and the offline `hotstart generate` both drive it; tests call it directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hotstart.config import EngineConfig, ModelConfig
from hotstart.engine import faults
from hotstart.engine.admission import request_error
from hotstart.engine.block_manager import BlockManager, freeable_window
from hotstart.engine.build import SpanHook, load
from hotstart.engine.executor import Executor
from hotstart.engine.grammar import WAIT_S, Grammars, grammar_finish
from hotstart.engine.kv_store import PrefixStore
from hotstart.engine.placement import Placement
from hotstart.engine.sampler import Sampler, prompt_logprobs
from hotstart.engine.scheduler import Scheduler
from hotstart.engine.sequence import Sequence
from hotstart.engine.step_guard import Scheduled, fail, guarded
from hotstart.messages import EngineRequest, EngineStats, TokenLogprobs, TokenOutput
from hotstart.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hotstart.engine.distributed import Group

PROMPT_LOGPROBS_CHUNK = 256  # prompt tokens per step of a request with prompt logprobs ([chunk, V] logits)
UINT64 = 1 << 64


def choice_seed(seed: int, index: int) -> int:
    """Choice INDEX of a seeded request samples with seed + index (wrapped to torch's seed range)."""
    s = seed + index
    return s - UINT64 if s >= UINT64 else s


class EngineCore:
    def __init__(self, executor: Executor, cfg: EngineConfig, model_cfg: ModelConfig, num_blocks: int,
                 max_model_len: int, placement: Placement):
        self.executor, self.cfg, self.model_cfg = executor, cfg, model_cfg
        self.runner = executor.runner  # this process's (rank 0's): the fast path installs into it
        self.max_model_len, self.placement = max_model_len, placement
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, freeable_window(
            [model_cfg.layer_window(i) for i in range(model_cfg.num_hidden_layers)]))
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.sampler = Sampler(model_cfg.vocab_size, placement.device, model_cfg.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its live choices
        self.default_generator = torch.Generator().manual_seed(cfg.seed)
        self.prompt_tokens_computed = 0
        self._num_prompt_logprobs = 0  # live sequences still collecting prompt logprobs
        self.grammars: Grammars | None = None  # built by the first constrained request (engine/grammar.py)
        self.spec = None  # the NgramSpeculator of --speculative-config (engine/spec_decode.py)
        self.stage = "forward"  # how far a step got: block copies, forward, sampling, token bookkeeping
        self.faults = faults.parse(cfg.debug_fault)  # --debug-fault: token id -> action (off: empty)
        if cfg.speculative_config:
            from hotstart.engine.spec_decode import NgramSpeculator  # noqa: PLC0415
            from hotstart.spec_config import SpecConfig  # noqa: PLC0415 - only with the option

            self.spec = NgramSpeculator(SpecConfig.parse(cfg.speculative_config), max_model_len)
        self.scheduler.gate = self.store = PrefixStore.open(self)  # the prefix cache on disk, or None

    @classmethod
    def build(cls, cfg: EngineConfig, on_span: SpanHook | None = None,
              on_progress: Callable[[int], None] | None = None, group: Group | None = None) -> EngineCore:
        """Load config, weights and KV cache (engine/build.py); report each phase through ON_SPAN. With
        GROUP (tensor parallel): this rank's part, under the tensor-parallel executor (ranks > 0 then
        only run its follow())."""
        return cls(*load(cfg, on_span, on_progress, group))

    # --- requests -------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> TokenOutput | None:
        """Queue REQ; returns an error output instead if it can never run, or if adding it failed (what it
        set up is dropped: the engine serves on)."""
        error = request_error(req, self.cfg, self.model_cfg, self.max_model_len, self.blocks,
                              req.request_id in self.requests)
        if error:
            return TokenOutput(req.request_id, [], "error", error)
        try:
            return self._add(req)
        except Exception as e:  # noqa: BLE001 - this request alone
            return fail(self, req.request_id, e, "while it was added")

    def _add(self, req: EngineRequest) -> None:
        if self.faults:
            faults.check(self.faults, "add", req.prompt_token_ids)
        n_prompt = len(req.prompt_token_ids)
        seq = Sequence(req.request_id, list(req.prompt_token_ids), n_prompt, req.params,
                       self._generator(req.params, 0), forks_pending=req.params.n - 1)
        self.requests[req.request_id] = [seq]  # first: a failure below is undone by abort()
        if req.params.prompt_logprobs is not None and n_prompt > 1:
            seq.skip_prefix_cache, seq.max_chunk, seq.prompt_logprobs = True, PROMPT_LOGPROBS_CHUNK, []
            self._num_prompt_logprobs += 1
        self.sampler.register(seq)
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

    def _admit_compiled(self) -> list[TokenOutput]:
        """Schedule the sequences whose grammar is compiled; error outputs for those that failed. With
        nothing else to run, wait a little for one (WAIT_S)."""
        if self.grammars is None or not self.grammars.pending:
            return []
        errors = []
        for seq, error in self.grammars.ready(0.0 if self.scheduler.has_work() else WAIT_S):
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
            **({} if self.spec is None else self.spec.stats()), **(self.store.stats() if self.store else {}),
        )

    # --- the step -------------------------------------------------------------------------
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
        """One iteration: admit the grammar-ready requests, then schedule -> execute -> update. Returns
        the new tokens of every sampled sequence (and the errors of grammars that failed to compile)."""
        outputs = self._admit_compiled()
        scheduled = self._schedule()
        if scheduled is not None:
            outputs += guarded(self, scheduled)  # a failure ends the requests it is traced to
        return outputs

    def _schedule(self) -> Scheduled | None:
        """This step's sequences and token counts (the scheduler), and what each wants back; None: idle."""
        if self.spec is not None:
            self.spec.draft(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            return None
        # a sequence samples once all its tokens are computed (end of prefill, or a decode, drafted or not)
        sampling = [seq.num_computed_tokens + n >= seq.num_tokens for seq, n in batch]
        positions = None
        if self._num_prompt_logprobs:
            positions = [self._prompt_positions(seq, n) for seq, n in batch]
        drafts = None
        if self.spec is not None and any(seq.draft for seq, _ in batch):
            drafts = [len(seq.draft) for seq, _ in batch]
        return Scheduled(batch, sampling, positions, drafts)

    def _execute(self, s: Scheduled) -> torch.Tensor | None:
        """The block copies the scheduler asked for, then the forward: float32 logits [N, V], the N
        sampling rows first, then each prompt-logprob entry's [n_i, V] (ModelRunner.forward)."""
        self.stage = "block copies"
        copies = self.blocks.take_copies()
        if copies:
            self.executor.copy_blocks(copies)
        self.stage = "forward"
        if self.faults:
            faults.check_step(self.faults, s.batch)
        return self.executor.execute(s.batch, s.want_logits, s.all_logits)

    def _update(self, s: Scheduled, logits: torch.Tensor | None) -> list[TokenOutput]:
        """Postprocess the forward: collect prompt logprobs, advance the counters, then sample the
        sequences whose tokens are all computed (forking n > 1 requests first), verify the drafts, and
        report them."""
        want, all_logits = s.want_logits, s.all_logits
        self.stage = "sampling"  # until _sample commits: undone and retried on a failure (step_guard)
        if s.prompt_positions:
            self._collect_prompt_logprobs(s.batch, s.prompt_positions, all_logits, logits, sum(want))
        self._advance(s.batch, s.drafts)
        outputs = []
        sampled = [seq for (seq, _), samples in zip(s.batch, want) if samples]
        if sampled:
            plain, sampled = self._fork_at_first_sample(logits[:len(sampled)], sampled)
            tokens, logprobs = self._sample(plain, sampled)
            for i, (seq, token) in enumerate(zip(sampled, tokens)):
                if seq.request_id not in self.requests:  # failed with another of its choices
                    continue
                try:
                    outputs.append(self._append(seq, token, logprobs[i] if logprobs is not None else None))
                except Exception as e:  # noqa: BLE001 - this request alone
                    outputs.append(fail(self, seq.request_id, e, "in the token bookkeeping"))
        if s.drafts:
            outputs += self._verify(s, all_logits, logits, sum(want))
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]
                ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token per row of LOGITS [len(SEQS), V]; the grammars take them."""
        tokens, logprobs = self.sampler.sample(logits, seqs)
        self.stage = "token bookkeeping"  # the sampler's counts moved, matchers move next: no undoing now
        if self.sampler.num_constrained:
            self.grammars.consume(seqs, tokens)
        return tokens, logprobs

    def _verify(self, s: Scheduled, all_logits: list[bool], logits: torch.Tensor, offset: int
                ) -> list[TokenOutput]:
        """The drafted entries of S: position by position (all of them at once), sample from the logits
        at it as a plain decode would and go on while the token equals the draft's
        (engine/spec_decode.py); then roll the sequences back to what they accepted and report them."""
        self.stage = "token bookkeeping"
        entries: list[tuple[Sequence, list[int], int]] = []  # (sequence, draft, its first logits row)
        for (seq, n), extra, k in zip(s.batch, all_logits, s.drafts, strict=True):
            if k:
                entries.append((seq, seq.draft, offset))
            offset += n if extra else 0
        accepted = [0] * len(entries)
        lps: list[list[TokenLogprobs]] = [[] for _ in entries]
        live = list(range(len(entries)))
        argmax = None  # plain greedy entries only: every position's token at once
        if not self.sampler.num_active and all(seq.params.temperature == 0 for seq, _, _ in entries):
            rows = [first + j for _, draft, first in entries for j in range(len(draft) + 1)]
            flat = logits[torch.tensor(rows, device=logits.device)].argmax(dim=-1).tolist()
            starts = itertools.accumulate((len(draft) + 1 for _, draft, _ in entries), initial=0)
            argmax = [flat[a:a + len(draft) + 1] for (_, draft, _), a in zip(entries, starts)]
        for j in range(max(len(draft) for _, draft, _ in entries) + 1):
            if not live:
                break
            seqs = [entries[e][0] for e in live]
            if argmax is not None:
                tokens, logprobs = [argmax[e][j] for e in live], None
            else:
                rows = torch.tensor([entries[e][2] + j for e in live], device=logits.device)
                tokens, logprobs = self._sample(logits[rows], seqs)
            going = []
            for i, (e, token) in enumerate(zip(live, tokens, strict=True)):
                seq, draft, _ = entries[e]
                self._take(seq, token)
                if logprobs is not None and logprobs[i] is not None:
                    lps[e].append(logprobs[i])
                if j < len(draft) and token == draft[j]:
                    accepted[e] += 1
                    if not seq.finished:
                        going.append(e)
            live = going
        outputs = []
        for e, (seq, draft, _) in enumerate(entries):
            seq.draft = []
            self.spec.record(seq, len(draft), accepted[e])
            seq.num_computed_tokens = seq.num_tokens - 1  # the K/V of rejected drafts is overwritten later
            self.blocks.trim(seq, seq.num_tokens)
            self.blocks.cache_full_blocks(seq)
            outputs.append(self._output(seq, lps[e] or None))
        return outputs

    def _advance(self, batch: list[tuple[Sequence, int]], drafts: list[int] | None) -> None:
        """num_computed_tokens += the step's tokens; register the blocks this filled in the prefix cache.
        Drafted entries advance in _verify, by what they accept."""
        for i, (seq, n) in enumerate(batch):
            if drafts is not None and drafts[i]:
                continue
            self.prompt_tokens_computed += max(0, min(seq.num_computed_tokens + n, seq.prompt_len)
                                               - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.blocks.cache_full_blocks(seq)

    def _fork_at_first_sample(self, logits: torch.Tensor, sampled: list[Sequence]
                              ) -> tuple[torch.Tensor, list[Sequence]]:
        """LOGITS [len(SAMPLED), V] and SAMPLED, with each sequence of pending choices followed by its
        forks, which sample from copies of its row."""
        if not any(seq.forks_pending for seq in sampled):
            return logits, sampled
        rows, expanded = [], []
        for i, seq in enumerate(sampled):
            group = [seq, *self._fork(seq)] if seq.forks_pending else [seq]
            rows += [i] * len(group)
            expanded += group
        return logits[torch.tensor(rows, device=logits.device)], expanded

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> TokenOutput:
        """Append TOKEN to SEQ, decide whether it finished, and build its output (the sequence is dropped
        once finished)."""
        self._take(seq, token)
        return self._output(seq, None if logprobs is None else [logprobs])

    def _take(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        seq.finish_reason = self._finish_reason(seq, token)

    def _output(self, seq: Sequence, logprobs: list[TokenLogprobs] | None) -> TokenOutput:
        """SEQ's tokens not reported yet (with their LOGPROBS); drops SEQ if it finished."""
        new = seq.token_ids[seq.prompt_len + seq.num_sent:]
        seq.num_sent += len(new)
        out = TokenOutput(seq.request_id, new, seq.finish_reason, index=seq.index)
        if logprobs is not None:
            out.logprobs = logprobs
        if seq.prompt_logprobs is not None:  # complete now: sent once, with the first token
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            self._num_prompt_logprobs -= 1
        if seq.finished:
            self._drop(seq)
        return out

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

    def _collect_prompt_logprobs(self, batch: list[tuple[Sequence, int]], wanted: list[range],
                                 all_logits: list[bool], logits: torch.Tensor, offset: int) -> None:
        """Prompt logprobs from the rows after the first OFFSET (the sampling rows) of LOGITS; ALL_LOGITS:
        [B] the entries with rows there (drafts too)."""
        for (seq, n), positions, extra in zip(batch, wanted, all_logits, strict=True):
            if not positions:
                offset += n if extra else 0
                continue
            start = seq.num_computed_tokens
            chunk = logits[offset:offset + n]  # logits at positions start .. start+n-1
            rows = torch.tensor([j - 1 - start for j in positions], device=chunk.device)
            seq.prompt_logprobs += prompt_logprobs(chunk[rows], [seq.token_ids[j] for j in positions],
                                                   seq.params.prompt_logprobs)
            offset += n
