"""Decode attention over the paged cache (model/attention.py) against a per-sequence float32 reference:
chunked (several chunks, ragged contexts) and in one gather, on odd shapes (GQA groups, head_dim 80,
blocks of 4 - 16), sliding windows and Gemma 2's logit soft-capping; the CPU kernel (bf16 too); and a batch
of ragged streams through the engine, chunked and not."""

from __future__ import annotations

import random

import pytest
import torch

from hotstart.model.attention import AttnMetadata, DecodeGroup, paged_attention

SCALE = 0.125


def _reference(q, k_cache, v_cache, tables, contexts, bs, window, softcap):
    # one sequence at a time, its keys read slot by slot: [B, H, D]
    kvh, out = k_cache.shape[0], []
    for i, (table, c) in enumerate(zip(tables, contexts)):
        slots = torch.tensor([b * bs + j for b in table for j in range(bs)])[:c]
        k, v = k_cache[:, slots], v_cache[:, slots]  # [KVH, c, D]
        s = q[i].view(kvh, -1, q.shape[-1]) @ k.transpose(-1, -2) * SCALE  # [KVH, G, c]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if window is not None:
            s[..., :max(0, c - window)] = float("-inf")
        out.append((s.softmax(-1) @ v).reshape(q.shape[1:]))
    return torch.stack(out)


def _case(kvh, groups, head_dim, bs, seed, contexts=(1, 37, 9, 101, 64, 5, 70), dtype=torch.float32):
    """Queries, K/V caches with each sequence's blocks scattered through them, block tables, contexts."""
    rnd = random.Random(seed)
    used = sum(-(-c // bs) for c in contexts)
    ids = list(range(1, used + 1))
    rnd.shuffle(ids)  # blocks scattered through the cache
    tables = []
    for c in contexts:
        n = -(-c // bs)
        tables.append(ids[:n])
        ids = ids[n:]
    g = torch.Generator().manual_seed(bs)
    k_cache = torch.randn(kvh, (used + 1) * bs, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kvh, (used + 1) * bs, head_dim, generator=g).to(dtype)
    q = torch.randn(len(contexts), kvh * groups, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, list(contexts)


@pytest.mark.parametrize("kvh, groups, head_dim, bs", [(2, 3, 64, 16), (1, 4, 80, 4), (4, 1, 64, 8)])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 3.0), (20, 2.0)])
def test_decode_chunks_match_a_per_sequence_reference(kvh, groups, head_dim, bs, window, softcap):
    q, k_cache, v_cache, tables, contexts = _case(kvh, groups, head_dim, bs, kvh * 100 + bs)
    want = _reference(q, k_cache, v_cache, tables, contexts, bs, window, softcap)
    for rows, n_chunks in ((1 << 20, 0), (3 * bs, None), (100, None)):
        group = DecodeGroup.build(tables, contexts, None, bs, torch.device("cpu"), rows)
        assert (len(group.chunks) == 0) == (n_chunks == 0)
        meta = AttnMetadata(torch.zeros(len(contexts), dtype=torch.long), bs, group, None)
        got = paged_attention(q, k_cache, v_cache, meta, SCALE, window, softcap)
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (rows, (got - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kvh, groups, head_dim, bs", [(3, 3, 64, 16), (1, 4, 80, 4), (4, 1, 36, 8),
                                                       (2, 2, 256, 16)])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 3.0), (20, 2.0)])
def test_the_cpu_kernel_matches_the_reference(dtype, kvh, groups, head_dim, bs, window, softcap, monkeypatch):
    """The paged decode kernel (model/cpu_kernels.py), through paged_attention as a layer calls it:
    float32 within 1e-5 of the reference, bf16 within bf16's rounding of the output (2^-8 relative)."""
    from hotstart.model import cpu_kernels

    if cpu_kernels.compiler() is None or not cpu_kernels.attention_supported(dtype):
        pytest.skip("no C++ compiler or no AVX2+FMA here: the torch path serves (tested above)")
    cpu_kernels.load(cpu_kernels.build())
    cpu_kernels.enable_attention(True)
    calls, fn = [], cpu_kernels._attention_fn
    monkeypatch.setattr(cpu_kernels, "_attention_fn", lambda *a: calls.append(1) or fn(*a))
    contexts = (1, 37, 9, 101, 64, 5, 70, 300)
    q, k_cache, v_cache, tables, contexts = _case(kvh, groups, head_dim, bs, bs + head_dim, contexts, dtype)
    want = _reference(q.float(), k_cache.float(), v_cache.float(), tables, contexts, bs, window, softcap)
    group = DecodeGroup.build(tables, contexts, None, bs, torch.device("cpu"), 1 << 20)
    meta = AttnMetadata(torch.zeros(len(contexts), dtype=torch.long), bs, group, None)
    got = paged_attention(q, k_cache, v_cache, meta, SCALE, window, softcap)
    assert calls and got.dtype == dtype and got.shape == q.shape
    err = (got.float() - want).abs()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * want.abs() + 1e-5
    assert (err <= tol).all(), err.max()


