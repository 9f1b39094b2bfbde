"""Every model family hotstart knows, in one torch-free table: the architectures it answers to, how its
config.json is read (as transformers' modeling code reads it), the module that builds it, the real shapes
`hotstart make-model` writes, and the tiny odd-shaped checkpoints the tests compare against transformers.

Readers: model_config.py (flags and defaults), model/registry.py (the builder, imported lazily),
bench/make_model.py and bench/args.py (sizes), tests/conftest.py and benchmarks/gpu_check.py (tiny
configs); the README's model table is model_table()'s output (a test checks). A new family is one entry
here and one small file in hotstart/model/families/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Shape(NamedTuple):
    """A checkpoint's dimensions, as its published config.json gives them."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int | None  # None: hidden // heads
    tied: bool


@dataclass(frozen=True)
class Family:
    """One family: what differs between families is written here and nowhere else."""

    name: str  # `make-model --family NAME`, ModelConfig.family, test ids
    architectures: tuple[str, ...]  # config.json `architectures[0]` values it serves
    model_type: str  # transformers' model_type (AutoConfig.for_model in tests, make-model's config.json)
    builder: str  # "module:class" building the model; imported when a model of the family is loaded
    status: str  # the README's model table
    # -- config.json --
    defaults: dict[str, Any] = field(default_factory=dict)  # field -> value where config.json lacks it
    # Biases: a constant (the modeling code hard-codes it) or the config.json field saying it (absent: False).
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE
    # How the attention window is read. "none": never (full attention whatever the file says);
    # "always": `sliding_window` (null: full); "opt-in": only with `use_sliding_window: true`, on the layers
    # `layer_types` names "sliding_attention" (absent: layers from `max_window_layers` on); "pattern": the
    # `layer_types` ones (absent: all but every `sliding_window_pattern`-th layer, Gemma).
    sliding_window: str = "none"
    # -- Gemma's differences (the defaults: none of them) --
    activation: str = "hidden_act"  # the config.json field naming the MLP's activation
    query_scalar: bool = False  # queries scaled by `query_pre_attn_scalar` ** -0.5, not head_dim ** -0.5
    softcaps: tuple[str, ...] = ()  # the logit soft-capping fields its code applies
    local_rope: bool = False  # the sliding layers have their own RoPE (`rope_local_base_freq`)
    # RMSNorms of each decoder layer (make-model writes them)
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # -- hotstart make-model --
    sizes: dict[str, Shape] = field(default_factory=dict)
    make_config: dict[str, Any] = field(default_factory=dict)  # config.json fields beside the shape
    size_config: dict[str, dict[str, Any]] = field(default_factory=dict)  # per size: changes to make_config
    # -- tests (transformers config kwargs) --
    tiny: dict[str, Any] = field(default_factory=dict)  # odd shapes on purpose
    tiny_tp: dict[str, Any] = field(default_factory=dict)  # changes to tiny: heads and MLP divisible by 2


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE_1M = {"rope_type": "default", "rope_theta": 1000000.0}
GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")
# Gemma 3: one RoPE per layer type (transformers >= 5 writes them so)
GEMMA3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
GEMMA_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                  "sliding_window": 4096}
# `make-model --size tiny` (any family): 4 heads / 2 KV heads of 32
MAKE_TINY = Shape(128, 384, 2, 4, 2, 32, True)

