"""`hotstart bench startup`: cold/warm A/B startup benchmark against peers and the floor.

For each round, each cold mode and each config (interleaved, so drift in the machine hits every config
alike; each round starts with the next config): evict, check residency with mincore, launch on a free
port, time /health == 200 (t_health) and a
verified greedy chat completion (t_first; hotstart's answer must contain --expect, a peer's
--expect-peers), then the same request again (t_repeat: t_first - t_repeat is the start's own cost),
keep hotstart's /startup timeline, stop the process group and check nothing is left. The floor is
measured in the same rounds: `python -c "import torch"` and a
sequential read of the weight files, after the same eviction. results.json is rewritten after every run,
so Ctrl-C (or a crash) keeps what was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from hotstart.bench import evict as ev
from hotstart.bench import floor, peers, report
from hotstart.bench import targets as tg
from hotstart.bench.process import RunFailed, Server, free_port, tail
from hotstart.bench.targets import Target
from hotstart.errors import HotstartError

VARIANTS = {"no-prefetch": (["--no-prefetch"], {}), "no-prespawn": (["--no-prespawn"], {}),
            "serial": ([], {"HOTSTART_SERIAL": "1"}),
            "zygote": (["--zygote", "auto"], {})}  # with one zygote started before the runs (bench_zygote)


def _hotstart_target(spec: str, model: str | None, extra: list[str]) -> Target:
    name, _, rest = spec.partition(":")
    if name != "hotstart":
        raise HotstartError(
            f"--config {spec!r}: must be hotstart[:VARIANT[+VARIANT]] (use --peer for other servers)"
        )
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


def build_targets(args: argparse.Namespace) -> list[Target]:
    extra = shlex.split(args.hotstart_args or "")
    targets: list[Target] = []
    for kind, value, name in args.targets or [("hotstart", "hotstart", None)]:
        if kind == "hotstart":
            targets.append(_hotstart_target(value, args.model, extra))
        else:
            targets += tg.peer_targets(kind, value, name)
    return tg.finish(targets, args)


def _check_args(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise HotstartError(f"--runs must be >= 1, got {args.runs}")
    if args.warmup < 0:
        raise HotstartError(f"--warmup must be >= 0, got {args.warmup}")
    if args.max_tokens < 1:
        raise HotstartError(f"--max-tokens must be >= 1, got {args.max_tokens}")


class Bench:
    """The state of one benchmark: where results go and what each mode evicts."""

    def __init__(self, args, targets: list[Target], model_path: Path, weights: list[Path], out: Path):
        self.args, self.targets, self.model_path, self.weights, self.out = (
            args,
            targets,
            model_path,
            weights,
            out,
        )
        self.modes = list(dict.fromkeys(args.cold or ["all"]))
        self.timeout, _ = peers.parse_timeouts(args.timeout)
        self.gguf = peers.default_gguf() if any(peers.needs_gguf(t.argv) for t in targets) else None
        own = {os.path.realpath(p) for p in weights}
        model_files = {t.label: [str(p) for p in peers.model_files(t.command(0, str(model_path), self.gguf))
                                 if os.path.realpath(p) not in own] for t in targets if t.kind == "peer"}
        hotstart_src = str(Path(__file__).resolve().parents[1])
        programs: dict = {}
        if "all" in self.modes:
            for t in targets:
                if t.kind == "hotstart":
                    programs[t.label] = (t.python, [hotstart_src], [])
                else:
                    programs[t.label] = (t.python, [], peers.program_files(list(t.argv), t.env))
            if args.floor:
                programs["floor: import torch"] = (sys.executable, [], [])
        vllm = next((t for t in targets if t.vllm), None)
        keep = [str(peers.vllm_cache_root(vllm.env))] if vllm else []
        self.cold = ev.build_cold_sets(
            weights, programs, [Path(p) for fs in model_files.values() for p in fs], keep
        )
        self.base_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.runs: list[dict] = []
        self.floor: list[dict] = []
        configs = [{**t.meta(), "model_files": model_files.get(t.label, []),
                    "evicted_in_cold_all": self.cold.per_config.get(t.label)} for t in targets]
        self.meta = {
            "model": str(model_path),
            "weights_bytes": sum(p.stat().st_size for p in weights),
            "gguf": self.gguf,
            "modes": self.modes,
            "configs": configs,
            "runs": args.runs,
            "warmup": args.warmup,
            "timeout": self.timeout,
            "expect": args.expect,
            "expect_peers": args.expect_peers,
            "prompt": args.prompt,
            "max_tokens": args.max_tokens,
            "env_files": len(self.cold.env.paths),
            "env_bytes": self.cold.env.nbytes,
            "env_dirs": self.cold.env_dirs,
            "weights": self.cold.weights.paths,
            "peer_weights": self.cold.peer_weights.paths,
            "never_evicted": self.cold.kept,
            "notes": self.cold.notes,
            "vllm_compile_cache": peers.vllm_compile_cache(vllm.env) if vllm else None,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {
                "cpus": os.cpu_count(),
                "python": sys.version.split()[0],
                "load1": os.getloadavg()[0],
            },
        }
        self.interrupted = False

    def evict(self, mode: str) -> dict:
        sets = self.cold.for_mode(mode)
        took = ev.evict_sets(sets)
        shown = sets or [self.cold.weights]
        if "all" in self.modes and self.cold.env not in shown:  # proof the environment is warm here
            shown = [*shown, self.cold.env]
        res = {s.name: round(ev.residency(s), 3) for s in shown}
        out = {"evict_s": round(took, 3), "residency": res}
        if sets and res["weights"] > 5.0:  # DONTNEED cannot drop pages another process maps: say who
            holders = ev.mapped_by(self.cold.weights.paths)
            out["warning"] = (
                f"weights {res['weights']:.0f}% resident after eviction; mapped by {holders or '?'}"
            )
            print(f"hotstart bench startup: WARNING: {out['warning']}", file=sys.stderr, flush=True)
        return out

    def save(self) -> None:
        data = {
            "meta": {**self.meta, "interrupted": self.interrupted},
            "runs": self.runs,
            "floor": self.floor,
        }
        data["answers"] = report.answers(data)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.out / "results.json")

    def run_server(self, t: Target, mode: str, rnd: int, warm: bool) -> dict:
        rec = {"config": t.label, "mode": mode, "round": rnd, "warmup": warm, "ok": False}
        with contextlib.ExitStack() as stack:
            env = {**self.base_env, **t.env}
            if t.first_start:  # an empty vLLM cache root, removed after the server has stopped
                env.update(stack.enter_context(peers.vllm_first_start()))
                rec["vllm_cache_root"] = env["VLLM_CACHE_ROOT"]
            rec.update(self.evict(mode))
            before = peers.vllm_compile_cache(env)["files"] if t.vllm and not t.first_start else None
            try:
                self._run(t, rec, env, rnd, warm)
            finally:
                if before is not None:  # files added: it compiled (no entry for this model path / config)
                    rec["vllm_cache_added"] = peers.vllm_compile_cache(env)["files"] - before
        return rec

    def _run(self, t: Target, rec: dict, env: dict, rnd: int, warm: bool) -> None:
        port = free_port()
        argv = t.command(port, str(self.model_path), self.gguf)
        tag = f"{'w' if warm else 'r'}{rnd}-{rec['mode']}-" + "".join(c if c.isalnum() or c in "-." else "_"
                                                                       for c in t.label)
        server = None
        try:
            server = Server.launch(argv, port, env, self.out / "logs", tag)
            rec["wall_launch"] = server.wall_launch
            deadline = server.t_launch + t.timeout
            rec["t_health"] = round(server.wait_healthy(deadline), 4)
            rec["health_path"] = server.health_path
            answer, t_first = server.ask(self.args.prompt, self.args.max_tokens, t.expect, deadline)
            rec.update(t_first=round(t_first, 4), answer=answer, ok=True)
            # The same request again, now warm: its duration is the request's own compute, so
            # t_first - t_repeat is what the start cost beyond serving one request.
            t_ask = time.perf_counter()
            try:
                server.ask(self.args.prompt, self.args.max_tokens, None, t_ask + t.timeout)
                rec["t_repeat"] = round(time.perf_counter() - t_ask, 4)
                rec["start_cost"] = round(rec["t_first"] - rec["t_repeat"], 4)
            except RunFailed as e:
                rec["repeat_error"] = str(e)
            if t.kind == "hotstart":
                rec["timeline"] = server.get_json("/startup")
        except RunFailed as e:
            rec["error"] = str(e)
            if e.answer is not None:
                rec["answer"] = e.answer
        except KeyboardInterrupt:
            rec.update(ok=False, error="interrupted", interrupted=True)
            raise
        finally:
            if server is not None:
                rec["stop"] = server.stop()
                if not rec["ok"]:
                    rec["stderr_tail"] = tail(server.stderr_path)
            self.runs.append(rec)  # also an interrupted run: its process group is on record

    def measure_floor(self, what: str, mode: str, rnd: int, warm: bool) -> dict:
        rec = {"what": what, "mode": mode, "round": rnd, "warmup": warm, **self.evict(mode)}
        if what == "import_torch":
            rec.update(floor.import_torch(self.timeout))
        elif what == "read_weights":
            rec.update(floor.read_weights(self.weights))
        else:
            rec.update(floor.import_alone(what, self.timeout))
        return rec

    def loop(self) -> None:
        a = self.args
        width = max(len(t.label) for t in self.targets)
        last = None
        for rnd in range(-a.warmup, a.runs):
            warm = rnd < 0
            for mode in self.modes:
                if last == "all" and mode != "all":  # the env is half evicted: bring it back for every config
                    took = ev.warm_sets([self.cold.env])
                    self.meta.setdefault("env_rewarm_s", []).append(round(took, 2))
                    print(
                        f"hotstart bench startup: environment read back into the page cache in {took:.1f} s "
                        f"(after the cold-all runs, before {mode})",
                        file=sys.stderr,
                        flush=True,
                    )
                last = mode
                # Each round starts with another config: a slot's own effects (the first run after the
                # re-warm measured ~0.2 s slower) are shared out instead of charged to one config.
                k = (rnd + a.warmup) % len(self.targets)
                for t in self.targets[k:] + self.targets[:k]:
                    if t.first_start and (rnd != 0 or mode != self.modes[0]):
                        continue  # once: round 1 of the first mode
                    rec = self.run_server(t, mode, rnd, warm)
                    self.save()
                    print(report.progress_line(rec, rnd, a.runs, width), file=sys.stderr, flush=True)
                if a.floor:
                    # the read last: it leaves the weights resident for the next mode's warm runs
                    for what in ("import_torch", *floor.IMPORTS_ALONE, "read_weights"):
                        rec = self.measure_floor(what, mode, rnd, warm)
                        self.floor.append(rec)
                        self.save()
                        print(report.progress_line(rec, rnd, a.runs, width), file=sys.stderr, flush=True)


def _on_sigterm(signum, frame):  # noqa: ARG001 - treated as Ctrl-C: stop the server, keep results
    raise KeyboardInterrupt


def run_startup_bench(args: argparse.Namespace) -> int:
    """Entry point of `hotstart bench startup`. Exit code 0: every run ok; 1: some failed; 130:
    interrupted."""
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
    if bench.meta["vllm_compile_cache"]:
        print(f"hotstart bench startup: {report.vllm_cache_line(bench.meta)}", file=sys.stderr, flush=True)
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
        vllm = next((t for t in targets if t.vllm), None)
        bench.meta["vllm_compile_cache_after"] = peers.vllm_compile_cache(vllm.env) if vllm else None
        bench.save()
    data = json.loads((out / "results.json").read_text())
    text = report.write_reports(data, out)
    print(text)
    if bench.interrupted:
        return 130
    return 0 if all(r["ok"] for r in bench.runs if not r["warmup"]) else 1
