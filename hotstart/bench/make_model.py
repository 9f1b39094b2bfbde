"""`hotstart make-model`: a random-weight checkpoint with a real model's shapes, written at disk speed.

Shapes come from the published config.json of each model (hotstart/bench/model_sizes.py); the
vocabulary is the default model's tokenizer (its files are copied), so a server can really tokenize,
chat and detokenize with it. Values are normal(0, 0.02) (norm weights 1): the output is gibberish, but
every startup cost (bytes, tensors, shapes) is real.

The safetensors files are written here, not by the safetensors package, so the model never sits in
RAM: a pool of random values is made once and each tensor is streamed from random offsets into it.
Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} padded
with spaces to 8 bytes, then the raw tensor bytes back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from hotstart import families
from hotstart.bench import model_sizes
from hotstart.errors import HotstartError
from hotstart.model_config import parse_model_config

DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")
POOL = 8 << 20  # random values made once (16 MiB in bf16)
CHUNK = 4 << 20  # values per write


def parse_size(text: str) -> int:
    """'2GB' -> 2e9, '1GiB' -> 2**30, '500MB', '200KB', or plain bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise HotstartError(f"--shard-size {text!r}: expected e.g. 2GB, 500MB, 1GiB")
    unit = m.group(2).rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30,
             "TI": 1 << 40}[unit]
    value = int(float(m.group(1)) * scale)
    if value < 1:
        raise HotstartError(f"--shard-size {text!r}: must be at least 1 byte")
    return value


def tokenizer_vocab(tokenizer_json: Path) -> int:
    """Number of token ids the tokenizer can produce (model vocab and added tokens)."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    ids = list((data.get("model") or {}).get("vocab", {}).values()) or [len(data["model"].get("vocab", []))]
    ids += [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1


def build_config(args: argparse.Namespace, vocab: int, special: dict) -> dict:
    """config.json for FAMILY/SIZE with the overrides on the command line; validated."""
    fam, made = families.by_name(args.family), model_sizes.by_name(args.family)
    size = (args.size or "").lower()
    extra = dict(made.config)
    if size == "tiny":
        base = model_sizes.TINY
        extra.update(made.size_config.get(size, {}))  # MoE: a few small experts
    elif size:
        if size not in made.sizes:
            known = ", ".join([*made.sizes, "tiny"])
            raise HotstartError(f"--size {args.size!r} for {fam.name}: known sizes: {known}")
        base = made.sizes[size]
        extra.update(made.size_config.get(size, {}))
    else:
        dims = ("hidden", "intermediate", "layers", "heads")
        missing = [f"--{n}" for n in dims if getattr(args, n) is None]
        if missing:
            raise HotstartError(f"give --size, or the dimensions ({' '.join(missing)} missing)")
        base = model_sizes.Shape(None, None, None, None, None, None, True)
    hidden, inter, layers, heads, kv, head_dim, tied = base
    pick = lambda given, default: default if given is None else given  # noqa: E731
    hidden, inter = pick(args.hidden, hidden), pick(args.intermediate, inter)
    layers = pick(args.layers, layers)
    heads, head_dim, tied = pick(args.heads, heads), pick(args.head_dim, head_dim), pick(args.tie, tied)
    kv = pick(args.kv_heads, kv if args.heads is None else heads)
    for name, v in (("hidden", hidden), ("intermediate", inter), ("layers", layers), ("heads", heads),
                    ("kv-heads", kv), ("head-dim", head_dim or 1), ("vocab", args.vocab or 1)):
        if v < 1:
            raise HotstartError(f"--{name} must be >= 1, got {v}")
    if heads % kv:
        raise HotstartError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv})")
    if head_dim is None:
        if hidden % heads:
            raise HotstartError(f"--hidden ({hidden}) is not a multiple of --heads ({heads}): "
                                "give --head-dim")
        head_dim = hidden // heads
    if args.vocab is not None and args.vocab < vocab:
        raise HotstartError(f"--vocab {args.vocab} is smaller than the tokenizer's {vocab} tokens")
    return {
        "architectures": [fam.architectures[0]], "model_type": fam.model_type, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "hidden_act": "silu", **extra,
        "tie_word_embeddings": tied,
        "vocab_size": args.vocab or -(-vocab // 64) * 64, "dtype": args.dtype, "initializer_range": 0.02,
        "attention_dropout": 0.0, "use_cache": True, **special,
    }


def tensor_plan(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, fill) in load order; fill is "normal" or "ones" (RMSNorm weights). Which tensors a
    layer has (biases, q/k norms) is what hotstart's own parser reads from CFG (model_config.py)."""
    mc = parse_model_config(cfg, Path("config.json"))
    h, i, hd = mc.hidden_size, mc.intermediate_size, mc.head_dim
    out = [("model.embed_tokens.weight", (mc.vocab_size, h), "normal")]

    def linear(name: str, rows: int, cols: int, bias: bool) -> None:
        out.append((name + ".weight", (rows, cols), "normal"))
        if bias:
            out.append((name + ".bias", (rows,), "normal"))

    fam = families.by_name(mc.family)
    for n in range(mc.num_hidden_layers):
        p = f"model.layers.{n}."
        if not fam.post_norm:
            out.append((p + "input_layernorm.weight", (h,), "ones"))
        if fam.fused_checkpoint:  # Phi-3: q/k/v in one tensor
            linear(p + "self_attn.qkv_proj", mc.q_size + 2 * mc.kv_size, h, mc.qkv_bias)
        else:
            for proj, rows in (("q_proj", mc.q_size), ("k_proj", mc.kv_size), ("v_proj", mc.kv_size)):
                linear(p + f"self_attn.{proj}", rows, h, mc.qkv_bias)
        linear(p + "self_attn.o_proj", h, mc.q_size, mc.o_bias)
        if mc.qk_norm:  # per-head RMSNorm on q and k
            out += [(p + f"self_attn.{n}.weight", (hd,), "ones") for n in ("q_norm", "k_norm")]
        elif fam.qk_norm == "full":  # OLMo 2: over the whole projections
            out += [(p + "self_attn.q_norm.weight", (mc.q_size,), "ones"),
                    (p + "self_attn.k_norm.weight", (mc.kv_size,), "ones")]
        out.append((p + "post_attention_layernorm.weight", (h,), "ones"))
        norms = [m for m in fam.layer_norms  # Gemma: pre/post-feedforward norms
                 if m not in ("input_layernorm", "post_attention_layernorm")]
        out += [(p + f"{m}.weight", (h,), "ones") for m in norms]
        if n in mc.moe_layers:
            out += _experts(p, mc)
            continue
        if fam.fused_checkpoint:  # gate and up in one tensor
            linear(p + "mlp.gate_up_proj", 2 * i, h, mc.mlp_bias)
        else:
            linear(p + "mlp.gate_proj", i, h, mc.mlp_bias)
            linear(p + "mlp.up_proj", i, h, mc.mlp_bias)
        linear(p + "mlp.down_proj", h, i, mc.mlp_bias)
        if fam.post_norm:
            out.append((p + "post_feedforward_layernorm.weight", (h,), "ones"))
    out.append(("model.norm.weight", (h,), "ones"))
    if not mc.tie_word_embeddings:
        out.append(("lm_head.weight", (mc.vocab_size, h), "normal"))
    return out


