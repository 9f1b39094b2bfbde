"""Blocks shared by every model family: linear layers, RMSNorm, rotary embedding, paged attention, gated
MLP, and the pre-norm decoder layer (the shared one; hotstart/model/families/ builds the others). What differs
between families is a ModelConfig flag (hotstart/families.py), read here; no block names a family.

Tokens of all sequences in a step are flattened into one batch dimension T (varlen, like vLLM):
linear layers see [T, hidden]; only attention regroups them per sequence (model/attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hotstart.model import cpu_kernels, onednn, quant, rope
from hotstart.model.attention import AttnMetadata, paged_attention
from hotstart.model_config import ModelConfig
from hotstart.rope_config import RopeConfig

# What a compiled layer graph computes with its inputs (engine/fastpath/cache.py keys packages by it): bump
# it when a layer's math or the meaning of its inputs changes (2: RoPE's sin table holds rotate_half's sign).
MATH_REVISION = 2


class Linear(nn.Module):
    """nn.Linear without weight initialisation: the loader fills it. (nn.Linear's init on the meta
    device routes through torch._refs, which imports torch._dynamo: ~1.5 s of startup.)"""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.prepacked: torch.Tensor | None = None  # oneDNN layout of weight, set between steps (onednn.py)
        self.gemv: cpu_kernels.Segments | None = None  # the small-batch kernel over weight, set between steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and self.gemv.fits(x):
            return self.gemv(x)
        if self.prepacked is not None:
            return onednn.linear(x, self.prepacked, self.bias)
        return F.linear(x, self.weight, self.bias)


class PackedGroup:
    """Sibling Linear modules that read the same input (q/k/v, gate/up), prepacked as one stacked weight:
    one oneDNN call instead of one per projection (engine/fastpath/pack.py builds it). The prepacked copy
    costs what the separate ones did; the checkpoint's views stay for the plain path and the loader."""

    def __init__(self, linears: list[Linear], copy: bool = True):
        self.split_sizes = [m.weight.shape[0] for m in linears]
        # [sum of outs, in]; None: no copy (it would not fit), each projection then multiplies its own
        self.prepacked = onednn.pack(torch.cat([m.weight for m in linears])) if copy else None
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None or not copy else torch.cat(biases)
        self.linears = linears if not copy else []
        self.gemv: cpu_kernels.Segments | None = None  # the small-batch kernel over the linears' own weights
        self.quantized = all(isinstance(m, quant.QuantLinear) for m in linears)

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, sum of outs]: the projections' outputs side by side, in order
        if self.gemv is not None and self.gemv.fits(x):
            return self.gemv(x)
        if self.prepacked is None:
            if self.quantized:  # ggml blocks (model/quant.py): one kernel call for the group
                return quant.stacked(self.linears, x)
            return torch.cat([m(x) for m in self.linears], dim=-1)
        return onednn.linear(x, self.prepacked, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x: [T, in] -> one [T, out_i] view per projection, in order
        return self.stacked(x).split(self.split_sizes, dim=-1)


class FusedLinear(Linear):
    """Several checkpoint projections stacked along dim 0 into one matmul (q/k/v, gate/up): the GPU layout,
    where weights are copied anyway (on CPU they stay separate zero-copy views of the file).

    `shards` is the layout, the one place it is written: checkpoint projection name (a sibling of
    this module in the checkpoint, e.g. "q_proj") -> (first row, rows). The loader fills the rows of
    each shard from that projection's tensors. With tensor parallelism the shards hold one rank's share
    and `sources` says which rows of each projection that is: name -> (first row in the checkpoint
    tensor, rows, the checkpoint tensor's rows); empty: all of them."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shards: dict[str, tuple[int, int]] = {}
        row = 0
        for name, rows in shards.items():
            self.shards[name] = (row, rows)
            row += rows
        self.split_sizes = list(shards.values())
        self.sources: dict[str, tuple[int, int, int]] = {}
        # True: the checkpoint ships this fused tensor itself under this module's name (Phi-3's qkv_proj,
        # gate_up_proj): the loader maps it whole (zero-copy on CPU); tensor parallel takes each shard's
        # rank rows out of it (parallel.shard).
        self.whole = False

    def take_rank_rows(self, rank: int, world_size: int) -> None:
        """Rank RANK of WORLD_SIZE: each shard is that rank's contiguous share of its projection."""
        self.sources = {name: (rank * rows, rows, rows * world_size)
                        for name, (_, rows) in self.shards.items()}

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x: [T, in] -> one [T, rows] tensor per shard, in layout order
        return self(x).split(self.split_sizes, dim=-1)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, like the reference implementation, then scale in the model dtype.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight) (the checkpoint stores weight - 1), in float32, then casts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


