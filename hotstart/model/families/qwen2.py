"""Qwen2 / Qwen2.5: the Llama layer with a bias on q/k/v (none on o_proj or the MLP); its sliding window
(`use_sliding_window`) is served only where it masks nothing (hotstart/families.py)."""

from __future__ import annotations

from hotstart.model.decoder import CausalLM
from hotstart.model.layers import DecoderLayer


class Qwen2ForCausalLM(CausalLM):
    layer_class = DecoderLayer
