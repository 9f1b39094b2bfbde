"""GGUF's quantized weights, kept quantized: dequantization in torch, and the linear layers over them.

THE KERNEL CONTRACT (kept stable: the quantized kernels register through it)

    quant.set_kernel(fn)        fn(x, w, ggml_type) -> y or None; set_kernel(None) unregisters
        x: [M, K] float32 or bfloat16, contiguous (the step's activations)
        w: [N, row_bytes] uint8, the ggml blocks of N rows of K elements, as the file holds them (a
           zero-copy view of the mapped GGUF file: never written to; rows contiguous)
        ggml_type: int, the ggml type id (gguf_file.TYPES: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8,
           Q4_K 12, Q5_K 13, Q6_K 14; also F16 1 / BF16 30 / F32 0 where a linear weight is a float one)
        y: [M, N] float32, x @ dequantize(w).T; None: not handled (this M, type or host), and the
           reference path below computes it
    The kernel library registers fn once it has loaded (behind READY, between two steps: one engine per
    process, so the slot is process-wide); every QuantLinear calls it first from then on. fn is called on
    the engine's step thread only, with torch's OpenMP threads free for it.

The reference path (any host): dequantize W per call, in float32, exactly as the `gguf` package's numpy
dequantization does (bit-identical: tests/model/test_gguf.py), in row chunks, then F.linear in float32
(bf16 activations too: no second rounding of the weights, and no bf16 GEMM, slow on CPUs without
AVX512-BF16). Its cost per step is a pass over the dequantized weights: correct everywhere, fast
nowhere; the kernel is the fast path. HOTSTART_QUANT_KEEP_DEQUANTIZED=1 (for tests and debugging, with
HOTSTART_QUANT_KERNEL=off) makes each QuantLinear keep its float32 chunks after their first use: the same
products, bit for bit, without the per-step dequantization, at 4-8x the file's bytes in memory.

Block layouts (ggml-common.h; d, dmin, m: float16 scales; q: packed integers):
    Q4_0 [d, qs 16]: x = d * (q - 8)              Q4_1 [d, m, qs 16]: x = d * q + m
    Q5_0 [d, qh 4, qs 16]: x = d * (q - 16)       Q5_1 [d, m, qh 4, qs 16]: x = d * q + m
    Q8_0 [d, qs int8 32]: x = d * q
    Q4_K [d, dmin, scales 12, qs 128]: 8 sub-blocks of 32, 6-bit scale and min each: x = d*sc*q - dmin*mn
    Q5_K [d, dmin, scales 12, qh 32, qs 128]: the same with a fifth bit
    Q6_K [ql 128, qh 64, scales int8 16, d]: 16 sub-blocks of 16: x = d * sc * (q - 32)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hotstart.gguf_file import TYPES

Kernel = Callable[[torch.Tensor, torch.Tensor, int], "torch.Tensor | None"]
# fn(x, [(w, ggml_type), ...]) -> [M, sum of N] float32 or None: several weights of one input in one call
# (x quantized once; q/k/v, gate/up: engine/fastpath/pack.py groups them)
Many = Callable[[torch.Tensor, list], "torch.Tensor | None"]
_kernel: Kernel | None = None
_many: Many | None = None
CHUNK_ELEMENTS = 1 << 22  # dequantize at most this many weights at a time (16 MiB of float32)
KEEP_DEQUANTIZED = os.environ.get("HOTSTART_QUANT_KEEP_DEQUANTIZED") == "1"


def set_kernel(fn: Kernel | None, many: Many | None = None) -> None:
    """Register the quantized matmul kernel (the contract above) and, optionally, its form for several
    weights of one input; None: back to the reference path."""
    global _kernel, _many
    _kernel, _many = fn, many


def kernel() -> Kernel | None:
    return _kernel


def _f16(b: torch.Tensor) -> torch.Tensor:
    # b: [n, 2] uint8 (a float16 per row) -> [n, 1] float32
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    # qs: [n, groups * 16] -> [n, groups * 2, 16]: each group's low nibbles, then its high nibbles
    q = qs.reshape(qs.shape[0], groups, 1, -1)
    return torch.cat((q & 0x0F, q >> 4), dim=2).reshape(qs.shape[0], groups * 2, -1)


def _bits(b: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    # b: [..., k] uint8 -> [..., len(shifts), k]: (b >> s) & mask for each shift s
    s = torch.tensor(list(shifts), dtype=torch.uint8).view(-1, 1)
    return (b.unsqueeze(-2) >> s) & mask


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, [n, 8] each
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _q4_0(b):
    q = _nibbles(b[:, 2:], 1).reshape(b.shape[0], 32).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_1(b):
    q = _nibbles(b[:, 4:], 1).reshape(b.shape[0], 32).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5(b, off):
    qh = _bits(b[:, off:off + 4], range(8), 1).transpose(1, 2).reshape(b.shape[0], 32)  # bit j of the u32
    return _nibbles(b[:, off + 4:], 1).reshape(b.shape[0], 32) | (qh << 4)


def _q5_0(b):
    return _f16(b[:, :2]) * (_q5(b, 2).to(torch.int8) - 16).float()


def _q5_1(b):
    return _f16(b[:, :2]) * _q5(b, 4).float() + _f16(b[:, 2:4])


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    return (d * _nibbles(b[:, 16:], 4).float() - dm).reshape(n, 256)


def _q5_k(b):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    qh = _bits(b[:, 16:48], range(8), 1)  # [n, 8, 32]: bit i of byte j is sub-block i's element j
    q = _nibbles(b[:, 48:], 4) | (qh << 4)
    return (d * q.float() - dm).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).view(n, 16, 1)
    ql = _bits(b[:, :128].reshape(n, 2, 64), range(0, 8, 4), 0x0F).reshape(n, 8, 32)  # [n, 2, 2, 64]
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), range(0, 8, 2), 0x03).reshape(n, 8, 32)  # [n, 2, 4, 32]
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


_BLOCKS = {2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 12: _q4_k, 13: _q5_k, 14: _q6_k}
_FLOATS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


def dequantize(w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """w: [..., row_bytes] uint8 ggml blocks -> [..., K] float32 (the gguf package's values, bit for bit)."""
    if ggml_type in _FLOATS:
        return w.contiguous().view(_FLOATS[ggml_type]).float()
    _, block, size = TYPES[ggml_type]
    lead, row_bytes = w.shape[:-1], w.shape[-1]
    blocks = w.reshape(-1, size)
    return _BLOCKS[ggml_type](blocks).reshape(*lead, row_bytes // size * block)


def reference_matmul(x: torch.Tensor, w: torch.Tensor, ggml_type: int,
                     kept: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, row_bytes] -> [M, N] float32: F.linear over W dequantized (row chunks at a time).
    kept: a list that holds (or is filled with) W's dequantized chunks: later calls skip dequantizing."""
    x = x.float()
    rows = max(1, CHUNK_ELEMENTS // max(1, x.shape[-1]))
    starts = range(0, w.shape[0], rows)
    if kept is not None and not kept:
        kept.extend(dequantize(w[r:r + rows], ggml_type) for r in starts)
    chunks = kept if kept is not None else (dequantize(w[r:r + rows], ggml_type) for r in starts)
    if w.shape[0] <= rows:
        return F.linear(x, next(iter(chunks)))
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for r, chunk in zip(starts, chunks):
        out[:, r:r + rows] = F.linear(x, chunk)
    return out


def matmul(x: torch.Tensor, w: torch.Tensor, ggml_type: int,
           kept: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x: [M, K] -> [M, N] float32: the registered kernel where it handles the call, else the reference
    (kept: reference_matmul's)."""
    if _kernel is not None:
        x = x.contiguous()
        y = _kernel(x, w, ggml_type)
        if y is not None:
            return y
    return reference_matmul(x, w, ggml_type, kept)


class QuantLinear(nn.Module):
    """A linear layer whose weight stays as the file's ggml blocks: weight [out, row_bytes] uint8.

    unpermute_heads (llama-family GGUFs): llama.cpp's converter permuted the rows of q and k within each
    head ([h, 2, D/2] -> [h, D/2, 2]: interleaved RoPE pairs); the output is put back in the checkpoint's
    order here (one [T, out] reshuffle) instead of copying the weight."""

    def __init__(self, weight: torch.Tensor, ggml_type: int, in_features: int,
                 bias: torch.Tensor | None = None, unpermute_heads: int = 0,
                 split_sizes: list[int] | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, weight.shape[0]
        self.unpermute_heads = unpermute_heads
        self.split_sizes = split_sizes  # a fused checkpoint tensor (Phi-3's qkv, gate_up): its parts
        self.kept: list[torch.Tensor] | None = [] if KEEP_DEQUANTIZED else None  # float32 row chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out] in x's dtype
        lead = x.shape[:-1]
        y = matmul(x.reshape(-1, self.in_features), self.weight, self.ggml_type, self.kept)
        return self.finish(y, x.dtype).view(*lead, self.out_features)

    def finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # y: [T, out] float32, the product in the file's row order -> the checkpoint's order, in DTYPE, + bias
        if self.unpermute_heads:
            h = self.unpermute_heads
            y = y.view(y.shape[0], h, -1, 2).transpose(2, 3).reshape(y.shape[0], -1)
        y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias
        return y

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x: [T, in] -> one [T, rows] tensor per part (FusedLinear's interface)
        return self(x).split(self.split_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, type={TYPES[self.ggml_type][0]}"


class QuantEmbedding(nn.Module):
    """The token embedding as ggml blocks, weight [vocab, row_bytes] uint8: only the rows looked up are
    dequantized."""

    def __init__(self, weight: torch.Tensor, ggml_type: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.ggml_type, self.dim, self.dtype = ggml_type, dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, dim]
        return dequantize(self.weight[ids], self.ggml_type).to(self.dtype)


def stacked(linears: list[QuantLinear], x: torch.Tensor) -> torch.Tensor:
    """x: [T, in] -> [T, sum of outs] in x's dtype: sibling projections of one input (q/k/v, gate/up) side by
    side, through one kernel call where the kernel takes them (x quantized once), else one call each."""
    if _many is not None:
        y = _many(x.contiguous(), [(m.weight, m.ggml_type) for m in linears])
        if y is not None:
            if not any(m.unpermute_heads or m.bias is not None for m in linears):
                return y.to(x.dtype)
            parts = y.split([m.out_features for m in linears], dim=-1)
            return torch.cat([m.finish(p, x.dtype) for m, p in zip(linears, parts)], dim=-1)
    return torch.cat([m(x) for m in linears], dim=-1)
