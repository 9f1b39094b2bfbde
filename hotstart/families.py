"""Every model family hotstart knows, in one torch-free table: the architectures it answers to, how its
config.json is read (as transformers' modeling code reads it), the module that builds it, and the real
shapes `hotstart make-model` writes.

Readers: model_config.py (flags and defaults), model/registry.py (the builder, imported lazily),
bench/make_model.py and bench/args.py (sizes); the README's model table is model_table()'s output (a test
checks). The tiny odd-shaped checkpoints the tests compare against transformers are tests/helpers/
families.py's. A new family is one entry here, one small file in hotstart/model/families/ and a tiny
config there.
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


class Moe(NamedTuple):
    """A mixture-of-experts family's facts: checkpoint names and how its config.json is read."""

    block: str  # the layer's MoE module in the checkpoint ("mlp", Mixtral: "block_sparse_moe")
    gate: str  # each expert's projections: <block>.experts.N.<gate|up|down>.weight
    up: str
    down: str
    intermediate: str  # the config.json field of each expert's width
    norm_topk: bool | str  # renormalise the top-k weights: a constant, or the config.json field saying it
    shared_expert: bool = False  # Qwen2-MoE: a sigmoid-gated shared expert beside the routed ones
    sparse_step: bool = False  # reads `decoder_sparse_step` and `mlp_only_layers` (dense layers among MoE)


