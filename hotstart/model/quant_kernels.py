"""Matrix products on ggml's quantized blocks (kernels/quant_matmul.cpp, quant_unpack.cpp, quant.h), in the
CPU kernels' library (model/cpu_kernels.py: built behind READY, loaded with ctypes, on torch's threads).

out[M, N] float32 = x[M, K] (float32 or bf16) times a weight held as ggml lays it out: a uint8 tensor
[N, row bytes], each row K elements in blocks of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (32 elements), Q4_K, Q5_K
or Q6_K (256). x is quantized to int8 per 32 elements, as llama.cpp's vec_dot quantizes its activations;
each weight block is unpacked in L1 into one affine form (u8 codes, a scale and an offset per group of
16 or 32) and multiplied with every token of the step: AVX512-VNNI (vpdpbusd), AVX2 (vpmaddubsw), or the
portable C++ reference, chosen per host (`host_isa`) as the bf16 kernels are.

Error: the int8 activations are the only approximation (the weights' codes are exact); each element of x
moves by at most d_a / 2 = max|x over its block| / 254, so |out - dequantize(w) @ x| <= sum_k |w_k| d_a(k) /
2 per output, and in practice about sqrt(K) times less (tests/model/test_quant_kernels.py states the bound
it checks). `install` registers `kernel` with model/quant.py's hook (`set_kernel`), where that exists.
"""

from __future__ import annotations

import ctypes
import os

import torch

from hotstart.model import cpu_kernels
from hotstart.system import cpu_flags

# ggml type id -> (elements per block, bytes per block): ggml-common.h's blocks
BLOCKS = {8: (32, 34), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 12: (256, 144), 13: (256, 176),
          14: (256, 210)}
NAMES = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
PORTABLE, AVX2, AVX512_VNNI = 0, 1, 2  # kernels/quant.h's Isa
ISA_NAMES = {PORTABLE: "portable C++", AVX2: "AVX2", AVX512_VNNI: "AVX512-VNNI"}
_AVX2_NEEDS = ("avx2", "fma", "f16c")
_AVX512_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi", *_AVX2_NEEDS)
_ISA_NEEDS = {AVX512_VNNI: _AVX512_NEEDS, AVX2: _AVX2_NEEDS}
_X_CODES = {torch.bfloat16: 1, torch.float32: 2}
MAX_WEIGHTS = 16  # weights one call multiplies side by side (kernels/quant_matmul.cpp)

_fn = None  # hs_quant_matmul, once the library is loaded (bind)
_isa = PORTABLE  # host_isa(), read once by bind (cpu_flags reads /proc/cpuinfo)
# the call's argument arrays, filled in place: building ctypes arrays per call costs more than the call
_ptrs, _lds = (ctypes.c_void_p * MAX_WEIGHTS)(), (ctypes.c_int64 * MAX_WEIGHTS)()
_ns, _types = (ctypes.c_int64 * MAX_WEIGHTS)(), (ctypes.c_int * MAX_WEIGHTS)()


def host_isa() -> int:
    """The best kernel this CPU runs (HOTSTART_QUANT_ISA=avx2|portable forces a lower one)."""
    ceiling = {"avx2": AVX2, "portable": PORTABLE}.get(os.environ.get("HOTSTART_QUANT_ISA", "").lower(),
                                                       AVX512_VNNI)
    flags = cpu_flags()
    return next((isa for isa in (AVX512_VNNI, AVX2) if isa <= ceiling and set(_ISA_NEEDS[isa]) <= flags),
                PORTABLE)


def bind() -> bool:
    """Take hs_quant_matmul from the loaded CPU kernels' library (cpu_kernels.load): False where the
    library is not loaded or predates it."""
    global _fn, _isa
    _isa = host_isa()
    lib = cpu_kernels._lib
    fn = getattr(lib, "hs_quant_matmul", None) if lib is not None else None
    if fn is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64]
    _fn = fn
    return fn is not None


def row_bytes(k: int, ggml_type: int) -> int:
    block, size = BLOCKS[ggml_type]
    return k // block * size


def takes(w: torch.Tensor, ggml_type: int, k: int) -> bool:
    """Whether the kernels multiply W (uint8 [N, row bytes] of GGML_TYPE) by rows of K elements: a type they
    have, K in whole blocks, rows contiguous, on the CPU."""
    return (ggml_type in BLOCKS and k % BLOCKS[ggml_type][0] == 0 and w.dtype == torch.uint8 and w.dim() == 2
            and w.stride(1) == 1 and w.shape[1] == row_bytes(k, ggml_type) and w.device.type == "cpu")


def matmul(x: torch.Tensor, weights: list[tuple[torch.Tensor, int]], isa: int | None = None
           ) -> torch.Tensor | None:
    """x: [M, K] float32 or bf16; weights: (uint8 [N_i, row bytes] with rows contiguous, ggml type) each ->
    [M, sum N_i] float32, the weights' outputs side by side. None where the kernel does not take it (not
    bound, a type or dtype it lacks, K not in whole blocks, another device)."""
    if (_fn is None or x.dim() != 2 or x.dtype not in _X_CODES or x.device.type != "cpu"
            or not 1 <= len(weights) <= MAX_WEIGHTS):
        return None
    m, k = x.shape
    if not all(takes(w, t, k) for w, t in weights):
        return None
    x = x.contiguous()
    n = 0
    for i, (w, t) in enumerate(weights):
        _ptrs[i], _lds[i], _ns[i], _types[i] = w.data_ptr(), w.stride(0), w.shape[0], t
        n += w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    rc = _fn(_isa if isa is None else isa, _X_CODES[x.dtype], x.data_ptr(), m, k, len(weights), _ptrs, _lds,
             _ns, _types, out.data_ptr(), n)
    return out if rc == 0 else None


def kernel(x: torch.Tensor, w: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
    """model/quant.py's hook: x [M, K], w uint8 [N, row bytes] of GGML_TYPE -> [M, N] float32, or None (the
    reference path runs)."""
    if cpu_kernels._traced:
        with torch.profiler.record_function("hotstart::quant_matmul"):
            return matmul(x, [(w, ggml_type)])
    return matmul(x, [(w, ggml_type)])


def many(x: torch.Tensor, weights: list[tuple[torch.Tensor, int]]) -> torch.Tensor | None:
    """model/quant.py's hook for several weights of one input: `matmul` (None: the per-weight path runs)."""
    if cpu_kernels._traced:
        with torch.profiler.record_function("hotstart::quant_matmul"):
            return matmul(x, weights)
    return matmul(x, weights)


def quantized(model: torch.nn.Module) -> bool:
    """Whether MODEL holds weights as ggml blocks of a type these kernels take (model/quant.py's modules)."""
    return any(getattr(m, "ggml_type", None) in BLOCKS for m in model.modules())


def install() -> str:
    """Register `kernel` with model/quant.py's hook (the library loaded: cpu_kernels.load) -> what now runs,
    for the packing stage's detail; "" where nothing was registered (HOTSTART_QUANT_KERNEL=off, a library
    without them, no hook)."""
    if cpu_kernels.switched_off("HOTSTART_QUANT_KERNEL") or not bind():
        return ""
    try:
        from hotstart.model import quant  # noqa: PLC0415 - only quantized models have it to register with
    except ImportError:
        return ""
    quant.set_kernel(kernel, many)
    return f"quantized matmul kernels ({ISA_NAMES[_isa]})"
