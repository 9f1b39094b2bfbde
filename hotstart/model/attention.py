"""Paged attention over the flat token batch of one step (varlen, like vLLM).

The tokens of all sequences in a step are flattened into one dimension T. A sequence with one new
token (a decode, or a one-token prompt) takes the decode path; sequences with several new tokens
(prefill chunks, multi-token verify queries) take SDPA with a causal mask over their padded queries.
Metadata is built once per step (engine/model_runner.py) and shared by every layer; a sliding window
W (a query at position p sees keys p - W + 1 .. p, transformers' convention) narrows the decode bias and
the prefill mask once per step per distinct window (AttnMetadata.window), at its first layer. Logit
soft-capping (Gemma 2: tanh(s / c) * c before the mask) cannot go through SDPA: capped prefills take a
manual softmax.

Decode over the paged cache (docs/serving.md, "Attention over the paged cache"): the cache is head-major
([KVH, slots, D]), so one index_select over whole blocks gives [KVH, n, keys, D], the layout the batched
matmuls want. The decode group is sorted by context, longest first, and its keys are cut into chunks of
whole blocks (KeyChunk): chunk c covers key positions start .. stop of the first n sequences, those
whose context reaches it, so no sequence is padded to the longest one, and a chunk is at most about
DECODE_CHUNK_BYTES of K or V, so what a chunk gathers stays in the caches between its gather and
its matmul (the whole-context gather wrote the step's entire K and V to memory and read them back).
Two passes: q.k of every chunk into one float32 score tensor [KVH, Bd, G, L] (small: no D), one softmax,
then probs.v chunk by chunk. A step whose keys fit one chunk takes exactly the single-gather path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from hotstart.model import cpu_kernels
from hotstart.system import native_cpu_dtypes

# Bytes of K (or V) one decode chunk gathers at most, as float32 (model/attention.py docstring): 1.5 MiB,
# 2,048 keys x sequences of SmolLM2-135M (3 KV heads of 64). Chosen by benchmarks/paged_attention.py on
# the 2-core AVX2 CPU: 1,024 - 8,192 such rows a chunk all beat one whole gather at 16 x 1,000 keys,
# 2,048 the most (docs/serving.md).
DECODE_CHUNK_BYTES = 1536 << 10


def chunk_rows(kv_heads: int, head_dim: int) -> int:
    """Keys x sequences of one decode chunk for KV_HEADS heads of HEAD_DIM (DECODE_CHUNK_BYTES)."""
    return max(1, DECODE_CHUNK_BYTES // (kv_heads * head_dim * 4))


@dataclass
class KeyChunk:
    """Key positions START .. STOP (whole blocks) of the first N sequences of a decode group."""

    n: int
    start: int
    stop: int
    blocks: torch.Tensor  # [n * (stop - start) / bs] long: their blocks, sequence by sequence
    shortest: int  # the smallest context among the N (windows skip a chunk every N slid past)


@dataclass
class DecodeGroup:
    """Sequences with one new token each, sorted by context, longest first."""

    tokens: torch.Tensor | None  # [Bd] long: their flat token indices (None: all T tokens, in order)
    block_tables: torch.Tensor  # [Bd, nb] long: KV blocks of each (0 = the null block)
    bias: torch.Tensor  # [Bd, 1, 1, nb * bs] float32: 0 where the key is in context, -inf past it
    context: torch.Tensor | None = None  # [Bd] long: keys in context (the query sits at context - 1)
    chunks: list[KeyChunk] = field(default_factory=list)  # empty: one gather of block_tables

    @classmethod
    def build(cls, tables: list[list[int]], context: list[int], tokens: list[int] | None, block_size: int,
              device: torch.device, rows: int) -> DecodeGroup:
        """The group of sequences with block TABLES and CONTEXT keys each, whose queries are the flat
        tokens TOKENS (None: all T tokens, in this order), sorted longest first; ROWS: the most keys x
        sequences of a chunk (chunk_rows())."""
        order = sorted(range(len(context)), key=lambda i: -context[i])
        if order != list(range(len(context))):
            tokens = [tokens[i] if tokens is not None else i for i in order]
            tables, context = [tables[i] for i in order], [context[i] for i in order]
        padded = pad_tables(tables, -(-context[0] // block_size))
        keys = torch.arange(len(padded[0]) * block_size)
        bias = torch.zeros(len(context), keys.shape[0])
        bias.masked_fill_(keys[None, :] >= torch.tensor(context)[:, None], float("-inf"))
        chunks = _plan(padded, context, block_size, rows)
        for c in chunks:
            c.blocks = c.blocks.to(device, non_blocking=True)
        return cls(None if tokens is None else torch.tensor(tokens).to(device, non_blocking=True),
                   torch.tensor(padded).to(device, non_blocking=True), bias[:, None, None, :].to(device),
                   context=torch.tensor(context).to(device, non_blocking=True), chunks=chunks)


def pad_tables(tables: list[list[int]], nb: int) -> list[list[int]]:
    """Each block table cut or padded with the null block 0 to NB blocks."""
    return [table[:nb] + [0] * (nb - min(nb, len(table))) for table in tables]


def _plan(tables: list[list[int]], context: list[int], block_size: int, rows: int) -> list[KeyChunk]:
    """Cut the keys of sequences sorted longest first into chunks of whole blocks of at most ROWS keys x
    sequences (at least one block); [] when one chunk holds them all (one gather of the tables)."""
    if len(tables[0]) * block_size * len(tables) <= rows:
        return []
    chunks: list[KeyChunk] = []
    start, end = 0, len(tables[0]) * block_size
    while start < end:
        n = sum(1 for c in context if c > start)  # the sequences this chunk's keys reach
        size = max(block_size, rows // n // block_size * block_size)
        stop = min(start + size, end)
        j0, j1 = start // block_size, stop // block_size
        blocks = torch.tensor([b for table in tables[:n] for b in table[j0:j1]])
        chunks.append(KeyChunk(n, start, stop, blocks, context[n - 1]))
        start = stop
    return chunks


@dataclass
class PrefillGroup:
    """Sequences with several new tokens, queries padded to the longest."""

    tokens: torch.Tensor | None  # [Tp] long: their flat token indices (None: all T tokens, in order)
    q_index: torch.Tensor  # [Bp, Qmax] long: index into the group's tokens of each padded query
    q_valid: torch.Tensor  # [Bp, Qmax] bool
    block_tables: torch.Tensor  # [Bp, nb] long
    mask: torch.Tensor  # [Bp, 1, Qmax, nb * bs] bool: True where the query may attend
    q_pos: torch.Tensor | None = None  # [Bp, Qmax] long: position of each padded query
    spans: torch.Tensor | None = None  # [Bp, 3] long, CPU: first token in the group, tokens, first position
    # every sequence's queries start at position 0 (no cached prefix, no window): the mask is plain causal,
    # and SDPA's is_causal skips the masked blocks (a 1,000-token prompt: 13.5 vs 19.3 ms a layer, bf16)
    from_zero: bool = False


@dataclass
class AttnMetadata:
    """Where each new token's K/V goes, and what each query sees; built once per step."""

    slot_mapping: torch.Tensor  # [T] long: flat KV-cache slot of each new token
    block_size: int
    decode: DecodeGroup | None
    prefill: PrefillGroup | None
    cos: torch.Tensor | None = None  # [T, 1, D] rotary tables at the tokens' positions (set by the model)
    sin: torch.Tensor | None = None
    cos_local: torch.Tensor | None = None  # [T, 1, D] the sliding layers' own RoPE (Gemma 3), else None
    sin_local: torch.Tensor | None = None
    windows: dict = field(default_factory=dict)  # window -> its AttnMetadata (built at first use)

    def window(self, w: int | None) -> AttnMetadata:
        """This step's metadata for layers of window W (None: self): keys before p - W + 1 masked."""
        if w is None:
            return self
        if w not in self.windows:
            d, p = self.decode, self.prefill
            if d is not None:
                keys = torch.arange(d.bias.shape[-1], device=d.bias.device)
                out = keys[None, :] < (d.context - w)[:, None]  # [Bd, L]: slid out of the window
                chunks = [c for c in d.chunks if c.stop > c.shortest - w]  # not slid out for all n
                d = replace(d, bias=d.bias.masked_fill(out[:, None, None, :], float("-inf")), chunks=chunks)
            if p is not None:
                keys = torch.arange(p.mask.shape[-1], device=p.mask.device)
                valid = p.q_valid[:, :, None]  # padded rows keep their one key (no NaN)
                inside = (keys[None, None, :] > (p.q_pos - w)[:, :, None]) | ~valid  # [Bp, Qmax, L]
                p = replace(p, mask=p.mask & inside[:, None], from_zero=False)
            self.windows[w] = replace(self, decode=d, prefill=p, windows={})
        return self.windows[w]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    # cache: [KVH, slots, D], blocks: [n * nb] -> those blocks, head-major: [KVH, n, nb * bs, D]
    kvh, _, d = cache.shape
    return cache.view(kvh, -1, block_size, d).index_select(1, blocks).view(kvh, n, -1, d)


