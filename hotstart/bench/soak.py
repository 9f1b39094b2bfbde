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
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotstart.bench import servers as sv
from hotstart.bench import soak_report as sr
from hotstart.bench.load import PROMPTS, aborted_request, served, stream_problem
from hotstart.bench.procgroup import processes
from hotstart.bench.prometheus import metric_values
from hotstart.bench.streams import stream_request
from hotstart.errors import HotstartError
from hotstart.procs import alive

KINDS = ("chat", "chat_stream", "text", "text_stream", "n", "json_schema", "tools", "hangup", "bad")
COLORS = ["red", "green", "blue"]
COLOR_SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": COLORS}},
    "required": ["color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
STRUCTURED_TOKENS = 64  # room for a whole JSON answer / tool call (a cut one is only checked for shape)
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
BACKOFF_S = 0.25  # a client's pause after a 503 or no answer (an engine being replaced)
FAULT_MARGIN_S = 5.0  # no fault this close to the end of the run (its recovery must be seen)


@dataclass
class Req:
    """One request to send: KIND (KINDS), VARIANT (the bad request's name), its path and body (or raw
    bytes), streamed or not."""

    kind: str
    model: str
    path: str
    body: dict | None = None
    raw: bytes | None = None
    variant: str = ""
    stream: bool = False
    extra: dict = field(default_factory=dict)


def parse_mix(spec: str) -> dict[str, int]:
    """'chat=2,bad=1' -> weights of the named kinds (the others 0); one-line errors."""
    mix: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, sep, w = part.partition("=")
        if kind not in KINDS:
            raise HotstartError(f"--mix: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
        try:
            mix[kind] = int(w) if sep else 1
        except ValueError:
            raise HotstartError(f"--mix: {part!r}: the weight must be an integer") from None
        if mix[kind] < 0:
            raise HotstartError(f"--mix: {part!r}: the weight must be >= 0")
    if not any(mix.values()):
        raise HotstartError("--mix: no kind with a weight above 0")
    return mix


class Deck:
    """Kinds in shuffled decks of WEIGHTS (every kind of weight > 0 once per deck at least), shared by
    all clients so that a short run still sends each kind."""

    def __init__(self, weights: dict[str, int], rng: random.Random):
        self.weights, self.rng, self.cards = weights, rng, []

    def draw(self) -> str:
        if not self.cards:
            self.cards = [k for k, w in self.weights.items() for _ in range(w)]
            self.rng.shuffle(self.cards)
        return self.cards.pop()


def _chat(model: str, prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        **extra,
    }


def bad_requests(model: str) -> list[Req]:
    """Requests that must get a 4xx: malformed JSON, an unknown model, parameters out of range, a schema
    with a typo, a tool_choice naming no tool."""
    hi = [{"role": "user", "content": "hi"}]
    raw = json.dumps({"model": model, "messages": hi}).encode()[:-12]  # cut mid-object
    bad = {
        "unknown_model": _chat("no-such-model-soak", "hi", 8),
        "temperature_negative": _chat(model, "hi", 8, temperature=-1),
        "max_tokens_zero": {"model": model, "prompt": "hi", "max_tokens": 0},
        "n_zero": _chat(model, "hi", 8, n=0),
        "schema_typo": _chat(
            model,
            "hi",
            8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            },
        ),
        "tool_choice_unknown": _chat(
            model,
            "hi",
            8,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}},
        ),
    }
    out = [Req("bad", model, CHAT, raw=raw, variant="malformed_json")]
    out += [
        Req("bad", model, TEXT if "prompt" in b else CHAT, body=b, variant=name) for name, b in bad.items()
    ]
    return out


BAD_VARIANTS = tuple(r.variant for r in bad_requests("m"))


