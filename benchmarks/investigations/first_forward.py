"""Why is the first forward after a start slower than the next? The engine core alone (no server, no
fast path, no compile worker), cold or warm weights: per request, wall time, this process's user and
system CPU, page faults (minor, major) and MemAvailable.

    python benchmarks/investigations/first_forward.py MODEL --cold [--max-model-len 2048] [--requests 3]
        [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hotstart.boot.prefetch import Prefetcher
from hotstart.boot.storage import MiB, PrefetchPlan
from hotstart.model.files import weight_files
from hotstart.residency import evict, resident_bytes
from hotstart.system import mem_available


def usage() -> dict:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"t": time.perf_counter(), "user": r.ru_utime, "sys": r.ru_stime, "minflt": r.ru_minflt,
            "majflt": r.ru_majflt}


def delta(a: dict, b: dict) -> dict:
    return {"wall_s": round(b["t"] - a["t"], 3), "user_s": round(b["user"] - a["user"], 3),
            "sys_s": round(b["sys"] - a["sys"], 3), "minflt": b["minflt"] - a["minflt"],
            "majflt": b["majflt"] - a["majflt"],
            "mem_available_gib": round((mem_available() or 0) / 2**30, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cold", action="store_true")
    mode.add_argument("--warm", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--dtype", default="auto", help="the engine's --dtype (auto: float32 without CPU bf16)")
    ap.add_argument("--touch", choices=["none", "copy", "tensors"], default="none",
                    help="before the requests, read every weight byte once: copy = preadv of the files into "
                         "a buffer; tensors = one element per page of every parameter (through the engine's "
                         "own mapping)")
    a = ap.parse_args()
    files = [str(p) for p in weight_files(Path(a.model).expanduser())]
    if a.cold:
        for f in files:
            evict(f)
    else:
        Prefetcher(files, PrefetchPlan(True, 2, 16 * MiB, "warm", method="fadvise")).start().wait(600)
    def resident() -> float:
        return sum(resident_bytes(f)[0] for f in files) / sum(resident_bytes(f)[1] for f in files)

    out: dict = {"mode": "cold" if a.cold else "warm", "resident_before": resident()}
    u0 = usage()
    import torch

    from hotstart.config import EngineConfig
    from hotstart.engine.core import EngineCore
    from hotstart.messages import EngineRequest
    from hotstart.sampling_params import SamplingParams

    if a.threads:
        torch.set_num_threads(a.threads)
    u1 = usage()
    out["import"] = delta(u0, u1)
    core = EngineCore.build(EngineConfig(model_path=str(Path(a.model).expanduser()), device="cpu",
                                         max_model_len=a.max_model_len, compile="off",
                                         dtype=a.dtype))
    u2 = usage()
    out["build"] = delta(u1, u2)
    if a.touch == "copy":
        buf = memoryview(bytearray(16 * MiB))
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            off = 0
            while n := os.preadv(fd, [buf], off):
                off += n
            os.close(fd)
    elif a.touch == "tensors":
        with torch.no_grad():  # one element per 4 KiB page, through the engine's own mapping
            for p in core.runner.model.parameters():
                p.view(-1)[:: max(1, 4096 // p.element_size())].float().sum()
    u3 = usage()
    out["touch"] = delta(u2, u3)
    out["requests"] = []
    for i in range(a.requests):
        ids = [(17 * i + k) % 1000 + 100 for k in range(a.prompt_tokens)]
        params = SamplingParams(max_tokens=1, temperature=0)
        assert core.add_request(EngineRequest(f"r{i}", ids, params)) is None
        t = usage()
        while core.has_work():
            core.step()
        out["requests"].append(delta(t, usage()))
    out["resident_after"] = resident()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
