"""`hotstart serve`: the startup pipeline of the API process (torch-free).

Order matters; each step is on the timeline:
  t=0  use this user's zygote if a matching one answers within ms ("zygote used" / "zygote not used"),
       else start the warm forkserver (it imports torch + the engine in another process) (cli.py)
       the engine's start (frontend/start.py): resolve the model (ms), send the engine its config (the
       forkserver forks it as soon as its preload is done), start the weight prefetcher (daemon threads
       doing reads only), the engine client
  then import the web stack, load the tokenizer, bind the socket, serve: /health is 503 until the
       engine reports ready.
HOTSTART_SERIAL=1 turns all of it off (the serial baseline): no forkserver, no prefetch, and the
engine is spawned only once the API process is otherwise ready. Several models (or --model-dir):
server/multi_launch.py.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from hotstart import logs
from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig, ServeConfig
from hotstart.forkserver.client import EngineLauncher
from hotstart.procs import collector_paused

log = logging.getLogger("hotstart")


def run_serve(args: argparse.Namespace, cfg: ServeConfig, t0: float, launcher: EngineLauncher,
              imports=None) -> int:
    """ARGS: the parsed command line (models, --revision, engine flags); CFG: the serve flags; IMPORTS:
    the import prefetch started at t=0 (boot/iosched.py ImportPrefetch), or None."""
    from hotstart.frontend.model_specs import ModelsConfig, gather  # noqa: PLC0415 - stdlib, imported already
    from hotstart.server.access import check_bind  # noqa: PLC0415 - stdlib only

    check_bind(cfg.host, bool(cfg.api_key), cfg.allow_no_api_key)  # before anything loads; again once bound
    specs = gather(args.model if isinstance(args.model, list) else [args.model] if args.model else [],
                   getattr(args, "model_dir", None))
    if len(specs) > 1 or getattr(args, "model_dir", None):
        from hotstart.server.multi_launch import run_serve_many  # noqa: PLC0415

        return run_serve_many(args, cfg, specs, t0, launcher)
    spec = specs[0] if specs else None
    logs.setup("api", cfg.log_level)
    timeline = Timeline(t0)
    timeline.on_event = lambda span: log.info(timeline.log_line(span))  # one log line per phase
    for name, start, end, detail in launcher.spans:  # the zygote: used, or why not
        timeline.add(name, start, end, "api", detail)
    if launcher.started_at is not None:
        timeline.add("forkserver launched", t0, launcher.started_at)
    from hotstart.frontend.start import EngineStart  # noqa: PLC0415 - stdlib only

    start = EngineStart(timeline, launcher, lambda **derived: EngineConfig.from_args(args, **derived),
                        prefetch=cfg, imports=imports, auto_restart=cfg.restart,
                        ranks=getattr(args, "tensor_parallel_size", 1))
    paused = contextlib.ExitStack()  # the collector, until the socket is bound
    paused.enter_context(collector_paused())
    try:
        start.begin(spec.spec if spec else None, args.revision)
        model, client = start.model, start.client
        with timeline.phase("web stack imported"):
            from hotstart.frontend.memory import memory_guard  # noqa: PLC0415
            from hotstart.frontend.sampling import sampling_defaults  # noqa: PLC0415
            from hotstart.server.access import Access, announce_metrics  # noqa: PLC0415
            from hotstart.server.api import ApiSettings  # noqa: PLC0415
            from hotstart.server.http import bind_listeners, serve  # noqa: PLC0415
            from hotstart.server.routes import build_app  # noqa: PLC0415
        tokenizer = start.load_tokenizer()
        names = list(cfg.served_model_name or [spec.name if spec and spec.name else model.name])
        names += ModelsConfig(alias=getattr(args, "alias", None)).alias_map(names)  # --alias NAME=TARGET
        settings = ApiSettings(
            served_model_names=names,
            api_key=cfg.api_key,
            max_request_bytes=cfg.max_request_bytes,
            sampling_defaults=sampling_defaults(model.path, cfg.generation_config),
            tool_call_parser=None if cfg.tool_call_parser == "auto" else cfg.tool_call_parser,
            auto_tool_choice=cfg.enable_auto_tool_choice,
            memory_guard=memory_guard(cfg.min_free_memory),
            access=Access.of(cfg),
            admin_key=cfg.admin_key,
        )
        app = build_app(client, tokenizer, settings)
        if start.prefetcher is not None:
            app.state.prefetch_stats = start.prefetcher.stats
        if start.remote is not None:
            app.state.download_stats = start.remote.stats
        with timeline.phase("socket bound"):
            sock, metrics_sock = bind_listeners(cfg)
        host, port = sock.getsockname()[:2]
        print(
            f"hotstart: serving {names[0]} on http://{host}:{port} (health: /health)",
            file=sys.stderr,
            flush=True,
        )
        announce_metrics(metrics_sock)
        start.spawn_serial()  # the serial way: a fresh interpreter, once the API is otherwise ready
        import asyncio  # noqa: PLC0415

        paused.close()
        return asyncio.run(serve(app, sock, client, cfg, start.prefetcher, imports, metrics_sock))
    finally:
        paused.close()
        start.close()  # in-flight chunks of a download end; what is written is kept for the next start
        launcher.shutdown()  # no-op after a clean serve; bounded otherwise
        if cfg.startup_trace:
            try:
                timeline.write_chrome_trace(cfg.startup_trace)
            except OSError as e:
                log.warning("hotstart: WARNING: could not write --startup-trace %s: %s", cfg.startup_trace,
                            e.strerror or e)
