"""Qwen3-MoE (30B-A3B, 235B-A22B): the Qwen3 layer (an RMSNorm over each head of q and k) with routed
experts (`mlp.experts.N.{gate,up,down}_proj`, no shared expert), renormalised with `norm_topk_prob`;
`decoder_sparse_step` / `mlp_only_layers` keep some layers dense. head_dim defaults to hidden / heads
here, unlike dense Qwen3 (hotstart/model/moe.py, hotstart/families.py)."""

from __future__ import annotations

from hotstart.model.moe import MoECausalLM


class Qwen3MoeForCausalLM(MoECausalLM):
    pass
