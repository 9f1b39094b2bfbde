"""The family table (hotstart/families.py), config.json as each family reads it (hotstart/model_config.py)
and the registry (hotstart/model/registry.py): the same file read by hotstart and by transformers gives
the same tensors, the same shape facts and the same attention window; what hotstart does not implement
is refused with one line naming the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.families import tiny_checkpoints

from hotstart import families
from hotstart.config import EngineConfig
from hotstart.engine.placement import max_model_len_for
from hotstart.errors import ModelConfigError
from hotstart.model import registry
from hotstart.model.decoder import CausalLM
from hotstart.model_config import load_model_config, parse_model_config

TINY = tiny_checkpoints()
DROP = object()  # a change that removes the field


def _write(tmp_path, family: str, **changes) -> str:
    """A folder with the config.json of FAMILY's tiny config and CHANGES."""
    model_type, kw = TINY[family]
    raw = {"model_type": model_type, **kw}
    for k, v in changes.items():
        if v is DROP:
            raw.pop(k, None)
        else:
            raw[k] = v
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def _theirs(folder: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def _published(shapes: dict[str, tuple], fam: families.Family) -> dict[str, tuple]:
    """transformers 5's in-memory names -> the checkpoint's: it holds a layer's experts as 3-D parameters
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) and writes them (save_pretrained), as
    published checkpoints have them, one tensor per expert and projection, under the family's names."""
    if fam.moe is None:
        return shapes
    out, m = {}, fam.moe
    for name, shape in shapes.items():
        layer, sep, rest = name.partition(".mlp.")
        block = f"{layer}.{m.block}." if rest.startswith(("experts.", "gate.")) else f"{layer}.mlp."
        if not sep or not rest.startswith("experts."):
            out[block + rest if sep else name] = shape
        elif rest == "experts.gate_up_proj":
            out.update({f"{block}experts.{e}.{p}.weight": (shape[1] // 2, shape[2])
                        for e in range(shape[0]) for p in (m.gate, m.up)})
        else:
            out.update({f"{block}experts.{e}.{m.down}.weight": shape[1:] for e in range(shape[0])})
    return out


# config.json variants each family must read as transformers does: the fields that decide which tensors
# exist (biases, head_dim), and defaults where a field is absent
VARIANTS = {"as is": {}, "attention_bias": {"attention_bias": True}, "mlp_bias": {"mlp_bias": True},
            "no head_dim": {"head_dim": DROP}, "no context": {"max_position_embeddings": DROP},
            "no eps": {"rms_norm_eps": DROP}, "no tie": {"tie_word_embeddings": DROP}}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", families.names())
def test_config_read_as_transformers_reads_it(tmp_path, family, variant):
    folder = _write(tmp_path, family, **VARIANTS[variant])
    theirs_cfg, theirs = _theirs(folder)
    cfg = load_model_config(folder)
    with torch.device("meta"):
        ours = registry.model_class(cfg)(cfg, fused=False)
    want = _published({n: tuple(p.shape) for n, p in theirs.state_dict().items()}, families.by_name(family))
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)  # tied: not in the checkpoint
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == want
    assert cfg.tie_word_embeddings == theirs_cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == theirs_cfg.max_position_embeddings
    assert cfg.rms_norm_eps == theirs_cfg.rms_norm_eps
    rope = theirs_cfg.rope_parameters
    if "full_attention" in rope:  # Gemma 3: one per layer type
        assert cfg.rope_local.theta == rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    assert cfg.rope.theta == rope["rope_theta"]


def _logits(folder: str, ids: torch.Tensor, state: dict | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        return model(ids, use_cache=False).logits, model.state_dict()


# (family, config.json changes): sliding windows that transformers applies and ones it ignores
WINDOWS = [
    ("mistral", {"sliding_window": 8}),
    ("mistral", {"sliding_window": 64}),
    ("llama", {"sliding_window": 8}),  # Llama's code never reads it
    ("qwen2", {"sliding_window": 8}),  # without use_sliding_window
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}),  # no layer slides
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8,
               "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"] * 3}),
    ("gemma2", {}),  # layer_types written by transformers
    ("gemma2", {"layer_types": DROP}),  # absent: every other layer, from layer 0
    ("gemma3", {"layer_types": DROP, "sliding_window_pattern": 2}),
    ("mixtral", {"sliding_window": 8}),
    ("qwen3-moe", {"sliding_window": 8}),  # without use_sliding_window
    ("qwen3-moe", {"use_sliding_window": True, "sliding_window": 8}),  # every layer
    ("qwen2-moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}),  # 0 and 2
    ("qwen2-moe", {"use_sliding_window": True, "sliding_window": 8,
                   "layer_types": ["sliding_attention"] + ["full_attention"] * 3}),
]
SLIDE_EVERY_LAYER = ("mistral", "mixtral", "qwen3-moe")  # their code applies the window to every layer


