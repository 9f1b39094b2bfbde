"""The HTTP server's life (torch-free): the listening socket, uvicorn on it with hotstart's connection
limits, signals (SIGTERM drains), and the engine client's (or the many-models router's) start and end.
server/launch.py (one model) and server/multi_launch.py (several) both serve through serve()."""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from hotstart.errors import HotstartError

if TYPE_CHECKING:
    from hotstart.boot.timeline import Timeline
    from hotstart.config import ServeConfig

log = logging.getLogger("hotstart")
GRACEFUL_SHUTDOWN_S = 3


def bind(host: str, port: int) -> socket.socket:
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


def bind_listeners(cfg) -> tuple[socket.socket, socket.socket | None]:
    """The API's socket (check_bind on the address bound) and --metrics-port's, on --host; a warning line
    when a keyless server listens beyond loopback (--allow-no-api-key)."""
    from hotstart.server.access import check_bind, is_loopback  # noqa: PLC0415 - stdlib only

    if cfg.metrics_port is not None and cfg.metrics_port == cfg.port != 0:
        raise HotstartError(f"--metrics-port {cfg.metrics_port} is the API's --port: pick another")
    sock = bind(cfg.host, cfg.port)
    bound = sock.getsockname()[0]
    try:
        check_bind(cfg.host, bool(cfg.api_key), cfg.allow_no_api_key, bound)
        metrics = bind(cfg.host, cfg.metrics_port) if cfg.metrics_port is not None else None
    except BaseException:
        sock.close()
        raise
    if not cfg.api_key and not is_loopback(bound):
        log.warning("hotstart: WARNING: listening on %s beyond this machine without an API key "
                    "(--allow-no-api-key): everyone who can reach it may use it", bound)
    return sock, metrics


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

    limits = ConnectionLimits(cfg.max_connections, cfg.header_timeout, cfg.body_timeout, cfg.write_timeout,
                              cfg.max_connections_per_client)
    return uvicorn.Config(app, http=protocol_class(limits), log_level="warning", access_log=False,
                          lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


async def _sample_memory(every: float) -> None:
    """Keep MemAvailable's last reading fresh (what an engine death by SIGKILL is reported with)."""
    import asyncio  # noqa: PLC0415

    from hotstart.frontend import memory  # noqa: PLC0415

    memory.prime()
    while True:
        await asyncio.sleep(every)
        memory.SAMPLER.available()


async def serve(app, sock: socket.socket, client, cfg: ServeConfig, prefetcher=None, imports=None,
                metrics_sock: socket.socket | None = None) -> int:
    """Serve APP on SOCK until a signal or the engine's fatal end (one model, or server/multi_launch.py's
    router standing in for CLIENT); GET /metrics alone on METRICS_SOCK (--metrics-port) meanwhile."""
    import uvicorn  # noqa: PLC0415

    from hotstart.frontend.memory import SAMPLE_S  # noqa: PLC0415

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
            imports_done(imports, client.timeline)
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
    metrics = metrics_server(Server, app, metrics_sock, cfg)
    try:
        await server.serve(sockets=[sock])
    finally:
        if metrics is not None:
            await metrics.stop()
        sampler.cancel()
        if prefetcher is not None:
            prefetcher.stop()
        await client.close()
    if client.fatal:
        print(f"hotstart: error: {client.fatal}", file=sys.stderr)
        return 1
    return 0


class _MetricsServer:
    """uvicorn on the --metrics-port socket, serving APP's GET /metrics alone (server/access.py
    metrics_only), for as long as the API's server runs."""

    def __init__(self, server_class, app, sock: socket.socket, cfg: ServeConfig) -> None:
        import asyncio  # noqa: PLC0415

        from hotstart.server.access import metrics_only  # noqa: PLC0415

        async def only_metrics(scope, receive, send) -> None:
            await metrics_only(app, scope, receive, send)

        self.server = server_class(uvicorn_config(only_metrics, cfg))
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))

    async def stop(self) -> None:
        import asyncio  # noqa: PLC0415

        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, GRACEFUL_SHUTDOWN_S + 1)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the API's exit is what matters
            self.task.cancel()


def metrics_server(server_class, app, sock: socket.socket | None, cfg: ServeConfig) -> _MetricsServer | None:
    return _MetricsServer(server_class, app, sock, cfg) if sock is not None else None


def imports_done(imports, timeline: Timeline) -> None:
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
