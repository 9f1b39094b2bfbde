"""`hotstart serve MODEL MODEL ...` / `--model-dir DIR`: several models, loaded on demand (torch-free).

The one warm forkserver (or the zygote) is started at t=0 as for one model; the models are resolved
(ms, an error names the spec and ends the start), the web stack imported, the socket bound, and then
nothing is loaded until a request names a model (or --preload). Each load forks an engine from the
forkserver (frontend/shared_launcher.py), supervised as one model's engine is; frontend/router.py decides
when to load and unload, server/multi_api.py answers the HTTP side. /health is 200 once the server is
up and every --preload model is loaded: it does not wait for models nobody asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from pathlib import Path

from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig, ServeConfig
from hotstart.errors import HotstartError
from hotstart.forkserver.client import EngineLauncher
from hotstart.frontend.model_specs import ModelsConfig, ModelSpec, parse_duration
from hotstart.frontend.router import ModelRecord, ModelRouter, State

log = logging.getLogger("hotstart")


KV_FRACTION = 0.5  # engine/placement.py's CPU_KV_MEMORY_FRACTION: the KV cache's share beside the weights


def free_memory() -> int | None:
    """Bytes free now for one more model (eviction by memory): the container-aware figure every memory
    budget reads (system.available_memory: a cgroup's limit minus its working set, else MemAvailable)."""
    from hotstart.system import available_memory  # noqa: PLC0415 - stdlib only

    return available_memory()


def estimate_cost(path: Path, args: argparse.Namespace, budget: int, slots: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) of a loaded model: its safetensors files; the KV cache is
    --kv-cache-memory, else max-num-seqs x max-model-len tokens of K and V in float32, capped at one
    of SLOTS (--max-loaded-models) equal shares of what the engine would take alone on CPU (half of what
    is left beside the weights, here of BUDGET), so that SLOTS such models fit the budget together. The
    engine is given that KV size (engine_config), so the estimate is what it allocates."""
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors") if p.is_file())
    kv = getattr(args, "kv_cache_memory", None)
    if kv is None:
        try:
            from hotstart.model_config import load_model_config  # noqa: PLC0415 - stdlib + json

            mc = load_model_config(path)
            tokens = (getattr(args, "max_model_len", None) or mc.max_position_embeddings) * args.max_num_seqs
            need = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4 * tokens
            kv = min(need, int(KV_FRACTION * max(0, budget - weights * slots) / max(1, slots)))
        except Exception:  # noqa: BLE001 - a bad config.json fails at load, with the engine's reason
            kv = 0
    return weights, kv


def models_budget(models_memory: int | None) -> int:
    """Bytes the loaded models may use together: --models-memory, else what is available at start
    (system.available_memory(): the container's limit minus its working set, else MemAvailable)."""
    from hotstart.system import available_memory_detail  # noqa: PLC0415 - stdlib only

    if models_memory:
        return models_memory
    available, source = available_memory_detail()
    if available is None:
        return 1 << 62
    log.info("hotstart: models may use %.1f GiB together (%s)", available / 2**30, source)
    return available


def resolve_all(specs: list[ModelSpec], revision: str | None) -> list[tuple[str, object]]:
    """(name, ResolvedModel) per spec; a spec that does not resolve, or a name given twice, ends the start."""
    from hotstart.boot.resolve import resolve_model  # noqa: PLC0415

    out, seen = [], set()
    for spec in specs:
        model = resolve_model(spec.spec, revision)
        name = spec.name or model.name
        if name in seen:
            raise HotstartError(f"two models are named '{name}' (name them: NAME=PATH)")
        seen.add(name)
        out.append((name, model))
    return out


def run_serve_many(args: argparse.Namespace, cfg: ServeConfig, specs: list[ModelSpec], t0: float,
                   launcher: EngineLauncher) -> int:
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()), format="%(message)s",
                        stream=sys.stderr)
    mcfg = ModelsConfig(**{k: getattr(args, k) for k in ModelsConfig.__dataclass_fields__
                           if hasattr(args, k)})
    timeline = Timeline(t0)
    timeline.on_event = lambda span: log.info(timeline.log_line(span))
    for name, start, end, detail in launcher.spans:
        timeline.add(name, start, end, "api", detail)
    remotes = []
    try:
        with timeline.phase("models resolved") as span:
            resolved = resolve_all(specs, args.revision)
            span.detail = f"{len(resolved)} models"
        remotes = [m.remote for _, m in resolved if m.remote is not None]
        served = [name for name, _ in resolved]
        preload, pins = mcfg.preload_names(), mcfg.pin_names()
        for flag, names in (("--preload", preload), ("--pin", pins)):
            unknown = [n for n in names if n not in served]
            if unknown:
                raise HotstartError(f"{flag} {', '.join(unknown)}: no such model (served: "
                                    f"{', '.join(served)})")
        if len(set(pins)) > mcfg.max_loaded_models:
            raise HotstartError(f"--pin names {len(set(pins))} models, more than --max-loaded-models "
                                f"{mcfg.max_loaded_models}")
        aliases, priorities = mcfg.alias_map(served), mcfg.priorities(served)
        if cfg.served_model_name:
            raise HotstartError("--served-model-name applies to one model; name several with NAME=PATH")
        with timeline.phase("web stack imported"):
            from hotstart.server.multi_api import build_multi_app  # noqa: PLC0415
        from hotstart.frontend.shared_launcher import SharedLauncher  # noqa: PLC0415
        budget = models_budget(mcfg.models_memory)
        records = []
        for name, m in resolved:
            weights, kv = estimate_cost(Path(m.path), args, budget, mcfg.max_loaded_models)
            records.append(ModelRecord(name, str(m.path), cost=weights + kv, pinned=name in pins,
                                       priority=priorities.get(name, 0),
                                       extra={"kv_bytes": kv, "resolved": m}))
        pinned_cost = sum(r.cost for r in records if r.pinned)
        if pinned_cost > budget:
            raise HotstartError(f"the --pin models need {pinned_cost / 2**30:.1f} GiB together, more than "
                                f"the {budget / 2**30:.1f} GiB the models may use (--models-memory)")
        shared = SharedLauncher(launcher) if launcher.use_forkserver else None
        router = ModelRouter(records, None, None, max_loaded=mcfg.max_loaded_models, budget=budget,
                             keep_alive=parse_duration(mcfg.keep_alive),
                             max_waiting=mcfg.max_waiting_requests, preload=preload, aliases=aliases,
                             free_memory=free_memory)

        def engine_config(rec: ModelRecord, **derived) -> EngineConfig:
            cfg = EngineConfig.from_args(args, **derived)
            kv = rec.extra.get("kv_bytes")  # the engine allocates what the budget counted for it
            if kv and cfg.kv_cache_memory is None:
                cfg = dataclasses.replace(cfg, kv_cache_memory=kv)
            others = any(r is not rec and r.state in (State.LOADED, State.LOADING) for r in records)
            return dataclasses.replace(cfg, background_load=others)  # others serve: load at low priority

        router.start_engine = engine_starter(router, shared, launcher.use_forkserver, engine_config,
                                             cfg.restart, cfg)
        app = build_multi_app(router, cfg, timeline)
        router.make_serving = serving_maker(cfg, app.state.drain, app.state.store)
        from hotstart.server.access import announce_metrics  # noqa: PLC0415
        from hotstart.server.http import bind_listeners, serve  # noqa: PLC0415

        with timeline.phase("socket bound"):
            sock, metrics_sock = bind_listeners(cfg)  # refused beyond loopback without a key
        host, port = sock.getsockname()[:2]
        print(f"hotstart: serving {len(records)} models ({', '.join(router.records)}) on "
              f"http://{host}:{port} (health: /health)", file=sys.stderr, flush=True)
        announce_metrics(metrics_sock)
        lifecycle = RouterLifecycle(router, timeline)
        return asyncio.run(serve(app, sock, lifecycle, cfg, metrics_sock=metrics_sock))
    finally:
        for remote in remotes:
            remote.stop()
        launcher.shutdown()


