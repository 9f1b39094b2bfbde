"""Serving metrics with `vllm bench serve`'s definitions, so the two tools' figures read the same.

One streamed request is a RequestTrace: the send time and the arrival time of every SSE event that
carries choices (a token event: vLLM counts each such event, even one with empty text, and ignores the
usage-only and [DONE] events). From the traces of one run (N requests at most C at a time):

  TTFT     first token event - send, per request
  ITL      gaps between consecutive token events, every request's pooled
  E2E      last token event - send, per request ("latency" in vLLM)
  TPOT     (E2E - TTFT) / (output tokens - 1), per request with more than one output token
  output tokens   usage.completion_tokens when the server reports it, else the tokenizer's count of the
                  text (vLLM's fallback), else 1
  input tokens    usage.prompt_tokens when reported, else the prompt's own token count
  request / output / total token throughput   completed / duration, sum(output) / duration,
                  (sum(input) + sum(output)) / duration; duration = first send of the run -> last
                  request done, failed requests included in it (they count 0 tokens)
  mean, median, std, p99   numpy's definitions (population std; linear-interpolated percentiles)

Stdlib only: the report needs no numpy (tests/bench/test_metrics.py checks these against numpy).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PERCENTILES = (99.0,)
MS = 1000.0


@dataclass
class RequestTrace:
    """One request as the client saw it. Times are perf_counter seconds."""

    sent: float
    prompt_len: int  # tokens the prompt was built with (replaced by usage.prompt_tokens when reported)
    events: list[float] = field(default_factory=list)  # arrival of each SSE event carrying choices
    text: str = ""
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """vLLM's success: HTTP 200, no exception, and at least one token event."""
        return self.error is None and bool(self.events)

    @property
    def ttft(self) -> float | None:
        return self.events[0] - self.sent if self.events else None

    @property
    def latency(self) -> float | None:
        return self.events[-1] - self.sent if self.events else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:])]

    def input_tokens(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_len

    def output_tokens(self, count_tokens: Callable[[str], int] | None = None) -> int:
        if self.usage_completion_tokens:
            return self.usage_completion_tokens
        if count_tokens is not None:
            return count_tokens(self.text)
        return 1

    def tpot(self, output_tokens: int) -> float | None:
        if not self.ok or output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """numpy.percentile's default ('linear'): interpolated between the two closest ranks."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float], scale: float = MS) -> dict[str, float | None]:
    """mean / median / std / p99 of VALUES times SCALE (seconds -> ms); None where there is no value."""
    if not values:
        return {"mean": None, "median": None, "std": None, **{f"p{q:g}": None for q in PERCENTILES}}
    return {"mean": statistics.fmean(values) * scale, "median": statistics.median(values) * scale,
            "std": statistics.pstdev(values) * scale,
            **{f"p{q:g}": percentile(values, q) * scale for q in PERCENTILES}}


def compute(traces: list[RequestTrace], duration_s: float,
            count_tokens: Callable[[str], int] | None = None) -> dict:
    """The run's metrics (module docstring). Latencies in ms, throughputs per second."""
    ok = [t for t in traces if t.ok]
    outputs = [t.output_tokens(count_tokens) for t in ok]
    total_in = sum(t.input_tokens() for t in ok)
    total_out = sum(outputs)
    tpots = [x for t, n in zip(ok, outputs) if (x := t.tpot(n)) is not None]
    dur = duration_s if duration_s > 0 else float("nan")
    return {
        "completed": len(ok), "failed": len(traces) - len(ok), "duration_s": duration_s,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur, "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "ttft_ms": summary([t.ttft for t in ok]), "tpot_ms": summary(tpots),
        "itl_ms": summary([x for t in ok for x in t.itl]), "e2el_ms": summary([t.latency for t in ok]),
        "errors": sorted({t.error or "no token event" for t in traces if not t.ok})[:5],
    }


SCALARS = ("request_throughput", "output_throughput", "total_token_throughput")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def median_of_runs(runs: Iterable[dict]) -> dict:
    """Per metric, the median over rounds (each statistic of each latency on its own); counts summed."""
    runs = list(runs)
    out: dict = {"rounds": len(runs), "completed": sum(r["completed"] for r in runs),
                 "failed": sum(r["failed"] for r in runs)}
    for k in SCALARS:
        xs = [r[k] for r in runs if r[k] == r[k]]  # NaN (zero duration) left out
        out[k] = statistics.median(xs) if xs else None
    for k in LATENCIES:
        stats = {}
        for s in runs[0][k] if runs else ():
            xs = [r[k][s] for r in runs if r[k][s] is not None]
            stats[s] = statistics.median(xs) if xs else None
        out[k] = stats
    return out
