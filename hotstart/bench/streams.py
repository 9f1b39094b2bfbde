"""Streaming chat clients of `hotstart bench load` and `over-time` (`bench serve` traces its own:
serve_client.py), and the CPU-noise accounting every serving verb uses.

stream_request times one streamed OpenAI request (TTFT, decode rate, optionally every content delta's
time); CpuNoise / wait_idle / wait_quiet measure and wait out other processes' CPU use (2 shared cores
here: one busy neighbour costs torch's threads up to 50x, docs/serving.md). httpx and psutil are
imported inside the functions that need them.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import time

from hotstart.bench.procgroup import processes


def wait_quiet(max_load: float, max_wait: float) -> dict:
    """Wait until the 1-minute load average is below max_load (at most max_wait seconds)."""
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    announced = False
    while load > max_load and time.monotonic() - t0 < max_wait:
        if not announced:
            print(f"  load average {load:.2f} > {max_load}: waiting (at most {max_wait:.0f} s)", flush=True)
            announced = True
        time.sleep(5)
        load = os.getloadavg()[0]
    return {"load1_at_start": round(load, 2), "waited_s": round(time.monotonic() - t0, 1)}


class CpuNoise:
    """CPU seconds burnt by processes other than the watched ones (a server tree and this client) while
    a measurement ran: busy time from /proc/stat minus the watched processes' own CPU time."""

    def __init__(self, pid: int | None):
        self.pid = pid

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    def _ours(self) -> float:
        import psutil

        procs = [psutil.Process()]
        if self.pid:
            try:
                procs += processes(self.pid)
            except psutil.NoSuchProcess:
                pass
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def start(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()

    def stop(self) -> dict:
        wall = time.monotonic() - self.t0
        busy, ours = self._busy() - self.busy0, self._ours() - self.ours0
        other = max(0.0, busy - ours)
        return {"other_cpu_s": round(other, 2), "other_cores": round(other / wall, 3),
                "our_cores": round(ours / wall, 3)}


async def wait_idle(pid: int | None, max_cores: float, max_wait: float, window: float = 2.0) -> float:
    """Wait until processes other than ours use at most max_cores over a `window`-second sample (the
    load average lags by a minute); give up after max_wait (<= 0: no wait, not even one sample). Returns
    the seconds waited."""
    if max_wait <= 0:
        return 0.0
    t0 = time.monotonic()
    announced = False
    while True:
        noise = CpuNoise(pid)
        noise.start()
        await asyncio.sleep(window)
        other = noise.stop()["other_cores"]
        if other <= max_cores or time.monotonic() - t0 > max_wait:
            return time.monotonic() - t0
        if not announced:
            print(f"  other processes busy ({other:.2f} cores): waiting", flush=True)
            announced = True


async def stream_request(client, url: str, body: dict, timeout: float, chat: bool = True,
                         times: list[float] | None = None) -> dict:
    """POST a streaming request; time it and check how the stream ended.

    Returns ttft/e2e (s), decode_tps, tokens (usage, else None), chunks (non-empty content deltas),
    finish_reason, done ([DONE] seen), error (None if the stream was well-formed and HTTP 200).
    `times`: gets the perf_counter() of every non-empty content delta appended.
    """
    import httpx

    rec: dict = {"ttft": None, "e2e": None, "decode_tps": None, "tokens": None, "chunks": 0,
                 "finish_reason": None, "done": False, "error": None}
    t0 = time.perf_counter()
    t_first = t_last = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    rec["error"] = f"HTTP {r.status_code}: {text[:300]}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if rec["done"]:
                        rec["error"] = f"data after [DONE]: {data[:200]}"
                        continue
                    if data == "[DONE]":
                        rec["done"] = True
                        continue
                    ev = json.loads(data)
                    if "error" in ev:
                        rec["error"] = f"error event: {json.dumps(ev)[:300]}"
                    for ch in ev.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                        if piece:
                            t_last = time.perf_counter()
                            if t_first is None:
                                t_first = t_last
                            rec["chunks"] += 1
                            if times is not None:
                                times.append(t_last)
                        if ch.get("finish_reason"):
                            rec["finish_reason"] = ch["finish_reason"]
                    usage = ev.get("usage")
                    if usage:
                        rec["tokens"] = usage.get("completion_tokens")
    except TimeoutError:
        rec["error"] = f"timeout after {timeout:.0f} s"
    except (httpx.HTTPError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2e"] = time.perf_counter() - t0
    if t_first is not None:
        rec["ttft"] = t_first - t0
        n = rec["tokens"] if rec["tokens"] is not None else rec["chunks"]
        if n > 1 and t_last > t_first:
            rec["decode_tps"] = (n - 1) / (t_last - t_first)
    return rec


def pct(xs: list[float | None], q: float) -> float | None:
    """Percentile of the non-None values: the median for q=50, else nearest rank."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    if q == 50:
        return statistics.median(xs)
    return xs[max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))]


