"""Batched logits transforms: each is one [B, V] operation over the rows of a step that need it.

A transform is a callable (logits [B, V] float32, seqs) -> logits (it may work in place), run in order
by the Sampler after the raw logprobs are taken and before the greedy / random choice. What a
transform needs of a sequence is built once, when the request arrives (SeqSampling, seq.sampling);
per step only index tensors of the rows concerned are built. A grammar's token mask (engine/grammar.py)
is one more callable, put first in Sampler.transforms by the first constrained request.

Definitions (the references the tests compare with):
  min_tokens      vLLM: eos (unless ignore_eos) and stop_token_ids are -inf until min_tokens are generated
  logit_bias      OpenAI: bias added to the token's logit
  repetition      HF RepetitionPenaltyLogitsProcessor, over prompt + generated tokens:
                  logit / p where logit > 0, else logit x p
  presence, frequency   OpenAI, over generated tokens: logit -= frequency x count + presence x [count > 0]
  min_p           vLLM / HF MinPLogitsWarper, on the temperature-scaled distribution: drop tokens with
                  prob < min_p x top prob, i.e. logit < top logit + temperature x ln(min_p)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from hotstart.engine.sequence import Sequence


@dataclass
class SeqSampling:
    """What the transforms need of one sequence beyond its params."""

    stop_ids: list[int] = field(default_factory=list)  # masked while num_generated < min_tokens
    bias_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    count_row: int = -1  # its row in TokenCounts (presence / frequency / repetition penalties), or -1
    matcher: Any = None  # its grammar's llguidance LLMatcher (engine/grammar.py), once compiled


def penalized(seq: Sequence) -> bool:
    p = seq.params
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


class TokenCounts:
    """Generated-token counts ([rows, V] float32), one row per live penalized sequence, kept
    incrementally (one index_put_ per step adds the sampled tokens), and per row the token ids a penalty
    applies to: the prompt's (for repetition) and every generated one, each once, so a step touches only
    those columns (hundreds), not the whole [R, V] rows. Built on first use, grown by doubling."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.counts: torch.Tensor | None = None
        self._free: list[int] = []
        self._seen: dict[int, tuple[set[int], list[int]]] = {}  # row -> (ids, the same in first-seen order)
        self._cols: dict[int, torch.Tensor] = {}  # row -> its ids as a tensor (rebuilt when a new id appears)

    @torch.inference_mode()
    def _grow(self) -> None:
        old = 0 if self.counts is None else self.counts.shape[0]
        rows = max(8, 2 * old)
        counts = torch.zeros(rows, self.vocab_size, device=self.device)
        if old:
            counts[:old] = self.counts
        self.counts = counts
        self._free.extend(range(rows - 1, old - 1, -1))

    @torch.inference_mode()
    def acquire(self, prompt_ids: list[int] | None = None, like: int = -1) -> int:
        """A zeroed row whose penalties also cover PROMPT_IDS; or a copy of row LIKE (a forked choice)."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        if like >= 0:
            self.counts[row] = self.counts[like]
            ids, order = self._seen[like]
            self._seen[row] = (set(ids), list(order))
        else:
            self.counts[row].zero_()
            order = list(dict.fromkeys(prompt_ids or ()))
            self._seen[row] = (set(order), order)
        self._cols.pop(row, None)
        return row

    def release(self, row: int) -> None:
        self._seen.pop(row, None)
        self._cols.pop(row, None)
        self._free.append(row)

    @torch.inference_mode()
    def add(self, rows: list[int], tokens: list[int]) -> None:
        """One sampled token per row."""
        if rows:
            r = torch.tensor(rows, device=self.device)
            t = torch.tensor(tokens, device=self.device)
            self.counts.index_put_((r, t), torch.ones(len(rows), device=self.device), accumulate=True)
            for row, tok in zip(rows, tokens, strict=True):
                ids, order = self._seen[row]
                if tok not in ids:
                    ids.add(tok)
                    order.append(tok)
                    self._cols.pop(row, None)

    def cols(self, row: int) -> torch.Tensor:
        """The ids row ROW's penalties apply to (prompt ids for repetition, generated ids), unique."""
        c = self._cols.get(row)
        if c is None:
            c = self._cols[row] = torch.tensor(self._seen[row][1], dtype=torch.long, device=self.device)
        return c


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=logits.device)


def mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """min_tokens: eos / stop tokens are impossible until enough tokens are generated."""
    rows, cols = [], []
    for i, s in enumerate(seqs):
        st = s.sampling
        if st is not None and st.stop_ids and s.num_generated < s.params.min_tokens:
            rows += [i] * len(st.stop_ids)
            cols += st.stop_ids
    if rows:
        logits[_rows(logits, rows), _rows(logits, cols)] = float("-inf")
    return logits


def add_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows, cols, values = [], [], []
    for i, s in enumerate(seqs):
        st = s.sampling
        if st is not None and st.bias_ids:
            rows += [i] * len(st.bias_ids)
            cols += st.bias_ids
            values += st.bias_values
    if rows:
        bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_((_rows(logits, rows), _rows(logits, cols)), bias, accumulate=True)
    return logits


class Penalties:
    """Repetition, then presence / frequency penalties, on the columns TokenCounts lists per row only:
    elsewhere the count is 0 and the token unseen, so the penalties change nothing there."""

    def __init__(self, counts: TokenCounts):
        self.counts = counts

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        idx = [i for i, s in enumerate(seqs) if s.sampling is not None and s.sampling.count_row >= 0]
        if not idx:
            return logits
        params = [seqs[i].params for i in idx]
        slots = [seqs[i].sampling.count_row for i in idx]
        cols = [self.counts.cols(r) for r in slots]
        lens = torch.tensor([c.numel() for c in cols], device=logits.device)
        if not int(lens.sum()):
            return logits
        dev = logits.device
        c = torch.cat(cols)  # [N]: every (row, column) pair a penalty applies to, each once
        r = torch.repeat_interleave(_rows(logits, idx), lens)
        sub = logits[r, c]  # [N]
        counts = self.counts.counts[torch.repeat_interleave(_rows(logits, slots), lens), c]  # [N]
        if any(p.repetition_penalty != 1 for p in params):  # every listed column is prompt or generated
            rep = torch.repeat_interleave(
                torch.tensor([p.repetition_penalty for p in params], device=dev), lens
            )
            sub = torch.where(sub > 0, sub / rep, sub * rep)
        if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
            freq = torch.repeat_interleave(
                torch.tensor([p.frequency_penalty for p in params], device=dev), lens
            )
            pres = torch.repeat_interleave(
                torch.tensor([p.presence_penalty for p in params], device=dev), lens
            )
            sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits[r, c] = sub
        return logits


def min_p_filter(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """min_p on the distribution the row samples from (temperature-scaled), without scaling the logits:
    p_i < min_p x p_max  <=>  logit_i < logit_max + temperature x ln(min_p). Greedy rows are left alone
    (the top token always survives)."""
    idx = [i for i, s in enumerate(seqs) if s.params.min_p > 0 and s.params.temperature > 0]
    if not idx:
        return logits
    rows = _rows(logits, idx)
    sub = logits[rows]
    shift = torch.tensor([seqs[i].params.temperature * math.log(seqs[i].params.min_p) for i in idx],
                         dtype=sub.dtype, device=logits.device)[:, None]
    floor = sub.max(dim=-1, keepdim=True).values + shift
    logits[rows] = sub.masked_fill(sub < floor, float("-inf"))
    return logits