def engine_starter(router: ModelRouter, shared, use_forkserver: bool, engine_config, auto_restart: bool,
                   prefetch: ServeConfig | None = None):
    """start_engine(rec) for the router: an engine forked from the shared forkserver (or spawned) through
    the one start sequence (frontend/start.py), its client started, then the tokenizer (once per model);
    a load error raises (the record fails). PREFETCH: the serve flags of the weights' page-cache
    prefetch (what is cached already is skipped: a warm swap reads nothing)."""
    import encodings.unicode_escape  # noqa: F401, PLC0415 - what Tokenizer.from_dir imports: it runs off the loop

    from hotstart.frontend.shared_launcher import launcher_for  # noqa: PLC0415
    from hotstart.frontend.start import EngineStart  # noqa: PLC0415
    from hotstart.text.tokenizer import Tokenizer  # noqa: F401, PLC0415 - likewise, before the worker thread

    async def start(rec: ModelRecord):
        timeline = rec.extra["timeline"] = Timeline(time.time())
        begun = EngineStart(timeline, launcher_for(shared, use_forkserver),
                            lambda **derived: engine_config(rec, **derived), auto_restart=auto_restart,
                            prefetch=prefetch)
        try:
            begun.begin(resolved=rec.extra["resolved"])
        except BaseException:
            begun.end_prefetch()
            raise
        client = begun.client

        def ready() -> None:
            begun.end_prefetch()  # the engine has read its weights
            router.notify()

        def fatal(message: str) -> None:
            begun.end_prefetch()
            router.engine_fatal(rec, message)

        client.on_fatal, client.on_ready = fatal, ready
        begun.spawn_serial()  # without a forkserver: a fresh interpreter (begin sent it to the forkserver)
        try:
            await client.start()
            if rec.tokenizer is None:  # on a worker thread: a large tokenizer.json takes 100s of ms to
                # parse, and the other models' streams go on meanwhile
                rec.tokenizer = await asyncio.get_running_loop().run_in_executor(None, begun.load_tokenizer)
        except BaseException:
            begun.end_prefetch()
            await client.close()
            raise
        return client

    return start


