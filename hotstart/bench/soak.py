"""`hotstart bench soak`: a mixed workload for a long time, with optional faults, against one server.

    hotstart bench soak --spawn [--model [NAME=]DIR ...] [--duration 600] [--clients 12] [--out soak.json]
    hotstart bench soak --url http://127.0.0.1:8000 [--fault-every 60 --fault kill|freeze|both]

--clients loops draw request kinds from one shared shuffled deck (--mix weights, so every kind comes
within the first deck) and a model among /v1/models' (those not `failed`, or --models): plain and
streamed chat and text completions, n = 2, response_format json_schema, forced tool calls, streams the
client hangs up on after a few tokens, and bad requests that must get a 4xx in OpenAI's error format
(malformed JSON, an unknown model, out-of-range parameters, a bad schema, a tool_choice naming no tool).
Every request is bounded by --request-timeout: one that reaches it "hung".

Meanwhile, every --sample-every seconds: RSS and open descriptors of every process of the server tree
(the API process, the forkserver, the engines and their children; --extra-pid adds a zygote's tree)
and the KV cache usage of each model from /metrics. With --fault-every, an engine (one of them at
random) is SIGKILLed (--fault kill) or SIGSTOPped (freeze; both: alternately); a frozen engine is left
to the server's watchdog for --freeze-for seconds, then resumed if it is still there (SIGCONT; every
process stopped here is resumed at the end whatever happens). soak_report.py turns the records into the
report: errors by kind outside / during fault windows, TTFT and total latency percentiles per --window,
each process's RSS and descriptors after its first window against the end (after the clients stopped
and the server settled), each fault's recovery time. Exit status 1 when a goal fails (soak_report.goals).

Here: the run (clients, sampler, settling) and the entry point. soak_workload.py makes the requests,
soak_client.py sends them, soak_checks.py judges the answers, soak_procs.py reads the server's processes,
soak_faults.py injects the faults.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from pathlib import Path

from hotstart.bench import servers as sv
from hotstart.bench import soak_report as sr
from hotstart.bench.load import served
from hotstart.bench.prometheus import metric_values
from hotstart.bench.soak_checks import classify
from hotstart.bench.soak_client import read_metrics, send
from hotstart.bench.soak_faults import Injector
from hotstart.bench.soak_procs import snapshot
from hotstart.bench.soak_workload import CHAT, Deck, Req, chat_body, make_request, parse_mix
from hotstart.errors import HotstartError
from hotstart.procs import alive

BACKOFF_S = 0.25  # a client's pause after a 503 or no answer (an engine being replaced)


class Soak:
    """One soak: clients, sampler and fault injector sharing the records (one asyncio loop)."""

    def __init__(self, args, url: str, pid: int | None):
        self.args, self.url, self.pid = args, url, pid
        self.extra = list(args.extra_pid or [])
        self.rng = random.Random(args.seed)
        self.records: list[dict] = []
        self.samples: list[dict] = []
        self.bad_counter = itertools.count()
        self.t0 = time.monotonic()
        self.injector = Injector(args, pid, self.extra, self.rng, self.now)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def models(self, client) -> list[str]:
        r = await client.get(self.url + "/v1/models", timeout=30)
        if r.status_code != 200:
            raise HotstartError(f"bench soak: GET /v1/models answered {r.status_code}: {r.text[:200]}")
        cards = r.json()["data"]
        ids = [c["id"] for c in cards if c.get("state") != "failed"]
        if self.args.models:
            wanted = [m.strip() for m in self.args.models.split(",") if m.strip()]
            unknown = sorted(set(wanted) - {c["id"] for c in cards})
            if unknown:
                raise HotstartError(
                    f"--models: not served: {', '.join(unknown)} (served: "
                    f"{', '.join(c['id'] for c in cards)})"
                )
            ids = wanted
        if not ids:
            raise HotstartError("bench soak: the server serves no model that has not failed")
        return ids

    async def wait_fast_path(self, client, models: list[str]) -> float:
        """Until the fast path of every model is built (/startup: packing and compile final), at most
        --fast-path-timeout seconds: it packs a copy of the weights behind READY, RSS growth that the
        first window must not be left to hold. A server that reports none within 5 s is not waited for.
        Returns the seconds waited."""
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < self.args.fast_path_timeout:
            try:
                r = await client.get(self.url + "/startup", timeout=10)
                body = r.json() if r.status_code == 200 else {}
            except (httpx.HTTPError, ValueError):
                body = {}
            entries = (
                [body] if "fast_path" in body else [(body.get("models") or {}).get(m) or {} for m in models]
            )
            if not any("fast_path" in e for e in entries) and time.monotonic() - t0 > 5:
                break
            if all(sv.fast_path_built(e.get("fast_path")) for e in entries):
                break
            await asyncio.sleep(1.0)
        return round(time.monotonic() - t0, 1)

    async def client_loop(self, idx: int, client, models: list[str], deck: Deck, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + idx + 1)
        while time.monotonic() < deadline:
            kind = deck.draw()
            req = make_request(
                kind,
                rng.choice(models),
                rng,
                self.args.min_tokens,
                self.args.max_tokens,
                next(self.bad_counter) if kind == "bad" else 0,
            )
            t0 = self.now()
            got = await send(client, self.url, req, self.args.request_timeout)
            t1 = self.now()
            if got["status"] == 503 or got["status"] is None:
                await asyncio.sleep(BACKOFF_S)  # as a client honouring Retry-After would: no busy loop
            self.records.append(
                {
                    "kind": kind,
                    "variant": req.variant,
                    "model": req.model,
                    "t0": round(t0, 4),
                    "t1": round(t1, 4),
                    "ttft": got["ttft"],
                    "status": got["status"],
                    "outcome": classify(kind, got["status"], got["error"]),
                    "error": got["error"],
                    "client": idx,
                }
            )

    async def sample(self, client) -> None:
        procs = snapshot(self.pid, self.extra)  # a few /proc reads: milliseconds, on the loop
        kv = metric_values(await read_metrics(client, self.url), "hotstart_kv_cache_usage_ratio")
        if len(kv) > 1:  # a many-models server: its own unlabelled gauge stands for no engine
            kv.pop("", None)
        self.samples.append({"t": round(self.now(), 3), "procs": procs, "kv": kv})

    async def sampler(self, client) -> None:
        while True:
            await self.sample(client)
            await asyncio.sleep(self.args.sample_every)

    async def settle(self, client) -> None:
        """Until no request runs or waits (or --settle-timeout): the end sample is taken idle."""
        t_end = time.monotonic() + self.args.settle_timeout
        while time.monotonic() < t_end:
            text = await read_metrics(client, self.url)
            busy = [
                v
                for name in ("hotstart_num_requests_running", "hotstart_num_requests_waiting")
                for v in metric_values(text, name).values()
            ]
            if text and not any(busy):
                return
            await asyncio.sleep(0.5)

    async def run(self) -> dict:
        import httpx

        args = self.args
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
        timeout = httpx.Timeout(args.request_timeout, connect=10)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
            models = await self.models(client)
            for m in models:  # loads every model of a many-models server before the clock starts
                warm = await send(
                    client, self.url, Req("chat", m, CHAT, chat_body(m, "Hi", 4)), args.request_timeout
                )
                if warm["error"]:
                    raise HotstartError(f"bench soak: the warm-up request to {m} failed: {warm['error']}")
            fast_path_wait = await self.wait_fast_path(client, models)
            deck = Deck(parse_mix(args.mix), self.rng)
            self.t0 = time.monotonic()
            deadline = self.t0 + args.duration
            background = [asyncio.create_task(self.sampler(client))]
            if args.fault_every:
                background.append(asyncio.create_task(self.injector.run()))
            clients = [
                asyncio.create_task(self.client_loop(i, client, models, deck, deadline))
                for i in range(args.clients)
            ]
            try:
                # each request ends within --request-timeout; the margin covers a last request's bookkeeping
                done, pending = await asyncio.wait(clients, timeout=args.duration + args.request_timeout + 10)
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()
            finally:
                for t in [*background, *clients]:
                    t.cancel()
                await asyncio.gather(*background, *clients, return_exceptions=True)
                left = self.injector.resume_all()
            end = self.now()
            await self.settle(client)
            await self.sample(client)
        faults = sr.recovery(self.injector.faults, self.records, args.fault_grace, end)
        return {
            "url": self.url,
            "server_pid": self.pid,
            "models": models,
            "clients": args.clients,
            "duration": args.duration,
            "window": args.window,
            "wall_s": round(end, 2),
            "mix": parse_mix(args.mix),
            "fast_path_wait_s": fast_path_wait,
            "stuck_clients": len(pending),
            "left_stopped": left,
            "server_alive": self.pid is None or alive(self.pid),
            "totals": sr.totals(self.records, faults),
            "faults": faults,
            "windows": sr.windows(self.records, self.samples, faults, args.window, args.duration),
            "processes": sr.growth(self.samples, args.window),
            "records": self.records,
            "samples": self.samples,
        }


def _check(args) -> None:
    for flag in ("clients", "min_tokens", "max_tokens"):
        if getattr(args, flag) < 1:
            raise HotstartError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("duration", "window", "sample_every", "request_timeout"):
        if not getattr(args, flag) > 0:
            raise HotstartError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.min_tokens > args.max_tokens:
        raise HotstartError(f"--min-tokens {args.min_tokens} > --max-tokens {args.max_tokens}")
    if args.fault_every is not None and args.fault_every <= 0:
        raise HotstartError(f"--fault-every must be > 0, got {args.fault_every}")
    if args.small_kv is not None and not args.spawn:
        raise HotstartError("--small-kv needs --spawn (for --url, start the server with --kv-cache-memory)")
    parse_mix(args.mix)


def run_soak_bench(args) -> int:
    """Entry point of `hotstart bench soak`. Exit code 0: every goal met, 1: not (the reasons printed)."""
    _check(args)
    extra = ["--kv-cache-memory", str(int(args.small_kv * 2**20))] if args.small_kv else []
    with served(args, args.model, extra) as (url, pid):
        res = asyncio.run(Soak(args, url, pid).run())
    res["rss_growth_limit_pct"], res["fd_slack"] = args.rss_growth, args.fd_slack
    res["args"] = {k: v for k, v in vars(args).items() if v is None or isinstance(v, (str, int, float, list))}
    why = sr.goals(res, args.rss_growth, args.fd_slack)
    if res["stuck_clients"]:
        why.append(f"{res['stuck_clients']} clients did not finish")
    res["ok"], res["failures"] = not why, why
    print(sr.table(res))
    for outcome, lines in res["totals"]["error_samples"].items():
        print(*(f"  {outcome}: {line}" for line in lines), sep="\n")
    print("PASS" if not why else "FAIL: " + "; ".join(why))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0 if not why else 1