def make_request(
    kind: str, model: str, rng: random.Random, min_tokens: int, max_tokens: int, bad_index: int = 0
) -> Req:
    """The request of KIND to MODEL (prompt, lengths and temperature drawn from RNG)."""
    prompt, n_tok = rng.choice(PROMPTS), rng.randint(min_tokens, max_tokens)
    temp = {"temperature": rng.choice([0.0, 0.7])}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        return Req(kind, model, CHAT, _chat(model, prompt, n_tok, **temp))
    if kind == "text":
        return Req(kind, model, TEXT, {"model": model, "prompt": prompt, "max_tokens": n_tok, **temp})
    if kind in ("chat_stream", "hangup"):
        return Req(
            kind,
            model,
            CHAT,
            _chat(model, prompt, n_tok, **temp, **usage),
            stream=True,
            extra={"after": rng.randint(1, 4)} if kind == "hangup" else {},
        )
    if kind == "text_stream":
        return Req(
            kind,
            model,
            TEXT,
            {"model": model, "prompt": prompt, "max_tokens": n_tok, **temp, **usage},
            stream=True,
        )
    if kind == "n":
        return Req(kind, model, CHAT, _chat(model, prompt, n_tok, n=2, temperature=0.7), extra={"n": 2})
    if kind == "json_schema":
        return Req(
            kind,
            model,
            CHAT,
            _chat(
                model,
                f"Pick a colour: {', '.join(COLORS)}.",
                STRUCTURED_TOKENS,
                **temp,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "colour", "schema": COLOR_SCHEMA, "strict": True},
                },
            ),
        )
    if kind == "tools":
        return Req(
            kind,
            model,
            CHAT,
            _chat(
                model,
                "What is the weather in Paris?",
                STRUCTURED_TOKENS,
                **temp,
                tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            ),
        )
    if kind == "bad":
        reqs = bad_requests(model)
        return reqs[bad_index % len(reqs)]
    raise ValueError(kind)


def answer_problem(req: Req, status: int, body) -> str | None:
    """What is wrong with a non-streamed answer to a good request (None: nothing). Cut answers
    (finish_reason length) are checked for shape only; whole ones for content."""
    if status != 200:
        return f"HTTP {status}: {json.dumps(body)[:300] if not isinstance(body, str) else body[:300]}"
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        return f"no choices: {str(body)[:300]}"
    choices = body["choices"]
    want = req.extra.get("n", 1)
    if sorted(c.get("index") for c in choices) != list(range(want)):
        return f"expected {want} choices indexed 0..{want - 1}, got {[c.get('index') for c in choices]}"
    if not isinstance(body.get("usage"), dict) or not body["usage"].get("completion_tokens"):
        return f"no usage: {body.get('usage')}"
    for c in choices:
        finish = c.get("finish_reason")
        if finish not in ("stop", "length", "tool_calls"):
            return f"finish_reason {finish!r}"
        if req.path == TEXT:
            if not isinstance(c.get("text"), str):
                return f"no text: {str(c)[:200]}"
            continue
        msg = c.get("message") or {}
        if req.kind == "tools":
            problem = _tool_problem(msg, finish)
            if problem:
                return problem
        elif not isinstance(msg.get("content"), str):
            return f"no message content: {str(msg)[:200]}"
        elif req.kind == "json_schema" and finish == "stop":
            try:
                got = json.loads(msg["content"])
            except ValueError:
                return f"not JSON under response_format json_schema: {msg['content'][:200]!r}"
            if not isinstance(got, dict) or got.get("color") not in COLORS or set(got) != {"color"}:
                return f"JSON not of the schema: {msg['content'][:200]!r}"
    return None


def _tool_problem(msg: dict, finish: str) -> str | None:
    if finish == "length":
        return None  # cut inside the forced call: nothing whole to check
    calls = msg.get("tool_calls") or []
    if finish != "tool_calls" or not calls:
        return f"forced tool_choice answered without a call (finish_reason {finish!r}): {str(msg)[:200]}"
    fn = calls[0].get("function") or {}
    if fn.get("name") != "get_weather":
        return f"called {fn.get('name')!r}, not the forced get_weather"
    try:
        args = json.loads(fn.get("arguments") or "")
    except ValueError:
        return f"arguments not JSON: {fn.get('arguments')!r:.200}"
    return (
        None if isinstance(args, dict) and isinstance(args.get("city"), str) else f"arguments {args!r:.200}"
    )