def serving_maker(cfg: ServeConfig, drain, store):
    """make_serving(rec): the OpenAIServing of a loaded model (its metrics kept across loads), with the
    server's DRAIN (server/gate.py) and Responses STORE (one for every model)."""
    from hotstart.frontend.metrics import Metrics  # noqa: PLC0415
    from hotstart.frontend.sampling import sampling_defaults  # noqa: PLC0415
    from hotstart.server.api import ApiSettings, OpenAIServing  # noqa: PLC0415

    def make(rec: ModelRecord):
        settings = ApiSettings(
            served_model_names=[rec.name, *rec.aliases], api_key=cfg.api_key,
            max_request_bytes=cfg.max_request_bytes,
            sampling_defaults=sampling_defaults(rec.path, cfg.generation_config),
            tool_call_parser=None if cfg.tool_call_parser == "auto" else cfg.tool_call_parser,
            auto_tool_choice=cfg.enable_auto_tool_choice,
        )
        if "metrics" not in rec.extra:
            rec.extra["metrics"] = Metrics(rec.name)  # vLLM's series labelled model_name=NAME
        if "timeline" in rec.extra:
            rec.extra["timeline"].mark("model serving")
        return OpenAIServing(rec.client, rec.tokenizer, settings, metrics=rec.extra["metrics"], drain=drain,
                             store=store)

    return make


class RouterLifecycle:
    """What launch._serve drives (the EngineClient lifecycle part) for a router: start, ready (every
    --preload model loaded), shutdown."""

    fatal = None

    def __init__(self, router: ModelRouter, timeline: Timeline) -> None:
        self.router, self.timeline = router, timeline
        self.on_ready = self.on_fatal = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        from hotstart.frontend.keep_warm import KeepWarm  # noqa: PLC0415

        self._tasks = [asyncio.ensure_future(self.router.reap()),
                       asyncio.ensure_future(KeepWarm(self.router, free_memory).run())]
        self.router.on_preloaded = self.on_ready
        for name in self.router.preload:
            self.router.load_soon(self.router.records[name])
        if not self.router.preload and self.on_ready is not None:
            asyncio.get_running_loop().call_soon(self.on_ready)

    def begin_shutdown(self) -> None:
        for rec in self.router.records.values():
            if rec.client is not None:
                rec.client.begin_shutdown()

    async def close(self, timeout: float = 3.0) -> None:  # noqa: ARG002 - each engine: CLOSE_TIMEOUT_S
        for task in self._tasks:
            task.cancel()
        await self.router.close_all()
