"""`hotstart` command line. Imports nothing heavy at module level: --help and argument errors are instant."""

from __future__ import annotations

import argparse
import os
import sys
import time

T0 = time.time()  # launch time as seen by the CLI (the timeline's zero)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: the checkpoint's dtype where the hardware computes it natively, else float32")
    p.add_argument("--max-model-len", type=_at_least_one, default=None,
                   help="longest prompt + completion (tokens)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) in the local cache")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other hotstart error (subparsers inherit the class)."""

    def error(self, message: str):  # noqa: ANN201 - argparse's signature
        self.exit(2, f"hotstart: error: {message} (see `{self.prog} --help`)\n")


def _int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [LOW, HIGH]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {value}")
        return value
    return parse


_positive_int = _int_in(0)  # 0 allowed: --port 0, --max-tokens 0 ...
_at_least_one = _int_in(1)
_port = _int_in(0, 65535)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a non-empty name")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hotstart", description="An OpenAI-compatible LLM server that starts fast.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument("model", nargs="?", default=None,
                   help="model folder, hub id in the local HF/ModelScope cache, or nothing for the default model")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 to expose)")
    s.add_argument("--port", type=_port, default=8000, help="port (0 picks a free one and prints it)")
    _add_engine_args(s)
    s.add_argument("--max-num-seqs", type=_at_least_one, default=64, help="most sequences batched in one step")
    s.add_argument("--max-num-batched-tokens", type=_at_least_one, default=2048, help="token budget of one step")
    s.add_argument("--kv-cache-memory", type=_at_least_one, default=None, help="bytes for the KV cache")
    s.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, help="fraction of GPU memory to use")
    s.add_argument("--served-model-name", action="append", type=_name, default=None,
                   help="name(s) clients use for the model")
    s.add_argument("--api-key", default=os.environ.get("HOTSTART_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or set HOTSTART_API_KEY)")
    s.add_argument("--max-request-bytes", type=_at_least_one, default=1 << 20, help="largest accepted request body")
    s.add_argument("--no-prespawn", dest="prespawn", action="store_false",
                   help="start the engine after the API is up, as a fresh interpreter (ablation)")
    s.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="do not prefetch weights into the page cache (ablation)")
    s.add_argument("--prefetch-threads", type=_positive_int, default=None, help="prefetch reader threads")
    s.add_argument("--prefetch-block-mb", type=_positive_int, default=None, help="prefetch read size in MiB")
    s.add_argument("--no-restart", dest="restart", action="store_false", help="do not refork a dead engine")
    s.add_argument("--startup-trace", default=None, metavar="FILE", help="write the startup timeline (Chrome trace JSON)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    g = sub.add_parser("generate", help="generate text offline (no server)")
    g.add_argument("model", nargs="?", default=None, help="model folder or hub id (default: the embedded model)")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=_positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    _add_engine_args(g)

    from hotstart.bench.args import add_bench_commands  # noqa: PLC0415 - argparse only

    add_bench_commands(sub)

    t = sub.add_parser("timeline", help="draw a startup trace (from --startup-trace or GET /startup) as a PNG")
    t.add_argument("trace", help="the JSON file")
    t.add_argument("-o", "--output", default="startup.png", help="PNG to write")
    return parser


def _fail(message: str) -> int:
    print(f"hotstart: error: {message}", file=sys.stderr)
    return 2


def _audit_imports(path: str) -> None:
    """HOTSTART_AUDIT_IMPORTS=FILE: record every import made off the main thread, written at exit.
    The tests use it to prove that background threads only do I/O."""
    import atexit  # noqa: PLC0415
    import json  # noqa: PLC0415
    import threading  # noqa: PLC0415

    main_thread = threading.main_thread()
    off_main: list[list[str]] = []

    def hook(event: str, args: tuple) -> None:
        if event == "import" and threading.current_thread() is not main_thread:
            off_main.append([args[0], threading.current_thread().name])

    def dump() -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"off_main_thread": off_main, "torch_imported": "torch" in sys.modules,
                       "modules": len(sys.modules)}, f)

    sys.addaudithook(hook)
    atexit.register(dump)


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("HOTSTART_AUDIT_IMPORTS"):
        _audit_imports(os.environ["HOTSTART_AUDIT_IMPORTS"])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from hotstart.errors import HotstartError  # noqa: PLC0415

    try:
        if args.command == "serve":
            # t=0: the forkserver starts importing torch before this process imports anything more.
            from hotstart.boot.prespawn import EngineLauncher, exit_on_sigterm, serial_baseline  # noqa: PLC0415

            exit_on_sigterm()
            launcher = EngineLauncher(use_forkserver=args.prespawn and not serial_baseline())
            try:
                launcher.start()
                from hotstart.server.launch import run_serve  # noqa: PLC0415

                return run_serve(args, T0, launcher)
            finally:
                launcher.shutdown()
        if args.command == "generate":
            from hotstart.generate import run_generate  # noqa: PLC0415

            return run_generate(args)
        if args.command in ("bench", "make-model"):
            from hotstart.bench.args import run_bench_command  # noqa: PLC0415

            return run_bench_command(args)
        if args.command == "timeline":
            from hotstart.boot.timeline_png import render_png  # noqa: PLC0415

            import json  # noqa: PLC0415

            try:
                with open(args.trace, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                return _fail(f"{args.trace}: {e}")
            render_png(data, args.output)
            print(args.output)
            return 0
    except HotstartError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
