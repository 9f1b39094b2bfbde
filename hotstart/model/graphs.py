"""The decoder layer as pure functions of tensors, weights passed in: what the compiled path compiles.

The compiled unit is `mid`: layer i after its attention (o_proj, residual, MLP) followed by layer i+1
up to its attention (norm, q/k/v, q/k norm, RoPE). Attention itself stays eager (paged, variable
context), so one graph per token-count bucket serves every layer and every context length; weights
are graph inputs, so a compiled graph fits any checkpoint of the same shapes and holds no weights.
Linear layers are F.linear on the plain [out, in] weights: the compiled path is what `--compile auto`
builds where the oneDNN-packed weights (model/packed.py) do not fit in memory (docs/serving.md has the
measurements: with packed weights, compiled graphs gained nothing here).
The math is that of hotstart/model/layers.py, op for op (tests check compiled == eager).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hotstart.config import ModelConfig


@dataclass(frozen=True)
class LayerSpec:
    """What a layer graph depends on besides its weights (also the compile cache's key)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, cfg: ModelConfig) -> LayerSpec:
        return cls(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                   cfg.intermediate_size, cfg.rms_norm_eps, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias,
                   cfg.qk_norm)

    def as_dict(self) -> dict:
        return asdict(self)

    # Parameter names within a decoder layer, in graph-input order ("?" marks linears: weight [+ bias]).
    def post_names(self) -> list[str]:
        return [*self._lin("self_attn.o_proj", self.o_bias), "post_attention_layernorm.weight",
                *self._lin("mlp.gate_proj", self.mlp_bias), *self._lin("mlp.up_proj", self.mlp_bias),
                *self._lin("mlp.down_proj", self.mlp_bias)]

    def pre_names(self) -> list[str]:
        names = ["input_layernorm.weight"]
        for p in ("q_proj", "k_proj", "v_proj"):
            names += self._lin(f"self_attn.{p}", self.qkv_bias)
        if self.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        return names

    @staticmethod
    def _lin(prefix: str, bias: bool) -> list[str]:
        return [f"{prefix}.weight"] + ([f"{prefix}.bias"] if bias else [])


def layer_inputs(layer: nn.Module, names: list[str]) -> list[torch.Tensor]:
    """The tensors named NAMES of one decoder layer."""
    out = []
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        out.append(getattr(layer.get_submodule(module_name), leaf))
    return out


def _take(ws: list[torch.Tensor], i: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    return ws[i], (ws[i + 1] if bias else None), i + (2 if bias else 1)


def _lin(spec: LayerSpec, x, w, b):
    return F.linear(x, w, b)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def pre(spec: LayerSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ws: list[torch.Tensor]):
    # x: [T, hidden]; cos, sin: [T, 1, D] -> q: [T, H, D], k, v: [T, KVH, D]
    t = x.shape[0]
    h = _norm(x, ws[0], spec.eps)
    i = 1
    outs = []
    for heads in (spec.heads, spec.kv_heads, spec.kv_heads):
        w, b, i = _take(ws, i, spec.qkv_bias)
        outs.append(_lin(spec, h, w, b).view(t, heads, spec.head_dim))
    q, k, v = outs
    if spec.qk_norm:
        q, k = _norm(q, ws[i], spec.eps), _norm(k, ws[i + 1], spec.eps)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def post(spec: LayerSpec, attn: torch.Tensor, x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    # attn: [T, H * D] (attention output), x: [T, hidden] (the layer's input) -> the next layer's input
    w, b, i = _take(ws, 0, spec.o_bias)
    x = x + _lin(spec, attn, w, b)
    h = _norm(x, ws[i], spec.eps)
    wg, bg, i = _take(ws, i + 1, spec.mlp_bias)
    wu, bu, i = _take(ws, i, spec.mlp_bias)
    wd, bd, i = _take(ws, i, spec.mlp_bias)
    return x + _lin(spec, F.silu(_lin(spec, h, wg, bg)) * _lin(spec, h, wu, bu), wd, bd)


class MidGraph(nn.Module):
    """post(layer i) then pre(layer i+1), as one module for torch.export; weights are inputs."""

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.n_post = len(spec.post_names())

    def forward(self, attn, x, cos, sin, *weights):
        x = post(self.spec, attn, x, list(weights[:self.n_post]))
        q, k, v = pre(self.spec, x, cos, sin, list(weights[self.n_post:]))
        return x, q, k, v


def example_inputs(spec: LayerSpec, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Inputs of MidGraph for TOKENS tokens, random."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "o_proj": (spec.hidden, spec.heads * spec.head_dim),
        "gate_proj": (spec.intermediate, spec.hidden),
        "up_proj": (spec.intermediate, spec.hidden),
        "down_proj": (spec.hidden, spec.intermediate),
        "q_proj": (spec.heads * spec.head_dim, spec.hidden),
        "k_proj": (spec.kv_heads * spec.head_dim, spec.hidden),
        "v_proj": (spec.kv_heads * spec.head_dim, spec.hidden),
    }
    ws = []
    for name in spec.post_names() + spec.pre_names():
        module, leaf = name.split(".")[-2], name.split(".")[-1]
        if module in shapes:
            shape = shapes[module] if leaf == "weight" else shapes[module][:1]
        else:  # a norm
            shape = (spec.head_dim,) if module in ("q_norm", "k_norm") else (spec.hidden,)
        ws.append(torch.randn(*shape, generator=g).to(dtype) * 0.02)
    d = spec.head_dim
    act = (
        torch.randn(tokens, spec.heads * d, generator=g).to(dtype),
        torch.randn(tokens, spec.hidden, generator=g).to(dtype),
        torch.randn(tokens, 1, d, generator=g).to(dtype),
        torch.randn(tokens, 1, d, generator=g).to(dtype),
    )
    return (*act, *ws)
