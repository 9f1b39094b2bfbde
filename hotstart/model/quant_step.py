"""A decode step of a GGUF model in one call into the CPU kernels' library (kernels/quant_step.cpp).

model/layer_ops.py runs a Llama-shaped layer as ~10 kernel calls from Python; on the 135M default model a
one-stream token then cost ~14 ms here, about half of it Python and torch's dispatch around the kernels
(per-call checks, ctypes argument conversion, torch.empty, and for every quantized product the float32 ->
dtype conversion, llama's q/k row order and the biases as torch ops). `QuantStep` hands the whole step to
C++, which calls the same kernels in the same order: its output equals layer_ops.forward's bit for bit
(tests/model/test_quant_step.py). It serves steps where every sequence brings one token (decode); a step
with a prompt in it returns None and layer_ops serves it. Built by the fast path with the layer ops
(engine/fastpath/pack.py) where every projection is a quantized block type the matmul kernel takes;
HOTSTART_QUANT_STEP=off keeps layer_ops for every step.
"""

from __future__ import annotations

import ctypes

import torch

from hotstart.model import cpu_kernels, quant_kernels
from hotstart.model.attention import AttnMetadata

PARTS = 4  # kernels/quant_step.cpp's HS_STEP_PARTS
_DTYPES = {torch.bfloat16: 1, torch.float32: 2}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Product(ctypes.Structure):  # kernels/quant_step.cpp's HsStepProduct
    _fields_ = [("parts", _i64), ("ws", _ptr * PARTS), ("lds", _i64 * PARTS), ("ns", _i64 * PARTS),
                ("types", ctypes.c_int32 * PARTS), ("heads", _i64 * PARTS), ("bias", _ptr * PARTS)]


class _Layer(ctypes.Structure):  # kernels/quant_step.cpp's HsStepLayer
    _fields_ = [("norm1", _ptr), ("norm2", _ptr), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product),
                ("k_cache", _ptr), ("v_cache", _ptr), ("head_stride", _i64), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("window", _i64)]


