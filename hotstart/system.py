"""Facts about this machine and this user's hotstart folders (torch-free, stdlib only)."""

from __future__ import annotations

import os
from pathlib import Path


def hotstart_home() -> Path:
    """$HOTSTART_HOME (default ~/.cache/hotstart): converted models, compile caches, runtime files."""
    return Path(os.environ.get("HOTSTART_HOME") or Path.home() / ".cache" / "hotstart")


def mem_available(meminfo: str | None = None) -> int | None:
    """MemAvailable in bytes from /proc/meminfo text (read if not given); None if unknown."""
    try:
        if meminfo is None:
            with open("/proc/meminfo") as f:
                meminfo = f.read()
    except OSError:
        return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) >= 2 and parts[1].isdigit() else None
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (/proc/cpuinfo), empty where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def native_cpu_dtypes() -> set[str]:
    """The half-precision dtypes this CPU multiplies natively (bf16: AVX512-BF16 or AMX; fp16: AVX512-FP16
    or AMX-FP16), by torch's names."""
    flags = cpu_flags()
    native = set()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        native.add("bfloat16")
    if "avx512_fp16" in flags or "amx_fp16" in flags:
        native.add("float16")
    return native
