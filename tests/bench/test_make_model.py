"""`hotstart make-model`: tiny random checkpoints that hotstart and transformers both accept."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from hotstart import families
from hotstart.bench import make_model as mm
from hotstart.config import load_model_config
from hotstart.errors import HotstartError

REPO = Path(__file__).resolve().parents[2]


def make(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hotstart", "make-model", "--out", str(out), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


@pytest.mark.parametrize("family", families.names())
def test_tiny_checkpoint_loads_everywhere(tmp_path, family, default_model_dir):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / family
    extra = ["--no-tie"] if family == "llama" else []
    res = make(out, "--family", family, "--size", "tiny", "--shard-size", "300KB", *extra)
    assert res.returncode == 0, res.stderr
    assert "MB/s" in res.stdout

    cfg = load_model_config(out)  # hotstart's parser
    assert (cfg.family, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (family, 128, 2, 32)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= mm.tokenizer_vocab(out / "tokenizer.json")
    assert cfg.tie_word_embeddings == (family != "llama")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (default_model_dir / f).read_bytes()

    # Shards and index agree: every tensor once, in the shard the index names, offsets back to back.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and {s.name for s in shards} == set(index["weight_map"].values())
    seen, total = {}, 0
    for s in shards:
        header, start = read_header(s)
        header.pop("__metadata__")
        end = 0
        for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
            assert meta["data_offsets"][0] == end and meta["dtype"] == "BF16", name
            end = meta["data_offsets"][1]
            assert name not in seen and index["weight_map"][name] == s.name
            seen[name] = meta["shape"]
        assert start % 8 == 0 and s.stat().st_size == start + end
        total += end
    assert set(seen) == set(index["weight_map"]) and index["metadata"]["total_size"] == total

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    if families.by_name(family).moe is None:  # transformers 5 holds experts as 3-D parameters of other names
        for name, shape in seen.items():
            assert list(state[name].shape) == shape, name
    # a down projection is in every family (Phi-3 fuses gate/up; Mixtral calls it w2)
    down = next(n for n in seen if n.endswith(("down_proj.weight", ".w2.weight")))
    with safe_open(str(out / index["weight_map"][down]), "pt") as f:
        w = f.get_tensor(down).float()
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.002
    assert torch.equal(state["model.norm.weight"].float(), torch.ones(128))
    with safe_open(str(shards[0]), "pt") as f:  # the reference reader agrees with our header
        assert list(f.get_tensor("model.embed_tokens.weight").shape) == [cfg.vocab_size, 128]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_custom_dims_and_single_file(tmp_path, default_model_dir):
    out = tmp_path / "custom"
    res = make(out, "--family", "qwen2", "--layers", "1", "--hidden", "64", "--intermediate", "96",
               "--heads", "4", "--kv-heads", "2", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    cfg = load_model_config(out)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads, cfg.head_dim) == (64, 96, 2, 16)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.torch_dtype == "float32"
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    header, _ = read_header(out / "model.safetensors")
    bias = header["model.layers.0.self_attn.k_proj.bias"]
    assert (bias["dtype"], bias["shape"]) == ("F32", [32])  # Qwen2: q/k/v biases, 2 KV heads x 16


def test_real_sizes_match_published_shapes():
    ns = dict(size=None, layers=None, hidden=None, intermediate=None, heads=None, kv_heads=None,
              head_dim=None,
              vocab=None, tie=None, dtype="bfloat16")

    def params(family, size, vocab):
        cfg = mm.build_config(Namespace(**{**ns, "family": family, "size": size, "vocab": vocab}), 1000, {})
        return sum(mm._numel(s) for _, s, _ in mm.tensor_plan(cfg)) / 1e9

    # With the real vocabularies the parameter counts are the published ones.
    assert params("qwen2", "1.5b", 151936) == pytest.approx(1.54, abs=0.01)
    assert params("qwen2", "7b", 152064) == pytest.approx(7.62, abs=0.01)
    assert params("qwen3", "0.6b", 151936) == pytest.approx(0.596, abs=0.005)
    assert params("llama", "1b", 128256) == pytest.approx(1.236, abs=0.005)
    assert params("llama", "8b", 128256) == pytest.approx(8.03, abs=0.01)
    assert params("mistral", "7b", 32768) == pytest.approx(7.248, abs=0.005)  # Mistral-7B-v0.3
    assert params("mixtral", "8x7b", 32000) == pytest.approx(46.70, abs=0.01)
    assert params("qwen2-moe", "14b-a2.7b", 151936) == pytest.approx(14.32, abs=0.01)  # Qwen1.5-MoE-A2.7B
    assert params("qwen3-moe", "30b-a3b", 151936) == pytest.approx(30.53, abs=0.01)

    assert params("gemma2", "2b", 256000) == pytest.approx(2.614, abs=0.005)
    assert params("gemma2", "9b", 256000) == pytest.approx(9.242, abs=0.005)
    assert params("gemma3", "1b", 262144) == pytest.approx(1.000, abs=0.005)
    assert params("gemma3", "4b", 262208) == pytest.approx(3.880, abs=0.005)  # without the vision tower


def test_a_size_that_does_not_fit_is_refused_in_one_line(tmp_path, default_model_dir):
    res = make(tmp_path / "m", "--family", "qwen3-moe", "--size", "30b-a3b", "--layers", "10000")  # ~6 TB
    assert res.returncode == 2 and "--size 30b-a3b (qwen3-moe): the checkpoint needs" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("args,message", [
    (["--family", "qwen2", "--size", "13b"], "known sizes: 0.5b, 1.5b, 3b, 7b, tiny"),
    (["--family", "llama"], "give --size, or the dimensions"),
    (["--family", "llama", "--size", "tiny", "--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
    (["--family", "llama", "--size", "tiny", "--shard-size", "lots"], "--shard-size 'lots'"),
    (["--family", "llama", "--size", "tiny", "--vocab", "100"], "smaller than the tokenizer"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, args, message, default_model_dir):
    res = make(tmp_path / "m", *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.tmp-*"))


def test_refuses_a_non_empty_out(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    res = make(tmp_path, "--family", "llama", "--size", "tiny")
    assert res.returncode == 2 and "not an empty folder" in res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_parse_size():
    assert mm.parse_size("2GB") == 2_000_000_000 and mm.parse_size("1GiB") == 1 << 30
    assert mm.parse_size("500mb") == 500_000_000 and mm.parse_size("1234") == 1234
    with pytest.raises(HotstartError):
        mm.parse_size("0B")