FAMILIES: tuple[Family, ...] = (
    Family(
        "llama", ("LlamaForCausalLM",), "llama", "hotstart.model.families.llama:LlamaForCausalLM",
        "supported: Llama 2 / 3.x, SmolLM2 (RoPE default, linear, llama3, dynamic)",
        defaults={"max_position_embeddings": 2048},
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
        # Llama-3.2-1B / 3B, Llama-3-8B (which has no RoPE scaling and an 8k context: Llama-3.1 added them)
        sizes={"1b": Shape(2048, 8192, 16, 32, 8, 64, True), "3b": Shape(3072, 8192, 28, 24, 8, 128, True),
               "8b": Shape(4096, 14336, 32, 32, 8, 128, False)},
        make_config={"rms_norm_eps": 1e-5, "rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 131072,
                     "attention_bias": False, "mlp_bias": False},
        size_config={"8b": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                            "max_position_embeddings": 8192}},
        # 5 heads / 1 KV head, llama3 RoPE scaling with a short original context
        tiny=dict(hidden_size=80, intermediate_size=144, num_hidden_layers=2, num_attention_heads=5,
                  num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, initializer_range=0.2, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
        # attention and MLP biases: the row-parallel layers add theirs after the all-reduce
        tiny_tp=dict(hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                     attention_bias=True, mlp_bias=True),
    ),
    Family(
        "qwen2", ("Qwen2ForCausalLM",), "qwen2", "hotstart.model.families.qwen2:Qwen2ForCausalLM",
        "supported: Qwen2, Qwen2.5 (`use_sliding_window`: windowed from layer `max_window_layers` on)",
        defaults={"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
                  "max_window_layers": 28},
        qkv_bias=True, sliding_window="opt-in",
        # Qwen2.5-0.5B / 1.5B / 3B / 7B
        sizes={"0.5b": Shape(896, 4864, 24, 14, 2, None, True),
               "1.5b": Shape(1536, 8960, 28, 12, 2, None, True),
               "3b": Shape(2048, 11008, 36, 16, 2, None, True),
               "7b": Shape(3584, 18944, 28, 28, 4, None, False)},
        make_config={"rms_norm_eps": 1e-6, "rope_parameters": ROPE_1M, "max_position_embeddings": 32768,
                     "use_sliding_window": False, "sliding_window": None},
        # 6 heads / 3 KV heads, q/k/v biases
        tiny=dict(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=3, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2),
        tiny_tp=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2),
    ),
    Family(
        "qwen3", ("Qwen3ForCausalLM",), "qwen3", "hotstart.model.families.qwen3:Qwen3ForCausalLM",
        "supported: Qwen3 (dense; with `use_sliding_window`: windowed layers as `layer_types` says)",
        defaults={"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128,
                  "sliding_window": 4096, "max_window_layers": 28},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, sliding_window="opt-in",
        # Qwen3-0.6B / 1.7B / 4B / 8B
        sizes={"0.6b": Shape(1024, 3072, 28, 16, 8, 128, True),
               "1.7b": Shape(2048, 6144, 28, 16, 8, 128, True),
               "4b": Shape(2560, 9728, 36, 32, 8, 128, True),
               "8b": Shape(4096, 12288, 36, 32, 8, 128, False)},
        make_config={"rms_norm_eps": 1e-6, "rope_parameters": ROPE_1M, "max_position_embeddings": 40960,
                     "attention_bias": False, "use_sliding_window": False, "sliding_window": None},
        # head_dim 24 != hidden / heads, tied embeddings
        tiny=dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=3, head_dim=24, vocab_size=512, max_position_embeddings=1024,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.2),
        # an odd vocabulary: the last rank's vocabulary shard is shorter
        tiny_tp=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=24, vocab_size=509),
    ),
    Family(
        "mistral", ("MistralForCausalLM",), "mistral", "hotstart.model.families.llama:LlamaForCausalLM",
        "supported: Mistral 7B v0.1 - v0.3 (`sliding_window` on every layer, or null)",
        defaults={"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
        sliding_window="always",
        # Mistral-7B-v0.3 (no sliding window)
        sizes={"7b": Shape(4096, 14336, 32, 32, 8, 128, False)},
        make_config={"rms_norm_eps": 1e-5, "rope_parameters": ROPE_1M, "max_position_embeddings": 32768,
                     "sliding_window": None},
        # head_dim 20 != hidden / heads; a window of 16, shorter than the test prompts
        tiny=dict(hidden_size=96, intermediate_size=136, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=20, vocab_size=512, max_position_embeddings=1024,
                  sliding_window=16, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  initializer_range=0.2),
        tiny_tp=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    ),
    Family(
        "gemma2", ("Gemma2ForCausalLM",), "gemma2", "hotstart.model.families.gemma2:Gemma2ForCausalLM",
        "supported: Gemma 2 (sliding window on alternate layers, logit soft-capping)",
        defaults={**GEMMA_DEFAULTS, "max_position_embeddings": 8192, "sliding_window_pattern": 2,
                  "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        qkv_bias="attention_bias", o_bias="attention_bias", sliding_window="pattern",
        activation="hidden_activation", query_scalar=True,
        softcaps=("attn_logit_softcapping", "final_logit_softcapping"), layer_norms=GEMMA_NORMS,
        # gemma-2-2b / 9b
        sizes={"2b": Shape(2304, 9216, 26, 8, 4, 256, True), "9b": Shape(3584, 14336, 42, 16, 8, 256, True)},
        make_config={"rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                     "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh",
                     "query_pre_attn_scalar": 256, "sliding_window": 4096, "attention_bias": False,
                     "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        # 3 heads / 1 KV head of 20 (!= 72 / 3), a window of 8 on layers 0 and 2, caps that bite
        tiny=dict(hidden_size=72, intermediate_size=136, num_hidden_layers=3, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=20, vocab_size=512, max_position_embeddings=1024,
                  sliding_window=8, query_pre_attn_scalar=18, attn_logit_softcapping=4.0,
                  final_logit_softcapping=8.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  initializer_range=0.2),
        tiny_tp=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16),
    ),
    Family(
        "gemma3", ("Gemma3ForCausalLM",), "gemma3_text", "hotstart.model.families.gemma3:Gemma3ForCausalLM",
        "supported: Gemma 3 text-only (`Gemma3ForCausalLM`: 5 sliding layers to 1 global, local RoPE)",
        defaults={**GEMMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window_pattern": 6,
                  "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, sliding_window="pattern",
        activation="hidden_activation", query_scalar=True, softcaps=("final_logit_softcapping",),
        local_rope=True, layer_norms=GEMMA_NORMS,
        # gemma-3-1b-it / the text model of gemma-3-4b-it
        sizes={"1b": Shape(1152, 6912, 26, 4, 1, 256, True), "4b": Shape(2560, 10240, 34, 8, 4, 256, True)},
        make_config={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
                     "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 512,
                     "attention_bias": False, "rope_parameters": GEMMA3_ROPE,
                     "final_logit_softcapping": None, "attn_logit_softcapping": None},
        size_config={"4b": {"sliding_window": 1024, "max_position_embeddings": 131072,
                            "rope_parameters": {**GEMMA3_ROPE, "full_attention": {
                                "rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}},
        # head_dim 24 != 96 / 6, a window of 12 on all but every 3rd layer, linear RoPE on global layers
        tiny=dict(hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=3, head_dim=24, vocab_size=512, max_position_embeddings=1024,
                  sliding_window=12, sliding_window_pattern=3, query_pre_attn_scalar=20,
                  final_logit_softcapping=8.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  initializer_range=0.2,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                      "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        tiny_tp=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16),
    ),
)

# Architectures refused today with "not supported yet": the families the next issue adds.
PLANNED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("phi3", ("Phi3ForCausalLM",)),
    ("olmo2", ("Olmo2ForCausalLM",)),
    ("moe", ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")),
)


# Architectures refused for good, with the reason.
REFUSED: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (vision tower) is not served; text-only "
                                      "Gemma3ForCausalLM checkpoints are",
}


def names() -> list[str]:
    return [f.name for f in FAMILIES]


def by_name(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"unknown family {name!r} (known: {', '.join(names())})")


def for_architecture(architecture: str) -> Family | None:
    """The family serving ARCHITECTURE (config.json's architectures[0]), or None."""
    return next((f for f in FAMILIES if architecture in f.architectures), None)


def planned(architecture: str) -> bool:
    return any(architecture in archs for _, archs in PLANNED)


def architectures() -> list[str]:
    return [a for f in FAMILIES for a in f.architectures]


def tiny_checkpoints() -> dict[str, tuple[str, dict[str, Any]]]:
    """Test checkpoint name ("qwen2", "qwen2-tp", ...) -> (model_type, transformers config kwargs)."""
    out = {}
    for f in FAMILIES:
        base = {"architectures": [f.architectures[0]], **f.tiny}
        out[f.name] = (f.model_type, base)
        out[f"{f.name}-tp"] = (f.model_type, {**base, **f.tiny_tp})
    return out


def model_table() -> str:
    """The README's model table (markdown)."""
    rows = ["| family | architectures | `make-model --size` | status |", "|---|---|---|---|"]
    for f in FAMILIES:
        archs = ", ".join(f"`{a}`" for a in f.architectures)
        rows.append(f"| {f.name} | {archs} | {', '.join(f.sizes)}, tiny | {f.status} |")
    for name, archs in PLANNED:
        rows.append(f"| {name} | {', '.join(f'`{a}`' for a in archs)} | | not yet: refused at load |")
    return "\n".join(rows) + "\n"
