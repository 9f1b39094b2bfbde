"""Qwen2 / Qwen2.5: the Llama layer with a bias on q/k/v (none on o_proj or the MLP); with
`use_sliding_window`, a window on the layers from `max_window_layers` on (hotstart/families.py)."""

from __future__ import annotations

from hotstart.model.decoder import CausalLM
from hotstart.model.layers import DecoderLayer


class Qwen2ForCausalLM(CausalLM):
    layer_class = DecoderLayer