def bad_problem(status: int, body) -> str | None:
    """A bad request must get a 4xx with OpenAI's error object."""
    if not 400 <= status < 500:
        return f"HTTP {status} (expected 4xx): {str(body)[:200]}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return f"HTTP {status} without OpenAI's error object: {str(body)[:200]}"
    return None


def classify(kind: str, status: int | None, error: str | None) -> str:
    """The outcome (soak_report.OUTCOMES) of a request of KIND that got STATUS (None: no answer) and
    ERROR (None: the answer was right)."""
    if error is not None and error.startswith("timeout after"):
        return "hung"
    if status is not None and status >= 500:
        return "5xx"
    if kind == "bad":
        if error is None:
            return "ok"
        return "not_4xx" if status is not None and status < 400 else "failed"
    if error is None:
        return "hangup" if kind == "hangup" else "ok"
    return "failed"


async def send(client, url: str, req: Req, timeout: float) -> dict:
    """Send REQ; {status, ttft, error} (the checks above applied)."""
    import httpx

    if req.stream and req.kind == "hangup":
        rec = await aborted_request(client, url + req.path, req.body, req.extra["after"], timeout)
        return {
            "status": _status(rec["error"]) or (None if rec["error"] else 200),
            "ttft": None,
            "error": rec["error"],
        }
    if req.stream:
        rec = await stream_request(client, url + req.path, req.body, timeout, chat=req.path == CHAT)
        error = rec["error"] or stream_problem(rec)
        return {
            "status": _status(rec["error"]) or (200 if rec["done"] or rec["chunks"] else None),
            "ttft": rec["ttft"],
            "error": error,
        }
    status, body = None, None
    try:
        async with asyncio.timeout(timeout):
            if req.raw is not None:
                r = await client.post(
                    url + req.path, content=req.raw, headers={"content-type": "application/json"}
                )
            else:
                r = await client.post(url + req.path, json=req.body)
            status = r.status_code
            try:
                body = r.json()
            except ValueError:
                body = r.text
    except TimeoutError:
        return {"status": None, "ttft": None, "error": f"timeout after {timeout:.0f} s"}
    except httpx.HTTPError as e:
        return {"status": None, "ttft": None, "error": f"{type(e).__name__}: {e}"}
    error = bad_problem(status, body) if req.kind == "bad" else answer_problem(req, status, body)
    return {"status": status, "ttft": None, "error": error}


def _status(error: str | None) -> int | None:
    m = re.match(r"HTTP (\d{3})", error or "")
    return int(m.group(1)) if m else None


# ---- the server's processes ------------------------------------------------------------------------


def server_processes(pid: int | None, extra: list[int]) -> dict[int, tuple[object, str]]:
    """pid -> (psutil.Process, role) for the server tree (api, forkserver, engine, engine child) and the
    trees of EXTRA pids (a zygote: zygote, engine, engine child)."""
    import psutil

    out: dict[int, tuple[object, str]] = {}
    for root_pid, root_role in ([(pid, "api")] if pid else []) + [(p, "zygote") for p in extra]:
        try:
            procs = processes(root_pid)
        except psutil.NoSuchProcess:
            continue
        roles = {root_pid: root_role}
        for p in procs[1:]:  # each after its parent: its role is known
            try:
                if not alive(p.pid):  # a killed engine not reaped yet: gone
                    continue
                cmd, parent = " ".join(p.cmdline()), p.ppid()
            except psutil.Error:
                continue
            up = roles.get(parent)
            if "hotstart.forkserver" in cmd and up == "api":
                roles[p.pid] = "forkserver"
            elif up in ("forkserver", "zygote") or "hotstart.engine.worker" in cmd:
                roles[p.pid] = "engine"
            else:
                roles[p.pid] = "engine child" if up in ("engine", "engine child") else "child"
        out.update({p.pid: (p, roles[p.pid]) for p in procs if p.pid in roles})
    return out


