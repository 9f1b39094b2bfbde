"""A step through Llama-shaped decoder layers on the CPU kernels' layer ops.

With the small-batch GEMV and the paged decode kernel (model/cpu_kernels.py), a one-stream decode step
of the default model spends about as long in the ~15 small torch ops around them per layer (the
residual adds, two RMSNorms, RoPE on q and k, the K/V write, SiLU x up) as in the weights' read: each
op costs more in dispatch than in arithmetic. Here a layer is nine calls:

    add + RMSNorm -> q/k/v (one matmul) -> RoPE + K/V write -> attention -> o_proj
    -> add + RMSNorm -> gate/up (one matmul) -> SiLU x up -> down

with the residual add of each block carried into the next norm (`x` the residual stream, `delta` what
the last block adds to it). The arithmetic and its roundings are layers.DecoderLayer's (equal in float32
to accumulation order: tests/model/test_layer_ops.py). Used by CausalLM.forward for every step once the
fast path has installed the kernels (engine/fastpath/pack.py) on a model
whose every layer computes the plain DecoderLayer (Llama, Mistral, Qwen2, Phi-3, SmolLM2, ...:
`unsupported`). The ops run 8 lanes at a time and split rows over threads, so prefill-sized steps gain
too: 8 prompts of 200 tokens in one step, 558 vs 872 ms through torch's ops (their [1600, 3072] temporaries).
"""

from __future__ import annotations

import torch

from hotstart.model import cpu_kernels
from hotstart.model.attention import AttnMetadata, paged_attention
from hotstart.model.layers import ACTIVATIONS, Attention, DecoderLayer, GatedMLP, RMSNorm, rope_of


def unsupported(model) -> str:
    """Why MODEL's layers do not run on the layer ops ("" where they do)."""
    if model.tp is not None:
        return "tensor parallel"
    # the activations' dtype: a GGUF's head stays ggml blocks (uint8), its norms are in the serving dtype
    weight = model.output_weight() if model.quant_head is None else model.model.norm.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return f"no layer ops for {weight.device.type} {str(weight.dtype)[6:]}"
    if model.model.rotary_local is not None or type(model.model.norm) is not RMSNorm:
        return "not a Llama-shaped model"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
        if (not _plain(type(layer)) or type(attn) is not Attention or type(mlp) is not GatedMLP
                or type(layer.input_layernorm) is not RMSNorm
                or type(layer.post_attention_layernorm) is not RMSNorm):
            return "not a Llama-shaped layer"
        if attn.q_norm is not None or mlp.act is not ACTIVATIONS["silu"]:
            return "q/k norms or an activation other than SiLU"
        one_qkv = attn.fused or attn.packed_qkv is not None
        if not (one_qkv and (mlp.fused or mlp.packed_gate_up is not None)):
            return "q/k/v or gate/up not one matmul"
    return ""


def _plain(cls) -> bool:
    """Whether layer class CLS computes what DecoderLayer does (Phi-3's only maps its fused checkpoint)."""
    return issubclass(cls, DecoderLayer) and all(getattr(cls, name) is getattr(DecoderLayer, name)
                                                 for name in ("forward", "attn_inputs", "finish"))


def attn_inputs(layer: DecoderLayer, x: torch.Tensor, delta: torch.Tensor | None, meta: AttnMetadata):
    """x + delta (the residual stream; delta None: x) -> (q: [T, H, D] rotated, the new residual stream);
    this step's K and V written to the layer's cache."""
    attn, norm = layer.self_attn, layer.input_layernorm
    normed, x = cpu_kernels.add_rmsnorm(x, delta, norm.weight, norm.eps)
    cos, sin = rope_of(attn, meta)
    q = cpu_kernels.rope_kv(attn.qkv_stacked(normed), attn.num_heads, attn.num_kv_heads, attn.head_dim,
                            cos, sin, meta.slot_mapping, attn.k_cache, attn.v_cache)
    return q, x


def attend(layer: DecoderLayer, q: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    """q: [T, H, D] -> the attention output [T, H * D] (its K/V already in the cache)."""
    attn = layer.self_attn
    o = paged_attention(q, attn.k_cache, attn.v_cache, meta, attn.scale, attn.window, attn.softcap)
    return o.reshape(q.shape[0], attn.q_size)


def finish(layer: DecoderLayer, o: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o: [T, H * D], x: the residual stream -> (the residual stream, what the MLP adds to it)."""
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    normed, x = cpu_kernels.add_rmsnorm(x, layer.self_attn.o_proj(o), norm.weight, norm.eps)
    gate_up = mlp.gate_up_proj(normed) if mlp.fused else mlp.packed_gate_up.stacked(normed)
    return x, mlp.down_proj(cpu_kernels.silu_mul(gate_up))


def forward(model, h: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    """h: [T, hidden] (the embeddings; meta's rotary tables set) -> the final norm's output [T, hidden]."""
    x, delta = h, None
    for layer in model.model.layers:
        q, x = attn_inputs(layer, x, delta, meta)
        x, delta = finish(layer, attend(layer, q, meta), x)
    norm = model.model.norm
    return cpu_kernels.add_rmsnorm(x, delta, norm.weight, norm.eps)[0]
