"""`hotstart bench roofline`: this machine's memory read bandwidth, and throughput as a fraction of it.

Decode at small batch is bound by memory: every step reads every weight once (shared by the batch)
plus each sequence's KV cache so far. The physical limit is therefore

    tokens/s <= bandwidth / bytes per token,  bytes per token = weights / batch + KV bytes per token x context

and fraction(...) reports tokens/s x bytes per token / bandwidth (1.0 = at the limit). "weights" are
the bytes one decode step reads at the served dtype: every tensor of the checkpoint, except the input
embedding table when the LM head is a separate tensor (a step reads one row of it per token). In a
mixture of experts a step reads only the routed experts its tokens picked: with B tokens each picking k
of E experts (taken as uniform and independent), a layer reads E x (1 - (1 - k/E)^B) of them on average,
so the routed experts' bytes count with that share (k/E at one stream, nearly all at a large batch).

The bandwidth is measured STREAM-like with torch on large float32 arrays (far beyond the caches):
`read` = sum(a) (bytes of a per pass), `copy` = b.copy_(a) (read + write: twice the bytes), with 1
thread and with every thread torch uses, medians (and best) of --reps passes, interleaved. The figure
the other benches use is the median `read` bandwidth at the most threads, saved to
$HOTSTART_HOME/bench/roofline.json by every run (per device).
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hotstart.errors import HotstartError
from hotstart.system import hotstart_home

ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                 "BOOL": 1, "float32": 4, "float16": 2, "bfloat16": 2}


def saved_path() -> Path:
    return hotstart_home() / "bench" / "roofline.json"


def measure(device: str = "cpu", size_mb: int = 1024, threads: list[int] | None = None,
            reps: int = 10) -> dict:
    """Read and copy bandwidth (GB/s, 1e9 bytes) of DEVICE with each thread count (CPU)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HotstartError("bench roofline --device cuda: no CUDA device visible")
    n = size_mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    counts = sorted(set(threads or [1, torch.get_num_threads()])) if dev.type == "cpu" else [0]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    kernels = {"read": (lambda: src.sum(), nbytes), "copy": (lambda: dst.copy_(src), 2 * nbytes)}
    times: dict[tuple[str, int], list[float]] = {(k, t): [] for k in kernels for t in counts}
    before = torch.get_num_threads()
    try:
        for rep in range(reps + 1):  # pass 0 warms (page faults, thread pool start)
            for t in counts:
                if t:
                    torch.set_num_threads(t)
                for name, (fn, _) in kernels.items():
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    if rep:
                        times[(name, t)].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    rows = []
    for (name, t), ts in times.items():
        moved = kernels[name][1]
        rows.append({"kernel": name, "threads": t or None, "median_gbs": moved / statistics.median(ts) / 1e9,
                     "best_gbs": moved / min(ts) / 1e9})
    top = max(counts)
    read = next(r for r in rows if r["kernel"] == "read" and (r["threads"] or 0) == top)
    return {"device": device, "size_mb": size_mb, "reps": reps, "cpus": os.cpu_count(), "results": rows,
            "bandwidth_gbs": read["median_gbs"], "threads": top or None,
            "load1": round(os.getloadavg()[0], 2), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "torch": torch.__version__}


def save(result: dict) -> Path:
    """Keep RESULT as this device's bandwidth for the other benches."""
    path = saved_path()
    data = {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    data[result["device"]] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def saved_bandwidth(device: str = "cpu") -> dict | None:
    try:
        entry = json.loads(saved_path().read_text()).get(device)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) and entry.get("bandwidth_gbs") else None


def bandwidth(given: float | None, device: str = "cpu", measure_if_unknown: bool = True) -> dict | None:
    """{"bandwidth_gbs", "source"}: GIVEN (a flag), else the saved measurement, else a quick one measured
    now in a child process (the caller stays torch-free), also saved; None if that fails."""
    if given is not None:
        return {"bandwidth_gbs": given, "source": "given"}
    saved = saved_bandwidth(device)
    if saved is not None:
        return {"bandwidth_gbs": saved["bandwidth_gbs"], "source": f"{saved_path()} ({saved.get('when')})"}
    if not measure_if_unknown:
        return None
    cmd = [sys.executable, "-m", "hotstart", "bench", "roofline", "--quick", "--device", device]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    saved = saved_bandwidth(device)
    return {"bandwidth_gbs": saved["bandwidth_gbs"], "source": "measured now (--quick)"} if saved else None