def _experts(p: str, mc) -> list[tuple[str, tuple[int, ...], str]]:
    """Layer prefix P's mixture of experts, under its family's checkpoint names (hotstart/families.py):
    the router [E, hidden], each expert's gate/up [I, hidden] and down [hidden, I], a shared expert."""
    m, h, i = families.by_name(mc.family).moe, mc.hidden_size, mc.moe_intermediate_size
    b = f"{p}{m.block}."
    out = [(b + "gate.weight", (mc.num_experts, h), "normal")]
    for e in range(mc.num_experts):
        out += [(f"{b}experts.{e}.{m.gate}.weight", (i, h), "normal"),
                (f"{b}experts.{e}.{m.up}.weight", (i, h), "normal"),
                (f"{b}experts.{e}.{m.down}.weight", (h, i), "normal")]
    s = mc.shared_expert_intermediate_size
    if s:
        out += [(b + "shared_expert.gate_proj.weight", (s, h), "normal"),
                (b + "shared_expert.up_proj.weight", (s, h), "normal"),
                (b + "shared_expert.down_proj.weight", (h, s), "normal"),
                (b + "shared_expert_gate.weight", (1, h), "normal")]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard(plan, itemsize: int, limit: int) -> list[list]:
    """Greedy split in load order: a new shard when the next tensor would pass `limit` bytes."""
    shards: list[list] = [[]]
    size = 0
    for t in plan:
        nbytes = _numel(t[1]) * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def make_pools(dtype: str, seed: int):
    """(normal pool with CHUNK spare values at the end, ones) as uint8 views of the target dtype's bytes."""
    import numpy as np  # noqa: PLC0415 - only here: the CLI stays light

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(POOL + CHUNK, dtype=np.float32)
    x *= 0.02
    ones = np.ones(CHUNK, dtype=np.float32)
    if dtype == "bfloat16":  # numpy has no bfloat16: round float32 to its upper 16 bits
        def conv(a):
            u = a.view(np.uint32)
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        def conv(a):
            return a.astype(np.float16 if dtype == "float16" else np.float32)
    return conv(x).view(np.uint8), conv(ones).view(np.uint8), rng


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_shard(path: Path, tensors, dtype: str, pools) -> int:
    """Stream one safetensors file; returns its size in bytes."""
    tag, itemsize = DTYPES[dtype]
    normal, ones, rng = pools
    header, offset = {}, 0
    for name, shape, _ in tensors:
        nbytes = _numel(shape) * itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "hotstart": "random weights (make-model)"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, struct.pack("<Q", len(raw)) + raw)
        for _, shape, fill in tensors:
            left = _numel(shape) * itemsize
            while left:
                n = min(left, CHUNK * itemsize)
                if fill == "ones":
                    _write_all(fd, ones[:n])
                else:  # a random window of the pool (value-aligned), so tensors differ
                    start = int(rng.integers(0, POOL)) * itemsize
                    _write_all(fd, normal[start:start + n])
                left -= n
        os.fsync(fd)  # the MB/s reported is the disk's, not the page cache's
    finally:
        os.close(fd)
    return 8 + len(raw) + offset


