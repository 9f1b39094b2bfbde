"""oneDNN-prepacked linear weights, layer by layer: the one loop that prepacks, used by the fast path
(rank 0), by every other tensor-parallel rank for its own shards (engine/distributed.py) and by the
step bench (bench/engine_setup.py)."""

from __future__ import annotations

from collections.abc import Iterator

from hotstart.model import cpu_kernels, layer_ops, onednn, quant_kernels, quant_step
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
    for calls in gemv_steps(model, tiles):  # noqa: B007 - the last count is the total
        pass
    return calls


def gemv_steps(model: CausalLM, tiles: bool = False) -> Iterator[int]:
    """attach_gemv a decoder layer at a time, the LM head last; each yield: the modules served so far. With
    TILES a layer's repacked copies take milliseconds (a 135M model's 121 linears ~0.45 s in all): the fast
    path attaches a layer or a few per gap between steps, so no gap waits for all of them."""
    calls = 0
    for layer in model.model.layers:
        in_groups: set[int] = set()
        modules = list(layer.modules())
        for m in modules:
            for attr, linears in (m.pack_groups() if hasattr(m, "pack_groups") else {}).items():
                group = getattr(m, attr)
                if group is not None and all(
                        lin.weight.stride(-1) == 1 and lin.weight.is_floating_point()
                        for lin in linears):  # ggml blocks: quant_kernels multiplies them
                    weights, biases = [lin.weight for lin in linears], [lin.bias for lin in linears]
                    group.gemv = cpu_kernels.Segments(weights, biases, tiles)
                    in_groups.update(id(lin) for lin in linears)
                    calls += 1
        for m in modules:
            if isinstance(m, Linear) and id(m) not in in_groups and m.weight.stride(-1) == 1:
                m.gemv = cpu_kernels.Segments([m.weight], [m.bias], tiles)
                calls += 1
        yield calls
    head = model.output_weight()
    if head.stride(-1) == 1 and head.is_floating_point():  # a GGUF's quantized head: quant_kernels
        model.lm_head_gemv = cpu_kernels.Segments([model.output_weight()], [None], tiles)
        calls += 1
    yield calls


class KernelInstall:
    """The CPU kernels' library built at PATH put to work as the plan allows (WHYS: plan.kernel_plans'
    reasons for the GEMV, the decode attention, the layer ops; a reason keeps that one off; without COPIES,
    no tile kernel: its copies would not fit), in pieces: the constructor loads the library (and the
    quantized matmul), step() attaches the small-batch kernel to one more decoder layer (True once none is
    left), finish() turns on the decode attention and the layer ops and returns what now runs, for the
    packing stage's detail. The model serves between the pieces (a linear without its kernel yet runs on
    oneDNN)."""

    def __init__(self, model: CausalLM, path, whys: tuple[str, str, str], copies: bool = True) -> None:
        self.model, self.whys = model, whys
        cpu_kernels.load(path)
        model.layer_ops = False  # until finish(): the layer ops want every layer's kernels
        model.quant_step = None
        self.notes: list[str] = []
        if quant_kernels.quantized(model):  # the library's quantized matmul, through model/quant.py's hook
            self.notes.append(quant_kernels.install()
                              or "no quantized matmul kernels (the reference path serves)")
        self.steps: Iterator[int] | None = None
        self.calls, self.upto = 0, 0
        if not whys[0]:
            weight = model.output_weight()
            tiles = copies and cpu_kernels.tiles_supported(weight.dtype, weight.device)
            self.upto = cpu_kernels.TILE_MAX_ROWS if tiles else cpu_kernels.MAX_ROWS
            self.steps = gemv_steps(model, tiles)

    def step(self) -> bool:
        if self.steps is not None:
            calls = next(self.steps, None)
            if calls is None:
                self.steps = None
            else:
                self.calls = calls
        return self.steps is None

    def finish(self) -> list[str]:
        gemv_why, attention_why, ops_why = self.whys
        model, notes = self.model, list(self.notes)
        if self.calls:
            notes.append(f"small-batch kernels on {self.calls} linears (<= {self.upto} tokens)")
        cpu_kernels.enable_attention(not attention_why)
        if not attention_why:
            prefill = " + bf16 prefill kernel" if cpu_kernels.prefill_enabled() else ""
            notes.append(f"paged decode kernel{prefill}")
        if not ops_why:  # the plan allows them (off since the constructor): the model's layers decide
            family_why = layer_ops.unsupported(model)
            model.layer_ops = not family_why
            notes.append(f"no layer ops: {family_why}" if family_why else "layer ops")
            if model.layer_ops and quant_kernels.quantized(model):
                step = quant_step.build(model)
                model.quant_step = None if isinstance(step, str) else step
                notes.append(f"no one-call decode step: {step}" if isinstance(step, str)
                             else "one-call decode step")
        return notes


def install_kernels(model: CausalLM, path, whys: tuple[str, str, str], copies: bool = True) -> list[str]:
    """KernelInstall at once (the step bench, the tests); the fast path runs it a piece per gap between
    steps."""
    install = KernelInstall(model, path, whys, copies)
    while not install.step():
        pass
    return install.finish()
