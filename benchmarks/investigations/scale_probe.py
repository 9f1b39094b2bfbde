"""One `hotstart serve` of a model folder, cold or warm, and where its time and memory go, as JSON.

    python benchmarks/investigations/scale_probe.py MODEL --cold --max-model-len 2048
    python benchmarks/investigations/scale_probe.py MODEL --warm --max-model-len 2048
    python benchmarks/investigations/scale_probe.py MODEL --cold --serve-args "--prefetch-method preadv"
    (MODEL: e.g. ~/.cache/hotstart/models/qwen2-7b-random, written by `hotstart make-model`)

--cold evicts the weights and sidecars first (posix_fadvise DONTNEED, checked with mincore); --warm reads
them into the page cache first. Then it launches the server (its own session, `--zygote off` so every
process is its descendant), samples /proc/PID/status of every process of the tree every 50 ms in a
thread (peak VmRSS, RssAnon, RssFile per process: api, forkserver, engine, workers), polls /health
(t_health), sends a 1-token completion (t_first, from launch) and the same again (t_repeat: that
request's own time), and reads GET /startup (phases, prefetch stats). Recorded at launch, health, after
the first and after the repeat: the weights' page-cache residency (mincore), MemAvailable, and the
engine's page faults (minor, major) and RSS. Stops the server with SIGTERM (SIGKILL after 15 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hotstart.boot.prefetch import Prefetcher
from hotstart.boot.storage import MiB, PrefetchPlan
from hotstart.model.files import sidecar_files, weight_files
from hotstart.procs import tree as descendants_with_parents
from hotstart.residency import evict, resident_bytes
from hotstart.system import mem_available

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def proc_status(pid: int) -> dict:
    """VmRSS, RssAnon, RssFile, RssShmem (bytes) and minor/major faults of PID; {} if it is gone."""
    out = {}
    for line in _read(f"/proc/{pid}/status").splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS:
            out[key] = int(rest.split()[0]) * 1024
    stat = _read(f"/proc/{pid}/stat")
    if stat:
        f = stat.rpartition(")")[2].split()  # fields after the command name: state is f[0]
        out["minflt"], out["majflt"] = int(f[7]), int(f[9])
    return out


def tree(root: int) -> dict[int, str]:
    """pid -> role of ROOT and its descendants: api, forkserver, engine (a forkserver's child), or the
    module a process runs (`-m X`)."""
    roles = {root: "api"}
    for c, p in descendants_with_parents(root).items():  # each after its parent: its role is known
        argv = _read(f"/proc/{c}/cmdline").split("\0")
        mod = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else Path(argv[0]).name if argv else "?"
        if roles[p] == "forkserver":
            roles[c] = "engine"
        elif mod == "hotstart.forkserver":
            roles[c] = "forkserver"
        else:
            roles[c] = mod
    return roles


class Sampler(threading.Thread):
    """Peak memory of every process of the server's tree, every `every` seconds."""

    def __init__(self, root: int, every: float = 0.05):
        super().__init__(daemon=True)
        self.root, self.every = root, every
        self.peaks: dict[int, dict] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            for pid, role in tree(self.root).items():
                s = proc_status(pid)
                if not s:
                    continue
                peak = self.peaks.setdefault(pid, {"role": role})
                for k in FIELDS:
                    if k in s:
                        peak["peak_" + k] = max(peak.get("peak_" + k, 0), s[k])
            self.stop_event.wait(self.every)

    def engine_pid(self) -> int | None:
        return next((p for p, v in self.peaks.items() if v["role"] == "engine"), None)


def residency(files: list[str]) -> dict:
    res = sum(resident_bytes(f)[0] for f in files)
    total = sum(os.path.getsize(f) for f in files)
    return {"resident_bytes": res, "total_bytes": total,
            "resident_fraction": round(res / total, 4) if total else 0}


def http(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def snapshot(name: str, t0: float, files: list[str], sampler: Sampler) -> dict:
    snap = {"at": name, "t": round(time.time() - t0, 3), "mem_available": mem_available(), **residency(files)}
    pid = sampler.engine_pid()
    if pid is not None:
        snap["engine"] = proc_status(pid)
    return snap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model folder")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cold", action="store_true", help="evict the weights and sidecars first")
    mode.add_argument("--warm", action="store_true", help="read the weights into the page cache first")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--serve-args", default="", help="more `hotstart serve` flags (one string)")
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    model = Path(a.model).expanduser().resolve()
    files = [str(p) for p in weight_files(model)]
    sidecars = [str(p) for p in sidecar_files(model)]
    if a.cold:
        for f in files + sidecars:
            evict(f)
    else:
        pf = Prefetcher(files + sidecars, PrefetchPlan(True, 2, 16 * MiB, "warm", method="fadvise")).start()
        pf.wait(a.timeout)
    before = residency(files)
    if a.cold and before["resident_fraction"] > 0.05:
        print(f"warning: {before['resident_fraction']:.1%} of the weights stayed resident (mapped by another "
              "process?)", file=sys.stderr)
    cmd = [sys.executable, "-m", "hotstart", "serve", str(model), "--port", "0", "--zygote", "off",
           "--max-model-len", str(a.max_model_len), *shlex.split(a.serve_args)]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"scale-probe-{os.getpid()}.log"
    log = open(log_path, "w+b")  # noqa: SIM115 - the server writes it until the end
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    sampler = Sampler(proc.pid)
    sampler.start()
    result: dict = {"model": str(model), "mode": "cold" if a.cold else "warm", "cmd": cmd,
                    "log": str(log_path), "before": before, "snapshots": []}
    try:
        url = None
        while url is None:
            if proc.poll() is not None or time.time() - t0 > a.timeout:
                raise RuntimeError(f"the server exited or never printed its URL: see {log_path}")
            for line in log_path.read_text(errors="replace").splitlines():
                if "serving" in line and "http://" in line:
                    url = line.split("http://")[1].split()[0]
            time.sleep(0.01)
        base = f"http://{url}"
        while http(base + "/health", timeout=5)[0] != 200:
            if proc.poll() is not None or time.time() - t0 > a.timeout:
                raise RuntimeError(f"never healthy: see {log_path}")
            time.sleep(0.02)
        result["t_health"] = round(time.time() - t0, 3)
        result["snapshots"].append(snapshot("health", t0, files, sampler))
        name = http(base + "/v1/models")[1]["data"][0]["id"]
        body = {"model": name, "prompt": a.prompt, "max_tokens": 1, "temperature": 0}
        code, _ = http(base + "/v1/completions", body, a.timeout)
        result["t_first"] = round(time.time() - t0, 3)
        result["first_ok"] = code == 200
        result["snapshots"].append(snapshot("first", t0, files, sampler))
        t = time.time()
        code, _ = http(base + "/v1/completions", body, a.timeout)
        result["t_repeat"] = round(time.time() - t, 3)
        result["repeat_ok"] = code == 200
        result["snapshots"].append(snapshot("repeat", t0, files, sampler))
        startup = http(base + "/startup")[1]
        # phases are seconds from the server's own t0 (its CLI's start), `server_t0_s` after this launch
        result["server_t0_s"] = round(startup.get("t0", t0) - t0, 3)
        result["phases"] = [{"name": p.get("name"), "process": p.get("process"), "start": p.get("start_s"),
                             "end": p.get("end_s"), "detail": p.get("detail", "")}
                            for p in startup.get("phases", [])]
        result["prefetch"] = startup.get("prefetch")
        result["startup_extra"] = {k: v for k, v in startup.items() if k not in ("phases", "prefetch", "t0")}
    except RuntimeError as e:
        result["error"] = str(e)
    finally:
        sampler.stop_event.set()
        sampler.join(2)
        result["processes"] = [{"pid": p, **v} for p, v in sorted(sampler.peaks.items())]
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        except ProcessLookupError:
            pass
        result["exit_code"] = proc.returncode
        result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-40:]
        log.close()
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
