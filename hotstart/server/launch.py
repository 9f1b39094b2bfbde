"""`hotstart serve`: the startup pipeline of the API process (torch-free).

Order matters; each step is on the timeline:
  t=0  use this user's zygote if a matching one answers within ms ("zygote used" / "zygote not used"),
       else start the warm forkserver (it imports torch + the engine in another process)
       resolve the model (ms), start the weight prefetcher (daemon threads doing reads only),
       send the engine its config (the forkserver forks it as soon as its preload is done)
  then import the web stack, load the tokenizer, bind the socket, serve: /health is 503 until the
       engine reports ready.
HOTSTART_SERIAL=1 turns all of it off (the serial baseline): no forkserver, no prefetch, and the
engine is spawned only once the API process is otherwise ready.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import logging
import signal
import socket
import sys
import threading
import time

from hotstart import logs
from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig, ServeConfig
from hotstart.errors import HotstartError
from hotstart.forkserver.client import EngineLauncher

log = logging.getLogger("hotstart")
GRACEFUL_SHUTDOWN_S = 3


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OverflowError:  # a port outside 0..65535
        sock.close()
        raise HotstartError(f"port {port} is out of range (0 to 65535)") from None
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise HotstartError(
                f"port {port} on {host} is already in use (pick another with --port, or 0 for a free one)"
            ) from None
        raise HotstartError(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _start_prefetch(cfg: ServeConfig, model_path, files, cursor, timeline: Timeline, imports=None,
                    api_imported=None):
    """Start the sidecar and weight prefetchers (daemon threads, reads only); the weights one or None.
    With IMPORTS (boot/iosched.py's ImportPrefetch, reading what the imports need) the weights start
    once it is done, and read in the idle I/O class until the imports are over (API_IMPORTED set, and the
    engine's loader started: the forkserver's import is done)."""
    from hotstart.boot.iosched import GATE_TIMEOUT_S, start_after  # noqa: PLC0415
    from hotstart.boot.prefetch import Prefetcher  # noqa: PLC0415
    from hotstart.boot.storage import PrefetchOverrides, plan_for  # noqa: PLC0415
    from hotstart.model.files import sidecar_files  # noqa: PLC0415

    with timeline.phase("prefetch started") as span:
        overrides = PrefetchOverrides(threads=cfg.prefetch_threads, block_mib=cfg.prefetch_block_mb,
                                      method=cfg.prefetch_method)
        try:
            plan = plan_for(files, overrides)
        except ValueError as e:
            raise HotstartError(str(e)) from None
        sidecars = sidecar_files(model_path)
        Prefetcher(sidecars, plan_for(sidecars, overrides)).start()
        span.detail = plan.reason if plan.enabled else f"off: {plan.reason}"
        prefetcher = None
        if plan.enabled and imports is None:
            prefetcher = Prefetcher(files, plan, cursor).start()
        elif plan.enabled:
            def imports_over() -> bool:
                return api_imported.is_set() and (cursor is None or cursor.position() >= 0)

            prefetcher = Prefetcher(files, plan, cursor, idle_io_until=imports_over)
            start_after(imports.done, GATE_TIMEOUT_S, prefetcher.start)
    return prefetcher


def run_serve(args: argparse.Namespace, cfg: ServeConfig, t0: float, launcher: EngineLauncher,
              imports=None) -> int:
    """ARGS: the parsed command line (models, --revision, engine flags); CFG: the serve flags; IMPORTS:
    the import prefetch started at t=0 (boot/iosched.py ImportPrefetch), or None. Several models (or
    --model-dir): server/multi_launch.py."""
    from hotstart.server.model_specs import gather  # noqa: PLC0415 - stdlib, imported by the CLI already

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
    prefetcher = cursor = remote = None
    try:
        from hotstart.boot.resolve import resolve_model  # noqa: PLC0415
        from hotstart.model.files import weight_files  # noqa: PLC0415

        with timeline.phase("model resolved") as span:
            model = resolve_model(spec.spec if spec else None, args.revision)
            files = weight_files(model.path)
            span.detail = f"{model.source}: {model.path}"
        remote = model.remote  # s3:// models (boot/remote/): its weights may be arriving
        if remote is not None:
            remote.attach(timeline.record)
        if cfg.prefetch and remote is not None and remote.downloading:  # the download fills the page cache
            cfg = dataclasses.replace(cfg, prefetch=False)
        if cfg.prefetch:
            from hotstart.model.cursor import LoadCursor  # noqa: PLC0415

            cursor = LoadCursor.create(ranks=getattr(args, "tensor_parallel_size", 1))  # a slot per rank
        engine_cfg = EngineConfig.from_args(
            args,
            model_path=str(model.path),
            weight_files=tuple(map(str, files)),
            cursor_path=cursor.path if cursor is not None else None,
            t0=t0,
        )
        if launcher.use_forkserver:
            with timeline.phase("engine config sent"):
                launcher.spawn(engine_cfg)  # the forkserver forks the engine once its preload is done
        api_imported = threading.Event()
        if cfg.prefetch:
            prefetcher = _start_prefetch(cfg, model.path, files, cursor, timeline, imports, api_imported)
        from hotstart.server.client import make_engine_client  # noqa: PLC0415

        client = make_engine_client(engine_cfg, timeline, launcher=launcher, auto_restart=cfg.restart)
        with timeline.phase("web stack imported"):
            from hotstart.server.api import ApiSettings, build_app  # noqa: PLC0415
            from hotstart.server.memory import memory_guard  # noqa: PLC0415
            from hotstart.server.validation import sampling_defaults  # noqa: PLC0415
            from hotstart.text.tokenizer import Tokenizer  # noqa: PLC0415
        with timeline.phase("tokenizer loaded"):
            tokenizer = Tokenizer.from_dir(model.path)
        api_imported.set()
        names = list(cfg.served_model_name or [spec.name if spec and spec.name else model.name])
        settings = ApiSettings(
            served_model_names=names,
            api_key=cfg.api_key,
            max_request_bytes=cfg.max_request_bytes,
            sampling_defaults=sampling_defaults(model.path, cfg.generation_config),
            tool_call_parser=None if cfg.tool_call_parser == "auto" else cfg.tool_call_parser,
            auto_tool_choice=cfg.enable_auto_tool_choice,
            memory_guard=memory_guard(cfg.min_free_memory),
        )
        app = build_app(client, tokenizer, settings)
        if prefetcher is not None:
            app.state.prefetch_stats = prefetcher.stats
        if remote is not None:
            app.state.download_stats = remote.stats
        with timeline.phase("socket bound"):
            sock = _bind(cfg.host, cfg.port)
        host, port = sock.getsockname()[:2]
        if cfg.host in ("0.0.0.0", "::") and not cfg.api_key:
            log.warning("hotstart: WARNING: listening on all interfaces without --api-key")
        print(
            f"hotstart: serving {names[0]} on http://{host}:{port} (health: /health)",
            file=sys.stderr,
            flush=True,
        )
        if not launcher.use_forkserver:
            client.spawn()  # the serial way: a fresh interpreter, once the API is otherwise ready
        import asyncio  # noqa: PLC0415

        return asyncio.run(_serve(app, sock, client, cfg, prefetcher, imports))
    finally:
        if remote is not None:
            remote.stop()  # in-flight chunks end; what is written is kept for the next start
        launcher.shutdown()  # no-op after a clean serve; bounded otherwise
        if cfg.startup_trace:
            try:
                timeline.write_chrome_trace(cfg.startup_trace)
            except OSError as e:
                log.warning("hotstart: WARNING: could not write --startup-trace %s: %s", cfg.startup_trace,
                            e.strerror or e)
        if cursor is not None:
            cursor.close()  # the owner's close removes its folder


def _imports_done(imports, timeline: Timeline) -> None:
    """At READY: the import prefetch on the timeline; this process's manifest recorded if it was missing
    or stale (boot/manifest.py; the forkserver records its own)."""
    from hotstart.boot import manifest  # noqa: PLC0415 - stdlib only
    from hotstart.system import hotstart_home  # noqa: PLC0415

    s = imports.stats()
    if imports.t_end is not None:
        timeline.add("imports prefetched", imports.t_start, imports.t_end, "api",
                     f"{s['bytes_listed'] / 1e6:.0f} MB in {s['files']} files, {s['errors']} errors")
    if "api" in imports.to_record:
        path = manifest.folder(hotstart_home()) / "api.json"
        try:
            manifest.record(path)
        except OSError as e:
            log.warning("hotstart: WARNING: could not record %s: %s", path, e.strerror or e)


class Shutdown:
    """SIGTERM drains: the gate (server/gate.py Drain) turns /health and new requests to 503 at once, the
    requests in flight run to their end for up to TIMEOUT seconds, then the server exits. SIGINT, a second
    SIGTERM or the timeout force it: what is still generating ends with an error event (a 503 if not
    streamed) and the server exits at once (uvicorn's graceful window bounds the last bytes)."""

    def __init__(self, server, client, drain, timeout: float) -> None:
        self.server, self.client, self.drain, self.timeout = server, client, drain, timeout
        self.task = None

    def on_signal(self, sig: int) -> None:
        import asyncio  # noqa: PLC0415 - loaded already (the event loop runs)

        if sig == signal.SIGTERM and self.drain is not None and not self.drain.draining:
            self.drain.begin()
            log.info("hotstart: SIGTERM: draining (%d in flight, up to %s s)", self.drain.in_flight,
                     self.timeout)
            self.task = asyncio.get_running_loop().create_task(self._drain())
            return
        self.stop(forced=True)

    async def _drain(self) -> None:
        took = time.monotonic()
        if await self.drain.wait_idle(self.timeout):
            log.info("hotstart: drained in %.2f s", time.monotonic() - took)
            self.stop(forced=False)
        elif not self.drain.forced:
            log.warning("hotstart: --shutdown-timeout (%s s) passed: ending %d requests", self.timeout,
                        self.drain.in_flight)
            self.stop(forced=True)

    def stop(self, forced: bool) -> None:
        if forced and self.drain is not None:
            self.drain.force()
        self.client.begin_shutdown()
        if self.server.should_exit and forced:
            self.server.force_exit = True
        self.server.should_exit = True


def uvicorn_config(app, cfg: ServeConfig):
    """uvicorn's settings: our protocol (server/connections.py: header and body deadlines, the connection
    cap with an OpenAI-shaped 503), our logging, no lifespan."""
    import uvicorn  # noqa: PLC0415

    from hotstart.server.connections import ConnectionLimits, protocol_class  # noqa: PLC0415

    limits = ConnectionLimits(cfg.max_connections, cfg.header_timeout, cfg.body_timeout)
    return uvicorn.Config(app, http=protocol_class(limits), log_level="warning", access_log=False,
                          lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


async def _sample_memory(every: float) -> None:
    """Keep MemAvailable's last reading fresh (what an engine death by SIGKILL is reported with)."""
    import asyncio  # noqa: PLC0415

    from hotstart.server import memory  # noqa: PLC0415

    memory.prime()
    while True:
        await asyncio.sleep(every)
        memory.SAMPLER.available()


async def _serve(app, sock: socket.socket, client, cfg: ServeConfig, prefetcher=None, imports=None) -> int:
    """Serve APP on SOCK until a signal or the engine's fatal end (one model, or server/multi_launch.py's
    router standing in for CLIENT)."""
    import uvicorn  # noqa: PLC0415

    from hotstart.server.memory import SAMPLE_S  # noqa: PLC0415

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # we install our own handlers on the loop below
            yield

    server = Server(uvicorn_config(app, cfg))
    import asyncio  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    sampler = loop.create_task(_sample_memory(SAMPLE_S))
    shutdown = Shutdown(server, client, getattr(app.state, "drain", None), cfg.shutdown_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.on_signal, sig)
    from hotstart.procs import exit_requested  # noqa: PLC0415 - loaded already (cli.py)

    if (early := exit_requested()) is not None:  # a SIGTERM during startup that an import swallowed
        log.info("hotstart: signal %d arrived while starting: stopping", early)
        shutdown.on_signal(early)

    def on_fatal(message: str) -> None:  # noqa: ARG001 - printed once, after shutdown
        server.should_exit = True

    def on_ready() -> None:
        took = time.time() - client.timeline.t0
        if imports is not None:
            _imports_done(imports, client.timeline)
        log.info("hotstart: ready in %.2f s since launch", took)
        if hasattr(app.state, "set_startup_seconds"):
            app.state.set_startup_seconds(took)
        if prefetcher is not None:
            s = prefetcher.stats()
            log.info("hotstart: prefetch %s: %.0f MB read, %.0f MB already resident, %.2f GB/s",
                     s.get("state"), s.get("bytes_read", 0) / 1e6, s.get("bytes_skipped_resident", 0) / 1e6,
                     s.get("gbps", 0.0))

    client.on_fatal = on_fatal
    client.on_ready = on_ready
    await client.start()
    try:
        await server.serve(sockets=[sock])
    finally:
        sampler.cancel()
        if prefetcher is not None:
            prefetcher.stop()
        await client.close()
    if client.fatal:
        print(f"hotstart: error: {client.fatal}", file=sys.stderr)
        return 1
    return 0
