"""One Ray Serve replica: hotstart's API process inside a Ray actor (torch-free: the engine runs in a process
of its own, as under `hotstart serve`).

A replica's start, in order (each step on its /startup timeline):
  ray worker      Ray's own: a worker process (python, `import ray`, the core worker), the deployment class
                  unpickled (this module imported), before our constructor runs; not ours to overlap but
                  measured ("ray worker" span: the process's start -> the constructor; a worker Ray had
                  started ahead of time shows as up long before)
  t=0             the node's zygote if one answers (ms: torch imported already), else a local forkserver that
                  imports torch + the engine in another process while this one goes on (cli.py's t=0 step)
  engine start    frontend/start.py EngineStart, as `hotstart serve`: resolve, engine config sent, weight
                  prefetch (daemon threads, reads only), the engine client
  http            the tokenizer and hotstart's own app (server/routes.py build_app: the same endpoints, gate,
                  errors as `hotstart serve`), handed to Ray Serve's proxy through @serve.ingress
  ready           the constructor returns once the engine is READY: Ray routes nothing here before that, so a
                  request arriving at zero replicas waits in Ray's proxy, never on a 503
  then            the node's zygote is asked for (ray/zygote.py), so the next replica on this node skips torch

Ray then drives it: check_health (a dead engine for good -> Ray replaces the replica),
record_autoscaling_stats (hotstart's running / waiting requests: ray/autoscale.py), __del__ after Ray drained
the requests in flight (its graceful shutdown), which stops the engine. If the replica's process dies, its
forkserver and engines die with it (PR_SET_PDEATHSIG; a zygote's engines by their lifeline).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray
from ray import serve

from hotstart import logs
from hotstart.boot.timeline import Timeline
from hotstart.forkserver.client import EngineLauncher
from hotstart.forkserver.runtime import import_env
from hotstart.frontend.model_specs import gather
from hotstart.frontend.start import EngineStart
from hotstart.ray import zygote
from hotstart.ray.autoscale import HTTP, RUNNING, WAITING
from hotstart.ray.options import ReplicaSpec

log = logging.getLogger("hotstart")


def _process_started() -> float | None:
    """This process's start (time.time() clock) from /proc, or None."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _route_logs() -> None:
    """hotstart's lines into this replica's own Ray Serve log file
    (logs/serve/replica_APP_DEPLOYMENT_ID.log)."""
    ours, ray_serve = logging.getLogger(logs.ROOT), logging.getLogger("ray.serve")
    for handler in ray_serve.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


