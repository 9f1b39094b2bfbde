"""Compare the prefetch methods (docs/prefetch.md): what each costs in CPU, and what it costs a concurrent
`import torch`, on a cold file. The numbers behind storage.AUTO_METHOD.

    python benchmarks/investigations/prefetch_methods.py --size-gb 3 --reps 5
    python benchmarks/investigations/prefetch_methods.py --size-gb 14 --reps 5   # windowed (RAM guard)
    python benchmarks/investigations/prefetch_methods.py --model MODEL --reps 5   # e.g. qwen2-7b-random

Each run evicts the file(s) (posix_fadvise DONTNEED, checked with mincore), starts a fresh child process
that runs the real Prefetcher (hotstart/boot/prefetch.py) with one method, and - in the `+ import` runs -
launches `python -c "import torch"` at the same moment. Measured per run: the child's wall time until
every byte is resident (its methods are synchronous per block; mincore checks it), bytes/s, the CPU
seconds of the prefetching process (getrusage: user + system, all its threads), the import's wall time
and CPU (wait4), the machine's busy CPU seconds over the run (/proc/stat: includes the kernel's I/O
completion work that no process is charged for, and the neighbours' load), and - after the clock stops
- the time of a first CPU read of every page (1 byte per page through a mapping: on this VM a page
just filled from disk costs ~1.7 us on its first CPU access; preadv pays that inside its copy, the
zero-copy methods leave it to whoever reads first: the engine's loader touches each tensor as it
loads, safetensors_io.PageToucher). Configurations are
interleaved within each round (so drift hits all alike); medians of --reps rounds after --warmup.

RAM guard: if the bytes exceed --ram-fraction of MemAvailable (checked before every run), the child
populates in windows: a consumer thread waits for each --window-gb of the file to be resident, evicts it
and advances a LoadCursor, and the Prefetcher stays within two windows of it, so the page cache never
holds more than 2 windows of the file. The consumer's own CPU (RUSAGE_THREAD) is not counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hotstart.bench.evict import FileSet, evict_sets
from hotstart.boot.populate import METHODS
from hotstart.boot.storage import MiB, detect, mem_available
from hotstart.model.files import weight_files
from hotstart.residency import evict, resident_bytes

CHILD = r"""
import json, os, resource, sys, threading, time
a = json.loads(sys.argv[1])
sys.path.insert(0, a["root"])
from hotstart.boot.prefetch import Prefetcher
from hotstart.residency import PAGE_SIZE, FileMap
from hotstart.boot.storage import PrefetchPlan
from hotstart.model.cursor import LoadCursor

files, W = a["files"], a["window"]
sizes = [os.path.getsize(f) for f in files]
bases = [sum(sizes[:i]) for i in range(len(sizes))]
total = sum(sizes)
cursor = LoadCursor.create() if W else None
plan = PrefetchPlan(True, a["threads"], a["block"], "bench", 2 * W if W else 1 << 40, a["method"], a["chunk"])
pf = Prefetcher(files, plan, cursor)
fds = [os.open(f, os.O_RDONLY) for f in files]
maps = [FileMap(fd, s) for fd, s in zip(fds, sizes)]

def segments(lo, hi):  # global [lo, hi) -> (file index, offset, length)
    for i, (b, s) in enumerate(zip(bases, sizes)):
        s0, s1 = max(lo, b), min(hi, b + s)
        if s0 < s1:
            yield i, s0 - b, s1 - s0

def first_missing(lo, hi):
    for i, off, n in segments(lo, hi):
        v = maps[i].vector(off, n)
        j = v.find(0)
        if j != -1:
            return bases[i] + off + j * PAGE_SIZE
    return None

consumer_cpu = [0.0]
def consume():
    r = resource.getrusage(resource.RUSAGE_THREAD)
    pos = 0
    while pos < total:
        end, lo = min(pos + W, total), pos
        while (lo := first_missing(lo, end)) is not None:
            if pf.wait(0):  # the prefetcher gave up: do not wait forever
                break
            time.sleep(0.01)
        for i, off, n in segments(pos, end):
            os.posix_fadvise(fds[i], off, n, os.POSIX_FADV_DONTNEED)
        pos = end
        cursor.advance(pos)
    q = resource.getrusage(resource.RUSAGE_THREAD)
    consumer_cpu[0] = q.ru_utime + q.ru_stime - r.ru_utime - r.ru_stime

print("ready", flush=True)
sys.stdin.buffer.read(1)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
if W:
    cursor.advance(0)
pf.start()  # before the consumer: an idle Prefetcher's wait(0) is already True
if W:
    c = threading.Thread(target=consume, daemon=True)
    c.start()
ok = pf.wait(a["timeout"])
if W:
    c.join(a["timeout"])
