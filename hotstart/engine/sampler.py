"""Token sampling: greedy (temperature 0), temperature, top-k, top-p, seeded generators; the batched
logits transforms (penalties, biases, min_tokens, min_p) and raw logprobs.

`sample` is the plain path, unchanged whatever the Sampler gains: a step takes it whenever no live
sequence needs more (one counter, checked once per step). Otherwise Sampler.sample runs, in order:
raw logprobs (log-softmax of the model's logits, before any transform, as vLLM reports them) for the
rows that asked; each of Sampler.transforms on the whole [B, V] batch (logits_transforms.py); then the
same choice as the plain path on the transformed logits.
"""

from __future__ import annotations

import torch

from hotstart.engine.logits_transforms import (
    Penalties,
    SeqSampling,
    TokenCounts,
    add_logit_bias,
    mask_stop_tokens,
    min_p_filter,
    penalized,
)
from hotstart.engine.sequence import Sequence
from hotstart.messages import TokenLogprobs


def _sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    # logits: [V] float32
    p = seq.params
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = cumulative - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [N, V] float32, one row per sequence -> one token id each."""
    greedy = logits.argmax(dim=-1).tolist()
    if all(s.params.temperature == 0 for s in seqs):
        return greedy
    # Random sampling runs on the CPU: per-request seeded generators live there, whatever the device.
    host = logits.cpu()
    return [greedy[i] if s.params.temperature == 0 else _sample_row(host[i], s) for i, s in enumerate(seqs)]


def _top(logprobs: torch.Tensor, chosen: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """logprobs: [R, V] -> per row the logprob of CHOSEN[r] and the top KS[r] (one transfer)."""
    pick = torch.tensor(chosen, dtype=torch.long, device=logprobs.device)[:, None]
    values = logprobs.gather(1, pick)[:, 0].tolist()
    k = max(ks)
    if k == 0:
        return [TokenLogprobs(v) for v in values]
    top = torch.topk(logprobs, k, dim=-1)
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprobs(v, i[:kr], t[:kr]) for v, i, t, kr in zip(values, top_ids, top_values, ks, strict=True)
    ]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """logits: [M, V] at the positions before TARGETS (prompt tokens) -> their raw logprobs and top K."""
    return _top(torch.log_softmax(logits, dim=-1), targets, [k] * len(targets))


class Sampler:
    """The per-engine sampler: per-sequence state for the transforms, and the step's sampling."""

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: tuple[int, ...] = ()):
        self.eos_token_ids = eos_token_ids
        self.counts = TokenCounts(vocab_size, device)
        # [B, V] -> [B, V], in order; each touches only the rows that need it
        self.transforms = [mask_stop_tokens, add_logit_bias, Penalties(self.counts), min_p_filter]
        self.num_active = 0  # live sequences with seq.sampling set: 0 means every step takes the plain path
        self.num_constrained = 0  # live sequences with a grammar matcher attached

    def register(self, seq: Sequence, like: Sequence | None = None) -> None:
        """Build SEQ's state if its params need more than the plain path (LIKE: the choice it forks from)."""
        p = seq.params
        if not p.needs_sampler_state:
            return
        if like is not None and like.sampling is not None:
            st = like.sampling
            row = self.counts.acquire(like=st.count_row) if st.count_row >= 0 else -1
            seq.sampling = SeqSampling(st.stop_ids, st.bias_ids, st.bias_values, row)
            if st.matcher is not None:
                self.attach_matcher(seq, st.matcher.deep_copy())
        else:
            stops = [] if p.min_tokens == 0 else list(dict.fromkeys(
                [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]))
            row = -1
            if penalized(seq):
                row = self.counts.acquire(
                    seq.token_ids[: seq.prompt_len] if p.repetition_penalty != 1 else None
                )
            seq.sampling = SeqSampling(stops, list(p.logit_bias), list(p.logit_bias.values()), row)
        self.num_active += 1

    def attach_matcher(self, seq: Sequence, matcher) -> None:
        """SEQ's grammar is compiled (engine/grammar.py): its rows are masked from now on."""
        seq.sampling.matcher = matcher
        self.num_constrained += 1

    def release(self, seq: Sequence) -> None:
        if seq.sampling is None:
            return
        if seq.sampling.count_row >= 0:
            self.counts.release(seq.sampling.count_row)
        if seq.sampling.matcher is not None:
            self.num_constrained -= 1
        seq.sampling = None
        self.num_active -= 1

    @torch.inference_mode()  # the logits are the runner's inference tensors; transforms write into them
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]
               ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """logits: [N, V] float32 (the runner's; transformed in place) -> (token ids, per-row logprobs or
        None when no row asked)."""
        if not self.num_active:
            return sample(logits, seqs), None
        lp_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw = None
        if lp_rows:
            picked = (
                logits if len(lp_rows) == len(seqs) else logits[torch.tensor(lp_rows, device=logits.device)]
            )
            raw = torch.log_softmax(picked, dim=-1)  # a new tensor: the transforms below do not touch it
        for transform in self.transforms:
            logits = transform(logits, seqs)
        tokens = sample(logits, seqs)
        counted = [(s.sampling.count_row, t) for s, t in zip(seqs, tokens, strict=True)
                   if s.sampling is not None and s.sampling.count_row >= 0]
        if counted:
            self.counts.add([r for r, _ in counted], [t for _, t in counted])
        if raw is None:
            return tokens, None
        out: list[TokenLogprobs | None] = [None] * len(seqs)
        ks = [seqs[i].params.logprobs for i in lp_rows]
        for i, lp in zip(lp_rows, _top(raw, [tokens[i] for i in lp_rows], ks), strict=True):
            out[i] = lp
        return tokens, out
