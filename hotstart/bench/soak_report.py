"""The soak report (`hotstart bench soak`): pure functions of what soak.py recorded, so they are tested
without a server (tests/bench/test_soak_report.py).

Inputs, all times in seconds since the soak started:
  records   one per request: kind (soak.KINDS), variant, model, t0, t1, ttft (streams only), outcome
            (OUTCOMES), status (HTTP, None if none came), error (None when ok)
  samples   one per sampling tick: {"t", "procs": {pid: {"role", "rss_mb", "fds"}}, "kv": {model: ratio}}
  faults    one per injected fault: {"t", "kind", "pid", ...}; recovery() adds recovered_at / recovery_s

A fault window runs from the fault to its recovery (the end of the first good request, started after the
fault, that succeeded: for each model, the latest of those) plus a grace; a request overlapping one is
"during a fault" and its errors are reported apart: the goals allow them there and nowhere else.
"""

from __future__ import annotations

import math

from hotstart.bench.streams import pct

# outcome of a request: ok; hangup (the client hung up on purpose, as planned); 5xx (an HTTP 5xx answer,
# good or bad request); failed (a good request answered otherwise wrongly: 4xx, error event, cut stream,
# malformed answer, connection error); not_4xx (a bad request answered 2xx/3xx); hung (no answer within
# --request-timeout)
OUTCOMES = ("ok", "hangup", "5xx", "failed", "not_4xx", "hung")
ERRORS = ("5xx", "failed", "not_4xx", "hung")
QUANTILES = (50, 90, 99)


def recovery(faults: list[dict], records: list[dict], grace: float, end: float) -> list[dict]:
    """Each fault with recovered_at / recovery_s (None: not recovered before the end), its window
    [t, until] and the requests overlapping it that hung / ended in any error.

    The fault hit the models whose good requests were in flight at it or failed after it (none: every
    model asked after it); it recovered when each of those had answered again: the latest, over them, of
    the end of its first successful good request started after the fault."""
    out = []
    good = [r for r in records if r["kind"] != "bad"]
    for f in faults:
        firsts: dict[str, float] = {}
        for r in sorted(good, key=lambda r: r["t1"]):
            if r["t0"] >= f["t"] and r["outcome"] == "ok":
                firsts.setdefault(r["model"], r["t1"])
        hit = {
            r["model"]
            for r in good
            if (r["t0"] <= f["t"] < r["t1"] and r["outcome"] != "hangup")
            or (r["t1"] >= f["t"] and r["outcome"] in ERRORS)
        }
        hit = hit or {r["model"] for r in good if r["t0"] >= f["t"]}
        rec = max(firsts[m] for m in hit) if hit and hit <= set(firsts) else None
        until = end if rec is None else min(end, rec + grace)
        during = [r for r in records if r["t0"] < until and r["t1"] > f["t"]]
        out.append(
            {
                **f,
                "models_hit": sorted(hit),
                "recovered_at": rec,
                "recovery_s": None if rec is None else round(rec - f["t"], 3),
                "until": until,
                "hung": sum(r["outcome"] == "hung" for r in during),
                "errors": sum(r["outcome"] in ERRORS for r in during),
            }
        )
    return out


def in_fault(r: dict, faults: list[dict]) -> bool:
    """Whether request R overlaps a fault window (recovery() gave each fault its `until`)."""
    return any(r["t0"] < f["until"] and r["t1"] > f["t"] for f in faults)


def _q(xs: list[float]) -> dict:
    return {f"p{q}": (None if (v := pct(xs, q)) is None else round(v, 4)) for q in QUANTILES}


def windows(
    records: list[dict], samples: list[dict], faults: list[dict], width: float, end: float
) -> list[dict]:
    """Per window of WIDTH seconds (by request end): requests by kind, errors by outcome (outside and
    during faults), TTFT and total latency percentiles of the good requests that succeeded, the KV cache
    usage (highest sample of each model) and the server tree's RSS and descriptors (last sample)."""
    n = max(1, math.ceil(end / width - 1e-9))
    out = []
    for i in range(n):
        lo, hi = i * width, (i + 1) * width
        rs = [r for r in records if lo <= r["t1"] < hi or (i == n - 1 and r["t1"] >= hi)]
        good = [r for r in rs if r["outcome"] == "ok" and r["kind"] != "bad"]
        errs = {"outside": dict.fromkeys(ERRORS, 0), "during_faults": dict.fromkeys(ERRORS, 0)}
        for r in rs:
            if r["outcome"] in ERRORS:
                errs["during_faults" if in_fault(r, faults) else "outside"][r["outcome"]] += 1
        kinds: dict[str, int] = {}
        for r in rs:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        ss = [s for s in samples if lo <= s["t"] < hi or (i == n - 1 and s["t"] >= hi)]
        kv: dict[str, float] = {}
        for s in ss:
            for model, v in s["kv"].items():
                kv[model] = max(kv.get(model, 0.0), v)
        last = ss[-1]["procs"] if ss else {}
        out.append(
            {
                "t0": lo,
                "t1": min(hi, end) if i < n - 1 else end,
                "requests": len(rs),
                "ok": len(good),
                "kinds": dict(sorted(kinds.items())),
                "errors": errs,
                "ttft": _q([r["ttft"] for r in good]),
                "total": _q([r["t1"] - r["t0"] for r in good]),
                "kv_usage_max": kv,
                "rss_mb": round(sum(p["rss_mb"] for p in last.values()), 1) if last else None,
                "fds": sum(p["fds"] for p in last.values()) if last else None,
            }
        )
    return out


