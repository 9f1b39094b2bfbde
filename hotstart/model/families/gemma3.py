"""Gemma 3, text-only (Gemma3ForCausalLM): the Gemma 2 layer (gemma2.py) with a (1 + w) RMSNorm over each
head of q and k before RoPE, five sliding layers to one global (`layer_types` / `sliding_window_pattern`),
the sliding layers on their own RoPE base (`rope_local_base_freq`; the decoder's `rotary_local`) and no
attention soft-capping (hotstart/families.py). The multimodal Gemma3ForConditionalGeneration is refused."""

from __future__ import annotations

from hotstart.model.families.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from hotstart.model.layers import OffsetRMSNorm
from hotstart.model_config import ModelConfig


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__(cfg, fused)
        attn = self.self_attn  # q_norm / k_norm: [D] weights, Gemma's offset
        attn.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        attn.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3DecoderLayer
