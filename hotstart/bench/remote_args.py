"""Arguments of `hotstart bench remote` (argparse only: `hotstart --help` stays light)."""

from __future__ import annotations


def add_remote(bsub, verb: str) -> None:
    p = bsub.add_parser(
        verb,
        help="s3:// or hub-id start vs download-then-serve (Run:ai streamer, vLLM); warm restarts; CPU-s/GB",
        description="Upload MODEL to an S3 endpoint (by default a moto server started here on loopback), "
        "then, "
        "interleaved for --runs rounds: launch -> first correct answer of `hotstart serve s3://...` "
        "with an empty cache; the serial way (a boto3 download of the folder, then `hotstart serve` "
        "of it); the Run:ai Model Streamer's load time of the same objects (--runai-python); a "
        "restart with the warm cache against serving the cached folder. Writes results.json and "
        "table.md.",
    )
    p.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--store", choices=("s3", "hf", "modelscope"), default="s3",
                   help="s3: upload to an S3 endpoint; hf / modelscope: serve MODEL from a loopback hub "
                        "(python -m hotstart.bench.hubserver) as ORG/NAME (--prefix, default bench/FOLDER)")
    p.add_argument("--cap-mbps", type=float, default=None, metavar="MB/S",
                   help="hub stores: the loopback hub's bandwidth cap, all connections together")
    p.add_argument("--vllm", action="store_true",
                   help="hub stores: also time the vLLM peer (`make peers`' VLLM_PEER) serving ORG/NAME")
    p.add_argument("--vllm-command", default=None, metavar="CMD",
                   help="hub stores: the vLLM command instead ({model}: the hub id, {port}: a free port)")
    p.add_argument(
        "--endpoint",
        default=None,
        metavar="URL",
        help="an S3 endpoint to use (credentials from the environment) instead of starting moto",
    )
    p.add_argument("--bucket", default="hotstart-bench", help="bucket to upload to (created if missing)")
    p.add_argument("--prefix", default=None, help="key prefix (default: bench/ + the folder's name)")
    p.add_argument("--runs", type=int, default=3, help="measured rounds (medians are reported)")
    p.add_argument(
        "--runai-python",
        default=None,
        metavar="PYTHON",
        help="a Python with runai-model-streamer + runai-model-streamer-s3 (and torch) installed: "
        "also time its load of the same objects",
    )
    p.add_argument(
        "--expect", default="Paris", help="the answers must contain this (default: Paris; '' = any)"
    )
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument(
        "--hotstart-args", default="", metavar="ARGS", help="extra `hotstart serve` flags, one string"
    )
    p.add_argument("--kernels", choices=("seeded", "cold"), default="seeded",
                   help="seeded: the CPU kernel library, built once first, is in every run's fresh "
                        "$HOTSTART_HOME (as in an image built with it); cold: every run of the cold pair "
                        "compiles it (bench/kernel_cache.py)")
    p.add_argument("--out", default=None, help="results folder (default: bench-results/remote-DATE)")