def _default_tokenizer_dir() -> Path:
    from hotstart.bench.default_hf import ensure_default_model  # noqa: PLC0415

    return ensure_default_model()


def _prepare_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HotstartError(f"--out {out}: already exists and is not an empty folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HotstartError(f"--out {out}: {e.strerror}") from None


def _make_gguf(args: argparse.Namespace, out: Path) -> int:
    """--format gguf: OUT/model.QUANT.gguf (bench/gguf_make.py), written beside OUT and renamed."""
    from hotstart.bench import gguf_make  # noqa: PLC0415 - imports numpy and the gguf package
    from hotstart.boot.default_model import find_gguf  # noqa: PLC0415
    from hotstart.gguf_file import GGUFFile  # noqa: PLC0415

    tok = GGUFFile(find_gguf())
    vocab = len(tok.fields["tokenizer.ggml.tokens"])
    special = {k: tok.fields[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id")}
    if args.vocab not in (None, vocab):
        raise HotstartError(f"--format gguf: --vocab must be the tokenizer's {vocab} tokens")
    args.vocab = vocab
    cfg = build_config(args, vocab, special)
    mc = parse_model_config(cfg, Path("config.json"))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        t = time.perf_counter()
        path = tmp / f"model.{args.quant}.gguf"
        gguf_make.write_gguf(path, mc, tensor_plan(cfg), args.quant, tok, args.seed,
                             name=f"hotstart random {args.family} {args.size or 'custom'}")
        size, took = path.stat().st_size, time.perf_counter() - t
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{out / path.name}: {mc.architecture} {args.size or 'custom'} {args.quant}, {size / 1e9:.2f} GB "
          f"in {took:.1f} s")
    return 0


def run_make_model(args: argparse.Namespace) -> int:
    """Entry point of `hotstart make-model`."""
    out = Path(args.out).expanduser().resolve()
    shard_limit = parse_size(args.shard_size)
    _prepare_out(out)
    if getattr(args, "format", "safetensors") == "gguf":
        return _make_gguf(args, out)
    given = getattr(args, "tokenizer", None)
    tok_dir = Path(given).expanduser() if given else _default_tokenizer_dir()
    if not (tok_dir / "tokenizer.json").is_file() or not (tok_dir / "config.json").is_file():
        raise HotstartError(f"--tokenizer {tok_dir}: needs tokenizer.json and config.json")
    src_cfg = json.loads((tok_dir / "config.json").read_text())
    special = {k: src_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src_cfg}
    cfg = build_config(args, tokenizer_vocab(tok_dir / "tokenizer.json"), special)
    plan = tensor_plan(cfg)
    itemsize = DTYPES[args.dtype][1]
    total = sum(_numel(s) for _, s, _ in plan) * itemsize
    free = shutil.disk_usage(out.parent).free
    what = f"--size {args.size} ({args.family})" if args.size else f"{args.family} (custom dimensions)"
    if total * 1.02 + (64 << 20) > free:
        raise HotstartError(f"{what}: the checkpoint needs {total / 1e9:.1f} GB, "
                            f"{out.parent} has {free / 1e9:.1f} GB free")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total > ram:  # it could never be served here: the weights are mapped and read in full
        raise HotstartError(f"{what}: the checkpoint needs {total / 1e9:.1f} GB, more than this machine's "
                            f"memory ({ram / 1e9:.1f} GB)")
    shards = shard(plan, itemsize, shard_limit)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    params = total // itemsize
    mc = parse_model_config(cfg, Path("config.json"))
    # a token runs num_experts_per_tok of each MoE layer's num_experts experts
    idle = len(mc.moe_layers) * (mc.num_experts - mc.num_experts_per_tok) * 3 * mc.hidden_size \
        * mc.moe_intermediate_size
    active = f" ({(params - idle) / 1e9:.2f}B active)" if mc.num_experts else ""
    print(f"hotstart make-model: {cfg['architectures'][0]} {args.size or 'custom'}: "
          f"{params / 1e9:.2f}B params{active}, {total / 1e9:.2f} GB {args.dtype} in {len(shards)} file(s) "
          f"-> {out}",
          file=sys.stderr, flush=True)
    # Written beside OUT and renamed at the end: an interrupted run leaves no half checkpoint behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        t = time.perf_counter()
        pools = make_pools(args.dtype, args.seed)
        written = sum(write_shard(tmp / n, s, args.dtype, pools) for n, s in zip(names, shards))
        took = time.perf_counter() - t
        if len(shards) > 1:
            index = {"metadata": {"total_size": total, "total_parameters": params},
                     "weight_map": {name: n for n, s in zip(names, shards) for name, _, _ in s}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for f in TOKENIZER_FILES:
            if (tok_dir / f).is_file():
                shutil.copyfile(tok_dir / f, tmp / f)
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{out}: {written / 1e9:.2f} GB in {took:.1f} s ({written / took / 1e6:.0f} MB/s, fsynced)")
    return 0
