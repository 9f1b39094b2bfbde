"""What the zygote checks: a SpawnEngine before it forks one, and its own files for changes (torch-free).

validate() is the zygote's side of "it forks only hotstart engines with a config it validates": the
message decoded as typed Structs (an EngineConfig) already; this checks that the paths exist where a
model and its client's ipc sockets must be and that every size is sane. stamps() / changed() notice
an edit or a reinstall of the code the zygote runs (its hotstart modules, every file of the packages
an engine may import lazily, torch's own version files), so that no engine runs stale code.
"""

from __future__ import annotations

import math
import os
import sys

from hotstart.forkserver.runtime import hotstart_dir
from hotstart.gguf_file import is_gguf

WATCHED = ("engine", "model", "forkserver")  # every file here counts, imported yet or not (lazy imports)


def stamps() -> dict[str, tuple[int, int]]:
    root = hotstart_dir()
    files = {f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)
             and f.startswith(root + os.sep)}
    for sub in WATCHED:
        for dirpath, _, names in os.walk(os.path.join(root, sub)):
            files.update(os.path.join(dirpath, n) for n in names if n.endswith(".py"))
    torch_dir = os.path.dirname(sys.modules["torch"].__file__)
    files.update(os.path.join(torch_dir, n) for n in ("__init__.py", "version.py"))
    out = {}
    for f in files:
        try:
            st = os.stat(f)
            out[f] = (st.st_mtime_ns, st.st_size)
        except OSError:
            pass
    return out


def changed(stamps: dict[str, tuple[int, int]]) -> str:
    """The first of STAMPS' files that changed (relative to hotstart's parent folder), or ""."""
    for f, stamp in stamps.items():
        try:
            st = os.stat(f)
            now = (st.st_mtime_ns, st.st_size)
        except OSError:
            now = None
        if now != stamp:
            return os.path.relpath(f, os.path.dirname(hotstart_dir()))
    return ""


def validate(msg, uid: int) -> str | None:
    """Why this SpawnEngine must not be forked, or None. The config decoded as an EngineConfig already."""
    cfg = msg.config
    if not 1 <= msg.world_size <= 64 or msg.generation < 0:
        return f"world_size {msg.world_size} / generation {msg.generation} out of range"
    gguf = os.path.isfile(cfg.model_path) and is_gguf(cfg.model_path)
    if not os.path.isabs(cfg.model_path) or not (gguf or os.path.isfile(os.path.join(cfg.model_path,
                                                                                     "config.json"))):
        return f"model_path {cfg.model_path!r} is not a model folder or GGUF file"
    if len(cfg.weight_files) > 100_000 or not all(
            os.path.isabs(f) and os.path.isfile(f) and (f.endswith(".safetensors") or is_gguf(f))
            for f in cfg.weight_files):
        return "weight_files must be existing .safetensors or .gguf files"
    ranges = {"max_model_len": 1 << 24, "max_num_seqs": 1 << 16, "max_num_batched_tokens": 1 << 24,
              "block_size": 1 << 12, "kv_cache_memory": 1 << 50}
    for name, high in ranges.items():
        v = getattr(cfg, name, None)
        if v is not None and not 1 <= v <= high:
            return f"{name} {v} out of range (1 to {high})"
    if not 0 < cfg.gpu_memory_utilization <= 1 or not math.isfinite(cfg.t0):
        return "gpu_memory_utilization or t0 out of range"
    if not all(0 <= t < math.inf for t in (cfg.engine_heartbeat_timeout, cfg.engine_step_timeout)):
        return "engine_heartbeat_timeout or engine_step_timeout out of range"
    if cfg.device not in ("auto", "cpu", "cuda") or cfg.dtype not in ("auto", "bfloat16", "float16",
                                                                      "float32"):
        return f"unknown device {cfg.device!r} or dtype {cfg.dtype!r}"
    if cfg.cursor_path is not None and not os.path.isfile(cfg.cursor_path):
        return f"cursor_path {cfg.cursor_path!r} is not a file"
    for address in (msg.addresses.requests, msg.addresses.outputs):
        path = address.removeprefix("ipc://")
        try:
            owner = os.stat(os.path.dirname(path)).st_uid
        except OSError:
            owner = None
        if not address.startswith("ipc://") or not os.path.isabs(path) or owner != uid:
            return f"address {address!r} is not an ipc path in a folder of the client's"
    return None
