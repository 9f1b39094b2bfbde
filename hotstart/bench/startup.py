"""`hotstart bench startup`: cold/warm A/B startup benchmark against peers and the floor.

For each round, each cold mode and each config (interleaved, so drift in the machine hits every config
alike): evict, check residency with mincore, launch on a free port, time /health == 200 (t_health) and a
verified greedy chat completion (t_first), keep hotstart's /startup timeline, stop the process group
and check nothing is left. The floor is measured in the same rounds: `python -c "import torch"` and a
sequential read of the weight files, after the same eviction. results.json is rewritten after every run,
so Ctrl-C (or a crash) keeps what was measured.
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
from dataclasses import dataclass, field
from pathlib import Path

# Imported before anything is evicted: an import during a cold run would warm the files it reads.
import psutil  # noqa: F401 - used by hotstart.bench.process at stop time

from hotstart.bench import evict as ev
from hotstart.bench import report
from hotstart.bench.process import RunFailed, Server, free_port, tail
from hotstart.errors import HotstartError

VARIANTS = {"no-prefetch": (["--no-prefetch"], {}), "no-prespawn": (["--no-prespawn"], {}),
            "serial": ([], {"HOTSTART_SERIAL": "1"}),
            "zygote": (["--zygote", "auto"], {})}  # with one zygote started before the runs (bench_zygote)
READ_BLOCK = 16 << 20
READ_THREADS = 4


@dataclass(frozen=True)
class Target:
    """One config: a command template ({port}, {model}) with extra environment."""

    label: str
    kind: str  # "hotstart" | "peer"
    argv: tuple[str, ...]
    env: dict = field(default_factory=dict, hash=False)
    python: str | None = None  # its interpreter, whose environment "--cold all" evicts

    def command(self, port: int, model: str) -> list[str]:
        return [a.replace("{port}", str(port)).replace("{model}", model) for a in self.argv]


def _hotstart_target(spec: str, model: str | None, extra: list[str]) -> Target:
    name, _, rest = spec.partition(":")
    if name != "hotstart":
        raise HotstartError(f"--config {spec!r}: must be hotstart[:VARIANT[+VARIANT]] (use --peer for other servers)")
    flags, env = [], {}
    for v in filter(None, rest.split("+")):
        if v not in VARIANTS:
            raise HotstartError(f"--config {spec!r}: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
        flags += VARIANTS[v][0]
        env.update(VARIANTS[v][1])
    script = Path(sys.executable).parent / "hotstart"  # what a user types, in this environment
    exe = [str(script)] if script.is_file() else [sys.executable, "-m", "hotstart"]
    argv = exe + ["serve"] + ([model] if model else []) + ["--host", "127.0.0.1", "--port", "{port}"]
    return Target(spec, "hotstart", tuple(argv + flags + extra), env, sys.executable)


def _peer_target(cmd: str) -> Target:
    try:
        words = shlex.split(cmd)
    except ValueError as e:
        raise HotstartError(f"--peer {cmd!r}: {e}") from None
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():  # leading VAR=value
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if not words:
        raise HotstartError(f"--peer {cmd!r}: no command")
    if not any("{port}" in w for w in words):
        raise HotstartError(f"--peer {cmd!r}: must contain {{port}} (the harness picks a free port)")
    label = os.path.basename(words[0])
    if len(words) > 2 and words[1] == "-m":  # "python -m http.server"
        label += " -m " + words[2]
    elif len(words) > 1 and words[1].isalpha():  # "transformers serve"; "sleep 600" stays "sleep"
        label += " " + words[1]
    return Target(label, "peer", tuple(words), env, ev.python_of(words[0]))


def build_targets(args: argparse.Namespace) -> list[Target]:
    extra = shlex.split(args.hotstart_args or "")
    specs = args.targets or [("hotstart", "hotstart")]
    targets: list[Target] = []
    for kind, value in specs:
        t = _hotstart_target(value, args.model, extra) if kind == "hotstart" else _peer_target(value)
        n = sum(1 for o in targets if o.label.split(" #")[0] == t.label)
        targets.append(Target(f"{t.label} #{n + 1}", t.kind, t.argv, t.env, t.python) if n else t)
    return targets


def _check_args(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise HotstartError(f"--runs must be >= 1, got {args.runs}")
    if args.warmup < 0:
        raise HotstartError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.timeout > 0:
        raise HotstartError(f"--timeout must be > 0, got {args.timeout}")
    if args.max_tokens < 1:
        raise HotstartError(f"--max-tokens must be >= 1, got {args.max_tokens}")


class Bench:
    """The state of one benchmark: where results go and what each mode evicts."""

    def __init__(self, args, targets: list[Target], model_path: Path, weights: list[Path], out: Path):
        self.args, self.targets, self.model_path, self.weights, self.out = args, targets, model_path, weights, out
        self.modes = list(dict.fromkeys(args.cold or ["all"]))
        pythons = [t.python for t in targets] + ([sys.executable] if args.floor else [])
        hotstart_src = [str(Path(__file__).resolve().parents[1])] if any(t.kind == "hotstart" for t in targets) else []
        self.cold = ev.build_cold_sets(weights, pythons, hotstart_src) if "all" in self.modes else \
            ev.build_cold_sets(weights, [], [])
        self.base_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.runs: list[dict] = []
        self.floor: list[dict] = []
        self.meta = {
            "model": str(model_path), "weights_bytes": sum(p.stat().st_size for p in weights),
            "modes": self.modes, "configs": [{"label": t.label, "kind": t.kind, "argv": list(t.argv), "env": t.env}
                                             for t in targets],
            "runs": args.runs, "warmup": args.warmup, "timeout": args.timeout, "expect": args.expect,
            "prompt": args.prompt, "env_files": len(self.cold.env.paths), "env_bytes": self.cold.env.nbytes,
            "env_dirs": self.cold.env_dirs, "notes": self.cold.notes, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        }
        self.interrupted = False

    def evict(self, mode: str) -> dict:
        sets = self.cold.for_mode(mode)
        took = ev.evict_sets(sets)
        res = {s.name: round(ev.residency(s), 3) for s in (sets or [self.cold.weights])}
        out = {"evict_s": round(took, 3), "residency": res}
        if sets and res["weights"] > 5.0:  # DONTNEED cannot drop pages another process maps: say who
            holders = ev.mapped_by(self.cold.weights.paths)
            out["warning"] = f"weights {res['weights']:.0f}% resident after eviction; mapped by {holders or '?'}"
            print(f"hotstart bench startup: WARNING: {out['warning']}", file=sys.stderr, flush=True)
        return out

    def save(self) -> None:
        data = {"meta": {**self.meta, "interrupted": self.interrupted}, "runs": self.runs, "floor": self.floor}
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.out / "results.json")

    def run_server(self, t: Target, mode: str, rnd: int, warm: bool) -> dict:
        rec = {"config": t.label, "mode": mode, "round": rnd, "warmup": warm, "ok": False, **self.evict(mode)}
        port = free_port()
        argv = t.command(port, str(self.model_path))
        tag = f"{'w' if warm else 'r'}{rnd}-{mode}-{t.label.replace(' ', '_').replace(':', '_').replace('#', '')}"
        server = None
        try:
            server = Server.launch(argv, port, {**self.base_env, **t.env}, self.out / "logs", tag)
            rec["wall_launch"] = server.wall_launch
            deadline = server.t_launch + self.args.timeout
            rec["t_health"] = round(server.wait_healthy(deadline), 4)
            answer, t_first = server.ask(self.args.prompt, self.args.max_tokens, self.args.expect, deadline)
            rec.update(t_first=round(t_first, 4), answer=answer, ok=True)
            # The same request again, now warm: its duration is the request's own compute, so
            # t_first - t_repeat is what the start cost beyond serving one request.
            t_ask = time.perf_counter()
            try:
                server.ask(self.args.prompt, self.args.max_tokens, None, t_ask + self.args.timeout)
                rec["t_repeat"] = round(time.perf_counter() - t_ask, 4)
            except RunFailed as e:
                rec["repeat_error"] = str(e)
            if t.kind == "hotstart":
                rec["timeline"] = server.get_json("/startup")
        except RunFailed as e:
            rec["error"] = str(e)
        except KeyboardInterrupt:
            rec.update(ok=False, error="interrupted", interrupted=True)
            raise
        finally:
            if server is not None:
                rec["stop"] = server.stop()
                if not rec["ok"]:
                    rec["stderr_tail"] = tail(server.stderr_path)
            self.runs.append(rec)  # also an interrupted run: its process group is on record
        return rec

    def floor_import(self, mode: str, rnd: int, warm: bool) -> dict:
        rec = {"what": "import_torch", "mode": mode, "round": rnd, "warmup": warm, **self.evict(mode)}
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", "import torch"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=self.args.timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        rec["seconds"] = round(time.perf_counter() - t, 4)
        rec["ok"] = proc.returncode == 0
        if not rec["ok"]:
            rec["error"] = err.decode(errors="replace").strip()[-300:]
        return rec

    def floor_read(self, mode: str, rnd: int, warm: bool) -> dict:
        """Read every weight byte once, READ_THREADS threads x 16 MiB preadv in file order.

        Several requests in flight, because this virtio disk is latency-bound at one (measured here:
        0.5-1.0 GB/s with 1 thread, 1.2-1.5 GB/s with 2-4). Threads doing only preadv release the GIL.
        """
        rec = {"what": "read_weights", "mode": mode, "round": rnd, "warmup": warm, **self.evict(mode)}
        blocks = [(p, off) for p in self.weights for off in range(0, p.stat().st_size, READ_BLOCK)]
        fds = {p: os.open(p, os.O_RDONLY) for p in self.weights}
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
        rec.update(seconds=round(took, 4), bytes=n, gbps=round(n / took / 1e9, 3), threads=READ_THREADS, ok=True)
        return rec

    def loop(self) -> None:
        a = self.args
        width = max(len(t.label) for t in self.targets)
        for rnd in range(-a.warmup, a.runs):
            warm = rnd < 0
            for mode in self.modes:
                for t in self.targets:
                    rec = self.run_server(t, mode, rnd, warm)
                    self.save()
                    print(report.progress_line(rec, rnd, a.runs, width), file=sys.stderr, flush=True)
                if a.floor:
                    for measure in (self.floor_import, self.floor_read):
                        rec = measure(mode, rnd, warm)
                        self.floor.append(rec)
                        self.save()
                        print(report.progress_line(rec, rnd, a.runs, width), file=sys.stderr, flush=True)


def _on_sigterm(signum, frame):  # noqa: ARG001 - treated as Ctrl-C: stop the server, keep results
    raise KeyboardInterrupt


def run_startup_bench(args: argparse.Namespace) -> int:
    """Entry point of `hotstart bench startup`. Exit code 0: every run ok; 1: some failed; 130: interrupted."""
    _check_args(args)
    targets = build_targets(args)
    from hotstart.boot.resolve import resolve_model  # noqa: PLC0415
    from hotstart.model.files import sidecar_files, weight_files  # noqa: PLC0415

    model = resolve_model(args.model)
    weights = weight_files(model.path) + sidecar_files(model.path)
    out = Path(args.out or f"bench-results/startup-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HotstartError(f"--out {out}: {e.strerror}") from None
    bench = Bench(args, targets, model.path, weights, out)
    print(f"hotstart bench startup: {len(targets)} configs x {len(bench.modes)} modes x "
          f"({args.warmup} warm-up + {args.runs}) runs; model {model.path} "
          f"({bench.meta['weights_bytes'] / 1e9:.2f} GB); results in {out}", file=sys.stderr, flush=True)
    # SIGINT explicitly too: a shell starts background jobs with SIGINT ignored, and Ctrl-C/kill -INT
    # must still stop the current server and keep the results.
    old = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, _on_sigterm),
                                               (signal.SIGINT, signal.default_int_handler))}
    from hotstart.forkserver.control import bench_zygote  # noqa: PLC0415

    try:
        with bench_zygote(targets):  # private runtime folders; the zygote variant's zygote, started once
            bench.loop()
    except KeyboardInterrupt:
        bench.interrupted = True
        print("hotstart bench startup: interrupted; keeping the finished runs", file=sys.stderr)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        bench.save()
    data = json.loads((out / "results.json").read_text())
    text = report.write_reports(data, out)
    print(text)
    if bench.interrupted:
        return 130
    return 0 if all(r["ok"] for r in bench.runs if not r["warmup"]) else 1
