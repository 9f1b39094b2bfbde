"""Every model family hotstart knows, in one torch-free table: the architectures it answers to, how its
config.json is read (as transformers' modeling code reads it) and the module that builds it.

Readers: model_config.py (flags and defaults; rope_config.py and sliding_window.py for theirs),
model/registry.py (the builder, imported lazily), bench/make_model.py (the checkpoint's names). A new
family is one entry here, its make-model sizes (hotstart/bench/model_sizes.py, whose model_table() is
the README's table), a tiny odd-shaped config the tests compare against transformers
(tests/helpers/families.py) and, where its layer differs from the shared one, a small file in
hotstart/model/families/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, NamedTuple


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


class Window(Enum):
    """How a family's code reads the attention window (hotstart/sliding_window.py: one rule each)."""

    NONE = auto()  # never: full attention whatever the file says
    ALWAYS = auto()  # `sliding_window` on every layer (null: full)
    # the OPT_IN ones only with `use_sliding_window: true`
    OPT_IN = auto()  # `layer_types`, else the layers from `max_window_layers` on (Qwen2, Qwen3)
    OPT_IN_ALL = auto()  # every layer (Qwen3-MoE)
    OPT_IN_EVEN = auto()  # `layer_types`, else the even layers below `max_window_layers` (Qwen2-MoE)
    PATTERN = auto()  # `layer_types`, else all but every `sliding_window_pattern`-th layer (Gemma)


QWEN_MOE_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj", "moe_intermediate_size", "norm_topk_prob")


@dataclass(frozen=True)
class Family:
    """One family: what differs between families is written here and nowhere else."""

    name: str  # `make-model --family NAME`, ModelConfig.family, test ids
    architectures: tuple[str, ...]  # config.json `architectures[0]` values it serves
    model_type: str  # transformers' model_type (AutoConfig.for_model in tests, make-model's config.json)
    status: str  # the README's model table
    # "module:class" of a family with a layer of its own (hotstart/model/families/), imported when a model
    # of it loads; "": the shared CausalLM (model/decoder.py), MoECausalLM (model/moe.py) with experts
    builder: str = ""
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
    sliding_window: Window = Window.NONE  # how the attention window is read
    moe: Moe | None = None  # a mixture of experts (hotstart/model/moe.py); None: dense MLPs
    # -- Gemma's differences (the defaults: none of them) --
    activation: str = "hidden_act"  # the config.json field naming the MLP's activation
    query_scalar: bool = False  # queries scaled by `query_pre_attn_scalar` ** -0.5, not head_dim ** -0.5
    softcaps: tuple[str, ...] = ()  # the logit soft-capping fields its code applies
    local_rope: bool = False  # the sliding layers have their own RoPE (`rope_local_base_freq`)
    # RMSNorms of each decoder layer (make-model writes them)
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")


GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")
GEMMA_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                  "sliding_window": 4096}

