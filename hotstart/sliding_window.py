"""Which layers of a model attend through a sliding window, and how wide it is: config.json read the way
the family's transformers code reads it. The family's Window (hotstart/families.py) picks the rule; a
layer with window W sees keys p - W + 1 .. p (model/attention.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hotstart import config_fields as fields
from hotstart.errors import ModelConfigError
from hotstart.families import Family, Window

LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(raw: dict, src: Path, layers: int) -> tuple[bool, ...] | None:
    """`layer_types` as one flag per layer (True: it slides); None where the file has none."""
    types = raw.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ModelConfigError(f"{src}: field 'layer_types' must list one of {', '.join(LAYER_TYPES)} "
                               f"per layer ({layers}), got {types!r}")
    return tuple(t == "sliding_attention" for t in types)


def _every_layer(fam: Family, raw: dict, src: Path, layers: int) -> tuple[bool, ...]:
    return (True,) * layers


def _from_max_window_layers(fam: Family, raw: dict, src: Path, layers: int) -> tuple[bool, ...]:
    # Qwen2 / Qwen3: `layer_types`, else the layers from `max_window_layers` on
    types = _layer_types(raw, src, layers)
    if types is not None:
        return types
    first = fields.read(raw, "max_window_layers", int, src, default=fam.defaults.get("max_window_layers", 0))
    return tuple(i >= first for i in range(layers))


def _even_below_max_window_layers(fam: Family, raw: dict, src: Path, layers: int) -> tuple[bool, ...]:
    # transformers' Qwen2-MoE: `layer_types`, else the even layers below `max_window_layers`
    types = _layer_types(raw, src, layers)
    if types is not None:
        return types
    first = fields.read(raw, "max_window_layers", int, src, default=fam.defaults["max_window_layers"])
    return tuple(i % 2 == 0 and i < first for i in range(layers))


def _all_but_every_nth(fam: Family, raw: dict, src: Path, layers: int) -> tuple[bool, ...]:
    # Gemma: `layer_types`, else every `sliding_window_pattern`-th layer is global, the others slide
    types = _layer_types(raw, src, layers)
    if types is not None:
        return types
    n = fields.read(raw, "sliding_window_pattern", int, src, default=fam.defaults["sliding_window_pattern"],
                    positive=True)
    return tuple((i + 1) % n != 0 for i in range(layers))


# Window -> (read only with `use_sliding_window: true`, which layers slide); Window.NONE reads nothing
RULES: dict[Window, tuple[bool, Callable[[Family, dict, Path, int], tuple[bool, ...]]]] = {
    Window.ALWAYS: (False, _every_layer),
    Window.OPT_IN: (True, _from_max_window_layers),
    Window.OPT_IN_ALL: (True, _every_layer),
    Window.OPT_IN_EVEN: (True, _even_below_max_window_layers),
    Window.PATTERN: (False, _all_but_every_nth),
}


def parse_window(fam: Family, raw: dict, src: Path, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """(the attention window, which layers slide) as FAM's transformers code reads them; (None, ()) where no
    layer slides."""
    if fam.sliding_window is Window.NONE:
        return None, ()
    opt_in, sliding = RULES[fam.sliding_window]
    opted = fields.read(raw, "use_sliding_window", bool, src, default=False)  # checked where not read too
    if opt_in and not opted:
        return None, ()
    if fields.read(raw, "use_bidirectional_attention", bool, src, default=False):
        raise ModelConfigError(f"{src}: field 'use_bidirectional_attention' is not supported (causal only)")
    window = raw["sliding_window"] if "sliding_window" in raw else fam.defaults.get("sliding_window")
    if window is None:
        return None, ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelConfigError(f"{src}: field 'sliding_window' must be a positive int or null, "
                               f"got {window!r}")
    slides = sliding(fam, raw, src, layers)
    return (window, slides) if any(slides) else (None, ())