def growth(samples: list[dict], width: float) -> dict[str, dict]:
    """Per process (pid): its value after its first window (the first sample at least WIDTH seconds
    after the run started and after the process was first seen: a replaced engine gets its own), its
    last value, its highest, and the growth from base to last (RSS in %, descriptors in count). A
    process whose base is its last sample (it lived less than a window) has none (checked: False)."""
    first_seen: dict[str, float] = {}
    for s in samples:
        for pid in s["procs"]:
            first_seen.setdefault(str(pid), s["t"])
    out: dict[str, dict] = {}
    last_t = samples[-1]["t"] if samples else 0.0
    for pid, t_first in first_seen.items():
        series = [(s["t"], s["procs"][p]) for s in samples for p in s["procs"] if str(p) == pid]
        base_t = max(width, t_first + width)
        base = next(((t, v) for t, v in series if t >= base_t), None)
        t_end, end = series[-1]
        row = {
            "role": end["role"],
            "first_seen": t_first,
            "gone": t_end < last_t,
            "rss_max": max(v["rss_mb"] for _, v in series),
            "fds_max": max(v["fds"] for _, v in series),
            "rss_end": end["rss_mb"],
            "fds_end": end["fds"],
            "checked": False,
        }
        if base is not None and base[0] < t_end:
            row.update(
                checked=True,
                base_t=base[0],
                rss_base=base[1]["rss_mb"],
                fds_base=base[1]["fds"],
                rss_growth_pct=round(100 * (end["rss_mb"] - base[1]["rss_mb"]) / base[1]["rss_mb"], 2)
                if base[1]["rss_mb"]
                else None,
                fds_growth=end["fds"] - base[1]["fds"],
            )
        out[pid] = row
    return out


def totals(records: list[dict], faults: list[dict]) -> dict:
    """Counts over the whole run: requests by kind and by outcome, errors outside / during faults, and
    a few error samples per outcome."""
    by_kind: dict[str, dict[str, int]] = {}
    errs = {"outside": dict.fromkeys(ERRORS, 0), "during_faults": dict.fromkeys(ERRORS, 0)}
    samples: dict[str, list[str]] = {}
    for r in records:
        k = by_kind.setdefault(r["kind"], dict.fromkeys(OUTCOMES, 0))
        k[r["outcome"]] += 1
        if r["outcome"] in ERRORS:
            errs["during_faults" if in_fault(r, faults) else "outside"][r["outcome"]] += 1
            if len(samples.setdefault(r["outcome"], [])) < 5:
                samples[r["outcome"]].append(
                    f"{r['kind']}/{r.get('variant') or '-'} {r['model']}: {r['error']}"
                )
    good = [r for r in records if r["outcome"] == "ok" and r["kind"] != "bad"]
    return {
        "requests": len(records),
        "by_kind": dict(sorted(by_kind.items())),
        "errors": errs,
        "error_samples": samples,
        "good_ok": len(good),
        "ttft": _q([r["ttft"] for r in good]),
        "total": _q([r["t1"] - r["t0"] for r in good]),
    }


