"""oneDNN-prepacked linear weights, layer by layer: the one loop that prepacks, used by the fast path
(rank 0), by every other tensor-parallel rank for its own shards (engine/distributed.py) and by the
step bench (bench/engine_setup.py)."""

from __future__ import annotations

from hotstart.model import cpu_kernels, layer_ops, onednn, quant_kernels
from hotstart.model.decoder import CausalLM
from hotstart.model.layers import Linear, PackedGroup

LM_HEAD = -1  # pack_layer's index of the LM head


def pack_layer(model: CausalLM, layer: int, copies: bool = True) -> None:
    """Prepack the linear weights of decoder layer LAYER (LM_HEAD: the LM head's, tied or not) once: a
    copy each, [out, in] in oneDNN's blocked layout, that Linear.forward then multiplies with; sibling
    projections of one input (a module's pack_groups(): q/k/v, gate/up) as one stacked copy instead.
    Without COPIES (they would not fit: plan.packing_plan) only the groups, for the CPU kernels."""
    if layer == LM_HEAD:
        if model.lm_head_prepacked is None and copies:
            model.lm_head_prepacked = onednn.pack(model.output_weight())
        return
    modules = list(model.model.layers[layer].modules())
    in_groups: set[int] = set()
    for m in modules:
        for attr, linears in (m.pack_groups() if hasattr(m, "pack_groups") else {}).items():
            if getattr(m, attr) is None:
                setattr(m, attr, PackedGroup(linears, copies))
            in_groups.update(id(linear) for linear in linears)
    for m in modules:
        if copies and isinstance(m, Linear) and m.prepacked is None and id(m) not in in_groups:
            m.prepacked = onednn.pack(m.weight)


def pack_model(model: CausalLM, copies: bool = True) -> None:
    """Every layer, then the LM head (what the fast path does a layer per step gap)."""
    for layer in range(len(model.model.layers)):
        pack_layer(model, layer, copies)
    pack_layer(model, LM_HEAD, copies)


def prepacked_bytes(model: CausalLM) -> int:
    """What the prepacked copies take: the size of every decoder layer's linear weights and the LM head's,
    twice where the tile kernel's copies come too (bf16 on an AVX512-BF16 CPU: attach_gemv)."""
    linears = sum(m.weight.nbytes for m in model.model.layers.modules() if isinstance(m, Linear))
    head = model.output_weight()
    copies = 2 if cpu_kernels.tiles_supported(head.dtype, head.device) else 1
    return copies * (linears + head.nbytes)


def attach_gemv(model: CausalLM, tiles: bool = False) -> int:
    """Let the small-batch kernel (model/cpu_kernels.py, loaded) run every linear layer's and the LM head's
    steps of few tokens, over their own weights: a PackedGroup's projections as one call, the other
    linears one each (a weight the kernel cannot read, e.g. with strided rows, keeps oneDNN); with TILES,
    steps of up to TILE_MAX_ROWS tokens too, over a repacked copy each (cpu_kernels.Tiles). Returns how
    many modules it serves."""
    calls = 0
    in_groups: set[int] = set()
    modules = list(model.model.layers.modules())
    for m in modules:
        for attr, linears in (m.pack_groups() if hasattr(m, "pack_groups") else {}).items():
            group = getattr(m, attr)
            if group is not None and all(lin.weight.stride(-1) == 1 and lin.weight.is_floating_point()
                                         for lin in linears):  # ggml blocks: quant_kernels multiplies them
                weights, biases = [lin.weight for lin in linears], [lin.bias for lin in linears]
                group.gemv = cpu_kernels.Segments(weights, biases, tiles)
                in_groups.update(id(lin) for lin in linears)
                calls += 1
    for m in modules:
        if isinstance(m, Linear) and id(m) not in in_groups and m.weight.stride(-1) == 1:
            m.gemv = cpu_kernels.Segments([m.weight], [m.bias], tiles)
            calls += 1
    head = model.output_weight()
    if head.stride(-1) == 1 and head.is_floating_point():  # a GGUF's quantized head: quant_kernels
        model.lm_head_gemv = cpu_kernels.Segments([model.output_weight()], [None], tiles)
        calls += 1
    return calls


def install_kernels(model: CausalLM, path, whys: tuple[str, str, str], copies: bool = True) -> list[str]:
    """Load the CPU kernels' library built at PATH and put the kernels the plan allows to work (WHYS:
    plan.kernel_plans' reasons for the GEMV, the decode attention, the layer ops; a reason keeps that one
    off; without COPIES, no tile kernel: its copies would not fit). -> what now runs, for the packing
    stage's detail. The fast path (behind READY) and the step bench both install them here."""
    gemv_why, attention_why, ops_why = whys
    cpu_kernels.load(path)
    notes = []
    if quant_kernels.quantized(model):  # the library's quantized matmul, through model/quant.py's hook
        notes.append(quant_kernels.install() or "no quantized matmul kernels (the reference path serves)")
    if not gemv_why:
        weight = model.output_weight()
        tiles = copies and cpu_kernels.tiles_supported(weight.dtype, weight.device)
        upto = cpu_kernels.TILE_MAX_ROWS if tiles else cpu_kernels.MAX_ROWS
        calls = attach_gemv(model, tiles)
        if calls:
            notes.append(f"small-batch kernels on {calls} linears (<= {upto} tokens)")
    cpu_kernels.enable_attention(not attention_why)
    if not attention_why:
        prefill = " + bf16 prefill kernel" if cpu_kernels.prefill_enabled() else ""
        notes.append(f"paged decode kernel{prefill}")
    model.layer_ops = False
    if not ops_why:  # the plan allows them: the model's layers decide
        family_why = layer_ops.unsupported(model)
        model.layer_ops = not family_why
        notes.append(f"no layer ops: {family_why}" if family_why else "layer ops")
    return notes
