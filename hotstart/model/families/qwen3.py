"""Qwen3 (dense): the Llama layer with an RMSNorm over each head of q and k before RoPE, and head_dim
given apart from hidden_size / heads (128 where config.json leaves it out; hotstart/families.py)."""

from __future__ import annotations

from hotstart.model.decoder import CausalLM
from hotstart.model.layers import DecoderLayer


class Qwen3ForCausalLM(CausalLM):
    layer_class = DecoderLayer
