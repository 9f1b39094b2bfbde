"""The decoder-only causal LM of every family (a family with its own layer subclasses it, in
hotstart/model/families/): embedding, a stack of the family's decoder layers, final norm, LM head (tied
or not).

Parameter names follow the Hugging Face checkpoints. With fused=True the q/k/v and gate/up projections
are fused into one matmul each (layers.FusedLinear; worth it on GPUs, where weights are copied anyway);
with fused=False every parameter is a checkpoint tensor as-is, so on CPU it can be a zero-copy view of
the file.
"""

from __future__ import annotations

import torch
from torch import nn

from hotstart.model import cpu_kernels, layer_ops, onednn
from hotstart.model.attention import AttnMetadata
from hotstart.model.layers import DecoderLayer, Embedding, Linear, RMSNorm, RotaryEmbedding
from hotstart.model_config import ModelConfig


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, fused: bool, layer_class: type[nn.Module]):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg, fused) for _ in range(cfg.num_hidden_layers))
        self.set_windows(cfg)
        # the sliding layers' own RoPE (Gemma 3), None: every layer uses `rotary`
        self.rotary_local = None if cfg.rope_local is None else \
            RotaryEmbedding(cfg.rope_local, cfg.head_dim, max_positions)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def set_windows(self, cfg: ModelConfig) -> None:
        """Each layer's sliding window (model_config.layer_window); a family that builds its layers
        itself (model/moe.py) calls this again once they exist."""
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "self_attn"):
                layer.self_attn.window = cfg.layer_window(i)
                layer.self_attn.sliding = bool(cfg.sliding_layers) and cfg.sliding_layers[i]


class CausalLM(nn.Module):
    """The decoder-only model of every family whose layer is layers.DecoderLayer (Llama, Qwen2, Qwen3,
    Mistral: they differ in ModelConfig flags only). A family with another layer subclasses it naming its
    layer_class, which implements attn_inputs / finish around self_attn.attend (the layer graphs of the
    fast path rely on that split)."""

    layer_class: type[nn.Module] = DecoderLayer
    graph_layers = True  # whether model/graphs.py's layer graphs compute this family's layer (Llama's)

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, fused: bool = True):
        super().__init__()
        self.cfg, self.fused = cfg, fused
        self.model = Backbone(cfg, max_positions or cfg.max_position_embeddings, fused, self.layer_class)
        tied = cfg.tie_word_embeddings
        self.lm_head = None if tied else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # oneDNN layout of output_weight(), set between steps (engine/fastpath/pack.py)
        self.lm_head_prepacked: torch.Tensor | None = None
        self.lm_head_gemv: cpu_kernels.Segments | None = None  # the small-batch kernel over output_weight()
        self.quant_head: nn.Module | None = None  # a GGUF's quantized LM head (model/quant.py QuantLinear)
        self.layer_ops = False  # every step through model/layer_ops.py (set with the CPU kernels)
        self.quant_step = None  # a GGUF's decode steps in one kernel call (model/quant_step.py), with them
        self.tp = None  # parallel.TensorParallel: this model is one rank's part (set by parallel.shard)

    def post_load(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build non-persistent state (rotary table) once real weights are in place."""
        self.model.rotary.build(device, dtype)
        if self.model.rotary_local is not None:
            self.model.rotary_local.build(device, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden] (Gemma scales them)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        h = self.embed(input_ids)
        meta.cos, meta.sin = self.model.rotary.lookup(positions)
        if self.model.rotary_local is not None:
            meta.cos_local, meta.sin_local = self.model.rotary_local.lookup(positions)
        if self.layer_ops:
            out = None if self.quant_step is None else self.quant_step(h, meta)
            return layer_ops.forward(self, h, meta) if out is None else out
        for layer in self.model.layers:
            h = layer(h, meta)
        return self.model.norm(h)

    def output_weight(self) -> torch.Tensor:
        """The LM head's [vocab, hidden] weight (the embedding's when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [N, hidden] -> logits: [N, vocab] float32 (tensor parallel: gathered on rank 0, else None)
        if self.quant_head is not None:
            logits = self.quant_head(hidden).float()
        elif self.lm_head_gemv is not None and self.lm_head_gemv.fits(hidden):
            logits = self.lm_head_gemv(hidden, torch.float32)
        elif self.lm_head_prepacked is not None:
            logits = onednn.linear(hidden, self.lm_head_prepacked, None).float()
        else:
            logits = (hidden @ self.output_weight().t()).float()
        cap = self.cfg.final_softcap  # final logit soft-capping (Gemma 2): elementwise, before the gather
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if self.tp is None else self.tp.gather_logits(logits, self.cfg.vocab_size)
