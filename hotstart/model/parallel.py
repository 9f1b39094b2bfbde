"""Tensor parallelism, Megatron-style: which slice of each checkpoint tensor a rank holds, and the
layers whose forward needs a collective.

  column-parallel  q/k/v, gate/up (each rank: a contiguous range of output rows; fused on GPUs, the
                   FusedLinear's per-rank `sources`), and the LM head over the vocabulary
  row-parallel     o_proj, down_proj (each rank: a range of input columns); the partial outputs are
                   summed by one all-reduce, the bias is added once, after it
  vocab-parallel   the embedding: ids outside a rank's rows give zeros, an all-reduce sums the rows;
                   the logits of the LM head are gathered on rank 0
  KV cache         split with the heads: a rank attends its own query and KV heads, no collective

A column slice of a row-major weight is one contiguous byte range of the file: on CPU it stays a
zero-copy view of the mapping, and only its pages are populated. A row-parallel slice is strided: the
tensor's pages are populated and the columns copied. The model is built from the per-rank config
(local_config) and then `shard()` marks and swaps the modules; at world size 1 none of this runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hotstart import families
from hotstart.errors import HotstartError
from hotstart.model import onednn
from hotstart.model.layers import Embedding, FusedLinear, Linear
from hotstart.model_config import ModelConfig


@dataclass(frozen=True)
class Split:
    """The part of a checkpoint tensor a rank holds: [start, start + size) along DIM, of FULL."""

    dim: int
    start: int
    size: int
    full: int
    # Several row ranges (start, size), concatenated: a rank's q, k, v (gate, up) out of a tensor the
    # checkpoint ships fused (Phi-3); start and size then cover their sum. Empty: one range.
    rows: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the group, and the collectives of the activations."""

    rank: int
    world_size: int
    group: Any = None  # the torch.distributed group of the activations (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """(first row, rows, rows per rank) of this rank's vocabulary shard; the last may be shorter."""
        per = -(-vocab // self.world_size)
        start = min(self.rank * per, vocab)
        return start, min(per, vocab - start), per

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        # local: [N, rows] float32 -> [N, vocab] on rank 0 (None elsewhere)
        per = self.vocab_range(vocab)[2]
        if local.shape[1] < per:
            local = F.pad(local, (0, per - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1)[:, :vocab] if parts is not None else None


def local_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shape one rank computes: its share of the heads and of the MLP (vocabulary: see shard())."""
    problem = divisibility_error(cfg, world_size)
    if problem:
        raise HotstartError(problem)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world_size,
                               num_key_value_heads=cfg.num_key_value_heads // world_size,
                               intermediate_size=cfg.intermediate_size // world_size,
                               # every expert's MLP is split the same way (model/moe.py)
                               moe_intermediate_size=cfg.moe_intermediate_size // world_size,
                               shared_expert_intermediate_size=cfg.shared_expert_intermediate_size
                               // world_size)


def divisibility_error(cfg: ModelConfig, n: int) -> str | None:
    """Why the model cannot be split over N ranks (the numbers named), or None."""
    refused = families.by_name(cfg.family).tensor_parallel
    if refused and n > 1:
        return f"--tensor-parallel-size {n}: not supported for {cfg.architecture}: {refused} ({cfg.path})"
    sizes = (("num_attention_heads", cfg.num_attention_heads),
             ("num_key_value_heads", cfg.num_key_value_heads), ("intermediate_size", cfg.intermediate_size),
             ("moe_intermediate_size", cfg.moe_intermediate_size),
             ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    bad = [f"{name} ({value})" for name, value in sizes if value % n]
    if not bad:
        return None
    return (f"--tensor-parallel-size {n}: the model's {' and '.join(bad)} must be divisible by it "
            f"({cfg.path}/config.json)")


class RowParallelLinear(Linear):
    """Holds input columns [rank * in, (rank + 1) * in) of the checkpoint weight; sums the partial
    outputs over the group, then adds the (whole) bias once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias)
        self.tp = tp
        self.splits = {"weight": Split(1, tp.rank * in_features, in_features, in_features * tp.world_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / world] -> [T, out]
        if self.prepacked is not None:
            y = onednn.linear(x, self.prepacked, None)
        else:
            y = F.linear(x, self.weight)
        self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Embedding):
    """Holds rows [start, start + size) of the embedding; other ids contribute zeros to the all-reduce."""

    def __init__(self, vocab: int, dim: int, tp: TensorParallel):
        start, size, _ = tp.vocab_range(vocab)
        super().__init__(size, dim)
        self.tp, self.start, self.size = tp, start, size
        self.splits = {"weight": Split(0, start, size, vocab)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, dim]
        local = ids - self.start
        inside = (local >= 0) & (local < self.size)
        out = F.embedding(torch.where(inside, local, 0), self.weight).masked_fill(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def _column(linear: Linear, tp: TensorParallel) -> None:
    rows = linear.weight.shape[0]
    split = Split(0, tp.rank * rows, rows, rows * tp.world_size)
    linear.splits = {"weight": split, **({"bias": split} if linear.bias is not None else {})}


def _fused_rows(m: FusedLinear, tp: TensorParallel) -> None:
    """M maps a checkpoint-fused tensor ([sum of shard rows * world, in]): the rank's rows of each shard,
    in layout order. A shard's rows start at (its local start) * world in the checkpoint tensor."""
    rows = tuple((start * tp.world_size + tp.rank * size, size) for start, size in m.shards.values())
    split = Split(0, 0, m.weight.shape[0], m.weight.shape[0] * tp.world_size, rows)
    m.splits = {"weight": split, **({"bias": split} if m.bias is not None else {})}


def _row(linear: Linear, tp: TensorParallel) -> RowParallelLinear:
    out_f, in_f = linear.weight.shape
    return RowParallelLinear(in_f, out_f, linear.bias is not None, tp)


def shard(model, tp: TensorParallel) -> None:
    """Turn MODEL (a CausalLM built on the meta device from local_config) into rank TP.rank's part."""
    model.tp = tp
    backbone, vocab, hidden = model.model, model.cfg.vocab_size, model.cfg.hidden_size
    for layer in backbone.layers:
        attn, mlp = layer.self_attn, layer.ffn() if hasattr(layer, "ffn") else layer.mlp
        experts = hasattr(mlp, "shard")  # a mixture of experts shards its experts itself (model/moe.py)
        if experts:
            mlp.shard(tp)
        dense = [] if experts else [mlp.gate_up_proj] if mlp.fused else [mlp.gate_proj, mlp.up_proj]
        for m in ([attn.qkv_proj] if attn.fused else [attn.q_proj, attn.k_proj, attn.v_proj]) + dense:
            if isinstance(m, FusedLinear) and m.whole:
                _fused_rows(m, tp)
            elif isinstance(m, FusedLinear):
                m.take_rank_rows(tp.rank, tp.world_size)
            else:
                _column(m, tp)
        attn.o_proj = _row(attn.o_proj, tp)
        if not experts:
            mlp.down_proj = _row(mlp.down_proj, tp)
    backbone.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp)
    if model.lm_head is not None:
        start, size, _ = tp.vocab_range(vocab)
        model.lm_head = Linear(hidden, size, bias=False)
        model.lm_head.splits = {"weight": Split(0, start, size, vocab)}


# ---- what the loader reads --------------------------------------------------------------------------

def split_of(model, param: str, proj: str | None) -> Split | None:
    """The slice of the checkpoint tensor behind PARAM (of fused projection PROJ) this rank holds."""
    module_name, _, leaf = param.rpartition(".")
    module = model.get_submodule(module_name)
    if proj is not None:
        src = getattr(module, "sources", {}).get(proj)
        return Split(0, *src) if src is not None else None
    return getattr(module, "splits", {}).get(leaf)


def full_shape(local: tuple[int, ...], split: Split | None) -> tuple[int, ...]:
    """The checkpoint tensor's shape, given the rank's LOCAL one."""
    if split is None:
        return tuple(local)
    shape = list(local)
    shape[split.dim] = split.full
    return tuple(shape)


def rank_part(st, info, split: Split | None) -> torch.Tensor:
    """The rank's part of tensor INFO of safetensors file ST, as a view of the mapping (strided for a
    column range); its bytes are made resident: the rows' byte range only, or the whole tensor when
    every row holds a piece."""
    full = st.get(info)
    if split is None:
        return full
    if split.rows:  # several row ranges: each made resident, then copied together
        row = (info.end - info.start) // info.shape[0]
        for start, size in split.rows:
            first = info.start + start * row
            st.populate(dataclasses.replace(info, start=first, end=first + size * row))
        return torch.cat([full.narrow(0, start, size) for start, size in split.rows])
    if split.dim == 0 and info.shape and info.shape[0]:
        row = (info.end - info.start) // info.shape[0]
        first = info.start + split.start * row
        st.populate(dataclasses.replace(info, start=first, end=first + split.size * row))
    else:
        st.populate(info)
    return full.narrow(split.dim, split.start, split.size)