else:  # every method is synchronous per block; wait for stragglers anyway (bounded)
    deadline = time.perf_counter() + 5
    while first_missing(0, total) is not None and time.perf_counter() < deadline:
        time.sleep(0.005)
t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime - consumer_cpu[0]
res = sum(m.vector().count(1) for m in maps) * PAGE_SIZE if not W else None
touch_s = touch_cpu = None
if not W:  # the first CPU read of every page (1 byte each): what the engine's first touch would pay
    import mmap
    mms = [mmap.mmap(fd, size, access=mmap.ACCESS_READ) for fd, size in zip(fds, sizes) if size]
    for mm in mms:  # page-table entries first (as the engine's loader does), so only the data access is timed
        mm.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
    t2, r2 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for mm in mms:
        memoryview(mm)[::PAGE_SIZE].tobytes()
    r3 = resource.getrusage(resource.RUSAGE_SELF)
    for mm in mms:
        mm.close()
    touch_s, touch_cpu = time.perf_counter() - t2, r3.ru_utime + r3.ru_stime - r2.ru_utime - r2.ru_stime
s = pf.stats()
print(json.dumps({"wall_s": t1 - t0, "cpu_s": cpu, "user_s": r1.ru_utime - r0.ru_utime,
                  "sys_s": r1.ru_stime - r0.ru_stime, "consumer_cpu_s": consumer_cpu[0], "ok": ok,
                  "state": s["state"], "errors": s["errors"], "first_error": s["first_error"],
                  "bytes_read": s["bytes_read"], "skipped_resident": s["bytes_skipped_resident"],
                  "resident_after": res, "total": total, "touch_s": touch_s, "touch_cpu_s": touch_cpu}))
"""


def busy_cpu_s() -> float:
    """Machine-wide busy CPU seconds so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    with open(path, "wb") as f:
        chunk = os.urandom(64 * MiB)  # random: nothing below can compress or dedupe it
        for off in range(0, size, len(chunk)):
            f.write(chunk[: min(len(chunk), size - off)])
            chunk = chunk[1:] + chunk[:1]
        os.fsync(f.fileno())


def cold(files: list[str], torch_set: FileSet | None) -> None:
    for f in files:
        evict(f)
    left = sum(resident_bytes(f)[0] for f in files)
    if left > 16 * MiB:
        raise SystemExit(f"eviction failed: {left / MiB:.0f} MiB still resident (mapped by another process?)")
    if torch_set is not None:
        evict_sets([torch_set])


def one_run(a: argparse.Namespace, files: list[str], method: str | None, with_import: bool,
            torch_set: FileSet | None) -> dict:
    cold(files, torch_set)
    total = sum(os.path.getsize(f) for f in files)
    avail = mem_available() or 0
    window = 0
    if total > a.ram_fraction * avail:
        window = int(a.window_gb * 2**30)
        if 2 * window + (1 << 30) > avail:
            raise SystemExit(f"MemAvailable {avail / 2**30:.1f} GiB cannot hold 2 windows of "
                             f"{a.window_gb} GiB")
    rec: dict = {"method": method, "import": with_import, "window": window, "mem_available": avail}
    child = None
    if method is not None:
        arg = {"root": str(ROOT), "files": files, "method": method, "threads": a.threads,
               "block": a.block_mib * MiB, "chunk": (detect(files[0]).ra_bytes or 128 << 10),
               "window": window, "timeout": a.timeout}
        child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(arg)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
        if child.stdout.readline().strip() != b"ready":
            raise SystemExit(f"{method}: the child did not start")
    b0, t0 = busy_cpu_s(), time.perf_counter()
    imp = subprocess.Popen([sys.executable, "-c", "import torch"]) if with_import else None
    if child is not None:
        child.stdin.write(b"g")
        child.stdin.flush()
    if imp is not None:
        _, status, ru = os.wait4(imp.pid, 0)
        imp.returncode = os.waitstatus_to_exitcode(status)
        rec.update(import_s=time.perf_counter() - t0, import_cpu_s=ru.ru_utime + ru.ru_stime,
                   import_rc=imp.returncode)
    if child is not None:
        out, _ = child.communicate(timeout=a.timeout + 30)
        rec.update(json.loads(out))
        rec["gbps"] = rec["total"] / rec["wall_s"] / 1e9
    rec["busy_cpu_s"] = busy_cpu_s() - b0
    rec["run_s"] = time.perf_counter() - t0
    return rec