def _products(layer) -> tuple[list, list, list, list]:
    """LAYER's q/k/v, o, gate/up, down projections, each a list of the QuantLinears one product holds."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if attn.fused else list(attn.packed_qkv.linears)
    gate_up = [mlp.gate_up_proj] if mlp.fused else list(mlp.packed_gate_up.linears)
    return qkv, [attn.o_proj], gate_up, [mlp.down_proj]


def unsupported(model) -> str:
    """Why MODEL's decode steps do not run in one call ("" where they do). Expects the layer ops on
    (model.layer_ops: Llama-shaped layers, q/k/v and gate/up grouped) and the kernels loaded."""
    lib = cpu_kernels._lib
    if lib is None or not hasattr(lib, "hs_quant_step") or quant_kernels._fn is None:
        return "no quantized matmul kernels"
    if cpu_kernels._attention_fn is None:
        return "no paged decode kernel"
    if not model.layer_ops:
        return "no layer ops"
    norm = model.model.norm.weight
    if norm.dtype not in _DTYPES:
        return f"no step for {norm.dtype}"
    attn0 = model.model.layers[0].self_attn
    h, kvh, d = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    r = model.model.rotary.cos.shape[-1]
    if h % kvh or h // kvh * d > 8 * 512 or r > d or r % 2:
        return "attention shapes the kernels do not take"
    for layer in model.model.layers:
        attn = layer.self_attn
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (h, kvh, d):
            return "layers of different attention shapes"
        for product in _products(layer):
            if len(product) > PARTS:
                return "a product of more than 4 weights"
            for lin in product:
                t = getattr(lin, "ggml_type", None)
                if t not in quant_kernels.BLOCKS:
                    return "a projection not in quantized blocks the kernel takes"
                if not quant_kernels.takes(lin.weight, t, lin.in_features):
                    return "a projection's width (not in whole blocks) or layout the kernel does not take"
                if lin.bias is not None and lin.bias.dtype != norm.dtype:
                    return "a bias in another dtype"
    return ""


class QuantStep:
    """MODEL's layers as kernels/quant_step.cpp's table (built once: the pointers are the checkpoint's
    mapped tensors, which stay; the caches' pointers are read each step)."""

    def __init__(self, model) -> None:
        self.layers = list(model.model.layers)
        self.table = (_Layer * len(self.layers))()
        self.keep: list[torch.Tensor] = []  # contiguous biases the table points into
        for entry, layer in zip(self.table, self.layers, strict=True):
            attn = layer.self_attn
            entry.norm1, entry.eps1 = layer.input_layernorm.weight.data_ptr(), layer.input_layernorm.eps
            entry.norm2 = layer.post_attention_layernorm.weight.data_ptr()
            entry.eps2 = layer.post_attention_layernorm.eps
            for name, product in zip(("qkv", "o", "gate_up", "down"), _products(layer), strict=True):
                self._fill(getattr(entry, name), product)
            entry.scale, entry.softcap, entry.window = attn.scale, attn.softcap or 0.0, attn.window or 0
        attn = self.layers[0].self_attn
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.norm = model.model.norm
        self.fn = cpu_kernels._lib.hs_quant_step
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_int, ctypes.c_int, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr,
                            _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, ctypes.c_float, _ptr]

    def _fill(self, p: _Product, linears: list) -> None:
        p.parts = len(linears)
        for i, lin in enumerate(linears):
            w = lin.weight
            p.ws[i], p.lds[i], p.ns[i], p.types[i] = w.data_ptr(), w.stride(0), w.shape[0], lin.ggml_type
            p.heads[i] = lin.unpermute_heads
            if lin.bias is not None:
                self.keep.append(lin.bias.contiguous())
                p.bias[i] = self.keep[-1].data_ptr()

    def __call__(self, h: torch.Tensor, meta: AttnMetadata) -> torch.Tensor | None:
        """h: [T, hidden] the embeddings (meta's rotary tables set) -> the final norm's output [T, hidden];
        None for a step that is not one token per sequence (or with activations, tables or a cache in
        another dtype than the norms')."""
        d, dtype = meta.decode, self.norm.weight.dtype
        if (meta.prefill is not None or d is None or d.context is None or h.dtype != dtype
                or meta.cos.dtype != dtype):
            return None
        for entry, layer in zip(self.table, self.layers, strict=True):
            k, v = layer.self_attn.k_cache, layer.self_attn.v_cache
            if (k is None or k.dtype != dtype or v.dtype != dtype or k.stride(2) != 1
                    or k.stride(1) != k.shape[2] or v.stride() != k.stride()):
                return None
            entry.k_cache, entry.v_cache, entry.head_stride = k.data_ptr(), v.data_ptr(), k.stride(0)
        if cpu_kernels._traced:
            with torch.profiler.record_function("hotstart::quant_step"):
                return self._run(h, meta)
        return self._run(h, meta)

    def _run(self, h: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        d, (heads, kv_heads, head_dim) = meta.decode, self.shape
        h = h.contiguous()
        cos, sin = meta.cos.contiguous(), meta.sin.contiguous()
        tables, context = d.block_tables.contiguous(), d.context.contiguous()
        order = None if d.tokens is None else d.tokens.contiguous()
        slots = meta.slot_mapping.contiguous()
        out = torch.empty_like(h)
        rc = self.fn(quant_kernels._isa, _DTYPES[h.dtype], len(self.layers), self.table, h.shape[0],
                     h.shape[1], heads, kv_heads, head_dim, cos.shape[-1], h.data_ptr(), cos.data_ptr(),
                     sin.data_ptr(), slots.data_ptr(), None if order is None else order.data_ptr(),
                     tables.data_ptr(), tables.shape[1], context.data_ptr(), meta.block_size,
                     self.norm.weight.data_ptr(), self.norm.eps, out.data_ptr())
        if rc != 0:
            raise RuntimeError("quant_step: the kernels refused their arguments")
        return out


def build(model) -> QuantStep | str:
    """The one-call decode step for MODEL, or why not (HOTSTART_QUANT_STEP=off, `unsupported`)."""
    if cpu_kernels.switched_off("HOTSTART_QUANT_STEP"):
        return "HOTSTART_QUANT_STEP=off"
    return unsupported(model) or QuantStep(model)
