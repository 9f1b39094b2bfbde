"""`hotstart bench prefix-cache`: TTFT of a chat's second turn with and without automatic prefix caching.

    hotstart bench prefix-cache [--model DIR] [--repeats 5] [--dtype auto] [--out prefix_cache.json]

Starts two real servers one after the other (never together): `hotstart serve` (prefix caching on, the
default) and `hotstart serve --no-enable-prefix-caching`. Against each, R conversations, each unique
from its first token (a session number opens the system prompt, so nothing is shared between
conversations or with the warm-up): turn 1 = system + a long user message, answered greedily
(max_tokens 32); turn 2 = turn 1 + that answer + a short question, streamed (max_tokens 8), and its
time to first token measured (send -> first non-empty content delta). Turn 2's prompt is ~1,500 tokens;
with the cache, the blocks of turn 1 (prompt and answer) are not computed again. Reports the median and
min TTFT of both turns per server, the prefix-cache counters from /metrics, and the 1-minute load
average before each server (2 shared cores here: quote the load beside the numbers).
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

from hotstart.bench import servers as sv
from hotstart.bench.process import Server
from hotstart.bench.prometheus import metric_value
from hotstart.errors import HotstartError

SENTENCES = [
    "The lighthouse stood on a cliff above the harbour, its lamp turning slowly through the night.",
    "Every evening the keeper climbed one hundred and twelve steps to trim the wick and polish the lens.",
    "Ships passing the headland counted the flashes to know which coast they were approaching.",
    "In winter the storms came from the west and the spray reached the gallery windows.",
    "The keeper kept a logbook of the weather, the ships and the birds that rested on the rail.",
    "Supplies arrived by boat once a fortnight, weather permitting, with letters and newspapers.",
    "Between the lamp's duties there was time for reading, mending nets and painting the iron railings.",
    "Old charts on the wall showed the reefs that had wrecked a dozen vessels before the light was built.",
]


def conversation(session: int, target_words: int) -> list[dict]:
    words, parts, i = 0, [], 0
    while words < target_words:
        s = SENTENCES[i % len(SENTENCES)]
        parts.append(f"({i + 1}) {s}")
        words += len(s.split()) + 1
        i += 1
    story = "Here is a story:\n" + " ".join(parts) + "\nSummarise it in one sentence."
    system = f"Session {session}. You are a careful reader who answers briefly."
    return [{"role": "system", "content": system}, {"role": "user", "content": story}]


def _connect(url: str, timeout: float) -> http.client.HTTPConnection:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def post(server: Server, body: dict, timeout: float = 300.0) -> dict:
    conn = _connect(server.url, timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise HotstartError(f"bench prefix-cache: HTTP {resp.status}: {raw[:300]!r}")
    return json.loads(raw)


def stream_ttft(url: str, body: dict, timeout: float = 300.0) -> float:
    conn = _connect(url, timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    ttft = None
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[5:])
        for ch in ev.get("choices") or []:
            if ttft is None and (ch.get("delta") or {}).get("content"):
                ttft = time.perf_counter() - t0
    conn.close()
    if ttft is None:
        raise HotstartError("bench prefix-cache: turn 2 produced no content")
    return ttft


def metric(server: Server, name: str) -> float:
    conn = _connect(server.url, 10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    value = metric_value(text, name)
    return float("nan") if value is None else value


def run_server(label: str, extra: list[str], args, session0: int) -> dict:
    t0 = time.monotonic()
    while os.getloadavg()[0] > args.max_load and time.monotonic() - t0 < args.max_wait:
        print(f"  load average {os.getloadavg()[0]:.2f} > {args.max_load}: waiting", flush=True)
        time.sleep(10)
    load = os.getloadavg()[0]
    server = sv.spawn(sv.hotstart_spec(args.model, args.dtype, extra), 300.0)
    try:
        models = (server.get_json("/v1/models") or {}).get("data") or [{}]
        served = models[0].get("id")
        base = dict(model=served, temperature=0)
        post(server, {**base, "messages": conversation(session0 - 1, 50), "max_tokens": 4})  # warm-up
        t1, t2, n_prompt = [], [], []
        for r in range(args.repeats):
            msgs = conversation(session0 + r, args.words)
            t = time.perf_counter()
            first = post(server, {**base, "messages": msgs, "max_tokens": 32})
            t1.append(time.perf_counter() - t)  # turn 1 end to end (prefill dominates)
            answer = first["choices"][0]["message"]["content"]
            msgs2 = [*msgs, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "Which detail of the story do you find most striking?"}]
            t2.append(stream_ttft(server.url, {**base, "messages": msgs2, "max_tokens": 8}))
            usage = post(server, {**base, "messages": msgs2, "max_tokens": 1})["usage"]
            n_prompt.append(usage["prompt_tokens"])
        return {"server": label, "flags": " ".join(extra) or "(defaults)", "load1_before": round(load, 2),
                "turn2_prompt_tokens": statistics.median(n_prompt),
                "turn1_e2e_median_s": statistics.median(t1), "turn2_ttft_median_s": statistics.median(t2),
                "turn2_ttft_min_s": min(t2), "turn2_ttft_all_s": [round(x, 3) for x in t2],
                "prefix_cache_queries": metric(server, "hotstart_prefix_cache_queries_total"),
                "prefix_cache_hits": metric(server, "hotstart_prefix_cache_hits_total"),
                "prompt_tokens_computed": metric(server, "hotstart_prompt_tokens_computed_total")}
    finally:
        server.stop()


def run_prefix_cache_bench(args) -> int:
    """Entry point of `hotstart bench prefix-cache`."""
    if args.repeats < 1 or args.words < 1:
        raise HotstartError("bench prefix-cache: --repeats and --words must be >= 1")
    results = [run_server("prefix caching on", [], args, 1000),
               run_server("prefix caching off", ["--no-enable-prefix-caching"], args, 2000)]
    print("\n| server | turn-2 prompt tokens | turn-1 e2e median (s) | turn-2 TTFT median (s) | "
          "turn-2 TTFT min (s) | prefix-cache hits / queries (tokens) | load avg before |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['server']} | {r['turn2_prompt_tokens']:.0f} | {r['turn1_e2e_median_s']:.2f} | "
              f"{r['turn2_ttft_median_s']:.3f} | {r['turn2_ttft_min_s']:.3f} | "
              f"{r['prefix_cache_hits']:.0f} / {r['prefix_cache_queries']:.0f} | {r['load1_before']:.2f} |")
    on, off = results
    print(f"\nturn-2 TTFT, off / on: {off['turn2_ttft_median_s'] / on['turn2_ttft_median_s']:.1f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0
