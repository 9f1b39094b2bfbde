"""Qwen1.5-MoE / Qwen2-MoE: the Qwen2 layer (q/k/v biases: `qkv_bias`) with routed experts
(`mlp.experts.N.{gate,up,down}_proj`), renormalised only with `norm_topk_prob`, and a shared expert
scaled by sigmoid(`shared_expert_gate`); `decoder_sparse_step` / `mlp_only_layers` keep some layers
dense (hotstart/model/moe.py, hotstart/families.py)."""

from __future__ import annotations

from hotstart.model.moe import MoECausalLM


class Qwen2MoeForCausalLM(MoECausalLM):
    pass
