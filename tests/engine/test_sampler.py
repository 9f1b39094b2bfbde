"""The sampler's random path (engine/sampler.py) against the exact distribution it must draw from:
softmax of logits / temperature, restricted to the top-k, then to the smallest top-p nucleus."""

from __future__ import annotations

import pytest
import torch

from hotstart.engine.sampler import _top_p_kept, sample
from hotstart.engine.sequence import Sequence
from hotstart.sampling_params import SamplingParams


def seqs(n: int, seed: int = 0, **params) -> list[Sequence]:
    return [Sequence(f"r{i}", [1], 1, SamplingParams(max_tokens=4, **params),
                     torch.Generator().manual_seed(seed + i)) for i in range(n)]


def exact(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits: [V] -> [V] float64 probabilities, by the definition (a full sort, no shortcuts)."""
    x = logits.double() / temperature
    if 0 < top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
    p = torch.softmax(x, -1)
    if top_p < 1.0:
        values, order = torch.sort(p, descending=True)
        values[(values.cumsum(0) - values) >= top_p] = 0
        p = torch.zeros_like(p).scatter_(0, order, values)
    return p / p.sum()


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.6, top_k=7),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=12, top_p=0.9),
])
def test_frequencies_follow_the_exact_distribution(params):
    v, n = 40, 6000
    logits = torch.linspace(-3, 2, v)[torch.randperm(v, generator=torch.Generator().manual_seed(1))]
    tokens = sample(logits.repeat(n, 1), seqs(n, **params))
    p = exact(logits, **params)
    freq = torch.bincount(torch.tensor(tokens), minlength=v).double() / n
    assert set(tokens) <= set(torch.nonzero(p).flatten().tolist())  # nothing outside top-k / the nucleus
    # each token's frequency within 5 standard errors of its probability (fixed seeds: deterministic)
    bound = 5 * torch.sqrt(p * (1 - p) / n) + 1e-9
    assert bool(((freq - p).abs() <= bound).all()), (freq - p).abs().max()


def test_a_mixed_batch_keeps_greedy_rows_and_never_picks_a_masked_token():
    v = 1000
    logits = torch.randn(8, v, generator=torch.Generator().manual_seed(3))
    logits[:, -300:] = float("-inf")  # masked tail, the last token included (a bias or a grammar mask)
    greedy = logits.argmax(-1).tolist()
    group = seqs(8, temperature=2.0)
    for i in (0, 5):
        group[i].params = SamplingParams(max_tokens=4, temperature=0.0)
    for i in (2, 6):
        group[i].params = SamplingParams(max_tokens=4, temperature=1.5, top_p=0.5)
    for _ in range(50):
        tokens = sample(logits.clone(), group)
        assert tokens[0] == greedy[0] and tokens[5] == greedy[5]
        assert all(t < v - 300 for t in tokens)


def test_seeded_rows_repeat():
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(4))
    groups = [seqs(4, 7, temperature=1.0, top_p=0.95) for _ in range(2)]
    runs = [[sample(logits.clone(), group) for _ in range(3)] for group in groups]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1  # the generators advance between steps


@pytest.mark.parametrize("v,top_p,scale",
                         [(50, 0.7, 1.0), (6000, 0.3, 4.0), (6000, 0.999, 0.05), (6000, 0.99, 0.5)])
def test_top_p_nucleus_equals_the_full_sort(v, top_p, scale):
    """The partial selection (256, then 4,096 tokens) or, when the nucleus is wider, the full sort."""
    p = torch.softmax(torch.randn(v, generator=torch.Generator().manual_seed(v)) * scale, -1)
    values, ids = _top_p_kept(p, top_p)
    ref = exact(torch.log(p), 1.0, top_p=top_p)
    assert set(ids.tolist()) == set(torch.nonzero(ref).flatten().tolist())
    assert torch.equal(values, p[ids]) and bool((values[:-1] >= values[1:]).all())
