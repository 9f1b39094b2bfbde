"""Ray Serve's autoscaling on hotstart's own signals (runs in Ray's Serve controller, which pickles this
module by value: it imports nothing of hotstart).

Each replica reports, every RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S, its engine's running and
waiting requests and the requests its HTTP layer holds (Replica.record_autoscaling_stats). Load = the larger
of hotstart's count and Ray's own count of requests at the replicas, plus the requests Ray holds before any
replica took them (the proxy's queue: the only signal at zero replicas). The replicas wanted: load /
target_ongoing_requests, rounded up. Ray applies the rest: min/max replicas, the up/down delays, a request at
zero replicas starting one at once. A replica with requests is never asked to stop before they end: Ray
drains it (graceful_shutdown_timeout_s).
"""

from __future__ import annotations

import math
from typing import Any

RUNNING, WAITING, HTTP = "hotstart_running", "hotstart_waiting", "hotstart_http_in_flight"


def _total(metrics: dict | None, name: str) -> float:
    per_replica = (metrics or {}).get(name) or {}
    return float(sum(per_replica.values()))


def hotstart_load(ctx: Any) -> float:
    """Requests wanting a replica now (AutoscalingContext CTX)."""
    metrics = ctx.aggregated_metrics
    engine = _total(metrics, RUNNING) + _total(metrics, WAITING)
    at_replicas = max(engine, _total(metrics, HTTP), float(ctx.total_running_requests or 0.0))
    return at_replicas + float(ctx.total_queued_requests or 0.0)


def policy(ctx: Any) -> tuple[float, dict]:
    """Ray Serve's policy_function: (replicas wanted, policy state)."""
    target = float(ctx.config.target_ongoing_requests or 1.0)
    load = hotstart_load(ctx)
    return float(math.ceil(load / target)) if load > 0 else 0.0, {}