FAMILIES: tuple[Family, ...] = (
    Family(
        "llama", ("LlamaForCausalLM",), "llama",
        "supported: Llama 2 / 3.x, SmolLM2 (RoPE default, linear, llama3, dynamic, yarn)",
        defaults={"max_position_embeddings": 2048},
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    ),
    Family(
        "qwen2", ("Qwen2ForCausalLM",), "qwen2",
        "supported: Qwen2, Qwen2.5 (`use_sliding_window`: windowed from layer `max_window_layers` on)",
        defaults={"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
                  "max_window_layers": 28},
        qkv_bias=True, sliding_window=Window.OPT_IN,
    ),
    Family(
        "qwen3", ("Qwen3ForCausalLM",), "qwen3",
        "supported: Qwen3 (dense; with `use_sliding_window`: windowed layers as `layer_types` says)",
        defaults={"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128,
                  "sliding_window": 4096, "max_window_layers": 28},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, sliding_window=Window.OPT_IN,
    ),
    Family(
        "mistral", ("MistralForCausalLM",), "mistral",
        "supported: Mistral 7B v0.1 - v0.3 (`sliding_window` on every layer, or null)",
        defaults={"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
        sliding_window=Window.ALWAYS,
    ),
    Family(
        "mixtral", ("MixtralForCausalLM",), "mixtral",
        "supported: Mixtral 8x7B / 8x22B (`sliding_window` on every layer, or null)",
        defaults={"max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                  "num_local_experts": 8, "num_experts_per_tok": 2},
        sliding_window=Window.ALWAYS,
        moe=Moe("block_sparse_moe", "w1", "w3", "w2", "intermediate_size", norm_topk=True),
    ),
    Family(
        "qwen2-moe", ("Qwen2MoeForCausalLM",), "qwen2_moe",
        "supported: Qwen1.5-MoE, Qwen2-MoE (routed and sigmoid-gated shared experts; `use_sliding_window`: "
        "windowed layers as `layer_types` says)",
        defaults={"max_position_embeddings": 32768, "num_key_value_heads": 16, "qkv_bias": True,
                  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "max_window_layers": 28},
        qkv_bias="qkv_bias", sliding_window=Window.OPT_IN_EVEN,
        moe=Moe(*QWEN_MOE_NAMES, shared_expert=True, sparse_step=True),
    ),
    Family(
        "qwen3-moe", ("Qwen3MoeForCausalLM",), "qwen3_moe",
        "supported: Qwen3-MoE (30B-A3B, 235B-A22B; `use_sliding_window`: every layer windowed)",
        defaults={"max_position_embeddings": 32768, "num_key_value_heads": 4, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, sliding_window=Window.OPT_IN_ALL,
        moe=Moe(*QWEN_MOE_NAMES, sparse_step=True),
    ),
    Family(
        "gemma2", ("Gemma2ForCausalLM",), "gemma2",
        "supported: Gemma 2 (sliding window on alternate layers, logit soft-capping)",
        builder="hotstart.model.families.gemma2:Gemma2ForCausalLM",
        defaults={**GEMMA_DEFAULTS, "max_position_embeddings": 8192, "sliding_window_pattern": 2,
                  "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        qkv_bias="attention_bias", o_bias="attention_bias", sliding_window=Window.PATTERN,
        activation="hidden_activation", query_scalar=True,
        softcaps=("attn_logit_softcapping", "final_logit_softcapping"), layer_norms=GEMMA_NORMS,
    ),
    Family(
        "gemma3", ("Gemma3ForCausalLM",), "gemma3_text",
        "supported: Gemma 3 text-only (`Gemma3ForCausalLM`: 5 sliding layers to 1 global, local RoPE)",
        builder="hotstart.model.families.gemma3:Gemma3ForCausalLM",
        defaults={**GEMMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window_pattern": 6,
                  "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, sliding_window=Window.PATTERN,
        activation="hidden_activation", query_scalar=True, softcaps=("final_logit_softcapping",),
        local_rope=True, layer_norms=GEMMA_NORMS,
    ),
    Family(
        "phi3", ("Phi3ForCausalLM",), "phi3",
        "supported: Phi-3, Phi-3.5, Phi-4-mini (fused qkv / gate_up, LongRoPE, partial rotary; "
        "`sliding_window` on every layer)",
        builder="hotstart.model.families.phi3:Phi3ForCausalLM",
        defaults={"max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                  "rms_norm_eps": 1e-5},
        sliding_window=Window.ALWAYS, fused_checkpoint=True, partial_rotary=True,
        # transformers' Phi3Config reads the old names "su" and "yarn" as longrope
        rope_aliases={"su": "longrope", "yarn": "longrope"},
    ),
    Family(
        "olmo2", ("Olmo2ForCausalLM",), "olmo2",
        "supported: OLMo 2 (post-norm, q/k norm over the whole projection; tensor parallel refused)",
        builder="hotstart.model.families.olmo2:Olmo2ForCausalLM",
        defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm="full", post_norm=True,
        tensor_parallel="OLMo 2's q/k RMSNorm spans the heads of every rank (not implemented)",
    ),
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


def architectures() -> list[str]:
    return [a for f in FAMILIES for a in f.architectures]