def med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict, total: int) -> str:
    alone_import = med(results.get(("none", True), []), "import_s")
    header = ("| method | with import: populate s | GB/s | prefetch CPU s | CPU s/GB | import s | "
              "import x alone | machine busy s | alone: populate s | GB/s | prefetch CPU s | first touch s |")
    lines = [header, "|---" * 12 + "|"]
    lines.append(f"| (import alone) | | | | | {fmt(alone_import)} | 1.00x | "
                 f"{fmt(med(results.get(('none', True), []), 'busy_cpu_s'))} | | | | |")
    for m in [m for m in METHODS if any(k[0] == m for k in results)]:
        w, s = results.get((m, True), []), results.get((m, False), [])
        imp = med(w, "import_s")
        cpu = med(w, "cpu_s")
        lines.append(f"| {m} | {fmt(med(w, 'wall_s'))} | {fmt(med(w, 'gbps'))} | {fmt(cpu, '.3f')} | "
                     f"{fmt(cpu / (total / 1e9) if cpu is not None else None, '.3f')} | {fmt(imp)} | "
                     f"{fmt(imp / alone_import if imp and alone_import else None)}x | "
                     f"{fmt(med(w, 'busy_cpu_s'))} | "
                     f"{fmt(med(s, 'wall_s'))} | {fmt(med(s, 'gbps'))} | {fmt(med(s, 'cpu_s'), '.3f')} | "
                     f"{fmt(med(s or w, 'touch_s'), '.3f')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="where to create the test file (not tmpfs)")
    ap.add_argument("--size-gb", type=float, default=3.0, help="size of the test file (GB)")
    ap.add_argument("--model", default=None, help="use this model folder's safetensors files (in load order)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-mib", type=int, default=16)
    ap.add_argument("--no-alone", action="store_true", help="skip the runs without a concurrent import")
    ap.add_argument("--cold-import", action="store_true",
                    help="also evict torch's package files before each run")
    ap.add_argument("--ram-fraction", type=float, default=0.5,
                    help="populate in windows above this share of MemAvailable")
    ap.add_argument("--window-gb", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="write every run here")
    ap.add_argument("--keep", action="store_true", help="keep the test file")
    a = ap.parse_args()
    made = None
    if a.model:
        files = [str(p) for p in weight_files(Path(a.model).expanduser())]
    else:
        size = int(a.size_gb * 1e9) // MiB * MiB
        made = Path(a.dir) / f"hotstart-prefetch-methods-{size}.bin"
        make_file(made, size)
        files = [str(made)]
    total = sum(os.path.getsize(f) for f in files)
    torch_set = None
    if a.cold_import:
        torch_set = FileSet("torch")
        torch_set.add_tree(importlib.util.find_spec("torch").submodule_search_locations[0])
    methods = [m for m in a.methods.split(",") if m]
    if bad := set(methods) - set(METHODS):
        raise SystemExit(f"unknown method(s) {sorted(bad)}: expected some of {', '.join(METHODS)}")
    configs = [("none", True)] + [(m, True) for m in methods]
    configs += [] if a.no_alone else [(m, False) for m in methods]
    print(f"{len(files)} file(s), {total / 1e9:.2f} GB on {detect(files[0])}; {os.cpu_count()} CPUs; "
          f"kernel {os.uname().release}; MemAvailable {(mem_available() or 0) / 2**30:.1f} GiB; "
          f"{a.threads} threads x {a.block_mib} MiB; reps={a.reps} (+{a.warmup} warm-up)", flush=True)
    results: dict = {c: [] for c in configs}
    every = []
    try:
        for rep in range(a.warmup + a.reps):
            for method, with_import in configs:
                rec = one_run(a, files, None if method == "none" else method, with_import, torch_set)
                rec.update(round=rep, warmup=rep < a.warmup)
                every.append(rec)
                if rep >= a.warmup:
                    results[method, with_import].append(rec)
                print(f"round {rep}{' (warm-up)' if rep < a.warmup else ''} {method:9s} "
                      f"{'+ import' if with_import else 'alone   '}: "
                      + (f"populate {rec['wall_s']:.2f} s {rec['gbps']:.2f} GB/s cpu {rec['cpu_s']:.3f} s "
                         f"errors {rec['errors']} " if method != "none" else "")
                      + (f"import {rec['import_s']:.2f} s" if with_import else "")
                      + (f" (windows of {rec['window'] / MiB:.0f} MiB)"
                         if rec["window"] and method != "none" else ""),
                      flush=True)
                if a.json:
                    Path(a.json).write_text(json.dumps(every, indent=1))
    finally:
        if made is not None and not a.keep:
            made.unlink(missing_ok=True)
    print(f"\nmedians of {a.reps} ({total / 1e9:.2f} GB, cold file; import: `python -c \"import torch\"` "
          f"started with the populate; CPU = user + system of the prefetching process)\n")
    print(table(results, total))


if __name__ == "__main__":
    main()
