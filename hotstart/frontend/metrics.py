"""Prometheus metrics for one app (torch-free).

Each Metrics owns a private CollectorRegistry, so two apps in one process (tests, several servers)
never collide on metric names. Engine gauges are read from EngineClient.stats when /metrics is
scraped, not pushed on every engine step, so the busy path pays nothing for them.

The `vllm:*` series are the ones autoscaling rules and dashboards are written against, with vLLM's names,
meanings and `model_name` label (docs/serving.md lists them); the hotstart_* ones stay as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from hotstart.messages import FastPathState

if TYPE_CHECKING:
    from hotstart.messages import EngineStats, FastPathStatus

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds; spans a warm single-token answer on a GPU to a long CPU generation.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
# The states a layer-graph bucket goes through (engine/fastpath/state.py): the label set of
# hotstart_compiled_bucket_state.
BUCKET_STATES = (FastPathState.PLANNED, FastPathState.COMPILING, FastPathState.READY, FastPathState.FAILED)
# vLLM's inter-token latency buckets
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    """Counters, gauges and histograms of one server; `render()` is the /metrics body."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.vllm = VllmMetrics(r, model_name)
        self.draining = Gauge("hotstart_draining", "1 from SIGTERM on: /health is 503, new requests 503",
                              registry=r)
        self.requests = Counter("hotstart_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("hotstart_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.generation_tokens = Counter("hotstart_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("hotstart_request_finished", "Generation requests by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("hotstart_time_to_first_token_seconds",
                              "From request arrival to its first generated token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("hotstart_e2e_request_latency_seconds",
                             "From request arrival to its last generated token", buckets=_E2E_BUCKETS,
                             registry=r)
        self.running = Gauge("hotstart_num_requests_running", "Requests the engine is running", registry=r)
        self.waiting = Gauge("hotstart_num_requests_waiting", "Requests waiting in the engine", registry=r)
        self.kv_usage = Gauge("hotstart_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                              registry=r)
        self.preemptions = Gauge("hotstart_num_preemptions", "Preemptions so far (engine total)",
                                 registry=r)
        self.prefix_queries = Counter("hotstart_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("hotstart_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.prompt_computed = Counter("hotstart_prompt_tokens_computed",
                                       "Prompt tokens the engine computed (prefill work: prefix-cache hits "
                                       "and the n choices of a request share it)", registry=r)
        self.disk_blocks = Gauge("hotstart_prefix_cache_disk_blocks", "Prefix-cache KV blocks of this model "
                                 "on disk (engine/kv_store.py)", registry=r)
        self.disk_restored = Counter("hotstart_prefix_cache_disk_restored_blocks",
                                     "Prefix-cache KV blocks read back from disk", registry=r)
        self.disk_written = Counter("hotstart_prefix_cache_disk_written_blocks",
                                    "Prefix-cache KV blocks written to disk", registry=r)
        self._engine_totals = (0, 0, 0, 0, 0)
        self.ready = Gauge("hotstart_engine_ready", "1 once the engine serves requests", registry=r)
        self.bucket_state = Gauge("hotstart_compiled_bucket_state", "1 for the state of each compiled bucket",
                                  ["bucket", "state"], registry=r)
        self.bucket_steps = Gauge(
            "hotstart_compiled_bucket_steps",
            "Engine steps run on each compiled bucket",
            ["bucket"],
            registry=r,
        )
        self.eager_steps = Gauge("hotstart_eager_steps", "Engine steps run on the eager forward", registry=r)
        self.startup = Gauge("hotstart_startup_duration_seconds",
                             "From `hotstart serve` to the engine being ready (set by the serve command)",
                             registry=r)

    def set_startup_duration(self, seconds: float) -> None:
        """Called once by the serve command when the server becomes ready."""
        self.startup.set(seconds)

    def observe_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def update_fast_path(self, status: FastPathStatus | None) -> None:
        """Per bucket of the layer graphs: its state (1 on the current one, one label per FastPathState a
        bucket can be in) and the steps it ran."""
        if status is None:
            return
        for b in status.buckets:
            for s in BUCKET_STATES:
                self.bucket_state.labels(str(b.tokens), s.value).set(1 if s is b.state else 0)
            self.bucket_steps.labels(str(b.tokens)).set(b.steps)
        self.eager_steps.set(status.eager_steps)

    def update_engine(self, stats: EngineStats | None, ready: bool) -> None:
        self.ready.set(1 if ready else 0)
        if stats is None:
            return
        self.vllm.update_engine(stats)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        self.preemptions.set(stats.num_preemptions)
        # engine totals since it started: counted forward by their growth (a replaced engine starts at 0)
        self.disk_blocks.set(stats.prefix_disk_blocks)
        totals = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prompt_tokens_computed,
                  stats.prefix_disk_restored, stats.prefix_disk_written)
        counters = (self.prefix_queries, self.prefix_hits, self.prompt_computed, self.disk_restored,
                    self.disk_written)
        for counter, new, old in zip(counters, totals, self._engine_totals, strict=True):
            counter.inc(new - old if new >= old else new)
        self._engine_totals = totals

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmMetrics:
    """vLLM's names for the same quantities, labelled by model_name (as vLLM labels them; one series per
    served model). Per request: TTFT, inter-token latency, time per output token and end-to-end latency
    measured in the API process, from the request's arrival to its tokens' delivery to the HTTP layer."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        label = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches", label,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", label,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent", label,
                              registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed (prompt tokens of "
                                     "accepted requests)", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", label,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Finished requests (each choice), by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", label,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens", label,
                             buckets=_ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: (end-to-end latency - time to first token) / (output tokens - 1)",
                              label, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", label,
                             buckets=_E2E_BUCKETS, registry=r)
        for m in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                  self.ttft, self.itl, self.tpot, self.e2e):
            m.labels(model_name)  # every series exists from the first scrape (0), as autoscalers expect
        # speculative decoding (--speculative-config): engine totals, counted forward by their growth;
        # registered by the first stats that carry any (no series without the option)
        self._registry = r
        self.spec: tuple[Counter, Counter, Counter] | None = None
        self._spec_totals = (0, 0, 0)

    def update_engine(self, stats: EngineStats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        total = stats.kv_blocks_total
        self.kv_usage.labels(m).set(stats.kv_blocks_used / total if total else 0.0)
        totals = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                  stats.spec_decode_num_accepted_tokens)
        if self.spec is None and totals[0]:
            r, label = self._registry, ["model_name"]
            self.spec = (
                Counter("vllm:spec_decode_num_drafts", "Speculative drafts verified", label, registry=r),
                Counter("vllm:spec_decode_num_draft_tokens", "Tokens in those drafts", label, registry=r),
                Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", label, registry=r),
            )
        if self.spec is not None:
            for counter, new, old in zip(self.spec, totals, self._spec_totals, strict=True):
                counter.labels(m).inc(new - old if new >= old else new)  # a replaced engine starts at 0
            self._spec_totals = totals

    def request_done(self, e2e: float, ttft: float | None, tokens: int) -> None:
        """One request's end (all its choices): its end-to-end latency and time per output token."""
        self.e2e.labels(self.model_name).observe(e2e)
        if ttft is not None and tokens > 1:
            self.tpot.labels(self.model_name).observe((e2e - ttft) / (tokens - 1))