def snapshot(pid: int | None, extra: list[int]) -> dict[int, dict]:
    """pid -> {role, rss_mb, fds} of every process of the server (those that vanish meanwhile skipped)."""
    import psutil

    out = {}
    for p_pid, (p, role) in server_processes(pid, extra).items():
        try:
            with p.oneshot():
                out[p_pid] = {
                    "role": role,
                    "rss_mb": round(p.memory_info().rss / 2**20, 1),
                    "fds": p.num_fds(),
                }
        except psutil.Error:
            pass
    return out


async def read_metrics(client, url: str) -> str:
    import httpx

    try:
        r = await client.get(url + "/metrics", timeout=10)
        return r.text if r.status_code == 200 else ""
    except httpx.HTTPError:
        return ""


# ---- the run ---------------------------------------------------------------------------------------


class Soak:
    """One soak: clients, sampler and fault injector sharing the records (one asyncio loop)."""

    def __init__(self, args, url: str, pid: int | None):
        self.args, self.url, self.pid = args, url, pid
        self.extra = list(args.extra_pid or [])
        self.rng = random.Random(args.seed)
        self.records: list[dict] = []
        self.samples: list[dict] = []
        self.faults: list[dict] = []
        self.stopped: set[int] = set()  # pids SIGSTOPped here and not yet resumed
        self.bad_counter = itertools.count()
        self.t0 = time.monotonic()

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

    async def injector(self) -> None:
        """Every --fault-every seconds: kill or freeze one engine (a freeze lasts until the engine is gone
        or --freeze-for seconds passed, then it is resumed). None later than FAULT_MARGIN_S (plus the
        freeze) before the clients stop: its recovery must be seen."""
        for i in itertools.count():
            kind = self.args.fault if self.args.fault != "both" else ("kill", "freeze")[i % 2]
            at = (i + 1) * self.args.fault_every
            if at > self.args.duration - FAULT_MARGIN_S - (self.args.freeze_for if kind == "freeze" else 0):
                return
            await asyncio.sleep(max(0.0, at - self.now()))
            engines = [
                p for p, (_, role) in server_processes(self.pid, self.extra).items() if role == "engine"
            ]
            fault = {"t": round(self.now(), 3), "kind": kind, "pid": None, "target": "engine", "note": ""}
            if not engines:
                self.faults.append({**fault, "note": "no engine process found"})
                continue
            target = self.rng.choice(sorted(engines))
            fault["pid"] = target
            try:
                os.kill(target, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            except ProcessLookupError:
                self.faults.append({**fault, "note": "gone before the signal"})
                continue
            self.faults.append(fault)
            if kind == "freeze":
                self.stopped.add(target)
                t_end = time.monotonic() + self.args.freeze_for
                while time.monotonic() < t_end and alive(target):
                    await asyncio.sleep(0.1)
                fault["note"] = (
                    f"resumed (SIGCONT) after {self.args.freeze_for:g} s"
                    if self.resume(target)
                    else f"gone after {self.now() - fault['t']:.1f} s (killed by the watchdog)"
                )

    def resume(self, pid: int) -> bool:
        """SIGCONT PID if it is still there (True then); forget it either way."""
        self.stopped.discard(pid)
        if not alive(pid):
            return False
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return True

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
                    client, self.url, Req("chat", m, CHAT, _chat(m, "Hi", 4)), args.request_timeout
                )
                if warm["error"]:
                    raise HotstartError(f"bench soak: the warm-up request to {m} failed: {warm['error']}")
            fast_path_wait = await self.wait_fast_path(client, models)
            deck = Deck(parse_mix(args.mix), self.rng)
            self.t0 = time.monotonic()
            deadline = self.t0 + args.duration
            background = [asyncio.create_task(self.sampler(client))]
            if args.fault_every:
                background.append(asyncio.create_task(self.injector()))
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
                left = sorted(p for p in list(self.stopped) if self.resume(p))
            end = self.now()
            await self.settle(client)
            await self.sample(client)
        faults = sr.recovery(self.faults, self.records, args.fault_grace, end)
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
