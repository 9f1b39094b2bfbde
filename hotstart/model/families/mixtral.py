"""Mixtral 8x7B / 8x22B: the Mistral layer with a mixture of experts in place of the MLP, under the
checkpoint name `block_sparse_moe` (router `gate`, experts `experts.N.{w1,w3,w2}`: gate, up, down); the
top-k routing weights are always renormalised (hotstart/model/moe.py, hotstart/families.py)."""

from __future__ import annotations

from hotstart.model.moe import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    pass
