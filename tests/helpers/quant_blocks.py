"""ggml-quantized test weights and the quantized matmul's arithmetic, in numpy: random valid blocks of every
type the kernels take, the `gguf` package's dequantization (the reference), and x quantized to int8 per
32 elements as the kernels quantize it (kernels/quant_matmul.cpp)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

from hotstart.model.quant_kernels import BLOCKS, NAMES

TYPES = {name: t for t, name in NAMES.items()}
# the gguf package quantizes these; the K-quants it does not (NotImplementedError): crafted blocks
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's fp16 scales


def random_weight(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] uint8: a [n, k] Gaussian quantized by the gguf package, or for the K-quants random
    blocks (every code, 6-bit scale / min and int8 sub-scale is valid) with fp16 scales in [0, 1/64)."""
    t = GGMLQuantizationType(TYPES[name])
    if name in QUANTIZABLE:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    block, size = BLOCKS[TYPES[name]]
    b = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in _SCALES[name]:
        scale = (rng.random((n, k // block, 1)) / 64).astype(np.float16)
        b[..., off:off + 2] = scale.view(np.uint8)
    return b.reshape(n, -1)


def dequantize(w: np.ndarray, name: str) -> np.ndarray:
    """The gguf package's reference dequantization, [n, k] float64."""
    return quants.dequantize(w, GGMLQuantizationType(TYPES[name])).astype(np.float64)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (x as the kernels see it: d_a * q, float64; d_a per element), per 32 elements:
    d_a = max |x| / 127 in float32, q = x * (1 / d_a) rounded to nearest even, in float32."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)  # float32 product, rounded half to even
    xq = (d.astype(np.float64) * q).reshape(m, k)
    return xq, np.broadcast_to(d, blocks.shape).reshape(m, k).astype(np.float64)
