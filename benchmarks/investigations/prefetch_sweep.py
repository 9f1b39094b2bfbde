"""Measure the prefetcher on this machine: the numbers behind the defaults in hotstart/boot/storage.py.

    python benchmarks/investigations/prefetch_sweep.py [--dir DIR] [--size-gb 1.5] [--reps 3]

1. Sweep: a cold (evicted) file read by the Prefetcher with 1/2/4/8 threads x 4/16/64 MiB blocks,
   against a plain single-thread read loop; then a warm run (everything resident: mincore only).
2. Loader race: a simulated loader in another process (like the engine) starts `delay` seconds after
   launch and copies the file out of an mmap in 16 MiB chunks (what a safetensors mmap load does),
   publishing its position on a LoadCursor. Its finish time (from launch) is measured with no
   prefetch, an uncoordinated prefetch, and cursor-coordinated prefetch with several windows.
Medians of `reps` runs; the file is evicted with posix_fadvise before every run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hotstart.boot.prefetch import Prefetcher  # noqa: E402
from hotstart.boot.storage import MiB, PrefetchPlan, detect  # noqa: E402
from hotstart.model.cursor import LoadCursor  # noqa: E402
from hotstart.residency import evict, resident_bytes  # noqa: E402

LOADER = r"""
import mmap, os, sys, time
sys.path.insert(0, sys.argv[4])
from hotstart.model.cursor import LoadCursor
path, t_start, cursor_path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
cur = LoadCursor.open(cursor_path) if cursor_path != "-" else None
time.sleep(max(0.0, t_start - time.time()))
chunk = 16 << 20
dst = memoryview(bytearray(chunk))
with open(path, "rb") as f:
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
src = memoryview(mm)
for a in range(0, len(mm), chunk):
    if cur: cur.advance(a)
    n = min(chunk, len(mm) - a)
    dst[:n] = src[a:a + n]
if cur: cur.advance(len(mm))
print(time.time())
"""


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    with open(path, "wb") as f:
        chunk = os.urandom(64 * MiB)  # random data: no layer below can compress or dedupe it
        for off in range(0, size, len(chunk)):
            f.write(chunk[: min(len(chunk), size - off)])
            chunk = chunk[1:] + chunk[:1]
        os.fsync(f.fileno())


def cold(path: Path) -> None:
    evict(path)
    res, _ = resident_bytes(path)
    assert res < 16 * MiB, f"eviction failed: {res} bytes still resident"


def prefetch_gbps(path: Path, threads: int, block_mib: int) -> tuple[float, int]:
    plan = PrefetchPlan(True, threads, block_mib * MiB, "sweep")  # no cursor: reads freely
    pf = Prefetcher([path], plan).start()
    pf.wait(120)
    s = pf.stats()
    return s["bytes_total"] / s["elapsed_s"] / 1e9, s["bytes_read"]


def plain_gbps(path: Path, block_mib: int = 16) -> float:
    buf = memoryview(bytearray(block_mib * MiB))
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return path.stat().st_size / (time.perf_counter() - t) / 1e9


def loader_run(path: Path, delay: float, mode: str, window_mib: int, threads: int, block_mib: int) -> float:
    """Seconds from launch to the simulated loader finishing. mode: none | free | cursor."""
    cursor = LoadCursor.create() if mode == "cursor" else None
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", LOADER, str(path), str(t0 + delay),
                             cursor.path if cursor else "-", str(Path(__file__).resolve().parents[2])],
                            stdout=subprocess.PIPE, text=True)
    pf = None
    if mode != "none":
        plan = PrefetchPlan(True, threads, block_mib * MiB, "race", window_mib * MiB)
        pf = Prefetcher([path], plan, cursor=cursor).start()
    out, _ = proc.communicate(timeout=300)
    if pf:
        pf.stop()
        pf.wait(10)
    if cursor:
        cursor.close()
    return float(out.strip()) - t0


def interleaved(reps: int, configs: dict) -> dict:
    """Median per config, running the configs round-robin within each rep so that drift in the
    (shared, noisy) disk hits every config alike."""
    results = {k: [] for k in configs}
    for _ in range(reps):
        for k, fn in configs.items():
            results[k].append(fn())
    return {k: statistics.median(v) for k, v in results.items()}


GIL_CHILD = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from hotstart.boot.prefetch import Prefetcher
from hotstart.boot.storage import PrefetchPlan
threads, block = int(sys.argv[2]), int(sys.argv[3])
plan = PrefetchPlan(True, threads, block << 20, "gil")
pf = Prefetcher([Path(sys.argv[1])], plan).start() if threads else None
t = time.perf_counter()
import fastapi, uvicorn, jinja2, msgspec, zmq, tokenizers  # what the API process imports at startup
imp = time.perf_counter() - t
s = pf.wait(60) and pf.stats() if pf else {"bytes_read": 0, "elapsed_s": 1}
print(imp, s["bytes_read"] / s["elapsed_s"] / 1e9)
"""


