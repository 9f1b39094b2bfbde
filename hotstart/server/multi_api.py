"""The HTTP side of several models (torch-free): each request's `model` picks a ModelRecord through the
router (server/router.py), and the model's own OpenAIServing (server/api.py) answers it.

Endpoints beside OpenAI's (documented in README "Many models"):
  GET  /v1/models                  every model, with `state`, `loaded_at`, `keep_alive_until`, `error`
  POST /v1/models/{name}/load      load it now (waits until it serves; body {"keep_alive": ...} optional)
  POST /v1/models/{name}/unload    stop its engine: at once when idle (200), else once its requests end
                                   (202); a loading model answers 409
  GET  /health                     200 when up and every --preload model is loaded
  GET  /startup, /metrics          the server's, plus one entry (a `model` label) per model
Requests may carry Ollama's `keep_alive` ("5m", seconds, 0 = unload after it, negative = never).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from hotstart.server.api import _api_error, _http_error
from hotstart.server.errors import ApiError, bad_param
from hotstart.server.gate import Gate, error_response, json_response
from hotstart.server.memory import memory_guard
from hotstart.server.metrics import CONTENT_TYPE, Metrics
from hotstart.server.model_specs import parse_duration
from hotstart.server.router import UNSET, ModelRecord, ModelRouter, RetryLater, State
from hotstart.server.schemas import ChatCompletionRequest, CompletionRequest, decode_request, read_body


class _KeepAlive(msgspec.Struct):
    keep_alive: str | float | None = None


def keep_alive_of(body: bytes) -> Any:
    """The body's keep_alive in seconds (None: forever), or UNSET; 400 when it is no duration."""
    try:
        raw = msgspec.json.decode(body, type=_KeepAlive).keep_alive if body.strip() else None
    except msgspec.ValidationError:
        raise bad_param("keep_alive", "keep_alive must be a duration (\"5m\", \"30s\") or seconds") from None
    except msgspec.DecodeError:
        raise ApiError(400, "the body is not valid JSON", code="invalid_json") from None
    if raw is None:
        return UNSET
    try:
        return parse_duration(raw)
    except ValueError as e:
        raise bad_param("keep_alive", str(e)) from None


class LeasedResponse(Response):
    """A streamed response whose model lease is released once the stream ends (or the client leaves)."""

    def __init__(self, inner: Response, release) -> None:
        self.inner, self.release = inner, release
        self.status_code, self.raw_headers, self.background = inner.status_code, inner.raw_headers, None

    async def __call__(self, scope, receive, send) -> None:
        if self.background is not None and self.inner.background is None:
            self.inner.background = self.background
        try:
            await self.inner(scope, receive, send)
        finally:
            self.release()


def labelled(text: bytes, model: str, seen: set[str]) -> list[str]:
    """Prometheus text with model="MODEL" added to every sample; HELP/TYPE lines once (SEEN)."""
    value = model.replace("\\", "\\\\").replace('"', '\\"')
    out = []
    for line in text.decode().splitlines():
        if line.startswith("#"):
            if line not in seen:
                seen.add(line)
                out.append(line)
            continue
        brace, space = line.find("{"), line.find(" ")
        if 0 <= brace < space:
            out.append(f'{line[:brace + 1]}model="{value}",{line[brace + 1:]}')
        elif space > 0:
            out.append(f'{line[:space]}{{model="{value}"}}{line[space:]}')
    return out


