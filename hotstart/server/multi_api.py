"""The HTTP side of several models (torch-free): each request's `model` picks a ModelRecord through the
router (frontend/router.py), and the model's own OpenAIServing (server/api.py) answers it.

The endpoints of one model (api.py MODEL_ENDPOINTS: /v1/chat/completions, /v1/completions,
/v1/responses, /tokenize, /detokenize) are the single-model app's own handlers, called on the serving of
the model the request names once it is acquired (loaded on demand); its lease ends with the response
(a stream's last byte, or the client leaving). One Responses store serves every model, so
`previous_response_id` finds a response whichever model answered it, across unloads (as OpenAI lets a
follow-up change `model`). Endpoints beside OpenAI's (documented in README "Many models"):
  GET  /v1/models                  every model, with `state`, `loaded_at`, `keep_alive_until`, `error`,
                                   `pinned`, `priority`, `aliases`, `last_used`, `memory_bytes`,
                                   `resident_bytes`, `prefix_blocks_on_disk`, `waiting` (requests
                                   waiting for its load); each alias also listed
  POST /v1/models/{name}/load      load it now (waits until it serves; body {"keep_alive": ...} optional)
  POST /v1/models/{name}/unload    stop its engine: at once when idle (200), else once its requests end
                                   (202); a loading model answers 409. With --admin-key both need that key
                                   (server/gate.py), and so does a request's `keep_alive`
  GET  /health                     200 when up and every --preload model is loaded; 503 from SIGTERM on
  GET  /live                       200 while the process serves HTTP (starting, ready or draining)
  GET  /startup, /metrics          the server's, plus one entry (a `model` label) per model; vLLM's
                                   series carry their `model_name` label instead
Requests may carry Ollama's `keep_alive` ("5m", seconds, 0 = unload after it, negative = never).
SIGTERM drains as with one model (server/gate.py Drain, server/launch.py Shutdown): the requests in
flight, of every model, run to their end, then every engine is stopped.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import generate_latest
from starlette.responses import Response, StreamingResponse

from hotstart.errors import HotstartError, RequestError, bad_param
from hotstart.frontend.memory import memory_guard
from hotstart.frontend.metrics import CONTENT_TYPE, Metrics
from hotstart.frontend.model_specs import parse_duration
from hotstart.frontend.router import UNSET, ModelRecord, ModelRouter, State
from hotstart.server.access import Access
from hotstart.server.gate import Drain, Gate, add_error_handlers, caller, json_response
from hotstart.server.offload import WORK
from hotstart.server.responses import ResponseStore
from hotstart.server.responses_serving import store_routes
from hotstart.server.routes import MODEL_ENDPOINTS, ModelEndpoint, answer
from hotstart.server.schemas import decode_request, read_body

DISK_COUNT_S = 2.0  # /v1/models and /metrics count a model's blocks on disk at most this often
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(pid: int) -> int | None:
    """The resident set of process PID (/proc/PID/statm), None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


class _KeepAlive(msgspec.Struct):
    keep_alive: str | float | None = None


def keep_alive_of(body: bytes) -> Any:
    """The body's keep_alive in seconds (None: forever), or UNSET; 400 when it is no duration."""
    try:
        raw = msgspec.json.decode(body, type=_KeepAlive).keep_alive if body.strip() else None
    except msgspec.ValidationError:
        raise bad_param("keep_alive", "keep_alive must be a duration (\"5m\", \"30s\") or seconds") from None
    except msgspec.DecodeError:
        raise RequestError(400, "the body is not valid JSON", code="invalid_json") from None
    if raw is None:
        return UNSET
    try:
        return parse_duration(raw)
    except ValueError as e:
        raise bad_param("keep_alive", str(e)) from None


class LeasedResponse(Response):
    """A streamed response whose model lease is released once the stream ends (or the client leaves);
    RELEASE is called once."""

    def __init__(self, inner: Response, release) -> None:
        self.inner, self.release = inner, release
        self.status_code, self.raw_headers, self.background = inner.status_code, inner.raw_headers, None

    async def __call__(self, scope, receive, send) -> None:
        if self.background is not None and self.inner.background is None:
            self.inner.background = self.background
        try:
            await self.inner(scope, receive, send)
        finally:
            release, self.release = self.release, None
            if release is not None:
                release()


