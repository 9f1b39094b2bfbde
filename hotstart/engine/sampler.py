"""Token sampling per sequence: greedy (temperature 0), temperature, top-k, top-p, seeded generators."""

from __future__ import annotations

import torch

from hotstart.engine.sequence import Sequence


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
