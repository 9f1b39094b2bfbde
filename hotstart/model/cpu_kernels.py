"""hotstart's own CPU kernels (kernels/*.cpp), one small library built on the host:

- small-batch linear layers (kernels/gemv.cpp, `Segments`) for steps of at most MAX_ROWS tokens, where
  oneDNN's prepacked kernels read the weights at about half the memory bandwidth;
- paged decode attention (kernels/decode_attention.cpp, `decode_attention`): one call per layer reads
  each sequence's keys and values in place through its block table, where the torch path gathers them
  into fresh tensors and runs ~10 ops over them;
- linear layers of steps of MAX_ROWS + 1 to TILE_MAX_ROWS tokens in bf16 (kernels/tiles.cpp, `Tiles`, a
  repacked copy of the weights), where oneDNN's prepacked kernels reach a third of the CPU's bf16 peak;
- causal prefill attention in bf16 (kernels/prefill_attention.cpp, `prefill_attention`, AVX512-BF16): flash
  attention with its dot products on vdpbf16ps, where torch's SDPA reaches ~30-50 GMAC/s here;
- the small ops between a Llama-shaped layer's matmuls (kernels/layer_ops.cpp: `add_rmsnorm`, `rope_kv`,
  `silu_mul`; model/layer_ops.py runs every step through them): three calls where the torch
  path runs ~15 ops, each over a few thousand numbers;
- a GGUF model's decode step in one call (kernels/quant_step.cpp, driven by model/quant_step.py): the
  ops above, the paged decode attention and the quantized matmul (model/quant_kernels.py) called in
  model/layer_ops.py's order from C++, where Python's calls around them cost as much as the kernels.

Decode at one stream is bound by the weight read. Measured on the 2-vCPU AVX512-BF16 EPYC (one process,
alternating rounds, the default model's 30 layers of shapes + its LM head, bf16): oneDNN prepacked 22-29
ms per step of weights, this kernel 10.5-17 ms at one row (a sum of the same bytes: 9.6-12 ms); 2x at
two rows, 1.4x at three, even at four, slower from eight on (it multiplies row by row: compute-bound
there). So steps of more than MAX_ROWS tokens keep oneDNN.

The kernel reads the checkpoint's own [out, in] weights (no copy): sibling projections (q/k/v, gate/up)
go in one call as segments, side by side in the output, as PackedGroup's stacked oneDNN weight does.

The library is built once per source, compiler and host by `g++ -O3 -fopenmp -shared` (~1 s) into
$HOTSTART_HOME/kernels/ with its sha256 beside it, in a child process behind READY
(engine/fastpath/builder.py), and loaded with ctypes only if it verifies (hotstart/trust.py: ours, no one
else's to write, the recorded hash): no torch headers, no inductor. Its OpenMP runtime is the one torch
has loaded (same soname), so it runs on torch's threads. float32 results equal F.linear's up to
accumulation order; bfloat16 ones within bf16's own error of the float32 model; decode attention equals
the torch path's within float32 accumulation order (tests/model/test_cpu_kernels.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from hotstart.diskio import publish_recorded, temp_name
from hotstart.system import cpu_flags, hotstart_home
from hotstart.trust import make_private_dir, open_verified, verified_problem

KERNELS = Path(__file__).with_name("kernels")
# compiled (common.h included)
SOURCES = [KERNELS / name for name in ("gemv.cpp", "decode_attention.cpp", "layer_ops.cpp", "tiles.cpp",
                                       "prefill_attention.cpp", "quant_unpack.cpp", "quant_matmul.cpp",
                                       "quant_vnni.cpp", "quant_tiles.cpp", "quant_avx2.cpp",
                                       "quant_acts.cpp", "quant_step.cpp", "quant_lanes.cpp")]
MAX_ROWS = 4  # tokens per step up to which the kernel runs (measured above)
TILE_MAX_ROWS = 48  # bf16: tokens per step up to which the tile kernel runs (docs/serving.md)
# with the tile kernel's copy, the GEMV keeps steps of this many tokens only: in the engine (default model,
# bf16, 200-token contexts, alternating) tiles and GEMV tie at 1 stream (15.5 ms a step), tiles win from 2
# (15.6 vs 17.7 ms), 3 (18.0 vs 19.7), 4 (18.7 vs 23.7)
GEMV_ROWS_WITH_TILES = 1
_TILE_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_DTYPE_CODES = {torch.bfloat16: 1, torch.float32: 2}
_NEEDS = {torch.bfloat16: ("avx512f", "avx512bw", "avx512_bf16"), torch.float32: ("avx2", "fma")}
_ATTENTION_NEEDS = ("avx2", "fma")  # both dtypes (bf16 is widened to float32 in registers); layer ops too

_lib: ctypes.CDLL | None = None
_fn = None
_attention_fn = None  # set when the library is loaded and decode attention is enabled (enable_attention)
_prefill_fn = None  # likewise, where the CPU has AVX512-BF16 and HOTSTART_PREFILL_KERNEL is not off
_dlopened: set[str] = set()  # names this process dlopen'ed (load)
_traced = False  # calls show in torch's profiler (a ctypes call is no torch op): the step bench's profile


def trace(on: bool) -> None:
    global _traced
    _traced = on


def switched_off(env: str) -> bool:
    """Whether environment variable ENV turns a kernel off (0, off, false, no)."""
    return os.environ.get(env, "").lower() in ("0", "off", "false", "no")


def _runs(needs: tuple[str, ...] | None, device: torch.device | str) -> bool:
    return needs is not None and torch.device(device).type == "cpu" and set(needs) <= cpu_flags()


def supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether this host runs the small-batch linear kernel for DTYPE (the CPU's instruction sets)."""
    return _runs(_NEEDS.get(dtype), device)