def labelled(line: str, model: str) -> str:
    """A Prometheus sample line with model="MODEL" added (vLLM's keep their own `model_name` alone)."""
    if line.startswith("vllm:"):
        return line
    value = model.replace("\\", "\\\\").replace('"', '\\"')
    brace, space = line.find("{"), line.find(" ")
    if 0 <= brace < space:
        return f'{line[:brace + 1]}model="{value}",{line[brace + 1:]}'
    return f'{line[:space]}{{model="{value}"}}{line[space:]}'


def merged(parts: list[tuple[bytes, str | None]]) -> str:
    """One exposition of several registries' texts (PARTS: (text, model or None)): each family once, its
    HELP/TYPE lines then the samples of every part (a model's labelled), as parsers require."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (HELP/TYPE lines, samples)
    for text, model in parts:
        family = families.setdefault("", ([], []))  # samples before any HELP/TYPE line
        for line in text.decode().splitlines():
            if line.startswith("# "):  # "# HELP name ..." / "# TYPE name ...": a family begins
                family = families.setdefault(line.split(" ", 3)[2], ([], []))
                if line not in family[0]:
                    family[0].append(line)
            elif line:
                family[1].append(labelled(line, model) if model is not None else line)
    return "".join("\n".join(head + samples) + "\n" for head, samples in families.values())


class MultiServing:
    def __init__(self, router: ModelRouter, max_request_bytes: int, timeline) -> None:
        self.router, self.max_bytes, self.timeline = router, max_request_bytes, timeline
        self.metrics = Metrics()  # the HTTP counters (the gate's) and the startup gauge
        self.drain = Drain()  # the server's (SIGTERM): every model's servings share it
        self.store = ResponseStore()  # every model's /v1/responses
        self.created = int(time.time())
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.g_state = Gauge("hotstart_model_state", "1 for the state each model is in", ["model", "state"],
                             registry=r)
        self.g_in_flight = Gauge("hotstart_model_requests_in_flight", "Requests being answered", ["model"],
                                 registry=r)
        self.g_waiting = Gauge("hotstart_model_requests_waiting", "Requests waiting for the model to load",
                               ["model"], registry=r)
        self.g_loads = Gauge("hotstart_model_loads", "Loads that succeeded", ["model"], registry=r)
        self.g_evictions = Gauge("hotstart_model_evictions", "Unloads to make room", ["model"], registry=r)
        self.g_load_s = Gauge("hotstart_model_load_seconds", "Last load: request to serving", ["model"],
                              registry=r)
        self.g_memory = Gauge("hotstart_model_memory_bytes", "Memory the budget counts for it: weights + KV "
                              "cache", ["model"], registry=r)
        self.g_resident = Gauge("hotstart_model_resident_bytes", "Resident memory of its engine process "
                                "(0: not loaded)", ["model"], registry=r)
        self.g_pinned = Gauge("hotstart_model_pinned", "1 for a --pin model", ["model"], registry=r)
        self.g_last_used = Gauge("hotstart_model_last_used_seconds", "When a request of it last began or "
                                 "ended (unix time; 0: never)", ["model"], registry=r)
        self.g_disk_blocks = Gauge("hotstart_model_prefix_blocks_on_disk", "Prefix-cache KV blocks of it on "
                                   "disk (every layout)", ["model"], registry=r)
        # model -> (when counted, (its state, loads) then, blocks): an unload writes blocks, so a new state
        # or load recounts
        self._disk: dict[str, tuple[float, tuple[State, int], int | None]] = {}

    def card(self, rec: ModelRecord, name: str | None = None) -> dict[str, Any]:
        """REC's /v1/models entry (NAME: one of its aliases, listed as a model of its own)."""
        info = rec.client.info if rec.client is not None else None
        until = rec.keep_alive_until if rec.state is State.LOADED else None
        return {"id": name or rec.name, "object": "model", "created": self.created, "owned_by": "hotstart",
                "root": rec.name, "parent": None, "max_model_len": info.max_model_len if info else None,
                "state": rec.state.value, "loaded_at": int(rec.loaded_at) if rec.loaded_at else None,
                "keep_alive_until": int(until) if until else None, "error": rec.error,
                "pinned": rec.pinned, "priority": rec.priority, "aliases": list(rec.aliases),
                "waiting": rec.waiting,
                "last_used": int(rec.last_used) if rec.last_used else None, "memory_bytes": rec.cost,
                "resident_bytes": resident_bytes(info.pid) if info and rec.state is State.LOADED else None,
                "prefix_blocks_on_disk": self.disk_blocks(rec)}

    def disk_blocks(self, rec: ModelRecord) -> int | None:
        """REC's prefix-cache blocks on disk (model/kv_files.py), counted at most every DISK_COUNT_S while
        its state stays the same."""
        from hotstart.model import kv_files  # noqa: PLC0415 - stdlib only

        when, state, count = self._disk.get(rec.name, (0.0, None, None))
        if time.monotonic() - when < DISK_COUNT_S and state == (rec.state, rec.loads):
            return count
        try:
            if "snapshot" not in rec.extra:
                from hotstart.model.files import weight_files  # noqa: PLC0415

                rec.extra["snapshot"] = kv_files.snapshot_key(rec.path, weight_files(rec.path))
            count = kv_files.count_blocks(kv_files.kv_root(), rec.extra["snapshot"])
        except (OSError, ValueError, HotstartError):  # no weights (yet): an s3:// download, a broken folder
            count = None
        self._disk[rec.name] = (time.monotonic(), (rec.state, rec.loads), count)
        return count

    def route(self, ep: ModelEndpoint):
        """EP's route: decode the body (a malformed request loads nothing), acquire the model it names,
        answer with that model's serving, release it when the response ends."""

        async def route(request: Request) -> Response:
            t0 = time.perf_counter()
            body = await read_body(request, self.max_bytes)
            req, keep = await WORK.run(lambda: (decode_request(body, ep.schema), keep_alive_of(body)))
            if keep is not UNSET and not caller(request.scope).admin:  # 0 unloads, -1 pins: an admin's say
                raise RequestError(403, "`keep_alive` needs the admin key (--admin-key)", param="keep_alive",
                                   code="admin_key_required")
            if req.model is None:  # /tokenize's is optional with one model
                raise bad_param("model", f"name the model (served: {', '.join(self.router.records)})")
            rec = await self.router.acquire(req.model)
            try:
                resp = await answer(rec.serving, ep, request, req, t0)
            except BaseException:
                self.router.release(rec, keep)
                raise
            if isinstance(resp, StreamingResponse):
                return LeasedResponse(resp, lambda: self.router.release(rec, keep))
            self.router.release(rec, keep)
            return resp

        return route

    async def list_models(self) -> Response:
        cards = [self.card(r) for r in self.router.records.values()]
        cards += [self.card(self.router.records[t], a) for a, t in self.router.aliases.items()]
        return json_response({"object": "list", "data": cards})

    async def get_model(self, name: str) -> Response:
        return json_response(self.card(self.router.lookup(name), name))

    async def load_model(self, name: str, request: Request) -> Response:
        self.router.lookup(name)
        keep = keep_alive_of(await read_body(request, self.max_bytes))
        rec = await self.router.acquire(name)
        self.router.release(rec, keep)
        return json_response(self.card(rec))

    async def unload_model(self, name: str) -> Response:
        rec = self.router.lookup(name)
        if rec.state is State.LOADING:
            raise RequestError(409, f"model `{name}` is loading; unload it once loaded", code="model_loading")
        if rec.state is State.LOADED and rec.in_flight:
            rec.extra["unload_when_idle"] = True
            return json_response(self.card(rec), 202)
        await self.router.unload(rec, "unload requested")
        return json_response(self.card(rec))

    async def health(self) -> Response:  # draining: the gate answers 503 "draining"
        if self.router.preloaded():
            return json_response({"status": "ready"})
        waiting = [f"{n}: {self.router.records[n].state.value}" for n in self.router.preload
                   if self.router.records[n].state is not State.LOADED]
        return json_response({"status": f"waiting for --preload models ({', '.join(waiting)})"}, 503)

    async def live(self) -> Response:
        return json_response({"status": "alive"})

    async def startup(self) -> Response:
        models = {}
        for rec in self.router.records.values():
            entry: dict[str, Any] = {"state": rec.state.value, "load_seconds": rec.load_seconds,
                                     "room_seconds": rec.extra.get("room_s")}
            if rec.serving is not None:
                entry.update(rec.serving.startup_body(None))
            elif "timeline" in rec.extra:
                entry.update(rec.extra["timeline"].to_json())
            models[rec.name] = entry
        from hotstart.system import memory_report  # noqa: PLC0415 - stdlib only

        memory = {**memory_report(), "models_budget_bytes": self.router.budget}
        return json_response({**self.timeline.to_json(), "memory": memory, "models": models})

    async def prometheus(self) -> Response:
        draining = 1 if self.drain.draining else 0
        self.metrics.draining.set(draining)
        parts: list[tuple[bytes, str | None]] = [(self.metrics.render(), None)]
        for rec in self.router.records.values():
            for s in State:
                self.g_state.labels(rec.name, s.value).set(1 if rec.state is s else 0)
            self.g_in_flight.labels(rec.name).set(rec.in_flight)
            self.g_waiting.labels(rec.name).set(rec.waiting)
            self.g_loads.labels(rec.name).set(rec.loads)
            self.g_evictions.labels(rec.name).set(rec.evictions)
            if rec.load_seconds is not None:
                self.g_load_s.labels(rec.name).set(rec.load_seconds)
            card = self.card(rec)
            self.g_memory.labels(rec.name).set(rec.cost)
            self.g_resident.labels(rec.name).set(card["resident_bytes"] or 0)
            self.g_pinned.labels(rec.name).set(1 if rec.pinned else 0)
            self.g_last_used.labels(rec.name).set(rec.last_used)
            self.g_disk_blocks.labels(rec.name).set(card["prefix_blocks_on_disk"] or 0)
            m = rec.extra.get("metrics")
            if m is not None:
                m.draining.set(draining)
                if rec.client is not None:
                    m.update_engine(rec.client.stats, rec.client.ready)
                    m.update_fast_path(rec.client.fast_path)
                parts.append((m.render(), rec.name))
        parts.append((generate_latest(self.registry), None))
        return Response(merged(parts), media_type=CONTENT_TYPE)


