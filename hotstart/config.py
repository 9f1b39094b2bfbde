"""Model configuration parsed from a model folder's config.json, without transformers or torch."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hotstart.errors import ModelConfigError
from hotstart.flags import at_least_one, bucket_list, fraction, name, non_negative, option, port, values

# architecture name in config.json -> (family, attention bias default, q/k RMSNorm)
ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3 scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, as the engine needs it."""

    path: str
    architecture: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h


def _field(raw: dict, name: str, kind: type, src: Path, default: Any = ..., positive: bool = False):
    if name not in raw or raw[name] is None:
        if default is ...:
            raise ModelConfigError(f"{src}: missing field '{name}'")
        return default
    value = raw[name]
    ok = isinstance(value, kind) and not isinstance(value, bool) if kind is not bool else isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok or (kind is float and not math.isfinite(value)):
        raise ModelConfigError(f"{src}: field '{name}' must be {kind.__name__}, got {value!r}")
    if positive and value <= 0:
        raise ModelConfigError(f"{src}: field '{name}' must be > 0, got {value!r}")
    return value


def _rope(raw: dict, src: Path) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older files write
    # "rope_theta" and "rope_scaling" at top level.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"{src}: field 'rope_scaling' must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ModelConfigError(f"{src}: field 'rope_theta' must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{src}: rope_scaling type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=float(theta),
        type="default" if rope_type == "dynamic" else rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _ids(value: Any, src: Path, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelConfigError(f"{src}: field '{name}' must be a token id or a list of them, got {value!r}")
    return tuple(values)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse MODEL_DIR/config.json (and generation_config.json's eos ids). Errors name file and field."""
    model_dir = Path(model_dir)
    src = model_dir / "config.json"
    try:
        raw = json.loads(src.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelConfigError(f"{src}: not found (is '{model_dir}' a model folder?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{src}: cannot be parsed: {e}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{src}: must hold a JSON object")
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelConfigError(f"{src}: missing field 'architectures'")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ModelConfigError(
            f"{src}: unknown architecture '{arch}' (supported: {', '.join(ARCHITECTURES)})"
        )
    family, bias_default, qk_norm = ARCHITECTURES[arch]
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{src}: field 'hidden_act' must be 'silu', got {act!r}")

    hidden = _field(raw, "hidden_size", int, src, positive=True)
    heads = _field(raw, "num_attention_heads", int, src, positive=True)
    kv_heads = _field(raw, "num_key_value_heads", int, src, default=heads, positive=True)
    if heads % kv_heads:
        raise ModelConfigError(
            f"{src}: field 'num_attention_heads' ({heads}) must be a multiple of 'num_key_value_heads' ({kv_heads})"
        )
    head_dim = _field(raw, "head_dim", int, src, default=None, positive=True)
    if head_dim is None:
        if hidden % heads:
            raise ModelConfigError(f"{src}: field 'head_dim' is needed: hidden_size % num_attention_heads != 0")
        head_dim = hidden // heads

    eos = _ids(raw.get("eos_token_id"), src, "eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            gen_raw = json.loads(gen.read_text(encoding="utf-8"))
            eos = tuple(dict.fromkeys(eos + _ids(gen_raw.get("eos_token_id"), gen, "eos_token_id")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{gen}: cannot be parsed: {e}") from None

    dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ModelConfigError(f"{src}: field 'torch_dtype' must be float32, float16 or bfloat16, got {dtype!r}")

    return ModelConfig(
        path=str(model_dir),
        architecture=arch,
        family=family,
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int, src, positive=True),
        num_hidden_layers=_field(raw, "num_hidden_layers", int, src, positive=True),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_field(raw, "vocab_size", int, src, positive=True),
        max_position_embeddings=_field(raw, "max_position_embeddings", int, src, default=2048, positive=True),
        rms_norm_eps=_field(raw, "rms_norm_eps", float, src, default=1e-6, positive=True),
        rope=_rope(raw, src),
        tie_word_embeddings=_field(raw, "tie_word_embeddings", bool, src, default=False),
        attention_bias=_field(raw, "attention_bias", bool, src, default=bias_default),
        mlp_bias=_field(raw, "mlp_bias", bool, src, default=False),
        qk_norm=qk_norm,
        bos_token_id=_ids(raw.get("bos_token_id"), src, "bos_token_id")[:1][0] if raw.get("bos_token_id") is not None else None,
        eos_token_ids=eos,
        torch_dtype=dtype,
        extra={k: raw[k] for k in ("model_type",) if k in raw},
    )


@dataclass(frozen=True)
class EngineConfig:
    """What the engine process needs to start; sent from the API process as soon as it is known.
    Fields declared with option() are also `hotstart serve` / `generate` flags (hotstart.flags)."""

    model_path: str
    weight_files: tuple[str, ...] = ()  # in load order (empty: discover in the engine)
    device: str = option("auto", "where the model runs", choices=["auto", "cpu", "cuda"])
    dtype: str = option("auto", "auto: the checkpoint's dtype where the hardware computes it natively, else float32",
                        choices=["auto", "bfloat16", "float16", "float32"])
    max_model_len: int | None = option(None, "longest prompt + completion in tokens "
                                             "(default: the model's max_position_embeddings)", type=at_least_one)
    max_num_seqs: int = option(64, "most sequences batched in one step", type=at_least_one)
    max_num_batched_tokens: int = option(2048, "token budget of one step (prefill chunks + decodes)", type=at_least_one)
    block_size: int = option(16, "tokens per KV-cache block", type=at_least_one)
    kv_cache_memory: int | None = option(None, "bytes for the KV cache (default: CPU enough for max-num-seqs x "
                                               "max-model-len, at most half of what MemAvailable leaves beside "
                                               "the weights, at least one sequence; CUDA from "
                                               "--gpu-memory-utilization)",
                                         type=at_least_one)
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory the engine may use (weights + KV cache)",
                                           type=fraction)
    seed: int = option(0, "seed of the sampler's default generator", type=int)
    compile: str = option("auto", "the fast path, built behind READY: auto = oneDNN-packed weights where their "
                                  "copy fits in memory, else compiled layer graphs where a C++ compiler exists "
                                  "(CPU); eager-only = packed weights, never a compiler; graphs = compiled "
                                  "graphs over the plain weights; off = the plain eager path only",
                          choices=["auto", "eager-only", "graphs", "off"], env="HOTSTART_COMPILE")
    compile_buckets: str = option("1,2,4,8,16,32,64", "token counts the compiled graphs are built for "
                                                      "(a step of T tokens runs on the smallest bucket >= T)",
                                  type=bucket_list)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes computed before "
                                               "(content-hashed full blocks, LRU eviction)", action="boolean")
    tensor_parallel_size: int = option(1, "ranks the model is split over (tensor parallel, one process each, "
                                          "forked from the one forkserver: gloo on CPU, NCCL on CUDA with rank r "
                                          "on cuda:r); the attention and KV heads must be divisible by it",
                                       short="-tp", type=at_least_one)
    cursor_path: str | None = None  # LoadCursor file shared with the API process's prefetcher (None: none)
    t0: float = 0.0  # launch time (time.time()) for the startup timeline

    def compile_bucket_sizes(self) -> tuple[int, ...]:
        """The buckets worth building: none above the most tokens a decode step can have."""
        sizes = sorted({int(b) for b in self.compile_buckets.split(",") if b.strip()})
        fit = [b for b in sizes if b <= self.max_num_seqs]
        bigger = [b for b in sizes if b > self.max_num_seqs]
        return tuple(fit + bigger[:1])

    @classmethod
    def from_args(cls, args, exclude: tuple[str, ...] = (), **fields: Any) -> EngineConfig:
        """The engine flags of ARGS (an argparse namespace; not those in EXCLUDE), plus FIELDS (model_path, ...)."""
        return cls(**values(cls, args, exclude, **fields))


@dataclass(frozen=True)
class ServeConfig:
    """`hotstart serve`'s own flags (the engine's are EngineConfig's)."""

    host: str = option("127.0.0.1", "address to bind (0.0.0.0 to expose)")
    port: int = option(8000, "port (0 picks a free one and prints it)", type=port)
    served_model_name: tuple[str, ...] | None = option(None, "name(s) clients use for the model (repeatable)",
                                                       action="append", type=name)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (prefer the environment variable "
                                       "HOTSTART_API_KEY: other users can read flags in ps)", env="HOTSTART_API_KEY")
    max_request_bytes: int = option(1 << 20, "largest accepted request body", type=at_least_one)
    prespawn: bool = option(True, "start the engine after the API is up, as a fresh interpreter (ablation)",
                            flag="--no-prespawn", action="store_false")
    prefetch: bool = option(True, "do not prefetch weights into the page cache (ablation)", flag="--no-prefetch",
                            action="store_false")
    import_prefetch: bool = option(True, "do not read the imports' files first at t=0, nor hold the weight "
                                         "prefetch back while the imports run (ablation)",
                                   flag="--no-import-prefetch", action="store_false")
    prefetch_threads: int | None = option(None, "prefetch reader threads", type=non_negative)
    prefetch_block_mb: int | None = option(None, "prefetch read size in MiB", type=non_negative)
    prefetch_method: str = option("auto", "how the prefetcher fills the page cache: preadv (reads, copied into "
                                          "a buffer), readahead / fadvise (the kernel queues the reads: no copy), "
                                          "madvise (MADV_POPULATE_READ on a read-only mapping: no copy); auto: "
                                          "the zero-copy default on local disks, preadv on network filesystems",
                                  choices=["auto", "preadv", "readahead", "fadvise", "madvise"])
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

    @classmethod
    def from_args(cls, args) -> ServeConfig:
        """The serve flags of ARGS. HOTSTART_SERIAL=1 (the benchmarks' serial baseline) turns every
        fast-start mechanism off: no forkserver, no zygote, no prefetch."""
        cfg = cls(**values(cls, args))
        if serial_baseline():
            cfg = replace(cfg, prespawn=False, prefetch=False, import_prefetch=False, zygote="off")
        return cfg


def serial_baseline() -> bool:
    """HOTSTART_SERIAL=1: every fast-start mechanism off (the baseline the benchmarks compare to)."""
    return os.environ.get("HOTSTART_SERIAL", "").lower() in ("1", "true", "yes")