def tiles_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether this host runs the tile kernel (bf16 only) for DTYPE."""
    return dtype == torch.bfloat16 and _runs(_TILE_NEEDS, device)


def attention_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether this host runs the paged decode attention kernel for DTYPE."""
    return _runs(_ATTENTION_NEEDS if dtype in _DTYPE_CODES else None, device)


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def library_path() -> Path:
    """Where this source, compiled by this compiler for this host, lives (a new key rebuilds it)."""
    cxx = compiler() or "none"
    key = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(KERNELS.glob("*.[ch]*"))))
    key.update(cxx.encode())
    key.update(" ".join(sorted(cpu_flags())).encode())
    return hotstart_home() / "kernels" / f"cpu-{key.hexdigest()[:16]}.so"


def staging_path(path: Path) -> Path:
    """The temporary name a build of PATH writes, then publishes (diskio.publish_recorded) as PATH: unique
    across the pods that share a cache volume."""
    return temp_name(path)


def verified(path: Path) -> str | None:
    """None if the library at PATH may be loaded (trust.open_verified); else why not."""
    return verified_problem(path, hotstart_home())


def build_command(out: Path) -> list[str]:
    """g++ writing the library to OUT (staging_path(): the caller publishes it)."""
    return [compiler() or "g++", "-O3", "-fopenmp", "-shared", "-fPIC", "-o", str(out), *map(str, SOURCES)]


def build(timeout_s: float = 120.0) -> Path:
    """Build the library now if it is not built (the step bench, tests); the engine builds it in a
    child process instead (engine/fastpath/builder.py). Raises RuntimeError with the compiler's words."""
    path = library_path()
    if path.exists() and verified(path) is None:
        return path
    make_private_dir(path.parent)
    tmp = staging_path(path)
    try:
        done = subprocess.run(build_command(tmp), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"g++ failed: {done.stderr.strip()[-500:]}")
        publish_recorded(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load(path: Path | str) -> None:
    """Load a built library (after torch: its OpenMP runtime is then torch's own) if it verifies: the
    bytes hashed are the bytes dlopen'ed (through the verified fd). PermissionError says why not."""
    global _lib, _fn
    fd = open_verified(Path(path), hotstart_home())
    fds = [fd]
    try:
        if os.path.isdir("/proc/self/fd"):
            # dlopen hands back the library already loaded under the same name: never reuse a name
            while f"/proc/self/fd/{fds[-1]}" in _dlopened:
                fds.append(os.dup(fd))
            name = f"/proc/self/fd/{fds[-1]}"
        else:
            name = str(path)
        lib = ctypes.CDLL(name)
        _dlopened.add(name)
    finally:
        for f in fds:
            os.close(f)
    if lib.hs_gemv_abi() != 1:
        raise RuntimeError(f"{path}: unknown kernel ABI")
    fn = lib.hs_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int]
    att = lib.hs_decode_attention
    att.restype = ctypes.c_int
    att.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                    ctypes.c_float, ctypes.c_int64]
    i64, ptr, code = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for name, args in (("hs_add_rmsnorm", [code, ptr, ptr, ptr, ctypes.c_float, i64, i64, ptr, ptr]),
                       ("hs_rope_kv", [code, ptr, *[i64] * 6, *[ptr] * 5, i64, ptr]),
                       ("hs_silu_mul", [code, ptr, i64, i64, ptr]),
                       ("hs_tiles", [ptr, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]),
                       ("hs_prefill_attention", [*[ptr] * 4, *[i64] * 5, ptr, ptr, i64, i64, ctypes.c_float,
                                                 i64])):
        op = getattr(lib, name)
        op.restype, op.argtypes = ctypes.c_int, args
    _lib, _fn = lib, fn


