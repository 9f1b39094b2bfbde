"""OLMo 2: post-norm layers (x + norm(attn(x)), then x + norm(mlp(x)); no norm before attention or the
MLP) and q/k RMSNorms over the whole projections (q_norm: [H * D], k_norm: [KVH * D]), not per head,
before RoPE. Those norms take statistics across all heads, which tensor parallelism splits over ranks:
refused there with one line (hotstart/families.py `tensor_parallel`), not all-gathered."""

from __future__ import annotations

import torch
from torch import nn

from hotstart.model.attention import AttnMetadata
from hotstart.model.decoder import CausalLM
from hotstart.model.layers import Attention, DecoderLayer, GatedMLP, RMSNorm, RotaryEmbedding
from hotstart.model_config import ModelConfig


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__(cfg, fused)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)  # over all heads of a token at once
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [T, hidden] -> q: [T, H, D], k, v: [T, KVH, D] (q/k normed over the projection, RoPE)."""
        t = x.shape[0]
        q, k, v = self.qkv(x)
        q = self.q_norm(q).view(t, self.num_heads, self.head_dim)  # normed as [T, H * D]
        k = self.k_norm(k).view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin), v


class Olmo2DecoderLayer(nn.Module):
    """The attn_inputs / finish split of layers.DecoderLayer, with the norms after the blocks."""

    def __init__(self, cfg: ModelConfig, fused: bool):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg, fused)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attn_inputs(self, x: torch.Tensor, meta: AttnMetadata):
        return self.self_attn.project(x, meta.cos, meta.sin)  # no pre-norm

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # o: [T, H * D], x: [T, hidden] (the layer's input) -> the next layer's input
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(o))
        return x + self.post_feedforward_layernorm(self.mlp(x))

    forward = DecoderLayer.forward


class Olmo2ForCausalLM(CausalLM):
    layer_class = Olmo2DecoderLayer
