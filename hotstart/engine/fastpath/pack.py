"""oneDNN-prepacked linear weights, layer by layer: the one loop that prepacks, used by the fast path
(rank 0), by every other tensor-parallel rank for its own shards (engine/distributed.py) and by the
step bench (bench/engine_setup.py)."""

from __future__ import annotations

from hotstart.model import onednn
from hotstart.model.decoder import CausalLM
from hotstart.model.layers import Linear, PackedGroup

LM_HEAD = -1  # pack_layer's index of the LM head


def pack_layer(model: CausalLM, layer: int) -> None:
    """Prepack the linear weights of decoder layer LAYER (LM_HEAD: the LM head's, tied or not) once: a
    copy each, [out, in] in oneDNN's blocked layout, that Linear.forward then multiplies with; sibling
    projections of one input (a module's pack_groups(): q/k/v, gate/up) as one stacked copy instead."""
    if layer == LM_HEAD:
        if model.lm_head_prepacked is None:
            model.lm_head_prepacked = onednn.pack(model.output_weight())
        return
    modules = list(model.model.layers[layer].modules())
    in_groups: set[int] = set()
    for m in modules:
        for attr, linears in (m.pack_groups() if hasattr(m, "pack_groups") else {}).items():
            if getattr(m, attr) is None:
                setattr(m, attr, PackedGroup(linears))
            in_groups.update(id(linear) for linear in linears)
    for m in modules:
        if isinstance(m, Linear) and m.prepacked is None and id(m) not in in_groups:
            m.prepacked = onednn.pack(m.weight)


def pack_model(model: CausalLM) -> None:
    """Every layer, then the LM head (what the fast path does a layer per step gap)."""
    for layer in range(len(model.model.layers)):
        pack_layer(model, layer)
    pack_layer(model, LM_HEAD)


def prepacked_bytes(model: CausalLM) -> int:
    """What the prepacked copies take: the size of every decoder layer's linear weights and the LM head's."""
    linears = sum(m.weight.nbytes for m in model.model.layers.modules() if isinstance(m, Linear))
    return linears + model.output_weight().nbytes