def build_multi_app(router: ModelRouter, cfg, timeline) -> FastAPI:
    """The app. `app.state.drain` is the server's Drain and `app.state.store` the Responses store: the
    servings that ROUTER.make_serving builds take both (server/multi_launch.py serving_maker)."""
    serving = MultiServing(router, cfg.max_request_bytes, timeline)
    app = FastAPI(title="hotstart", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = serving.metrics
    app.state.set_startup_seconds = serving.metrics.set_startup_duration
    app.state.drain = serving.drain  # server/launch.py begins (and forces) it on SIGTERM
    app.state.store = serving.store
    access = Access.of(cfg)
    app.add_middleware(Gate, api_key=cfg.api_key, metrics=serving.metrics, drain=serving.drain,
                       memory=memory_guard(cfg.min_free_memory), access=access, admin_key=cfg.admin_key)
    access.add_cors(app)
    add_error_handlers(app)
    for ep in MODEL_ENDPOINTS:
        app.add_api_route(ep.path, serving.route(ep), methods=["POST"])
    retrieve, delete = store_routes(serving.store)
    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/models", serving.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}/load", serving.load_model, methods=["POST"])
    app.add_api_route("/v1/models/{name:path}/unload", serving.unload_model, methods=["POST"])
    app.add_api_route("/v1/models/{name:path}", serving.get_model, methods=["GET"])
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/live", serving.live, methods=["GET"])
    app.add_api_route("/startup", serving.startup, methods=["GET"])
    app.add_api_route("/metrics", serving.prometheus, methods=["GET"])
    return app