@pytest.mark.parametrize("family,changes", WINDOWS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(WINDOWS)])
def test_windows_are_read_as_transformers_reads_them(tmp_path, family, changes):
    """The window of each layer, as transformers' config gives it (and a window masks only where it does)."""
    from transformers import AutoConfig

    folder = _write(tmp_path, family, **changes)
    theirs = AutoConfig.from_pretrained(folder)
    cfg = load_model_config(folder)
    window = getattr(theirs, "sliding_window", None)
    types = getattr(theirs, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if family in SLIDE_EVERY_LAYER:
        types = ["sliding_attention"] * cfg.num_hidden_layers
    want = [window if t == "sliding_attention" else None for t in types]
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == want
    ids = torch.arange(1, 25).unsqueeze(0)  # 24 tokens: past a window of 8, within one of 64
    windowed, state = _logits(folder, ids)
    plain = {k: DROP for k in ("sliding_window", "use_sliding_window", "layer_types", "max_window_layers",
                               "sliding_window_pattern")}
    if family.startswith("gemma"):
        plain = {"sliding_window": 4096}  # (transformers' Gemma code cannot run without a window)
    full, _ = _logits(_write(tmp_path / "full", family, **plain), ids, state)
    masks = not torch.allclose(windowed, full, atol=1e-6)
    assert masks == any(w is not None and w < 24 for w in want)


def test_gemma3_rope_fields_of_older_files(tmp_path):
    """rope_theta / rope_scaling (the global layers) and rope_local_base_freq (the sliding ones)."""
    from transformers import AutoConfig

    folder = _write(tmp_path, "gemma3", rope_parameters=DROP, rope_theta=500000.0,
                    rope_local_base_freq=20000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    theirs = AutoConfig.from_pretrained(folder).rope_parameters
    cfg = load_model_config(folder)
    glob, local = theirs["full_attention"], theirs["sliding_attention"]
    assert (cfg.rope.theta, cfg.rope.type, cfg.rope.factor) == (glob["rope_theta"], "linear", glob["factor"])
    assert (cfg.rope_local.theta, cfg.rope_local.type) == (local["rope_theta"], local["rope_type"]) == \
        (20000.0, "default")


def test_the_served_context_is_not_bounded_by_the_window(tmp_path):
    folder = _write(tmp_path, "mistral", sliding_window=256)
    cfg = load_model_config(folder)
    assert max_model_len_for(EngineConfig(model_path=folder), cfg) == 1024  # max_position_embeddings
    null = _write(tmp_path / "m", "mistral", sliding_window=None)
    assert load_model_config(null).sliding_window is None  # null: full attention (Mistral-7B-v0.2 on)


@pytest.mark.parametrize("family,changes,message", [
    ("llama", {"hidden_act": "gelu"}, r"field 'hidden_act' 'gelu' is not supported"),
    ("qwen2", {"partial_rotary_factor": 0.5}, r"field 'partial_rotary_factor' \(0.5\) is not supported"),
    # "su" is longrope to Phi-3's code only
    ("llama", {"rope_scaling": {"rope_type": "su", "factor": 4.0}}, r"field 'rope_scaling' type 'su'"),
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [1.0] * 5}},
     r"field 'rope_scaling.long_factor' must list 6 numbers"),
    ("phi3", {"partial_rotary_factor": 0.7}, r"field 'partial_rotary_factor' \(0.7\) must be in \(0, 1\]"),
    ("qwen3", {"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                   "sliding_attention": {"rope_theta": 1e4}}},
     r"field 'rope_parameters' per layer type is not supported"),
    ("qwen2", {"quantization_config": {"quant_method": "gptq", "bits": 4}},
     r"field 'quantization_config' \(gptq\): quantized checkpoints are not supported"),
    ("qwen2", {"use_sliding_window": True, "layer_types": ["full_attention", "chunked_attention", "x"]},
     r"field 'layer_types' must list one of full_attention, sliding_attention per layer \(3\)"),
    ("mistral", {"sliding_window": 0}, r"field 'sliding_window' must be a positive int or null"),
    ("llama", {"architectures": ["Gemma3ForConditionalGeneration"]},
     r"architecture 'Gemma3ForConditionalGeneration' is not supported: the multimodal Gemma 3"),
    ("gemma2", {"use_bidirectional_attention": True},
     r"field 'use_bidirectional_attention' is not supported"),
    ("gemma3", {"attn_logit_softcapping": 50.0},
     r"field 'attn_logit_softcapping' is not supported for gemma3"),
    ("gemma2", {"hidden_activation": "gelu"}, r"field 'hidden_activation' 'gelu' is not supported"),
])
def test_features_not_implemented_are_refused_naming_the_field(tmp_path, family, changes, message):
    folder = _write(tmp_path, family, **changes)
    with pytest.raises(ModelConfigError, match=message) as e:
        load_model_config(folder)
    assert str(e.value).startswith(f"{folder}/config.json: ") and "\n" not in str(e.value)