def enable_attention(on: bool) -> None:
    """From the next layer on, decode attention on CPU runs the kernel (on) or the torch path; so does
    bf16 prefill attention where the CPU has AVX512-BF16 (HOTSTART_PREFILL_KERNEL=off: the torch path)."""
    global _attention_fn, _prefill_fn
    _attention_fn = _lib.hs_decode_attention if on and _lib is not None else None
    runs = _attention_fn is not None and _runs(_TILE_NEEDS, "cpu")
    _prefill_fn = _lib.hs_prefill_attention if runs and not switched_off("HOTSTART_PREFILL_KERNEL") else None


def prefill_enabled() -> bool:
    return _prefill_fn is not None


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: torch.Tensor,
                      tables: torch.Tensor, block_size: int, scale: float, window: int | None
                      ) -> torch.Tensor | None:
    """q: [T, H, D] bf16 (each sequence's rows together), caches: [KVH, slots, D], spans: [B, 3] long (first
    row, rows, position of the first), tables: [B, nb] long -> [T, H, D]: causal attention of each row
    over its sequence's keys up to its position (within WINDOW). None where the kernel does not run (not
    enabled, another dtype or layout, a head size it does not take): the caller takes the torch path."""
    fn = _prefill_fn
    t, h, d = q.shape
    if (fn is None or q.device.type != "cpu" or q.dtype != torch.bfloat16 or k_cache.dtype != q.dtype
            or d % 16 or d > 256 or k_cache.stride(2) != 1 or k_cache.stride(1) != d
            or v_cache.stride() != k_cache.stride()):
        return None
    q, spans, tables = q.contiguous(), spans.contiguous(), tables.contiguous()
    out = torch.empty_like(q)
    if _traced:
        with torch.profiler.record_function("hotstart::prefill_attention"):
            rc = _prefill_call(fn, q, out, k_cache, v_cache, spans, tables, block_size, scale, window)
    else:
        rc = _prefill_call(fn, q, out, k_cache, v_cache, spans, tables, block_size, scale, window)
    return out if rc == 0 else None


def _prefill_call(fn, q, out, k_cache, v_cache, spans, tables, block_size, scale, window) -> int:
    return fn(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), spans.shape[0],
              q.shape[1], k_cache.shape[0], q.shape[2], k_cache.stride(0), spans.data_ptr(),
              tables.data_ptr(), tables.shape[1], block_size, scale, window or 0)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     context: torch.Tensor, block_size: int, scale: float, softcap: float | None,
                     window: int | None) -> torch.Tensor | None:
    """q: [B, H, D], caches: [KVH, slots, D], tables: [B, nb] long, context: [B] long (keys in context,
    >= 1) -> [B, H, D] in q's dtype; None where the kernel does not run (not enabled, another device or
    dtype, a layout it does not read): the caller takes the torch path."""
    fn = _attention_fn
    if (fn is None or q.device.type != "cpu" or q.dtype not in _DTYPE_CODES or k_cache.dtype != q.dtype
            or k_cache.stride(2) != 1 or k_cache.stride(1) != k_cache.shape[2]
            or v_cache.stride() != k_cache.stride()):
        return None
    if _traced:
        with torch.profiler.record_function("hotstart::decode_attention"):
            return _attention(fn, q, k_cache, v_cache, tables, context, block_size, scale, softcap, window)
    return _attention(fn, q, k_cache, v_cache, tables, context, block_size, scale, softcap, window)


def _attention(fn, q, k_cache, v_cache, tables, context, block_size, scale, softcap, window):
    b, h, d = q.shape
    q = q.contiguous()
    tables, context = tables.contiguous(), context.contiguous()
    out = torch.empty_like(q)
    rc = fn(_DTYPE_CODES[q.dtype], q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), b,
            h, k_cache.shape[0], d, k_cache.stride(0), tables.data_ptr(), tables.shape[1], context.data_ptr(),
            block_size, scale, softcap or 0.0, window or 0)
    return out if rc == 0 else None


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name}: the kernel refused its arguments")


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [T, N] (delta None: x alone) -> (weight * rmsnorm(s), s) for s = x + delta: the residual
    stream's add and the next RMSNorm in one call, rounded as layers.RMSNorm's ops round."""
    out = torch.empty_like(x)
    s = x if delta is None else torch.empty_like(x)
    rc = _lib.hs_add_rmsnorm(_DTYPE_CODES[x.dtype], x.data_ptr(), None if delta is None else delta.data_ptr(),
                             weight.data_ptr(), eps, x.shape[0], x.shape[1], out.data_ptr(), s.data_ptr())
    _check(rc, "add_rmsnorm")
    return out, s


def rope_kv(y: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
            slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """y: [T, (H + 2 KVH) D] (q | k | v, one projection's output), cos / sin: [T, 1, R] (the rotary tables at
    the tokens' positions), slots: [T] long -> q: [T, H, D] rotated; k rotated and v written to their cache
    slots ([KVH, slots, D] each), as layers.RotaryEmbedding.apply and Attention.attend do."""
    t = y.shape[0]
    q = y.new_empty(t, heads, head_dim)
    rc = _lib.hs_rope_kv(_DTYPE_CODES[y.dtype], y.data_ptr(), t, y.stride(0), heads, kv_heads, head_dim,
                         cos.shape[-1], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                         v_cache.data_ptr(), k_cache.stride(0), q.data_ptr())
    _check(rc, "rope_kv")
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 I] (gate | up) -> silu(gate) * up: [T, I]."""
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(t, n)
    _check(_lib.hs_silu_mul(_DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), t, n, out.data_ptr()),
           "silu_mul")
    return out


