"""`hotstart bench serve`: serving throughput and latency of any OpenAI-compatible servers, measured
and defined as `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
--random-input-len N --random-output-len M --ignore-eos --max-concurrency C --num-prompts P` does
(metrics.py has the definitions, dataset.py the prompts, serve_targets.py the servers).

Every level (prompt length N x concurrency C) runs R rounds. Schedule `interleaved` (default): every
target is started once and kept up; round r runs each level on every target back to back (the first
target rotating per round), so a drifting machine hits all alike. `sequential`: one target up at a
time (for checkpoints too big to hold twice), all its rounds, then the next. Within a round every
target gets the same prompts; no two rounds share one (no prefix-cache hits across rounds). A round
waits until other processes are idle (--noise-cores over a 2 s sample; the load average below
--max-load), records the CPU they took meanwhile and is run again (--retries) when that was above
--noise-cores. results.json is rewritten after every run (Ctrl-C keeps what was measured); table.md
has the medians of rounds and the ratios against --baseline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from hotstart.bench import roofline, serve_client, serve_report
from hotstart.bench import servers as sv
from hotstart.bench.dataset import RandomPrompts
from hotstart.bench.metrics import compute
from hotstart.bench.serve_targets import ServeTarget, build_targets, start, stop
from hotstart.bench.streams import CpuNoise, wait_idle, wait_quiet
from hotstart.errors import HotstartError


def _ints(value: str, flag: str) -> list[int]:
    try:
        xs = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise HotstartError(f"{flag} {value!r}: must be comma-separated integers") from None
    if not xs or min(xs) < 1:
        raise HotstartError(f"{flag} {value!r}: give integers >= 1")
    return list(dict.fromkeys(xs))


def _check(args) -> None:
    args.input_len = _ints(args.input_len, "--input-len")
    args.concurrency = _ints(args.concurrency, "--concurrency")
    for flag in ("output_len", "rounds"):
        if getattr(args, flag) < 1:
            raise HotstartError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise HotstartError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    try:
        args.extra_body = json.loads(args.extra_body) if args.extra_body else {}
    except ValueError as e:
        raise HotstartError(f"--extra-body: not JSON ({e})") from None
    if not isinstance(args.extra_body, dict):
        raise HotstartError("--extra-body: must be a JSON object")


class ServeBench:
    """The state of one `bench serve` run: targets, prompts, records, where results go."""

    def __init__(self, args, model: Path, targets: list[ServeTarget], prompts: RandomPrompts, out: Path):
        self.args, self.model, self.targets, self.prompts, self.out = args, model, targets, prompts, out
        self.levels = [(n, c) for n in args.input_len for c in args.concurrency]
        self.eog = sv.eog_ids(str(model))
        key = args.api_key or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else None
        labels = [t.label for t in targets]
        if args.baseline is not None and args.baseline not in labels:
            raise HotstartError(f"--baseline {args.baseline!r}: no such target "
                                f"(targets: {', '.join(labels)})")
        others = [t.label for t in targets if t.kind != "hotstart"]
        self.baseline = args.baseline or (others[0] if others and len(targets) > 1 else labels[0])
        self.runs: list[dict] = []
        self.meta = {"model": str(model), "endpoint": args.endpoint, "input_lens": args.input_len,
                     "concurrency": args.concurrency, "output_len": args.output_len, "rounds": args.rounds,
                     "num_prompts": args.num_prompts, "schedule": args.schedule, "baseline": self.baseline,
                     "temperature": args.temperature, "extra_body": args.extra_body, "seed": args.seed,
                     "cpus": os.cpu_count(), "python": sys.version.split()[0],
                     "load1_start": round(os.getloadavg()[0], 2),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "targets": [], "interrupted": False}

    def num_prompts(self, c: int) -> int:
        return self.args.num_prompts or max(8, 4 * c)

    def save(self) -> None:
        self.meta["targets"] = [
            {"label": t.label, "kind": t.kind, "url": t.url, "model_id": t.model_id,
             "argv": t.spec.argv if t.spec else None, "env": t.spec.env if t.spec else None,
             "weights": t.weights, "bytes_per_step": t.mb and t.mb.weights,
             "kv_bytes_per_token": t.mb and t.mb.kv_per_token, **t.info} for t in self.targets]
        data = {"meta": self.meta, "runs": self.runs}
        data["summary"] = serve_report.summarize(self.runs, [t.label for t in self.targets], self.levels)
        data["ratios"] = serve_report.ratios(data["summary"], self.baseline)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.out / "results.json")

    def _bodies(self, t: ServeTarget, n: int, count: int, key: tuple) -> list[tuple[dict, object]]:
        a = self.args
        force = sv.force_fields(t.kind, a.output_len, self.eog)
        prompts = self.prompts.batch(n, count, key)
        return [(serve_client.request_body(a.endpoint, t.model_id, p.text, a.output_len, force, a.temperature,
                                           a.extra_body), p) for p in prompts]

    async def _run(self, t: ServeTarget, bodies: list, c: int) -> tuple[list, float, dict]:
        import httpx

        limits = httpx.Limits(max_connections=c + 2, max_keepalive_connections=c + 2)
        timeout = httpx.Timeout(self.args.timeout, connect=10)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            await wait_idle(t.pid, self.args.noise_cores, self.args.max_wait)
            noise = CpuNoise(t.pid)
            noise.start()
            traces, duration = await serve_client.run(client, t.url + self.args.endpoint, bodies, c,
                                                      self.args.timeout, self.headers)
            return traces, duration, noise.stop()

    def warm(self, t: ServeTarget) -> None:
        """One request per prompt length (vLLM's initial test request): a target that cannot answer stops
        the benchmark before any figure is taken."""
        for n in self.args.input_len:
            traces, _, _ = asyncio.run(self._run(t, self._bodies(t, n, 1, ("warm-up", n)), 1))
            if not traces[0].ok:
                raise HotstartError(f"{t.label}: the warm-up request failed: {traces[0].error or 'no token'}")

    def measure(self, t: ServeTarget, n: int, c: int, rnd: int) -> dict:
        a = self.args
        count = self.prompts.tok.encode
        for attempt in range(a.retries + 1):
            # a rerun gets prompts of its own: the first try's are in the server's prefix cache now
            bodies = self._bodies(t, n, self.num_prompts(c), ("round", rnd, n, c, attempt))
            traces, duration, cpu = asyncio.run(self._run(t, bodies, c))
            m = compute(traces, duration, lambda s: len(count(s, add_special_tokens=False)))
            frac = roofline.fraction(m["output_throughput"], t.mb, c, n + a.output_len / 2,
                                     (self.meta.get("bandwidth") or {}).get("bandwidth_gbs"))
            requests = [{"ttft": x.ttft, "e2el": x.latency, "output_tokens": x.usage_completion_tokens,
                         "prompt_tokens": x.input_tokens(), "events": len(x.events),
                         "finish_reason": x.finish_reason, "error": x.error} for x in traces]
            rec = {"target": t.label, "input_len": n, "concurrency": c, "round": rnd + 1,
                   "num_prompts": len(bodies), "attempt": attempt + 1, "metrics": m,
                   "roofline_fraction": frac, "load1": round(os.getloadavg()[0], 2), **cpu,
                   "noisy": cpu["other_cores"] > a.noise_cores, "requests": requests}
            rec["again"] = rec["noisy"] and attempt < a.retries
            print(serve_report.progress_line(rec, a.rounds, max(len(x.label) for x in self.targets)),
                  file=sys.stderr, flush=True)
            if not rec["again"]:
                return rec
        return rec

    def round(self, rnd: int, targets: list[ServeTarget]) -> None:
        wait_quiet(self.args.max_load, self.args.max_wait)
        k = rnd % len(targets)
        for n, c in self.levels:
            for t in targets[k:] + targets[:k]:
                rec = self.measure(t, n, c, rnd)
                rec.pop("again", None)
                self.runs.append(rec)
                self.save()

    def bring_up(self, t: ServeTarget) -> None:
        wait_quiet(self.args.max_load, self.args.max_wait)
        print(f"hotstart bench serve: starting {t.label}", file=sys.stderr, flush=True)
        start(t, self.args, str(self.model), self.headers)
        self.warm(t)
        print(f"hotstart bench serve: {t.label} at {t.url} serves {t.weights or '?'} as {t.model_id!r}; "
              f"{t.info}", file=sys.stderr, flush=True)

    def loop(self) -> None:
        if self.args.schedule == "interleaved":
            for t in self.targets:
                self.bring_up(t)
            for rnd in range(self.args.rounds):
                self.round(rnd, self.targets)
        else:
            for t in self.targets:
                self.bring_up(t)
                for rnd in range(self.args.rounds):
                    self.round(rnd, [t])
                t.info["stop"] = stop(t)


def _on_sigterm(signum, frame):  # noqa: ARG001 - treated as Ctrl-C: stop the servers, keep results
    raise KeyboardInterrupt


def run_serve_bench(args) -> int:
    """Entry point of `hotstart bench serve`. Exit code 0: every request ok; 1: some failed; 130:
    interrupted."""
    from hotstart.boot.resolve import resolve_model
    from hotstart.text.tokenizer import Tokenizer

    _check(args)
    model = resolve_model(args.model).path
    prompts = RandomPrompts(Tokenizer.from_dir(args.tokenizer or model), args.seed)
    targets = build_targets(args, str(model))
    out = Path(args.out or f"bench-results/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HotstartError(f"--out {out}: {e.strerror}") from None
    bench = ServeBench(args, model, targets, prompts, out)
    if not args.no_roofline:
        bench.meta["bandwidth"] = roofline.bandwidth(args.bandwidth, args.roofline_device)
    print(f"hotstart bench serve: {len(targets)} targets x {len(bench.levels)} levels x {args.rounds} rounds "
          f"({args.schedule}); results in {out}", file=sys.stderr, flush=True)
    old = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, _on_sigterm),
                                               (signal.SIGINT, signal.default_int_handler))}
    try:
        bench.loop()
    except KeyboardInterrupt:
        bench.meta["interrupted"] = True
        print("hotstart bench serve: interrupted; keeping the finished runs", file=sys.stderr)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in targets:
            if t.srv is not None:
                t.info["stop"] = stop(t)
        bench.meta["load1_end"] = round(os.getloadavg()[0], 2)
        bench.save()
    data = json.loads((out / "results.json").read_text())
    text = "\n".join(serve_report.tables(data))
    (out / "table.md").write_text(text + "\n")
    print(text)
    if bench.meta["interrupted"]:
        return 130
    return 0 if bench.runs and all(r["metrics"]["failed"] == 0 for r in bench.runs) else 1