def goals(res: dict, rss_growth: float, fd_slack: int) -> list[str]:
    """What failed, as lines (empty: PASS): 5xx, failed good requests and bad requests not answered 4xx
    outside fault windows, any hung request, RSS of a process grown by more than RSS_GROWTH % or its
    descriptors by more than FD_SLACK since its first window, an unrecovered fault, nothing served, the
    server gone, a process left stopped."""
    why = []
    out, during = res["totals"]["errors"]["outside"], res["totals"]["errors"]["during_faults"]
    for k, what in (
        ("5xx", "5xx answers"),
        ("failed", "failed good requests"),
        ("not_4xx", "bad requests not answered 4xx"),
    ):
        if out[k]:
            why.append(f"{out[k]} {what} outside fault windows")
    if out["hung"] + during["hung"]:
        why.append(f"{out['hung'] + during['hung']} requests hung (no answer within the request timeout)")
    if not res["totals"]["good_ok"]:
        why.append("no good request succeeded")
    for pid, g in res["processes"].items():
        if not g["checked"] or g["gone"]:
            continue
        if g["rss_growth_pct"] is not None and g["rss_growth_pct"] > rss_growth:
            why.append(
                f"RSS of {g['role']} (pid {pid}) grew {g['rss_growth_pct']:.1f} % "
                f"({g['rss_base']} -> {g['rss_end']} MB; limit {rss_growth:g} %)"
            )
        if g["fds_growth"] > fd_slack:
            why.append(
                f"descriptors of {g['role']} (pid {pid}) grew by {g['fds_growth']} "
                f"({g['fds_base']} -> {g['fds_end']}; slack {fd_slack})"
            )
    for f in res["faults"]:
        if f["recovery_s"] is None:
            why.append(f"{f['kind']} of pid {f['pid']} at {f['t']:.1f} s: never recovered")
    if not res.get("server_alive", True):
        why.append("the server died")
    if res.get("left_stopped"):
        why.append(f"processes found stopped at the end (resumed): {res['left_stopped']}")
    return why


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(res: dict) -> str:
    """The readable report: totals, one line per window, one per process, one per fault."""
    t = res["totals"]
    lines = [
        f"soak: {res['clients']} clients x {res['duration']:g} s on {', '.join(res['models'])}; "
        f"{t['requests']} requests, {t['good_ok']} good ones answered"
    ]
    if res.get("fast_path_wait_s"):
        lines[0] += f" (after {res['fast_path_wait_s']} s waiting for the fast path)"
    lines.append("kind          " + " ".join(f"{o:>8}" for o in OUTCOMES))
    for kind, c in t["by_kind"].items():
        lines.append(f"{kind:<13} " + " ".join(f"{c[o]:>8}" for o in OUTCOMES))
    e = t["errors"]
    lines.append(
        "errors outside faults: "
        + ", ".join(f"{k} {v}" for k, v in e["outside"].items())
        + "; during faults: "
        + ", ".join(f"{k} {v}" for k, v in e["during_faults"].items())
    )
    lines.append("")
    lines.append(
        "window (s)    reqs    ok  err out/fault  TTFT p50/p90/p99 (s)   total p50/p90/p99 (s)"
        "     RSS MB   fds  KV max"
    )
    for w in res["windows"]:
        out, dur = (sum(w["errors"][k].values()) for k in ("outside", "during_faults"))
        q = lambda d: "/".join(_f(d[f"p{x}"]) for x in QUANTILES)  # noqa: E731
        kv = " ".join(f"{m or '-'}:{v:.2f}" for m, v in w["kv_usage_max"].items())
        lines.append(
            f"{w['t0']:>5.0f}-{w['t1']:<6.0f} {w['requests']:>5} {w['ok']:>5} {out:>6}/{dur:<6}"
            f"{q(w['ttft']):>22} {q(w['total']):>23} {_f(w['rss_mb'], 1):>10} {w['fds'] or '-':>5}  {kv}"
        )
    lines.append("")
    lines.append("process                         RSS base -> end MB (growth, max)     fds base -> end (max)")
    for pid, g in res["processes"].items():
        name = f"{g['role']} {pid}" + (" (gone)" if g["gone"] else "")
        if g["checked"]:
            grown = _f(g["rss_growth_pct"], 1)
            rss = f"{g['rss_base']:.1f} -> {g['rss_end']:.1f} ({grown} %, {g['rss_max']:.1f})"
            fds = f"{g['fds_base']} -> {g['fds_end']} ({g['fds_max']})"
        else:
            rss = f"- -> {g['rss_end']:.1f} (lived < a window, max {g['rss_max']:.1f})"
            fds = f"- -> {g['fds_end']} ({g['fds_max']})"
        lines.append(f"{name:<31} {rss:<36} {fds}")
    if res["faults"]:
        lines.append("")
        lines.append("fault at (s)  kind    pid      target         recovery (s)  hung  errors during")
        for f in res["faults"]:
            lines.append(
                f"{f['t']:>11.1f}  {f['kind']:<7} {f['pid']:<8} {f.get('target', ''):<14} "
                f"{_f(f['recovery_s']):>12}  {f.get('hung', 0):>4}  {f.get('errors', 0):>6}"
                + (f"  ({f['note']})" if f.get("note") else "")
            )
    return "\n".join(lines)