def test_chunks_reach_only_the_sequences_whose_context_does():
    contexts = [40, 8, 24]  # sorted: 40, 24, 8
    tables = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    group = DecodeGroup.build(tables, contexts, [5, 6, 7], 8, torch.device("cpu"), 16)
    assert group.tokens.tolist() == [5, 7, 6]  # longest first
    plan = [(c.n, c.start, c.stop, c.blocks.tolist()) for c in group.chunks]
    assert plan == [(3, 0, 8, [1, 7, 6]), (2, 8, 16, [2, 8]), (2, 16, 24, [3, 9]), (1, 24, 40, [4, 5])]
    meta = AttnMetadata(torch.zeros(3, dtype=torch.long), 8, group, None).window(4)
    # a window of 4: keys 8 .. 15 are behind the windows of both sequences that reach them (20 .. 23,
    # 36 .. 39); the context of 8 still sees keys 4 .. 7
    assert [(c.n, c.start) for c in meta.decode.chunks] == [(3, 0), (2, 16), (1, 24)]


@pytest.mark.parametrize("family", ["qwen2", "mistral"])  # GQA; a window of 16 on every layer
def test_ragged_streams_decode_the_same_chunked_or_not(tiny_checkpoint, family):
    """Several streams of ragged prompts, greedy, through the engine: tokens equal with chunks of a few
    keys and with one gather (float32)."""
    from hotstart.config import EngineConfig
    from hotstart.engine.core import EngineCore
    from hotstart.messages import EngineRequest
    from hotstart.model.files import weight_files
    from hotstart.sampling_params import SamplingParams

    folder = tiny_checkpoint(family)
    cfg = EngineConfig(model_path=str(folder), weight_files=tuple(map(str, weight_files(folder))),
                       device="cpu", dtype="float32", kv_cache_memory=16 << 20, max_model_len=256,
                       block_size=4)

    def generate(rows: int) -> dict[str, list[int]]:
        core = EngineCore.build(cfg)
        core.runner.chunk_rows = rows
        for i, n in enumerate((3, 50, 17, 90, 1)):
            ids = torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(i)).tolist()
            core.add_request(EngineRequest(f"r{i}", ids, SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True)))
        out: dict[str, list[int]] = {}
        while core.has_work():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    assert generate(24) == generate(1 << 20)


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_decode_within_bfloat16_of_the_float32_reference(monkeypatch, native):
    """bfloat16 caches: chunked decode multiplies in bfloat16 where the CPU has a bfloat16 dot product
    (`native`, forced here either way: both run on any host), else upcast to float32; one gather is
    always upcast. Either way within bfloat16's precision of the float32 reference on the same values."""
    from hotstart.model import attention

    monkeypatch.setattr(attention, "_bf16_dot", lambda: native)
    kvh, groups, head_dim, bs = 2, 3, 64, 8
    contexts = [90, 41, 7, 66]
    tables, start = [], 1
    for c in contexts:
        tables.append(list(range(start, start + -(-c // bs))))
        start += -(-c // bs)
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(kvh, start * bs, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(kvh, start * bs, head_dim, generator=g).bfloat16()
    q = torch.randn(len(contexts), kvh * groups, head_dim, generator=g).bfloat16()
    want = _reference(q.float(), k_cache.float(), v_cache.float(), tables, contexts, bs, None, None)
    for rows in (1 << 20, 3 * bs):  # one gather, then chunks
        group = DecodeGroup.build(tables, contexts, None, bs, torch.device("cpu"), rows)
        meta = AttnMetadata(torch.zeros(len(contexts), dtype=torch.long), bs, group, None)
        got = paged_attention(q, k_cache, v_cache, meta, SCALE)
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want, atol=3e-2, rtol=0), (rows, (got.float() - want).abs().max())
