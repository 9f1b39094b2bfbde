"""Llama 2 / 3.x (SmolLM2, TinyLlama, ...) and Mistral: pre-norm decoder layers of grouped-query attention
with RoPE and a gated SiLU MLP. `attention_bias` puts a bias on q/k/v and o_proj, `mlp_bias` on the MLP
(hotstart/families.py); Mistral has neither, and a sliding window on every layer (model/attention.py)."""

from __future__ import annotations

from hotstart.model.decoder import CausalLM
from hotstart.model.layers import DecoderLayer


class LlamaForCausalLM(CausalLM):
    layer_class = DecoderLayer
