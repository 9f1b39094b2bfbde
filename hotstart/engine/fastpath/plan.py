"""What the fast path will build on this engine, decided once: each stage PLANNED, or OFF with why.

`--compile off` nothing; `eager-only` prepacking; `auto` prepacking where the copies fit, else the
layer graphs; `graphs` the layer graphs only (CPU, unfused weights, one rank). auto compiles only where
the weights are not prepacked: over prepacked weights the graphs measured no faster (docs/design.md).
"""

from __future__ import annotations

import os
import shutil

from hotstart.engine.fastpath.pack import prepacked_bytes
from hotstart.messages import FastPathState as S
from hotstart.model import cpu_kernels, onednn
from hotstart.system import available_memory_detail

PACK_RAM_FRACTION = 0.5  # prepack only if the copies take at most this share of the available memory
# a GGUF model's linears stay ggml blocks: no oneDNN copies, no layer graphs; the packing stage only groups
# sibling projections and installs the CPU kernels' quantized matmul in model/quant.py's kernel slot
QUANTIZED = "quantized GGUF weights (model/quant.py multiplies them)"


def packing_plan(core, mode: str) -> tuple[S, str, int]:
    """(PLANNED or OFF, why OFF (PLANNED: why without copies, or ""), bytes the prepacked copies will take).

    Where the copies would not fit in memory (a 7B model on a small host) but hotstart's CPU kernels run,
    the stage is PLANNED without copies (bytes 0): the GEMV, the decode attention and the layer ops read
    the checkpoint's own weights, and the layers' sibling projections are grouped for them (pack.py)."""
    p, model, ranks = core.placement, core.runner.model, core.executor.world_size
    if mode in ("off", "graphs"):
        return S.OFF, f"--compile {mode}", 0
    if model.fused:
        return S.OFF, "fused weights (GPU layout)", 0
    if model.quant_head is not None:
        if cpu_kernels.switched_off("HOTSTART_QUANT_KERNEL"):  # the plain path: no kernel of any kind
            return S.OFF, f"{QUANTIZED}; HOTSTART_QUANT_KERNEL=off", 0
        if ranks > 1 or cpu_kernels.compiler() is None:
            return S.OFF, QUANTIZED, 0
        return S.PLANNED, f"no copies: {QUANTIZED}", 0
    if not onednn.available(p.device, p.dtype):
        return S.OFF, f"no oneDNN prepacking for {p.device.type} {str(p.dtype)[6:]}", 0
    need = prepacked_bytes(model) * ranks  # ranks share the RAM
    avail, source = available_memory_detail()  # a container's limit, not the node's RAM
    if avail is not None and need > PACK_RAM_FRACTION * avail:
        why = (f"prepacked weights ({need / 1e9:.1f} GB) would take over {PACK_RAM_FRACTION:.0%} of "
               f"{source} ({avail / 1e9:.1f} GB)")
        kernels = cpu_kernels.compiler() is not None and cpu_kernels.attention_supported(p.dtype, p.device)
        if ranks == 1 and kernels:
            return S.PLANNED, f"no copies: {why}", 0
        return S.OFF, why, 0
    return S.PLANNED, "", need


def compile_plan(core, mode: str, packing: bool) -> tuple[S, str]:
    """(PLANNED or OFF, why OFF) for the layer graphs."""
    cxx = os.environ.get("CXX", "g++")
    if mode not in ("auto", "graphs"):
        return S.OFF, f"--compile {mode}"
    if core.runner.model.quant_head is not None:
        return S.OFF, QUANTIZED
    if mode == "auto" and packing:
        return S.OFF, "the prepacked weights serve faster (auto)"
    if core.executor.world_size > 1:
        return S.OFF, "tensor parallel (the layer graphs hold no collectives)"
    if core.runner.model.cfg.num_experts:
        return S.OFF, "mixture of experts (the layer graphs have a dense MLP)"
    if not getattr(core.runner.model, "graph_layers", True):
        return S.OFF, "this family's layers are not split for layer graphs (Gemma)"
    if core.placement.device.type != "cpu" or core.runner.model.fused:
        return S.OFF, "the layer graphs are built for CPU engines"
    if shutil.which(cxx) is None:
        return S.OFF, f"no C++ compiler ({cxx}) found"
    return S.PLANNED, ""


def kernel_plans(core) -> tuple[str, str, str]:
    """Why hotstart's CPU kernels (model/cpu_kernels.py) do not run on this engine, "" where they do: the
    small-batch linear kernel's, the paged decode attention kernel's, the layer ops' (model/layer_ops.py:
    they also need a Llama-shaped model, checked when installed). They come with the prepacked weights
    (packing PLANNED); the library is built first where this host has not built it yet."""
    p = core.placement
    common = ""
    if core.executor.world_size > 1:
        common = "tensor parallel"
    elif cpu_kernels.compiler() is None:
        common = f"no C++ compiler ({os.environ.get('CXX', 'g++')}) found"

    def why(env: str, runs) -> str:  # the common reason, else ENV=off, else this CPU's, else "" (runs)
        if common or cpu_kernels.switched_off(env):
            return common or f"{env}=off"
        cpu = f"no kernel for {p.device.type} {str(p.dtype)[6:]} on this CPU"
        return "" if runs(p.dtype, p.device) else cpu

    return (why("HOTSTART_GEMV", cpu_kernels.supported),
            why("HOTSTART_DECODE_KERNEL", cpu_kernels.attention_supported),
            why("HOTSTART_LAYER_OPS", cpu_kernels.attention_supported))