def sweep(path: Path, reps: int) -> None:
    def plain():
        cold(path)
        return plain_gbps(path)

    def pf(threads, block):
        def run():
            cold(path)
            return prefetch_gbps(path, threads, block)[0]
        return run

    configs = {("plain", 16): plain}
    configs.update({(t, b): pf(t, b) for t in (1, 2, 4, 8) for b in (4, 16, 64)})
    med = interleaved(reps, configs)
    print(f"plain readinto loop, 1 thread, 16 MiB: {med['plain', 16]:.2f} GB/s (cold, median)\n")
    print("| prefetch threads | 4 MiB | 16 MiB | 64 MiB |  (cold GB/s, median)\n|---|---|---|---|")
    for t in (1, 2, 4, 8):
        print(f"| {t} | " + " | ".join(f"{med[t, b]:.2f}" for b in (4, 16, 64)) + " |")
    prefetch_gbps(path, 2, 16)
    t = time.perf_counter()
    _, read = prefetch_gbps(path, 2, 16)
    print(f"\nwarm (all resident): {time.perf_counter() - t:.3f} s for {path.stat().st_size / 1e9:.2f} GB, "
          f"bytes_read={read}\n", flush=True)


def race(path: Path, reps: int, delays: list[float], windows: list[int], threads: int, block: int) -> None:
    modes = [("none", 0), ("free", 1024)] + [("cursor", w) for w in windows]
    names = ["no prefetch", "free-running"] + [f"cursor {w} MiB" for w in windows]
    print(f"| loader delay | {' | '.join(names)} |  (loader done, s from launch, median; "
          f"prefetch {threads} threads x {block} MiB)\n|---" + "|---" * len(modes) + "|")
    for delay in delays:
        def one(mode, window, delay=delay):
            def run():
                cold(path)
                return loader_run(path, delay, mode, window, threads, block)
            return run
        med = interleaved(reps, {m: one(*m) for m in modes})
        print(f"| {delay:.1f} s | " + " | ".join(f"{med[m]:.2f}" for m in modes) + " |", flush=True)
    print()


def gil(path: Path, reps: int) -> None:
    """Prefetch threads in the API process vs its main thread's imports (GIL contention)."""
    root = str(Path(__file__).resolve().parents[2])

    def one(threads, block):
        def run():
            cold(path)
            out = subprocess.run([sys.executable, "-c", GIL_CHILD, str(path), str(threads), str(block), root],
                                 capture_output=True, text=True, check=True).stdout.split()
            return float(out[0]), float(out[1])
        return run

    configs = [(0, 0), (1, 16), (2, 4), (2, 16), (4, 4), (4, 16), (8, 16)]
    one(0, 0)()  # warm the imported modules' files
    res = {c: [] for c in configs}
    for _ in range(reps):
        for c in configs:
            res[c].append(one(*c)())
    print("| prefetch | imports (s) | prefetch GB/s |  (median; imports: fastapi uvicorn jinja2 msgspec zmq "
          "tokenizers, warm)\n|---|---|---|")
    for c, v in res.items():
        name = f"{c[0]} x {c[1]} MiB" if c[0] else "none"
        imports, gbps = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        print(f"| {name} | {imports:.3f} | {gbps:.2f} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="where to create the test file (not tmpfs)")
    ap.add_argument("--size-gb", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sections", default="sweep,gil,race", help="any of sweep,gil,race")
    ap.add_argument("--delays", default="0,1", help="loader start delays (s) in the race")
    ap.add_argument("--windows", default="64,256,1024", help="cursor windows (MiB) in the race")
    ap.add_argument("--threads", type=int, default=2, help="prefetch threads in the loader race")
    ap.add_argument("--block-mib", type=int, default=16, help="prefetch block in the loader race")
    ap.add_argument("--keep", action="store_true", help="keep the test file")
    args = ap.parse_args()
    path = Path(args.dir) / "hotstart-prefetch-sweep.bin"
    size = int(args.size_gb * 1e9) // MiB * MiB
    make_file(path, size)
    print(f"file {path}: {size / 1e9:.2f} GB on {detect(path)}; {os.cpu_count()} CPUs; reps={args.reps}\n")
    sections = args.sections.split(",")
    if "sweep" in sections:
        sweep(path, args.reps)
    if "gil" in sections:
        gil(path, args.reps)
    if "race" in sections:
        race(path, args.reps, [float(d) for d in args.delays.split(",")],
             [int(w) for w in args.windows.split(",")], args.threads, args.block_mib)
    if not args.keep:
        path.unlink()


if __name__ == "__main__":
    main()
