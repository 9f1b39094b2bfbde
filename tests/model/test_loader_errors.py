"""Bad model folders fail with a clear message naming the file and the tensor or field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.procs import no_torch_in
from safetensors.torch import load_file, save_file

from hotstart.config import load_model_config
from hotstart.errors import HotstartError
from hotstart.model.files import weight_files
from hotstart.model.loader import load_model


def _load(model_dir):
    cfg = load_model_config(model_dir)
    return load_model(cfg, weight_files(model_dir))


@pytest.fixture
def qwen2_copy(tiny_checkpoint, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("qwen2"), dst)
    return dst


def test_missing_config(tmp_path):
    with pytest.raises(HotstartError, match=r"config.json: not found"):
        load_model_config(tmp_path)


def test_unknown_architecture(qwen2_copy):
    cfg = json.loads((qwen2_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (qwen2_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HotstartError, match=r"config.json: unknown architecture 'GPT2LMHeadModel'"):
        load_model_config(qwen2_copy)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", None, "missing field 'hidden_size'"),
    ("num_attention_heads", "six", "field 'num_attention_heads' must be int"),
    ("num_key_value_heads", 4, "must be a multiple of 'num_key_value_heads'"),
    ("rms_norm_eps", -1.0, "field 'rms_norm_eps' must be > 0"),
])
def test_invalid_fields(qwen2_copy, field, value, message):
    cfg = json.loads((qwen2_copy / "config.json").read_text())
    if value is None:
        del cfg[field]
    else:
        cfg[field] = value
    (qwen2_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HotstartError, match=message):
        load_model_config(qwen2_copy)


def test_truncated_safetensors(qwen2_copy):
    f = qwen2_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    truncated = r"model.safetensors: truncated: tensor '.+' ends at byte \d+, file has \d+ bytes"
    with pytest.raises(HotstartError, match=truncated):
        _load(qwen2_copy)
    f.write_bytes(data[:4])
    with pytest.raises(HotstartError, match="truncated safetensors file"):
        _load(qwen2_copy)


def test_missing_shard(tiny_checkpoint, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama", True), dst)
    shards = sorted(dst.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(HotstartError, match=shards[-1].name):
        weight_files(dst)


def _rewrite(model_dir, change):
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    change(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_wrong_shape(qwen2_copy):
    def change(t):
        t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(201, 96)
    _rewrite(qwen2_copy, change)
    shape = r"tensor 'model.layers.1.mlp.up_proj.weight' has shape \[201, 96\], expected \[200, 96\]"
    with pytest.raises(HotstartError, match=shape):
        _load(qwen2_copy)


def test_wrong_dtype(qwen2_copy):
    def change(t):
        t["model.norm.weight"] = torch.zeros(96, dtype=torch.int64)
    _rewrite(qwen2_copy, change)
    with pytest.raises(HotstartError, match=r"tensor 'model.norm.weight' has dtype I64"):
        _load(qwen2_copy)


def test_missing_and_unexpected_tensors(qwen2_copy):
    _rewrite(qwen2_copy, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(HotstartError, match=r"missing tensor\(s\) 'model.layers.0.self_attn.k_proj.bias'$"):
        _load(qwen2_copy)
    _rewrite(qwen2_copy, lambda t: t.update({"model.layers.0.self_attn.k_proj.bias": torch.zeros(24),
                                             "model.extra.weight": torch.zeros(3)}))
    with pytest.raises(HotstartError, match=r"unexpected tensor 'model.extra.weight'"):
        _load(qwen2_copy)


def test_cli_reports_bad_model_in_one_line(qwen2_copy, default_model_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, qwen2_copy / name)
    (qwen2_copy / "model.safetensors").write_bytes(b"\x00" * 3)
    out = subprocess.run([sys.executable, "-m", "hotstart", "generate", str(qwen2_copy), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hotstart: error:") and "truncated" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_cli_and_config_do_not_import_torch():
    for module in ("hotstart.cli", "hotstart.config", "hotstart.model_config", "hotstart.families",
                   "hotstart.bench.make_model"):
        ok, heavy = no_torch_in(module)
        assert ok, f"{module} imported {heavy}"
