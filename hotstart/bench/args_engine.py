"""Parsers of the engine verbs of `hotstart bench`, step and roofline (argparse only: stays light). Each adds
the subparser of the verb it is given (args.BENCH_VERBS spells them)."""

from __future__ import annotations

MODEL_HELP = "model folder or hub id (default: the embedded model)"


def _bandwidth(p) -> None:
    p.add_argument("--bandwidth", type=float, default=None, metavar="GB/S",
                   help="memory bandwidth for the roofline fraction (default: the last `hotstart bench "
                        "roofline` result, else a quick measurement now)")


def add_step(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb, help="the decode step in one EngineCore: profile, sampler cost, grammar cost",
        description="One EngineCore (no HTTP), built once for MODEL, dtype, fast path and batch; then the "
                    "parts: profile (ms per decode step, the torch op table, tokens/s and the roofline "
                    "fraction), sampling (plain vs penalties vs logit_bias + min_p, interleaved rounds), "
                    "grammar (unconstrained vs a JSON-schema grammar on every stream) and blocks (wall "
                    "time per decoder block without the profiler; not in the default). A timing: run it "
                    "alone.")
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--parts", default="profile,sampling,grammar", help="which, in order (comma-separated)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--fast-path", default="off", choices=["off", "packed"],
                   help="off: the plain eager path (--compile off); packed: linear weights packed for oneDNN "
                        "first, as --compile eager-only|auto does behind READY")
    p.add_argument("--streams", type=int, default=16, help="sequences decoding together (the batch)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per measurement")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the sampling and grammar parts")
    p.add_argument("--top", type=int, default=15, help="ops in the profile's table")
    _bandwidth(p)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


def add_roofline(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb, help="memory read bandwidth (STREAM-like), and a throughput as a fraction of it",
        description="Sum (read) and copy of large float32 arrays with torch, 1 thread and every thread, "
                    "medians of --reps passes; saved in $HOTSTART_HOME/bench/roofline.json for `bench serve` "
                    "and `bench step`. With --tokens-per-s: that throughput as a fraction of the roofline "
                    "(weights / batch + KV bytes per token x context, per token).")
    p.add_argument("model", nargs="?", default=None,
                   help="model folder or hub id whose bytes per token to show (default: none; with "
                        "--tokens-per-s: the embedded model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size-mb", type=int, default=1024, help="array size in MiB (far beyond the caches)")
    p.add_argument("--reps", type=int, default=10, help="timed passes per kernel and thread count")
    p.add_argument("--threads", default=None, help="thread counts, e.g. 1,2 (default: 1 and torch's)")
    p.add_argument("--quick", action="store_true", help="256 MiB, 3 passes (what the other benches run)")
    p.add_argument("--tokens-per-s", type=float, default=None, help="a throughput to express as a fraction")
    p.add_argument("--batch", type=int, default=1, help="with --tokens-per-s: sequences per step")
    p.add_argument("--context", type=float, default=0.0, help="with --tokens-per-s: mean tokens attended")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="the served dtype (default: the checkpoint's)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the results as JSON")