def test_every_family_has_a_builder_and_odd_test_shapes():
    seen: set[str] = set()
    for fam in families.FAMILIES:
        assert fam.name not in seen and not seen & set(fam.architectures)
        seen |= {fam.name, *fam.architectures}
        assert not fam.builder or fam.builder.startswith("hotstart.model.families.")
        model_type, kw = TINY[fam.name]
        cfg = parse_model_config({"model_type": model_type, **kw}, Path("config.json"))
        assert issubclass(registry.model_class(cfg), CausalLM) and cfg.family == fam.name
        heads = cfg.num_attention_heads
        odd = heads & (heads - 1) or cfg.num_key_value_heads == 1 or cfg.head_dim * heads != cfg.hidden_size
        assert odd, f"{fam.name}: tiny heads a power of two, KV heads > 1 and head_dim = hidden / heads"
        _, tp = TINY[f"{fam.name}-tp"]
        halves = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
        assert all(tp[k] % 2 == 0 for k in halves), tp


def test_every_window_mode_has_one_rule():
    from hotstart import sliding_window

    assert set(sliding_window.RULES) == set(families.Window) - {families.Window.NONE}
    assert {f.sliding_window for f in families.FAMILIES} == set(families.Window)  # each mode is used


def test_family_modules_load_lazily(tiny_checkpoint):
    """A Qwen3 checkpoint (the shared layer) imports no family module; a Gemma 2 one gemma2's alone."""
    code = ("import sys; from hotstart.model import loader, registry; "
            "from hotstart.config import load_model_config; "
            "loaded = lambda: sorted(m for m in sys.modules if m.startswith('hotstart.model.families.')); "
            "before = loaded(); "
            f"registry.model_class(load_model_config({str(tiny_checkpoint('qwen3'))!r})); shared = loaded(); "
            f"registry.model_class(load_model_config({str(tiny_checkpoint('gemma2'))!r})); "
            "print(before, shared, loaded())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "[]", "['hotstart.model.families.gemma2']"]


def test_readme_model_table_is_the_family_table():
    from hotstart.bench import model_sizes

    assert model_sizes.names() == families.names()  # make-model writes every family
    readme = (REPO / "README.md").read_text()
    assert model_sizes.model_table() in readme, "README.md: paste `python -c 'from hotstart.bench import " \
        "model_sizes; print(model_sizes.model_table())'` over the model table"


def test_cli_refuses_multimodal_gemma3_in_one_line(tiny_checkpoint, default_model_dir, tmp_path):
    folder = tmp_path / "gemma3"
    shutil.copytree(tiny_checkpoint("gemma3"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, folder / name)
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["Gemma3ForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(raw))
    out = subprocess.run([sys.executable, "-m", "hotstart", "generate", str(folder), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"hotstart: error: {folder}/config.json: architecture 'Gemma3ForConditionalGeneration' is not "
        "supported: the multimodal Gemma 3 (vision tower) is not served; text-only Gemma3ForCausalLM "
        "checkpoints are"]