@dataclass(frozen=True)
class ModelBytes:
    weights: int  # bytes of the tensors a decode step may read (module docstring), routed experts included
    kv_per_token: int  # K and V of every layer for one token
    dtype: str
    experts: int = 0  # of `weights`: the routed experts' bytes (a mixture of experts; 0: dense)
    num_experts: int = 0  # E routed experts per layer
    top_k: int = 0  # k experts per token

    def step_bytes(self, batch: int) -> float:
        """Weight bytes one decode step of BATCH tokens reads (on average, for routed experts)."""
        if not self.experts:
            return float(self.weights)
        touched = 1 - (1 - self.top_k / self.num_experts) ** max(1, batch)
        return self.weights - self.experts + self.experts * touched

    def per_token(self, batch: int, context: float) -> float:
        return self.step_bytes(batch) / max(1, batch) + self.kv_per_token * context


def _tensors(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v for k, v in header.items() if k != "__metadata__"}


def model_bytes(model_dir: str | Path, dtype: str | None = None) -> ModelBytes:
    """Bytes per decode step of the checkpoint in MODEL_DIR served in DTYPE (None: its own)."""
    from hotstart.config import load_model_config
    from hotstart.gguf_file import is_gguf
    from hotstart.model.files import weight_files

    files = weight_files(Path(model_dir))
    if len(files) == 1 and is_gguf(files[0]):
        return _gguf_bytes(Path(files[0]), load_model_config(model_dir))
    tensors: dict[str, dict] = {}
    for f in files:
        tensors.update(_tensors(Path(f)))
    untied = any(k.endswith("lm_head.weight") for k in tensors)
    read = {k: v for k, v in tensors.items() if not (untied and k.endswith("embed_tokens.weight"))}
    own = max(read.values(), key=lambda v: _numel(v["shape"]))["dtype"] if read else "BF16"
    size = ELEMENT_BYTES.get(dtype or own, ELEMENT_BYTES[own])
    weights = sum(_numel(v["shape"]) * size for v in read.values())
    cfg = load_model_config(model_dir)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * size
    if not cfg.num_experts:
        return ModelBytes(weights, kv, dtype or own)
    experts = sum(_numel(v["shape"]) * size for k, v in read.items() if ".experts." in k)
    return ModelBytes(weights, kv, dtype or own, experts, cfg.num_experts, cfg.num_experts_per_tok)


def _gguf_bytes(path: Path, cfg) -> ModelBytes:
    """A GGUF's step streams its blocks as stored (the kernels multiply them quantized); the KV cache is
    the engine's bf16."""
    from hotstart.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    untied = "output.weight" in tensors
    weights = sum(t.end - t.start for name, t in tensors.items()
                  if not (untied and name == "token_embd.weight"))
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * ELEMENT_BYTES["BF16"]
    return ModelBytes(weights, kv, "GGUF")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def fraction(tokens_per_s: float | None, mb: ModelBytes | None, batch: int, context: float,
             bandwidth_gbs: float | None) -> float | None:
    """tokens/s x bytes per token / bandwidth (None where a figure is missing)."""
    if not tokens_per_s or mb is None or not bandwidth_gbs:
        return None
    return tokens_per_s * mb.per_token(batch, context) / (bandwidth_gbs * 1e9)


def run_roofline_bench(args) -> int:
    """Entry point of `hotstart bench roofline`."""
    size = 256 if args.quick else args.size_mb
    reps = 3 if args.quick else args.reps
    threads = [int(t) for t in args.threads.split(",")] if args.threads else None
    if size < 1 or reps < 1 or any(t < 1 for t in threads or []):
        raise HotstartError("bench roofline: --size-mb, --reps and --threads must be >= 1")
    res = measure(args.device, size, threads, reps)
    path = save(res)
    lines = ["| kernel | threads | median GB/s | best GB/s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['threads'] or '-'} | {r['median_gbs']:.2f} | {r['best_gbs']:.2f} |"
              for r in res["results"]]
    print(f"{res['device']}: {size} MiB float32 arrays, {reps} passes each, load average {res['load1']}")
    print("\n".join(lines))
    print(f"roofline bandwidth (median read, {res['threads'] or 'all'} threads): "
          f"{res['bandwidth_gbs']:.2f} GB/s (saved in {path})")
    if args.model is not None or args.tokens_per_s is not None:
        mb = model_bytes(_model_dir(args.model), args.dtype)
        print(f"model: {mb.weights / 1e6:.1f} MB of {mb.dtype} weights per step, "
              f"{mb.kv_per_token} KV bytes per token")
        if args.tokens_per_s is not None:
            f = fraction(args.tokens_per_s, mb, args.batch, args.context, res["bandwidth_gbs"])
            print(f"{args.tokens_per_s} tok/s at batch {args.batch}, context {args.context}: "
                  f"{f:.1%} of the roofline")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def _model_dir(model: str | None) -> Path:
    from hotstart.boot.resolve import resolve_model

    return resolve_model(model).path