@functools.cache
def _bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 natively (read once: the decode path asks every layer)."""
    return "bfloat16" in native_cpu_dtypes()


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    # Gemma 2's attention logit soft-capping, after the scaling and before the mask
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                     block_size: int, scale: float, softcap: float | None = None,
                     window: int | None = None) -> torch.Tensor:
    # q: [Bd, H, D] (the group's order) -> [Bd, H, D]; grouped-query: H = KVH * G, query heads of one KV
    # head adjacent. g's bias and chunks already carry WINDOW (AttnMetadata.window); the CPU kernel
    # (model/cpu_kernels.py: reads the blocks in place, where it is enabled) takes it as a number.
    if q.device.type == "cpu" and g.context is not None:
        out = cpu_kernels.decode_attention(q, k_cache, v_cache, g.block_tables, g.context, block_size, scale,
                                           softcap, window)
        if out is not None:
            return out
    bd, h, d = q.shape
    kvh = k_cache.shape[0]
    chunks = g.chunks or [KeyChunk(bd, 0, g.bias.shape[-1], g.block_tables.flatten(), 0)]
    one = len(chunks) == 1 and chunks[0].n == bd  # every key of every sequence in one chunk
    # The matmuls' dtype: the cache's off the CPU, and for chunked bfloat16 on a CPU with a bfloat16 dot
    # product (AVX512-BF16 / AMX: 6-35 % faster than upcasting at 16 x 300-500 and 4 x 1,000 keys, the
    # scores then rounded to bfloat16 as in transformers' bf16 attention); else float32 (AVX2 has no
    # bfloat16 dot product: a chunk upcast in cache then multiplied in float32 measured ~2.7x faster than
    # torch's bfloat16 matmul there; and one small chunk is faster upcast on either host).
    cd = q.dtype
    if q.device.type == "cpu" and (one or q.dtype != torch.bfloat16 or not _bf16_dot()):
        cd = torch.float32
    if one and softcap is None and cd == torch.float32:
        return _decode_one_chunk(q, k_cache, v_cache, g, chunks[0].blocks, block_size, scale)
    qg = q.to(cd).view(bd, kvh, h // kvh, d).transpose(0, 1)  # [KVH, Bd, G, D]
    bias = g.bias.view(1, bd, 1, -1)
    # [KVH, Bd, G, L] float32; scores no chunk reaches stay 0 and get their -inf from the bias
    scores = None if one else q.new_zeros(kvh, bd, h // kvh, bias.shape[-1], dtype=torch.float32)
    for c in chunks:
        k = _gather(k_cache, c.blocks, c.n, block_size).to(cd)  # [KVH, n, keys, D]
        part = torch.matmul(qg[:, :c.n], k.transpose(-1, -2))  # [KVH, n, G, keys]
        if one:
            scores = part.float()
        else:
            scores[:, :c.n, :, c.start:c.stop] = part
    probs = torch.softmax(_cap(scores.mul_(scale), softcap).add_(bias), dim=-1).to(cd)
    out = None if one else q.new_zeros(kvh, bd, h // kvh, d, dtype=torch.float32)  # [KVH, Bd, G, D]
    for c in chunks:
        v = _gather(v_cache, c.blocks, c.n, block_size).to(cd)
        part = torch.matmul(probs[:, :c.n, :, c.start:c.stop], v)
        if one:
            out = part
        else:
            out[:, :c.n] += part
    return out.to(q.dtype).transpose(0, 1).reshape(bd, h, d)


def _decode_one_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                      blocks: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """decode_attention's single-gather case in float32 (short contexts, small batches: where the step
    is mostly per-op overhead), as 3-D batched matmuls over KVH * Bd: the scale and the context bias in
    the first (baddbmm), no broadcasting 4-D matmul. q: [Bd, H, D], blocks: the chunk's, every sequence's
    in turn -> [Bd, H, D]."""
    bd, h, d = q.shape
    kvh = k_cache.shape[0]
    b, keys = kvh * bd, g.bias.shape[-1]
    qg = q.float().view(bd, kvh, h // kvh, d).transpose(0, 1).reshape(b, h // kvh, d)  # [KVH * Bd, G, D]
    k = _gather(k_cache, blocks, bd, block_size).float().view(b, keys, d)  # [KVH * Bd, L, D]
    bias = g.bias.view(1, bd, keys).expand(kvh, bd, keys).reshape(b, 1, keys)  # [KVH * Bd, 1, L]
    probs = torch.softmax(torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=scale), dim=-1)  # [KVH * Bd, G, L]
    v = _gather(v_cache, blocks, bd, block_size).float().view(b, keys, d)
    out = torch.bmm(probs, v)  # [KVH * Bd, G, D]
    return out.to(q.dtype).view(kvh, bd, h // kvh, d).transpose(0, 1).reshape(bd, h, d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: PrefillGroup,
                      block_size: int, scale: float, softcap: float | None = None,
                      window: int | None = None) -> torch.Tensor:
    # q: [Tp, H, D] -> [Tp, H, D]. g's mask already carries WINDOW (AttnMetadata.window); the bf16 CPU
    # kernel (model/cpu_kernels.py: reads the blocks in place, where it is enabled) takes it as a number.
    if q.device.type == "cpu" and softcap is None and g.spans is not None:
        out = cpu_kernels.prefill_attention(q, k_cache, v_cache, g.spans, g.block_tables, block_size, scale,
                                            window)
        if out is not None:
            return out
    qp = q[g.q_index].transpose(1, 2)  # [Bp, H, Qmax, D]
    tables, bp = g.block_tables.flatten(), g.block_tables.shape[0]
    kp = _gather(k_cache, tables, bp, block_size).transpose(0, 1)  # [Bp, KVH, L, D]
    vp = _gather(v_cache, tables, bp, block_size).transpose(0, 1)
    if softcap is None and g.from_zero:  # query i sees keys 0 .. i; a padded query's row is dropped below
        q_max = qp.shape[2]
        out = F.scaled_dot_product_attention(qp, kp[:, :, :q_max], vp[:, :, :q_max], is_causal=True,
                                             scale=scale, enable_gqa=True)
    elif softcap is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=g.mask, scale=scale, enable_gqa=True)
    else:  # SDPA cannot cap: the softmax by hand, KV heads repeated for their query heads
        groups = qp.shape[1] // kp.shape[1]
        kp, vp = kp.repeat_interleave(groups, dim=1), vp.repeat_interleave(groups, dim=1)  # [Bp, H, L, D]
        scores = _cap(torch.matmul(qp, kp.transpose(-1, -2)).float() * scale, softcap)  # [Bp, H, Qmax, L]
        probs = torch.softmax(scores.masked_fill(~g.mask, float("-inf")), dim=-1).to(q.dtype)
        out = torch.matmul(probs, vp)
    return out.transpose(1, 2)[g.q_valid]  # [Tp, H, D], tokens back in the group's order


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [T, H, D] (this step's queries, RoPE applied; their K/V already written) -> [T, H, D].
    window: the layer's sliding window (None: full); softcap: its attention logit cap (None: none)."""
    meta = meta.window(window)
    d, p, block_size = meta.decode, meta.prefill, meta.block_size
    if p is None and d.tokens is None:
        return decode_attention(q, k_cache, v_cache, d, block_size, scale, softcap, window)
    if d is None and p.tokens is None:
        return prefill_attention(q, k_cache, v_cache, p, block_size, scale, softcap, window)
    out = torch.empty_like(q)  # a group's tokens are None only when it holds all T tokens, in order
    if d is not None:
        out[d.tokens] = decode_attention(q[d.tokens], k_cache, v_cache, d, block_size, scale, softcap, window)
    if p is not None:
        out[p.tokens] = prefill_attention(q[p.tokens], k_cache, v_cache, p, block_size, scale, softcap,
                                          window)
    return out
