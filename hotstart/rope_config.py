"""RopeConfig: a model's rotary position embedding as its config.json gives it, read as the family's
transformers code reads it (torch-free; model/rope.py builds the tables). Either spelling: transformers
>= 5 writes `rope_parameters` (rope_theta inside), older files `rope_theta` and `rope_scaling` at top
level; Gemma 3 one per layer type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hotstart import config_fields as fields
from hotstart.errors import ModelConfigError

if TYPE_CHECKING:
    from hotstart.families import Family

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3 scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope: the pretraining context
    partial_rotary_factor: float = 1.0  # RoPE over the first int(head_dim * this) dims of each head
    # yarn and longrope: cos / sin are multiplied by it (None: derived from factor, as transformers does)
    attention_factor: float | None = None
    # yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope only: one divisor per rotary frequency (rotary dims / 2 each); model/rope.py says which
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def parse_rope(raw: dict, src: Path, fam: Family, max_pos: int, head_dim: int) -> RopeConfig:
    """The one RoPE of every layer."""
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"{src}: field '{key}' must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError(f"{src}: field '{key}' per layer type is not supported "
                               "(one RoPE for all layers)")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and not fam.partial_rotary:
        raise ModelConfigError(f"{src}: field 'partial_rotary_factor' ({partial!r}) is not supported for "
                               f"{fam.name} (its transformers code rotates the whole head)")
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1 or \
            int(head_dim * partial) % 2:
        raise ModelConfigError(f"{src}: field 'partial_rotary_factor' ({partial!r}) must be in (0, 1] and "
                               f"rotate an even number of the {head_dim} head dims")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ModelConfigError(f"{src}: field 'rope_theta' must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = fam.rope_aliases.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"{src}: field '{key}' type '{rope_type}' is not supported "
                               f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    # transformers: a top-level original_max_position_embeddings (Phi-3's, a class default there) wins
    # over the RoPE parameters'; absent from both: max_position_embeddings
    orig = raw.get("original_max_position_embeddings", fam.defaults.get("original_max_position_embeddings"))
    orig = params.get("original_max_position_embeddings", max_pos) if orig is None else orig
    if not isinstance(orig, int) or isinstance(orig, bool) or orig < 1:
        raise ModelConfigError(f"{src}: field 'original_max_position_embeddings' must be a positive int, "
                               f"got {orig!r}")
    # yarn / longrope without a factor: the context extension (max_position_embeddings / original)
    factor = fields.number(params, "factor", key, src,
                           max_pos / orig if rope_type in ("yarn", "longrope") else 1.0)
    short, long = (), ()
    if rope_type == "longrope":
        half = int(head_dim * partial) // 2
        lists = []
        for name in ("short_factor", "long_factor"):
            v = params.get(name)
            if not isinstance(v, list) or len(v) != half or \
                    not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                raise ModelConfigError(f"{src}: field '{key}.{name}' must list {half} numbers (rotary dims "
                                       f"/ 2), got {v!r}")
            lists.append(tuple(float(x) for x in v))
        short, long = lists
    return RopeConfig(
        theta=float(theta),
        # dynamic NTK scaling changes nothing within max_position_embeddings, the most the engine serves
        type="default" if rope_type == "dynamic" else rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=orig,
        partial_rotary_factor=float(partial),
        attention_factor=fields.number(params, "attention_factor", key, src, None),
        beta_fast=fields.number(params, "beta_fast", key, src, None) or 32.0,  # transformers: `or 32`
        beta_slow=fields.number(params, "beta_slow", key, src, None) or 1.0,
        mscale=fields.number(params, "mscale", key, src, None),
        mscale_all_dim=fields.number(params, "mscale_all_dim", key, src, None),
        truncate=bool(params.get("truncate", True)),
        short_factor=short,
        long_factor=long,
    )


def parse_ropes(raw: dict, src: Path, fam: Family, max_pos: int,
                head_dim: int) -> tuple[RopeConfig, RopeConfig | None]:
    """(the global layers' RoPE, the sliding layers' or None). Gemma 3 writes either one `rope_parameters`
    per layer type (transformers >= 5) or `rope_theta` / `rope_scaling` (global) and
    `rope_local_base_freq` (sliding, no scaling)."""
    if not fam.local_rope:
        return parse_rope(raw, src, fam, max_pos, head_dim), None
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and set(params) == {"full_attention", "sliding_attention"}:
        return (parse_rope({"rope_parameters": params["full_attention"]}, src, fam, max_pos, head_dim),
                parse_rope({"rope_parameters": params["sliding_attention"]}, src, fam, max_pos, head_dim))
    default = {"rope_theta": fam.defaults["rope_theta"]} if "rope_theta" not in raw else {}
    local = fields.read(raw, "rope_local_base_freq", float, src, default=fam.defaults["rope_local_base_freq"],
                        positive=True)
    return parse_rope({**default, **raw}, src, fam, max_pos, head_dim), RopeConfig(theta=local)