@serve.ingress()
class HotstartReplica:
    """SPEC: the model and hotstart's flags; OPTIONS: ray/options.py's Ray options (node_zygote,
    startup_timeout_s, graceful_shutdown_timeout_s)."""

    async def __init__(self, spec: ReplicaSpec, options: dict[str, Any]) -> None:
        t0 = time.time()
        ctx = serve.get_replica_context()
        node_id = ray.get_runtime_context().get_node_id()
        self.env = import_env()
        use_zygote = bool(options.get("node_zygote")) and spec.serve.prespawn
        if use_zygote:  # read by the launcher's probe below: this node's zygote, not the user's
            self.zygote_dir = zygote.node_runtime_dir(ctx.app_name, node_id, self.env)
            os.environ["HOTSTART_RUNTIME_DIR"] = self.zygote_dir
        self.launcher = EngineLauncher(use_forkserver=spec.serve.prespawn,
                                       zygote="auto" if use_zygote else "off")
        self.launcher.start()  # t=0: a fork from the node's zygote, or torch importing in our forkserver
        _route_logs()
        self.spec, self.options, self.app_name, self.node_id = spec, options, ctx.app_name, node_id
        self.timeline = timeline = Timeline(t0)
        started = _process_started()
        if started is not None and started < t0:
            timeline.add("ray worker", started, t0, "api",
                         f"process up {t0 - started:.2f} s before the replica")
        for name, start, end, detail in self.launcher.spans:
            timeline.add(name, start, end, "api", detail)
        if self.launcher.started_at is not None:
            timeline.add("forkserver launched", t0, self.launcher.started_at)
        specs = gather([spec.model] if spec.model else [], None)
        self.start = EngineStart(timeline, self.launcher, spec.engine_config, prefetch=spec.serve,
                                 auto_restart=spec.serve.restart,
                                 ranks=spec.engine.get("tensor_parallel_size", 1))
        try:
            self.start.begin(specs[0].spec if specs else None, spec.revision)
            self.client = self.start.client
            self.http = self._build_app(specs[0].name if specs else None)
            self.start.spawn_serial()
            await self._wait_ready(float(options.get("startup_timeout_s") or 600.0))
        except BaseException:
            await self._close()
            raise
        log.info("hotstart: replica %s ready in %.2f s on node %s", ctx.replica_id.unique_id,
                 time.time() - t0, node_id[:12])
        if use_zygote and self.launcher.zygote_pid is None:
            try:
                zygote.ensure(self.zygote_dir, ctx.app_name, node_id, self.env)
            except Exception as e:  # noqa: BLE001 - an optimisation: the replica serves without it
                log.warning("hotstart: WARNING: no node zygote: %s", e)

    def _build_app(self, name: str | None):
        from hotstart.frontend.memory import memory_guard  # noqa: PLC0415 - the web stack, after t=0
        from hotstart.frontend.sampling import sampling_defaults  # noqa: PLC0415
        from hotstart.server.api import ApiSettings  # noqa: PLC0415
        from hotstart.server.routes import build_app  # noqa: PLC0415

        cfg, model = self.spec.serve, self.start.model
        tokenizer = self.start.load_tokenizer()
        settings = ApiSettings(
            served_model_names=list(cfg.served_model_name or [name or model.name]),
            api_key=cfg.api_key or os.environ.get("HOTSTART_API_KEY") or None,
            max_request_bytes=cfg.max_request_bytes,
            sampling_defaults=sampling_defaults(model.path, cfg.generation_config),
            tool_call_parser=None if cfg.tool_call_parser == "auto" else cfg.tool_call_parser,
            auto_tool_choice=cfg.enable_auto_tool_choice,
            memory_guard=memory_guard(cfg.min_free_memory),
        )
        app = build_app(self.client, tokenizer, settings)
        if self.start.prefetcher is not None:
            app.state.prefetch_stats = self.start.prefetcher.stats
        self.drain = app.state.drain
        return app

    async def _wait_ready(self, timeout: float) -> None:
        changed = asyncio.Event()
        client = self.client

        def on_ready() -> None:
            took = time.time() - self.timeline.t0
            log.info("hotstart: ready in %.2f s since the replica's constructor", took)
            self.http.state.set_startup_seconds(took)
            changed.set()

        client.on_ready = on_ready
        client.on_fatal = lambda message: changed.set()
        await client.start()
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"hotstart: the engine was not ready within {timeout:.0f} s "
                               f"({client.status})") from None
        if client.fatal:
            raise RuntimeError(f"hotstart: the engine failed to start: {client.fatal}")

    def __serve_build_asgi_app__(self):
        return self.http

    # ---- what Ray asks -------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Ray replaces the replica when this raises: an engine that is gone for good (a crash loop)."""
        if self.client.fatal:
            raise RuntimeError(f"hotstart: the engine is gone: {self.client.fatal}")

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.client.stats
        return {RUNNING: float(stats.num_running), WAITING: float(stats.num_waiting),
                HTTP: float(self.drain.in_flight)}

    async def __del__(self) -> None:
        """After Ray's drain (requests in flight ended, up to graceful_shutdown_timeout_s): refuse any late
        request (503 server_draining), wait for ours, stop the engine and the forkserver."""
        drain = getattr(self, "drain", None)
        if drain is not None:
            drain.begin()
            await drain.wait_idle(float(self.options.get("graceful_shutdown_timeout_s") or 0))
        await self._close()

    async def _close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.begin_shutdown()
            try:
                await client.close()
            except Exception as e:  # noqa: BLE001 - stopping: the launcher's shutdown below still runs
                log.warning("hotstart: WARNING: closing the engine client: %s", e)
        if getattr(self, "start", None) is not None:
            self.start.close()
        self.launcher.shutdown()