QWEN_MOE_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj", "moe_intermediate_size", "norm_topk_prob")


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
    qk_norm: bool | str = False  # True: RMSNorm over each head of q and k, before RoPE; "full": over the
    # whole q and k projections (OLMo 2: its own module; ModelConfig.qk_norm says per head only)
    post_norm: bool = False  # OLMo 2: norms after attention and after the MLP, none before them
    fused_checkpoint: bool = False  # Phi-3: the checkpoint ships qkv_proj and gate_up_proj fused
    partial_rotary: bool = False  # its code reads `partial_rotary_factor` (others refuse one below 1)
    rope_aliases: dict[str, str] = field(default_factory=dict)  # rope type in config.json -> as read
    tensor_parallel: str = ""  # not empty: why --tensor-parallel-size above 1 is refused
    # How the attention window is read. "none": never (full attention whatever the file says);
    # "always": `sliding_window` (null: full); "opt-in": only with `use_sliding_window: true`, on the layers
    # `layer_types` names "sliding_attention" (absent: layers from `max_window_layers` on); "opt-in-all":
    # with `use_sliding_window: true`, every layer (Qwen3-MoE); "opt-in-even": with `use_sliding_window:
    # true`, the `layer_types` ones (absent: the even layers below `max_window_layers`, Qwen2-MoE);
    # "pattern": the `layer_types` ones (absent: all but every `sliding_window_pattern`-th layer, Gemma).
    sliding_window: str = "none"
    moe: Moe | None = None  # a mixture of experts (hotstart/model/moe.py); None: dense MLPs
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
        "supported: Llama 2 / 3.x, SmolLM2 (RoPE default, linear, llama3, dynamic, yarn)",
        defaults={"max_position_embeddings": 2048},
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
        # Llama-3.2-1B / 3B, Llama-3-8B (which has no RoPE scaling and an 8k context: Llama-3.1 added them)
        sizes={"1b": Shape(2048, 8192, 16, 32, 8, 64, True), "3b": Shape(3072, 8192, 28, 24, 8, 128, True),
               "8b": Shape(4096, 14336, 32, 32, 8, 128, False)},
        make_config={"rms_norm_eps": 1e-5, "rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 131072,
                     "attention_bias": False, "mlp_bias": False},
        size_config={"8b": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                            "max_position_embeddings": 8192}},
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
    ),
    Family(
        "mixtral", ("MixtralForCausalLM",), "mixtral", "hotstart.model.families.mixtral:MixtralForCausalLM",
        "supported: Mixtral 8x7B / 8x22B (`sliding_window` on every layer, or null)",
        defaults={"max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                  "num_local_experts": 8, "num_experts_per_tok": 2},
        sliding_window="always",
        moe=Moe("block_sparse_moe", "w1", "w3", "w2", "intermediate_size", norm_topk=True),
        # Mixtral-8x7B-v0.1: 8 experts of 14336, 2 per token
        sizes={"8x7b": Shape(4096, 14336, 32, 32, 8, 128, False)},
        make_config={"rms_norm_eps": 1e-5, "rope_parameters": ROPE_1M, "max_position_embeddings": 32768,
                     "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
        size_config={"tiny": {"num_local_experts": 4}},
    ),
    Family(
        "qwen2-moe", ("Qwen2MoeForCausalLM",), "qwen2_moe",
        "hotstart.model.families.qwen2_moe:Qwen2MoeForCausalLM",
        "supported: Qwen1.5-MoE, Qwen2-MoE (routed and sigmoid-gated shared experts; `use_sliding_window`: "
        "windowed layers as `layer_types` says)",
        defaults={"max_position_embeddings": 32768, "num_key_value_heads": 16, "qkv_bias": True,
                  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "max_window_layers": 28},
        qkv_bias="qkv_bias", sliding_window="opt-in-even",
        moe=Moe(*QWEN_MOE_NAMES, shared_expert=True, sparse_step=True),
        # Qwen1.5-MoE-A2.7B: 60 experts of 1408, 4 per token, a shared expert of 5632
        sizes={"14b-a2.7b": Shape(2048, 5632, 24, 16, 16, None, False)},
        make_config={"rms_norm_eps": 1e-6, "rope_parameters": ROPE_1M, "max_position_embeddings": 8192,
                     "use_sliding_window": False, "qkv_bias": True, "num_experts": 60,
                     "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                     "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                     "decoder_sparse_step": 1, "mlp_only_layers": []},
        size_config={"tiny": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                              "shared_expert_intermediate_size": 192}},
    ),
    Family(
        "qwen3-moe", ("Qwen3MoeForCausalLM",), "qwen3_moe",
        "hotstart.model.families.qwen3_moe:Qwen3MoeForCausalLM",
        "supported: Qwen3-MoE (30B-A3B, 235B-A22B; `use_sliding_window`: every layer windowed)",
        defaults={"max_position_embeddings": 32768, "num_key_value_heads": 4, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, sliding_window="opt-in-all",
        moe=Moe(*QWEN_MOE_NAMES, sparse_step=True),
        # Qwen3-30B-A3B: 128 experts of 768, 8 per token; 3b-a0.6b: that shape scaled to fit a 24 GB host
        sizes={"30b-a3b": Shape(2048, 6144, 48, 32, 4, 128, False),
               "3b-a0.6b": Shape(1024, 3072, 28, 16, 4, 128, True)},
        make_config={"rms_norm_eps": 1e-6, "rope_parameters": ROPE_1M, "max_position_embeddings": 40960,
                     "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                     "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                     "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
        size_config={"3b-a0.6b": {"num_experts": 64, "moe_intermediate_size": 512},
                     "tiny": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96}},
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
    ),
)

# Phi-3.5-mini-instruct's and Phi-4-mini-instruct's LongRoPE factors (rotary dims / 2 = 48 each), rounded
PHI35_LONG = [1.08, 1.11, 1.14, 1.34, 1.59, 1.6, 1.62, 2.62, 3.23, 3.23, 4.79, 7.4, 7.7, 9.09, 12.2, 17.67,
              24.46, 28.57, 30.42, 30.84, 32.59, 32.93, 42.32, 44.96, 50.34, 50.45, 57.55, 57.93, 58.21,
              60.14, 62.61, 62.62, 62.71, 63.14, 63.14, 63.77, 63.93, 63.96, 63.97, 64.03, 64.07, 64.08,
              64.12, 64.41, 64.48, 64.51, 64.53, 64.84]
PHI35_SHORT = [1.0, 1.02, 1.03, 1.03, 1.05, 1.05, 1.05, 1.05, 1.05, 1.07, 1.1, 1.11, 1.16, 1.16, 1.17, 1.29,
               1.34, 1.68, 1.79, 1.82, 1.85, 1.88, 1.91, 1.94, 1.99, 2.02, 2.02, 2.02, 2.02, 2.02, 2.02, 2.03,
               2.03, 2.03, 2.03, 2.03, 2.03, 2.03, 2.03, 2.03, 2.08, 2.09, 2.19, 2.22, 2.59, 2.73, 2.75, 2.84]
PHI4_LONG = [1.0, 1.1183, 1.2506, 1.3986, 1.5641, 1.7492, 1.9561, 2.1876, 2.4464, 2.7359, 3.0596, 3.4216,
             3.8265, 4.2792, 4.7855, 5.3517, 5.985, 6.6931, 7.485, 8.3707, 9.3611, 10.4687, 11.7074, 13.0926,
             14.6417, 16.3742, 18.3116, 20.4782, 22.9012, 25.6109, 28.6412, 32.03, 32.1, 32.13, 32.23, 32.6,
             32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]

PHI_FAMILIES: tuple[Family, ...] = (
    Family(
        "phi3", ("Phi3ForCausalLM",), "phi3", "hotstart.model.families.phi3:Phi3ForCausalLM",
        "supported: Phi-3, Phi-3.5, Phi-4-mini (fused qkv / gate_up, LongRoPE, partial rotary; "
        "`sliding_window` on every layer)",
        defaults={"max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                  "rms_norm_eps": 1e-5},
        sliding_window="always", fused_checkpoint=True, partial_rotary=True,
        # transformers' Phi3Config reads the old names "su" and "yarn" as longrope
        rope_aliases={"su": "longrope", "yarn": "longrope"},
        # Phi-3.5-mini-instruct (3.8B) and Phi-4-mini-instruct
        sizes={"mini": Shape(3072, 8192, 32, 32, 32, None, False),
               "phi4-mini": Shape(3072, 8192, 32, 24, 8, None, True)},
        make_config={"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 131072,
                     "original_max_position_embeddings": 4096, "sliding_window": 262144,
                     "attention_bias": False, "rope_scaling": {"type": "longrope", "long_factor": PHI35_LONG,
                                                               "short_factor": PHI35_SHORT}},
        size_config={"phi4-mini": {"partial_rotary_factor": 0.75, "rope_scaling": {
            "type": "longrope", "long_factor": PHI4_LONG, "short_factor": [1.0] * 48}},
            "tiny": {"rope_scaling": None, "max_position_embeddings": 4096}},  # 48 factors fit no tiny head
    ),
    Family(
        "olmo2", ("Olmo2ForCausalLM",), "olmo2", "hotstart.model.families.olmo2:Olmo2ForCausalLM",
        "supported: OLMo 2 (post-norm, q/k norm over the whole projection; tensor parallel refused)",
        defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm="full", post_norm=True,
        tensor_parallel="OLMo 2's q/k RMSNorm spans the heads of every rank (not implemented)",
        # OLMo-2-0425-1B, OLMo-2-1124-7B
        sizes={"1b": Shape(2048, 8192, 16, 16, 16, None, False),
               "7b": Shape(4096, 11008, 32, 32, 32, None, False)},
        make_config={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "attention_bias": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    ),
)
FAMILIES += PHI_FAMILIES

# Architectures refused today with "not supported yet": the families the next issue adds.
PLANNED: tuple[tuple[str, tuple[str, ...]], ...] = (
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


def model_table() -> str:
    """The README's model table (markdown)."""
    rows = ["| family | architectures | `make-model --size` | status |", "|---|---|---|---|"]
    for f in FAMILIES:
        archs = ", ".join(f"`{a}`" for a in f.architectures)
        rows.append(f"| {f.name} | {archs} | {', '.join(f.sizes)}, tiny | {f.status} |")
    for name, archs in PLANNED:
        rows.append(f"| {name} | {', '.join(f'`{a}`' for a in archs)} | | not yet: refused at load |")
    return "\n".join(rows) + "\n"
