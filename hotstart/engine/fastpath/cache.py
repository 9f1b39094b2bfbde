"""The compile cache: $HOTSTART_HOME/compile/KEY/layers-T{tokens}.pt2, one AOTInductor package per token
bucket, reused by every later start whose layer graphs would compile the same.

A package is written to a temporary name unique across the pods sharing the cache, fsynced and renamed
with its sha256 beside it (`publish_recorded`, hotstart/diskio.py); a reader loads one only if it
verifies (hotstart/trust.py: ours, writable by no one else, the recorded hash) and is a complete zip
(`usable`), and one that fails to load is removed so the next start compiles it again. A $HOTSTART_HOME
that takes no writes (diskio.check_home) leaves the buckets not cached eager, and the cached ones serve."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hotstart import __version__
from hotstart.diskio import home_writable, remove_stale_temps
from hotstart.model.layers import MATH_REVISION
from hotstart.model.registry import model_class
from hotstart.model_config import ModelConfig
from hotstart.system import cpu_flags, hotstart_home
from hotstart.trust import discard_recorded, verified_problem

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")


@dataclass(frozen=True)
class LayerSpec:
    """What a layer graph depends on besides its weights (graph inputs): the compile cache's key, and
    the decoder-layer class the compile worker exports it from ("module:qualname")."""

    layer: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, cfg: ModelConfig) -> LayerSpec:
        layer = model_class(cfg).layer_class
        return cls(f"{layer.__module__}:{layer.__qualname__}", cfg.hidden_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
                   cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm)

    def as_dict(self) -> dict:
        return asdict(self)


def cache_folder(spec: LayerSpec, dtype: torch.dtype) -> Path:
    """$HOTSTART_HOME/compile/KEY: KEY hashes what a compiled graph depends on (the layer class and shapes,
    dtype, torch, hotstart, the layer math's revision, Python, the CPU's instruction sets); not the weights
    (graph inputs)."""
    key = {"spec": spec.as_dict(), "dtype": str(dtype), "torch": torch.__version__, "hotstart": __version__,
           "math": MATH_REVISION,
           "python": list(sys.version_info[:2]), "isa": sorted(cpu_flags() & set(ISA_FLAGS))}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return hotstart_home() / "compile" / digest


def package_name(tokens: int) -> str:
    return f"layers-T{tokens}.pt2"


def remove_stale(folder: Path) -> None:
    """Temp files of compile workers that died mid-write (diskio.temp_name's, here or on another pod)."""
    remove_stale_temps(folder)


def usable(path: Path) -> bool:
    """Whether PATH is a package a start may load: it verifies (trust.open_verified) and is a zip whose
    central directory (at its end) reads. One that exists but is not (a torn write, a foreign file, one
    without its recorded hash) is removed, where the home takes writes: the next start compiles it."""
    import zipfile  # noqa: PLC0415 - only when a cached package is there to check

    if not path.is_file():
        return False
    if verified_problem(path, hotstart_home()) is None:
        try:
            with zipfile.ZipFile(path) as z:
                if z.namelist():
                    return True
        except (OSError, zipfile.BadZipFile):
            pass
    discard(path)
    return False


def discard(path: Path) -> None:
    """Remove a package that cannot serve (it would fail every later start the same way)."""
    if home_writable():
        discard_recorded(path)
