"""The engine's and the server's configuration (their flags), without torch. The model's own
(config.json) is hotstart/model_config.py's ModelConfig, also importable from here."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from hotstart.flags import (
    at_least_one,
    bucket_list,
    byte_size,
    byte_size_or_auto,
    fraction,
    memory_amount,
    name,
    non_negative,
    option,
    port,
    seconds,
    values,
)
from hotstart.model_config import ModelConfig, load_model_config
from hotstart.rope_config import RopeConfig
from hotstart.spec_config import speculative_config

TCP_PORT = port  # in ServeConfig's body its own `port` field hides the flag type

__all__ = ["EngineConfig", "ModelConfig", "RopeConfig", "ServeConfig", "load_model_config", "serial_baseline"]


@dataclass(frozen=True)
class EngineConfig:
    """What the engine process needs to start; sent from the API process as soon as it is known.
    Fields declared with option() are also `hotstart serve` / `generate` flags (hotstart.flags)."""

    model_path: str
    weight_files: tuple[str, ...] = ()  # in load order (empty: discover in the engine)
    device: str = option("auto", "where the model runs", choices=["auto", "cpu", "cuda"])
    dtype: str = option(
        "auto", "auto: the checkpoint's dtype where the hardware computes it natively, else float32",
        choices=["auto", "bfloat16", "float16", "float32"])
    max_model_len: int | None = option(
        None, "longest prompt + completion in tokens (default: the model's max_position_embeddings)",
        type=at_least_one)
    max_num_seqs: int = option(64, "most sequences batched in one step", type=at_least_one)
    max_num_batched_tokens: int = option(2048, "token budget of one step (prefill chunks + decodes)",
                                         type=at_least_one)
    block_size: int = option(16, "tokens per KV-cache block", type=at_least_one)
    kv_cache_memory: int | None = option(
        None, "bytes for the KV cache, e.g. 2G (default: CPU enough for max-num-seqs x max-model-len, at "
              "most half of what the available memory (a cgroup's limit minus its working set, else "
              "MemAvailable) leaves beside the weights, at least one sequence; CUDA from "
              "--gpu-memory-utilization)",
        type=byte_size, env="HOTSTART_KV_CACHE_MEMORY", aliases=("--kv-cache-memory-bytes",))
    gpu_memory_utilization: float = option(
        0.9, "fraction of GPU memory the engine may use (weights + KV cache)", type=fraction)
    seed: int = option(0, "seed of the sampler's default generator", type=int)
    compile: str = option(
        "auto", "the fast path, built behind READY: auto = oneDNN-packed weights where their copy fits in "
                "memory (and hotstart's CPU kernels), else the CPU kernels alone over the checkpoint's "
                "weights, else compiled layer graphs where a C++ compiler exists (CPU); eager-only = packed "
                "weights, never a compiler; graphs = compiled graphs over the plain weights; off = the plain "
                "eager path only",
        choices=["auto", "eager-only", "graphs", "off"], env="HOTSTART_COMPILE")
    compile_buckets: str = option("1,2,4,8,16,32,64", "token counts the compiled graphs are built for "
                                                      "(a step of T tokens runs on the smallest bucket >= T)",
                                  type=bucket_list)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes computed before "
                                               "(content-hashed full blocks, LRU eviction)", action="boolean")
    prefix_cache_disk: str = option(
        "auto", "bytes of full prefix-cache KV blocks kept on disk ($HOTSTART_HOME/kv/, shared by every "
                "model, least recently used dropped first) so that an unloaded or restarted model finds the "
                "prefixes it had: 4G, 512M, 0 = off; auto: $HOTSTART_PREFIX_CACHE_DISK, else 4G",
        type=byte_size_or_auto)
    tensor_parallel_size: int = option(
        1, "ranks the model is split over (tensor parallel, one process each, forked from the one "
           "forkserver: gloo on CPU, NCCL on CUDA with rank r on cuda:r); the attention and KV heads must be "
           "divisible by it",
        short="-tp", type=at_least_one)
    speculative_config: str | None = option(
        None, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' drafts up to K tokens per sequence by "
              "prompt lookup and verifies them in one forward (same output; docs/serving.md)",
        type=speculative_config)
    engine_heartbeat_timeout: float = option(
        5.0, "an engine process (any tensor-parallel rank) silent this long is killed and replaced, its "
             "requests failed: it beats from a thread every 0.5 s, also during long steps (0: off)",
        type=seconds)
    engine_step_timeout: float = option(
        0.0, "an engine step running this long is taken for a hang (a Python-level deadlock, a wedged "
             "collective): killed and replaced like a silent engine (0: off)", type=seconds)
    cursor_path: str | None = None  # LoadCursor file shared with the API process's prefetcher (None: none)
    background_load: bool = False  # other models serve: load and build the fast path at low CPU priority
    t0: float = 0.0  # launch time (time.time()) for the startup timeline
    engine_restart_backoff: float = option(
        5.0, "past the crash-loop limit (more than 5 engine deaths within 60 s) the server waits this long "
             "before starting the engine again (503 + Retry-After meanwhile, /live 200), doubling while "
             "the loop goes on, at most 5 minutes", type=seconds)
    debug_fault: str | None = option(
        None, "debugging, off unless set: ACTION@TOKEN_ID[,...] makes a request whose prompt holds that "
              "token id fail on purpose: add (raise while adding it), step (raise in its forward), crash "
              "(SIGKILL the engine in its step); rehearses what clients see (docs/reliability.md)",
        type=lambda text: (parse_debug_faults(text), text)[1], metavar="ACTION@TOKEN_ID")

    def compile_bucket_sizes(self) -> tuple[int, ...]:
        """The buckets worth building: none above the most tokens a decode step can have."""
        sizes = sorted({int(b) for b in self.compile_buckets.split(",") if b.strip()})
        fit = [b for b in sizes if b <= self.max_num_seqs]
        bigger = [b for b in sizes if b > self.max_num_seqs]
        return tuple(fit + bigger[:1])

    @classmethod
    def from_args(cls, args, exclude: tuple[str, ...] = (), **fields: Any) -> EngineConfig:
        """The engine flags of ARGS (an argparse namespace; not those in EXCLUDE), plus FIELDS (model_path,
        ...)."""
        return cls(**values(cls, args, exclude, **fields))


@dataclass(frozen=True)
class ServeConfig:
    """`hotstart serve`'s own flags (the engine's are EngineConfig's)."""

    host: str = option("127.0.0.1", "address to bind (0.0.0.0 to expose)")
    port: int = option(8000, "port (0 picks a free one and prints it)", type=port)
    served_model_name: tuple[str, ...] | None = option(None, "name(s) clients use for the model (repeatable)",
                                                       action="append", type=name)
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' (prefer the environment variable HOTSTART_API_KEY: other "
              "users can read flags in ps)", env="HOTSTART_API_KEY")
    max_request_bytes: int = option(1 << 20, "largest accepted request body", type=at_least_one)
    max_connections: int = option(
        512, "most open HTTP connections; a connection opened past it has 2 s to send its request, which is "
             "answered 503 (OpenAI error JSON, Retry-After)", type=at_least_one)
    header_timeout: int = option(
        10, "seconds a connection has to send a request's headers, from when it opens or its last response "
            "ends (idle and half-open sockets are closed after it)", type=at_least_one)
    body_timeout: int = option(30, "seconds a request has to send its body once its headers are in",
                               type=at_least_one)
    min_free_memory: str = option(
        "auto", "while the available memory (a cgroup's limit minus its working set, else MemAvailable) "
                "is below this, new requests wait up to 1 s, then get 503 with Retry-After instead of the "
                "engine meeting the OOM killer: bytes (512M, 2G), a percentage of the RAM (the cgroup's "
                "limit, else MemTotal), 0 (off), or auto (5%% of it, at most 1 GiB)", type=memory_amount)
    prespawn: bool = option(True, "start the engine after the API is up, as a fresh interpreter (ablation)",
                            flag="--no-prespawn", action="store_false")
    prefetch: bool = option(True, "do not prefetch weights into the page cache (ablation)",
                            flag="--no-prefetch", action="store_false")
    import_prefetch: bool = option(True, "do not read the imports' files first at t=0, nor hold the weight "
                                         "prefetch back while the imports run (ablation)",
                                   flag="--no-import-prefetch", action="store_false")
    prefetch_threads: int | None = option(None, "prefetch reader threads", type=non_negative)
    prefetch_block_mb: int | None = option(None, "prefetch read size in MiB", type=non_negative)
    prefetch_method: str = option(
        "auto", "how the prefetcher fills the page cache: preadv (reads, copied into a buffer), readahead / "
                "fadvise (the kernel queues the reads: no copy), madvise (MADV_POPULATE_READ on a read-only "
                "mapping: no copy); auto: the zero-copy default on local disks, preadv on network "
                "filesystems",
        choices=["auto", "preadv", "readahead", "fadvise", "madvise"])
    shutdown_timeout: int = option(
        25, "seconds SIGTERM waits for requests in flight (new ones get 503, /health turns 503 at once) "
            "before ending them with an error and exiting; fits Kubernetes' default 30 s grace period",
        type=non_negative)
    restart: bool = option(True, "do not replace a dead engine or forkserver", flag="--no-restart",
                           action="store_false")
    zygote: str = option("auto", "auto: fork the engine from this user's running `hotstart zygote` (torch "
                                 "imported already) if one matches this hotstart, python and torch; off: "
                                 "always start a local forkserver", choices=["auto", "off"])
    startup_trace: str | None = option(None, "write the startup timeline (Chrome trace JSON)", metavar="FILE")
    log_level: str = option("info", "log verbosity", choices=["debug", "info", "warning", "error"])
    generation_config: str = option("auto", "auto: the model folder's generation_config.json sampling fields "
                                            "(temperature, top_p, top_k, min_p, repetition_penalty) are the "
                                            "defaults requests override; none: ignore them",
                                    choices=["auto", "none"])
    tool_call_parser: str = option("auto", "how tool calls are read from (and, for tool_choice required / a "
                                           "named function, forced into) the model's text: hermes (Qwen2.5, "
                                           "Qwen3: <tool_call>{...}</tool_call>), llama3_json (Llama 3.x); "
                                           "auto: chosen from the chat template's text",
                                   choices=["auto", "hermes", "llama3_json"])
    enable_auto_tool_choice: bool = option(True, "parse tool calls out of answers to tool_choice auto (off: "
                                                 "they stay text)", action="boolean")
    # who may reach the server (server/access.py, docs/security.md)
    allowed_hosts: tuple[str, ...] | None = option(
        None, "Host header names served besides this machine's own (localhost, its hostname, IP addresses), "
              "which refuses DNS rebinding: NAME, .DOMAIN (it and its subdomains) or * (any); checked on a "
              "keyless server, and on a keyed one once given (repeatable, or comma-separated)",
        action="append")
    allowed_origins: tuple[str, ...] | None = option(
        None, "browser origins (https://app.example.com, or *) whose pages may call the API (CORS); without "
              "it a cross-origin browser request is refused (repeatable, or comma-separated)",
        action="append")
    allow_no_api_key: bool = option(
        False, "serve a --host beyond loopback without an API key (everyone who reaches the port may use it)",
        action="boolean")
    metrics_port: int | None = option(
        None, "also serve GET /metrics on this port of --host, without the API key (a Prometheus scrape; "
              "0 picks a free one)", type=TCP_PORT)
    admin_key: str | None = option(
        None, "the key that loading and unloading models and a request's keep_alive need (the API key is "
              "then not enough; prefer the environment variable HOTSTART_ADMIN_KEY)",
        env="HOTSTART_ADMIN_KEY")
    write_timeout: float = option(
        10.0, "seconds a client may read nothing while its answer waits to be sent (the server's socket "
              "buffers full): the connection is then closed and a stream's generation aborted (0: no "
              "deadline)", type=seconds)
    max_connections_per_client: int | None = option(
        None, "most open HTTP connections from one client address; past it a connection's request is "
              "answered 429 (default: half of --max-connections; 0: no per-client cap; behind a proxy every "
              "client shares the proxy's address)", type=non_negative)

    @classmethod
    def from_args(cls, args) -> ServeConfig:
        """The serve flags of ARGS. HOTSTART_SERIAL=1 (the benchmarks' serial baseline) turns every
        fast-start mechanism off: no forkserver, no zygote, no prefetch."""
        cfg = cls(**values(cls, args))
        if serial_baseline():
            cfg = replace(cfg, prespawn=False, prefetch=False, import_prefetch=False, zygote="off")
        return cfg


FAULT_ACTIONS = ("add", "step", "crash")


def parse_debug_faults(text: str | None) -> dict[int, str]:
    """--debug-fault's ACTION@TOKEN_ID[,...] as {token id: action} (empty: off); argparse's error if bad."""
    import argparse  # noqa: PLC0415 - stdlib; only where the flag is set

    out: dict[int, str] = {}
    for item in text.split(",") if text else ():
        action, _, token = item.strip().partition("@")
        if action not in FAULT_ACTIONS or not token.isdigit():
            raise argparse.ArgumentTypeError(
                f"expected ACTION@TOKEN_ID with ACTION one of {', '.join(FAULT_ACTIONS)}, got {item!r}")
        out[int(token)] = action
    return out


def serial_baseline() -> bool:
    """HOTSTART_SERIAL=1: every fast-start mechanism off (the baseline the benchmarks compare to)."""
    return os.environ.get("HOTSTART_SERIAL", "").lower() in ("1", "true", "yes")
