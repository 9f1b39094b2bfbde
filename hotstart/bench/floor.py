"""The floor of `hotstart bench startup`: what no start can beat on this machine, measured in the same
rounds.

`python -c "import torch"` (the harness's interpreter) and one read of every weight byte; the caller
evicts first, as for the servers. Beside the floor, the two imports of a start measured alone (the
forkserver's preload and the API process's web stack, timed inside a fresh interpreter exactly as the
start's timeline times them), so a start's timeline can say how much slower each ran under its load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READ_BLOCK = 16 << 20
READ_THREADS = 4

# what -> the imports a start's phase of that name times (forkserver/server.py's preload; the "web stack
# imported" phase of server/launch.py)
IMPORTS_ALONE = {
    "import_engine": ("forkserver up", "from hotstart.engine import worker"),
    "import_web": ("web stack imported", "from hotstart.server.api import ApiSettings\n"
                   "from hotstart.server.routes import build_app\n"
                   "from hotstart.frontend.sampling import sampling_defaults\n"
                   "from hotstart.text.tokenizer import Tokenizer"),
}


def import_torch(timeout: float) -> dict:
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "import torch"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        err = b"timed out"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rec = {"seconds": round(time.perf_counter() - t, 4), "ok": proc.returncode == 0}
    if not rec["ok"]:
        rec["error"] = err.decode(errors="replace").strip()[-300:]
    return rec


def import_alone(what: str, timeout: float) -> dict:
    """IMPORTS_ALONE[WHAT]'s imports in a fresh interpreter, timed inside it (interpreter start excluded,
    as in the start's timeline); `wall` is the whole process."""
    code = f"import time\nt = time.time()\n{IMPORTS_ALONE[what][1]}\nprint(time.time() - t)"
    t = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=timeout, start_new_session=True, text=True, check=False)
    except subprocess.TimeoutExpired:
        return {"seconds": None, "ok": False, "error": "timed out"}
    wall = round(time.perf_counter() - t, 4)
    try:
        return {"seconds": round(float(out.stdout.strip().splitlines()[-1]), 4), "wall": wall, "ok": True}
    except (IndexError, ValueError):
        return {"seconds": None, "wall": wall, "ok": False, "error": out.stderr.strip()[-300:]}


def read_weights(paths: list[Path]) -> dict:
    """Read every byte once, READ_THREADS threads x 16 MiB preadv in file order.

    Several requests in flight, because this virtio disk is latency-bound at one (measured here:
    0.5-1.0 GB/s with 1 thread, 1.2-1.5 GB/s with 2-4). Threads doing only preadv release the GIL.
    """
    blocks = [(p, off) for p in paths for off in range(0, p.stat().st_size, READ_BLOCK)]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    lock, total = threading.Lock(), [0]

    def reader() -> None:
        buf = memoryview(bytearray(READ_BLOCK))
        while True:
            with lock:
                if not blocks:
                    return
                path, off = blocks.pop()
            n = os.preadv(fds[path], [buf], off)
            with lock:
                total[0] += n

    blocks.reverse()  # pop() from the end = file order
    t = time.perf_counter()
    threads = [threading.Thread(target=reader, daemon=True) for _ in range(READ_THREADS)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    took = time.perf_counter() - t
    n = total[0]
    return {"seconds": round(took, 4), "bytes": n, "gbps": round(n / took / 1e9, 3), "threads": READ_THREADS,
            "ok": True}
