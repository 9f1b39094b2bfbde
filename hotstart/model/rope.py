"""RoPE frequencies, computed as transformers' rope init functions compute them (modeling_rope_utils:
default, linear, llama3, yarn, longrope; "dynamic" is read as default by rope_config.py: it changes
nothing within max_position_embeddings).

Each type gives inv_freq ([rotary_dim / 2]) and an attention factor that scales the cos/sin tables
(yarn's mscale, longrope's sqrt(1 + log(factor) / log(original))). rotary_dim = int(head_dim *
partial_rotary_factor): only the first rotary_dim dims of each head rotate (layers.RotaryEmbedding).

LongRoPE: transformers picks the long factors for a whole forward when its longest position passes
original_max_position_embeddings, the short ones otherwise. A paged KV cache cannot re-rotate cached
keys when a sequence crosses that length, so the set is chosen once, for the served context: long
where the served max length (--max-model-len) exceeds original_max_position_embeddings, short where it
does not. Equal to transformers for every sequence when served within the original context, and for
sequences longer than it otherwise; a shorter sequence served beyond the original context gets the
long factors (as it would once it grows past the original length: vLLM makes the same choice).
"""

from __future__ import annotations

import math

import torch

from hotstart.rope_config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attn = mscale(factor)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes ROTATIONS turns over the original context
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / \
            (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: high frequencies kept (extrapolated), 0: low ones interpolated by factor
    return interpolation * (1 - keep) + extrapolation * keep, attn


def _longrope(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    orig, factor = rope.original_max_position_embeddings, rope.factor
    attn = rope.attention_factor
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    factors = rope.long_factor if max_positions > orig else rope.short_factor  # module docstring
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * rope.theta**shape), attn


def inv_freq_and_scale(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], the factor cos and sin are multiplied by) for positions < MAX_POSITIONS."""
    dim = rotary_dim(rope, head_dim)
    if rope.type == "yarn":
        return _yarn(rope, dim)
    if rope.type == "longrope":
        return _longrope(rope, dim, max_positions)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths scaled by factor, short kept,
        # a smooth blend in between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq, 1.0