class Tiles:
    """The weights (and biases) of one call repacked for kernels/tiles.cpp: [N/64][K/2][64][2] bf16, N
    padded to 64 and K to even with zeros (a copy the size of the weights)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
        w = weights[0] if len(weights) == 1 else torch.cat(weights)  # [N, K]
        n, k = w.shape
        n_pad, k_pad = -(-n // 64) * 64, k + k % 2
        padded = torch.zeros(n_pad, k_pad, dtype=w.dtype)
        padded[:n, :k] = w
        self.packed = padded.view(n_pad // 64, 64, k_pad // 2, 2).transpose(1, 2).contiguous()
        self.n, self.k = n, k
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([torch.zeros(wi.shape[0], dtype=w.dtype) if b is None else b.to(w.dtype)
                                   for wi, b in zip(weights, biases, strict=True)]).contiguous()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        # x: [M, K] bf16 contiguous -> [M, N] in OUT_DTYPE (bf16 or float32)
        out = torch.empty(x.shape[0], self.n, dtype=out_dtype)
        rc = _lib.hs_tiles(x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self.n,
                           None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), self.n,
                           int(out_dtype == torch.float32))
        _check(rc, "tiles")
        return out

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


class Segments:
    """The [out_i, in] weights (and biases) one call multiplies, side by side in its output: built once
    per module (the pointer arrays are the call's arguments; the tensors are kept alive here)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], tiles: bool = False):
        w0 = weights[0]
        for w in weights:
            if w.dtype != w0.dtype or w.dim() != 2 or w.shape[1] != w0.shape[1] or w.stride(1) != 1:
                raise ValueError("gemv segments: 2-D weights of one dtype and width, rows contiguous")
        self.weights, self.dtype, self.k = weights, w0.dtype, w0.shape[1]
        self.code = _DTYPE_CODES[w0.dtype]
        self.n = sum(w.shape[0] for w in weights)
        count = len(weights)
        self.biases = [None if b is None else b.to(w0.dtype).contiguous() for b in biases]
        self._ws = (ctypes.c_void_p * count)(*[w.data_ptr() for w in weights])
        self._lds = (ctypes.c_int64 * count)(*[w.stride(0) for w in weights])
        self._ns = (ctypes.c_int64 * count)(*[w.shape[0] for w in weights])
        self._bs = None
        if any(b is not None for b in self.biases):
            self._bs = (ctypes.c_void_p * count)(*[0 if b is None else b.data_ptr() for b in self.biases])
        self._count = count
        # steps of MAX_ROWS + 1 .. TILE_MAX_ROWS tokens: the tile kernel over a repacked copy (bf16)
        self.tiles = Tiles(weights, self.biases) if tiles else None

    def fits(self, x: torch.Tensor) -> bool:
        """Whether a call with X ([T, in]) is one the kernels take: at most MAX_ROWS tokens, or
        TILE_MAX_ROWS with the tile kernel's copy."""
        return x.dim() == 2 and x.shape[0] <= (MAX_ROWS if self.tiles is None else TILE_MAX_ROWS)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # x: [M, in] -> [M, sum of outs] in OUT_DTYPE (the weights' by default; float32 for logits)
        if _traced:
            with torch.profiler.record_function("hotstart::gemv_linear"):
                return self._run(x, out_dtype)
        return self._run(x, out_dtype)

    def _run(self, x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if not x.is_contiguous():
            x = x.contiguous()
        out_dtype = out_dtype or self.dtype
        if self.tiles is not None and x.shape[0] > GEMV_ROWS_WITH_TILES:
            return self.tiles(x, out_dtype)
        out = torch.empty(x.shape[0], self.n, dtype=out_dtype)
        rc = _fn(self.code, x.data_ptr(), x.shape[0], self.k, self._count, self._ws, self._lds, self._ns,
                 self._bs, out.data_ptr(), self.n, int(out_dtype == torch.float32))
        if rc != 0:
            raise RuntimeError("gemv kernel refused its arguments")
        return out
