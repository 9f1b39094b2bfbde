"""Gemma 2: grouped-query attention with queries scaled by `query_pre_attn_scalar` ** -0.5 and logits
soft-capped (tanh(s / 50) * 50), a sliding window on every other layer (layer 0 slides), a GELU-tanh
gated MLP, "sandwich" norms (each of attention and MLP between a pre- and a post-norm), Gemma's (1 + w)
RMSNorm, embeddings scaled by sqrt(hidden) and the output logits soft-capped (hotstart/families.py reads
the config; model/attention.py caps and slides). Gemma 3 (gemma3.py) builds on this layer."""

from __future__ import annotations

import torch

from hotstart.model.decoder import CausalLM
from hotstart.model.layers import DecoderLayer, OffsetRMSNorm
from hotstart.model_config import ModelConfig


class Gemma2DecoderLayer(DecoderLayer):
    """x + post_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))); every norm (1 + w)."""

    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__(cfg, fused)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)  # on the attention output, not the MLP input
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o: [T, H * D] (attention output), x: [T, hidden] (the layer's input) -> the next layer's input."""
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(o))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(CausalLM):
    layer_class = Gemma2DecoderLayer
    graph_layers = False  # the compiled layer graphs (model/graphs.py) are the Llama layer's math

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, fused: bool = True):
        super().__init__(cfg, max_positions, fused)
        self.model.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [T] -> [T, hidden], times sqrt(hidden) rounded to the embedding's dtype (as transformers does)
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(self.cfg.hidden_size**0.5, dtype=h.dtype)