# ModelConfig.hidden_act -> the gated MLP's activation
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a cos/sin table computed once for max_positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq, scale = rope.inv_freq_and_scale(self.rope, self.head_dim, self.max_positions)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))  # [P, R/2]; R = rotary dims (partial RoPE: R < D)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
        # yarn / longrope scale cos and sin (the attention factor), in float32 before the cast
        sin = emb.sin()
        sin[:, : sin.shape[-1] // 2].neg_()  # rotate_half's sign, folded into the table (see apply)
        self.cos, self.sin = (emb.cos() * scale).to(dtype), (sin * scale).to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, D] (once per step, shared by every layer)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D], cos / sin: [T, 1, R]; partial RoPE (R < D): the last D - R dims pass through.
        # transformers' x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]: the table's sin is
        # [-sin1, sin2] (build), so rotate_half(x) * sin == roll(x, R/2) * table, bit for bit, in 3 ops
        # instead of 7 (a decode step runs this for q and k of every layer)
        r = cos.shape[-1]
        if r < x.shape[-1]:
            rot = x[..., :r]
            return torch.cat((rot * cos + rot.roll(r // 2, -1) * sin, x[..., r:]), dim=-1)
        return x * cos + x.roll(r // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.fused = fused
        if fused:
            shards = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
            self.qkv_proj = FusedLinear(cfg.hidden_size, shards, bias=cfg.qkv_bias)
        else:
            self.q_proj = Linear(cfg.hidden_size, self.q_size, bias=cfg.qkv_bias)
            self.k_proj = Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
            self.v_proj = Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.packed_qkv: PackedGroup | None = None  # q/k/v prepacked as one (fast path), unfused only
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim**-0.5
        self.softcap = cfg.attn_softcap  # attention logit soft-capping (Gemma 2), None: none
        # Set by the Backbone from the layer's index: its window (None: full attention) and whether it is a
        # "sliding_attention" layer (Gemma 3: those use the local RoPE, even with a null window).
        self.window: int | None = None
        self.sliding = False
        # Set by the engine: [KVH, num_slots, D] each (paged: slot = block * block_size + offset).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def pack_groups(self) -> dict[str, list[Linear]]:
        """Attribute -> the projections the fast path prepacks into it as one PackedGroup."""
        return {} if self.fused else {"packed_qkv": [self.q_proj, self.k_proj, self.v_proj]}

    def qkv_stacked(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [T, hidden] -> [T, H * D + 2 * KVH * D], q | k | v side by side, where one matmul makes them
        (fused checkpoint layout, or packed by the fast path); else None."""
        if self.fused:
            return self.qkv_proj(x)
        if self.packed_qkv is not None:
            return self.packed_qkv.stacked(x)
        return None

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q: [T, H * D], k, v: [T, KVH * D] (one matmul where fused or packed)."""
        y = self.qkv_stacked(x)
        if y is not None:
            return y.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [T, hidden] (normed) -> q: [T, H, D], k, v: [T, KVH, D] (q/k normed, RoPE applied)."""
        t = x.shape[0]
        y = self.qkv_stacked(x) if self.q_norm is None else None
        if y is not None:  # q and k side by side: one rotation of [T, H + KVH, D] instead of two
            qk_size, heads = self.q_size + self.kv_size, self.num_heads
            qk = y[:, :qk_size].view(t, heads + self.num_kv_heads, self.head_dim)
            qk = RotaryEmbedding.apply(qk, cos, sin)
            return qk[:, :heads], qk[:, heads:], y[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        q, k, v = self.qkv(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Write this step's K/V into the paged cache and attend (eager: paged, any context).
        q: [T, H, D], k, v: [T, KVH, D] -> o: [T, H * D] (before o_proj)."""
        self.k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))  # cache: [KVH, slots, D]
        self.v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.window, self.softcap)
        return o.reshape(q.shape[0], self.q_size)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__()
        self.intermediate, self.fused = cfg.intermediate_size, fused
        if fused:
            shards = {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
            self.gate_up_proj = FusedLinear(cfg.hidden_size, shards, bias=cfg.mlp_bias)
        else:
            self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
            self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.packed_gate_up: PackedGroup | None = None  # gate/up prepacked as one (fast path), unfused only

    def pack_groups(self) -> dict[str, list[Linear]]:
        return {} if self.fused else {"packed_gate_up": [self.gate_proj, self.up_proj]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj.forward_split(x)
        elif self.packed_gate_up is not None:
            gate, up = self.packed_gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


def rope_of(attn: Attention, meta: AttnMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos, sin tables ([T, 1, D]) ATTN's layer rotates by: the local ones on sliding layers, if any."""
    if attn.sliding and meta.cos_local is not None:
        return meta.cos_local, meta.sin_local
    return meta.cos, meta.sin


class DecoderLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg, fused)

    # The layer in two pure halves around attention, so a layer graph can take every op but the paged
    # attention (engine/fastpath/layer_graphs.py exports these very methods):
    # forward(x) == finish(self_attn.attend(*attn_inputs(x, meta), meta), x).
    def attn_inputs(self, x: torch.Tensor, meta: AttnMetadata):
        """x: [T, hidden] (the layer's input) -> q: [T, H, D], k, v: [T, KVH, D]."""
        return self.self_attn.project(self.input_layernorm(x), *rope_of(self.self_attn, meta))

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o: [T, H * D] (attention output), x: [T, hidden] (the layer's input) -> the next layer's input."""
        x = x + self.self_attn.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        q, k, v = self.attn_inputs(x, meta)
        return self.finish(self.self_attn.attend(q, k, v, meta), x)