class MultiServing:
    def __init__(self, router: ModelRouter, max_request_bytes: int, timeline) -> None:
        self.router, self.max_bytes, self.timeline = router, max_request_bytes, timeline
        self.metrics = Metrics()  # the HTTP counters (the gate's) and the startup gauge
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

    def card(self, rec: ModelRecord) -> dict[str, Any]:
        info = rec.client.info if rec.client is not None else None
        until = rec.keep_alive_until if rec.state is State.LOADED else None
        return {"id": rec.name, "object": "model", "created": self.created, "owned_by": "hotstart",
                "root": rec.name, "parent": None, "max_model_len": info.max_model_len if info else None,
                "state": rec.state.value, "loaded_at": int(rec.loaded_at) if rec.loaded_at else None,
                "keep_alive_until": int(until) if until else None, "error": rec.error}

    async def _generate(self, request: Request, cls, chat: bool) -> Response:
        t0 = time.perf_counter()
        body = await read_body(request, self.max_bytes)
        req = decode_request(body, cls)
        keep = keep_alive_of(body)
        rec = await self.router.acquire(req.model)
        try:
            s = rec.serving
            if chat:
                model, ids, params = s.prepare_chat(req)
                resp = await s.run(request, req, model, ids, params, t0, chat=True)
            else:
                model, ids, params, echo = s.prepare_completion(req)
                resp = await s.run(request, req, model, ids, params, t0, chat=False, echo=echo)
        except BaseException:
            self.router.release(rec, keep)
            raise
        if isinstance(resp, StreamingResponse):
            done = []

            def release() -> None:
                if not done:
                    done.append(True)
                    self.router.release(rec, keep)

            return LeasedResponse(resp, release)
        self.router.release(rec, keep)
        return resp

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, chat=False)

    async def list_models(self) -> Response:
        return json_response({"object": "list", "data": [self.card(r) for r in self.router.records.values()]})

    async def get_model(self, name: str) -> Response:
        return json_response(self.card(self.router.lookup(name)))

    async def load_model(self, name: str, request: Request) -> Response:
        self.router.lookup(name)
        keep = keep_alive_of(await read_body(request, self.max_bytes))
        rec = await self.router.acquire(name)
        self.router.release(rec, keep)
        return json_response(self.card(rec))

    async def unload_model(self, name: str) -> Response:
        rec = self.router.lookup(name)
        if rec.state is State.LOADING:
            raise ApiError(409, f"model `{name}` is loading; unload it once loaded", code="model_loading")
        if rec.state is State.LOADED and rec.in_flight:
            rec.extra["unload_when_idle"] = True
            return json_response(self.card(rec), 202)
        await self.router.unload(rec, "unload requested")
        return json_response(self.card(rec))

    async def health(self) -> Response:
        if self.router.preloaded():
            return json_response({"status": "ready"})
        waiting = [f"{n}: {self.router.records[n].state.value}" for n in self.router.preload
                   if self.router.records[n].state is not State.LOADED]
        return json_response({"status": f"waiting for --preload models ({', '.join(waiting)})"}, 503)

    async def startup(self) -> Response:
        models = {}
        for rec in self.router.records.values():
            entry: dict[str, Any] = {"state": rec.state.value, "load_seconds": rec.load_seconds}
            if rec.serving is not None:
                entry.update(rec.serving.startup_body(None))
            elif "timeline" in rec.extra:
                entry.update(rec.extra["timeline"].to_json())
            models[rec.name] = entry
        return json_response({**self.timeline.to_json(), "models": models})

    async def prometheus(self) -> Response:
        seen: set[str] = set()
        lines = self.metrics.render().decode().splitlines()
        for rec in self.router.records.values():
            for s in State:
                self.g_state.labels(rec.name, s.value).set(1 if rec.state is s else 0)
            self.g_in_flight.labels(rec.name).set(rec.in_flight)
            self.g_waiting.labels(rec.name).set(rec.waiting)
            self.g_loads.labels(rec.name).set(rec.loads)
            self.g_evictions.labels(rec.name).set(rec.evictions)
            if rec.load_seconds is not None:
                self.g_load_s.labels(rec.name).set(rec.load_seconds)
            m = rec.extra.get("metrics")
            if m is not None:
                if rec.client is not None:
                    m.update_engine(rec.client.stats, rec.client.ready)
                    m.update_fast_path(rec.client.fast_path)
                lines += labelled(m.render(), rec.name, seen)
        body = "\n".join(lines + generate_latest(self.registry).decode().splitlines()) + "\n"
        return Response(body, media_type=CONTENT_TYPE)


async def _retry_later(request: Request, exc: RetryLater) -> Response:
    resp = error_response(exc)
    resp.headers["Retry-After"] = str(exc.retry_after)
    return resp


def build_multi_app(router: ModelRouter, cfg, timeline) -> FastAPI:
    serving = MultiServing(router, cfg.max_request_bytes, timeline)
    app = FastAPI(title="hotstart", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = serving.metrics
    app.state.set_startup_seconds = serving.metrics.set_startup_duration
    app.add_middleware(Gate, api_key=cfg.api_key, metrics=serving.metrics,
                       memory=memory_guard(cfg.min_free_memory))
    app.add_exception_handler(RetryLater, _retry_later)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route("/v1/models", serving.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}/load", serving.load_model, methods=["POST"])
    app.add_api_route("/v1/models/{name:path}/unload", serving.unload_model, methods=["POST"])
    app.add_api_route("/v1/models/{name:path}", serving.get_model, methods=["GET"])
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/startup", serving.startup, methods=["GET"])
    app.add_api_route("/metrics", serving.prometheus, methods=["GET"])
    return app
