"""`hotstart` command line. Imports nothing heavy at module level: --help and argument errors are instant."""

from __future__ import annotations

import argparse
import os
import sys
import time

T0 = time.time()  # launch time as seen by the CLI (the timeline's zero)

from hotstart.config import EngineConfig, ServeConfig  # noqa: E402 - stdlib + dataclasses only
from hotstart.flags import add_options  # noqa: E402
from hotstart.frontend.model_specs import ModelsConfig  # noqa: E402 - stdlib + flags only
from hotstart.generate import ENGINE_EXCLUDES, add_sampling_flags  # noqa: E402 - argparse/time only


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other hotstart error (subparsers inherit the class)."""

    def error(self, message: str):  # noqa: ANN201 - argparse's signature
        self.exit(2, f"hotstart: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hotstart", description="An OpenAI-compatible LLM server that starts fast.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument("model", nargs="*", default=None,
                   help="model folder, hub id (ORG/NAME: Hugging Face; modelscope://ORG/NAME), or "
                        "s3://BUCKET/PREFIX (downloaded into the cache while torch imports), each optionally "
                        "NAME=...; or nothing for the default model. Several (or --model-dir): loaded on "
                        "demand (README: Many models)")
    s.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    add_options(s, ServeConfig)
    add_options(s.add_argument_group("several models"), ModelsConfig)
    add_options(s.add_argument_group("engine"), EngineConfig)

    pl = sub.add_parser("pull", help="download a model into its hub's cache without serving it",
                        description="Fetch ORG/NAME (Hugging Face Hub; modelscope://ORG/NAME or "
                        "VLLM_USE_MODELSCOPE=true: ModelScope; or s3://BUCKET/PREFIX) into the standard "
                        "cache, only the files serving needs, verified; prints the folder. Resumes an "
                        "interrupted pull.")
    pl.add_argument("model", help="hub id ORG/NAME, modelscope://ORG/NAME or s3://BUCKET/PREFIX")
    pl.add_argument("--revision", default=None, help="branch, tag or commit (default: the default branch)")

    g = sub.add_parser("generate", help="generate text offline (no server)")
    g.add_argument(
        "model", nargs="?", default=None, help="model folder or hub id (default: the embedded model)"
    )
    g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    add_sampling_flags(g)
    add_options(g.add_argument_group("engine"), EngineConfig, exclude=ENGINE_EXCLUDES)

    from hotstart.bench.args import add_bench_commands  # noqa: PLC0415 - argparse only

    add_bench_commands(sub)

    z = sub.add_parser(
        "zygote",
        help="a warm process (torch imported) that outlives servers and forks their engines",
        description="Run this user's zygote: `hotstart serve` then forks its engine from it "
        "instead of importing torch again (see README: when to run one).",
    )
    zsub = z.add_subparsers(dest="zygote_command", metavar="ACTION", required=True)
    zs = zsub.add_parser("start", help="start it (in the background) and wait until it answers")
    zs.add_argument("--keep", nargs="+", action="extend", default=[], metavar="MODEL",
                    help="keep these models' files resident (mlock'ed, within half of MemAvailable)")
    zs.add_argument(
        "--foreground", action="store_true", help="run it in this process (for a service manager)"
    )
    zs.add_argument("--no-watch", action="store_true",
                    help="keep it when hotstart's or torch's files change on disk (default: it restarts "
                         "itself once idle; servers bypass it meanwhile)")
    zsub.add_parser(
        "stop", help="stop it and every engine it forked (their servers fall back to a local forkserver)"
    )
    zsub.add_parser("status", help="pid, age, CPU, memory and kept models (exit code 3: none running)")

    t = sub.add_parser(
        "timeline", help="draw a startup trace (from --startup-trace or GET /startup) as a PNG"
    )
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
            # t=0: a matching zygote is used (ms), or the forkserver starts importing torch before this
            # process imports anything more.
            from hotstart.forkserver.client import EngineLauncher  # noqa: PLC0415
            from hotstart.procs import exit_on_sigterm  # noqa: PLC0415

            exit_on_sigterm()
            serve_cfg = ServeConfig.from_args(args)
            from hotstart.diskio import check_home  # noqa: PLC0415 - stdlib only
            from hotstart.system import hotstart_home  # noqa: PLC0415

            check_home(hotstart_home())  # one warning if it is read-only or full; the children learn it too
            if (len(args.model or []) > 1 or getattr(args, "model_dir", None)) and \
                    getattr(args, "max_loaded_models", 2) > 1:  # engines that may run side by side
                from hotstart.forkserver.runtime import share_cores_between_engines  # noqa: PLC0415

                share_cores_between_engines()
            launcher = EngineLauncher(use_forkserver=serve_cfg.prespawn, zygote=serve_cfg.zygote)
            try:
                launcher.start()
                from hotstart.server.connections import open_files_for

                open_files_for(serve_cfg.max_connections)  # NOFILE raised to fit, or one error line now
                imports = None
                if serve_cfg.prefetch and serve_cfg.import_prefetch:  # the bytes the imports need, first
                    from hotstart.boot.iosched import start_import_prefetch

                    imports = start_import_prefetch(hotstart_home(), forkserver=launcher.server is not None)
                from hotstart.server.launch import run_serve  # noqa: PLC0415

                return run_serve(args, serve_cfg, T0, launcher, imports)
            finally:
                launcher.shutdown()
        if args.command == "pull":
            from hotstart.boot.remote.pull import run_pull

            return run_pull(args.model, args.revision)
        if args.command == "generate":
            from hotstart.generate import run_generate  # noqa: PLC0415

            return run_generate(args)
        if args.command in ("bench", "make-model"):
            from hotstart.bench.args import run_bench_command  # noqa: PLC0415

            return run_bench_command(args)
        if args.command == "zygote":
            from hotstart.forkserver.control import run_zygote_command  # noqa: PLC0415

            return run_zygote_command(args)
        if args.command == "timeline":
            import json  # noqa: PLC0415

            from hotstart.boot.timeline_png import render_png  # noqa: PLC0415

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
