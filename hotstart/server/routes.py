"""The HTTP shell of one model's OpenAIServing (torch-free): the POST endpoints a request's `model` picks
(MODEL_ENDPOINTS: the single-model app routes them to its serving, the many-models app server/multi_api.py to
the serving of the model that `model` names), and build_app, the single-model FastAPI app around them
(routes, the gate middleware: reach, API key, request counting, drain, memory; OpenAI-shaped errors)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from hotstart.frontend.protocol import ChatCompletionRequest, CompletionRequest
from hotstart.frontend.validation import too_deep
from hotstart.server.api import ApiSettings, OpenAIServing
from hotstart.server.gate import Gate, add_error_handlers
from hotstart.server.offload import WORK
from hotstart.server.responses import ResponsesRequest
from hotstart.server.responses_serving import ResponsesServing, store_routes
from hotstart.server.schemas import decode_request, read_body
from hotstart.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

if TYPE_CHECKING:
    from hotstart.frontend.client import EngineClient
    from hotstart.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelEndpoint:
    """A POST endpoint answered by one model's OpenAIServing: the body's schema (with a `model` field) and
    HANDLE(serving, request, decoded body, t0 = the request's arrival, time.perf_counter())."""

    path: str
    schema: type[msgspec.Struct]
    handle: Callable[[OpenAIServing, Request, Any, float], Awaitable[Response]]


async def _responses(s: OpenAIServing, request: Request, req: ResponsesRequest, t0: float) -> Response:
    return await ResponsesServing(s, s.store).create(request, req, t0)


async def _tokenize(s: OpenAIServing, request: Request, req: TokenizeRequest, t0: float) -> Response:
    return await WORK.run(tokenize, s, req)


async def _detokenize(s: OpenAIServing, request: Request, req: DetokenizeRequest, t0: float) -> Response:
    return await WORK.run(detokenize, s, req)


# the endpoints of one model: the single-model app routes them to its serving, the many-models app to the
# serving of the model that a request's `model` names (server/multi_api.py)
MODEL_ENDPOINTS = (
    ModelEndpoint("/v1/chat/completions", ChatCompletionRequest, OpenAIServing.chat_completions),
    ModelEndpoint("/v1/completions", CompletionRequest, OpenAIServing.completions),
    ModelEndpoint("/v1/responses", ResponsesRequest, _responses),
    ModelEndpoint("/tokenize", TokenizeRequest, _tokenize),
    ModelEndpoint("/detokenize", DetokenizeRequest, _detokenize),
)


async def answer(serving: OpenAIServing, ep: ModelEndpoint, request: Request, req: Any,
                 t0: float) -> Response:
    """EP's answer with SERVING. Nesting past MAX_JSON_DEPTH is refused where a request is decoded; a
    RecursionError that still escapes (JSON text inside a field, read by some library) is the same 400."""
    try:
        return await ep.handle(serving, request, req, t0)
    except RecursionError:
        raise too_deep(None) from None


def model_route(serving: OpenAIServing, ep: ModelEndpoint) -> Callable[[Request], Awaitable[Response]]:
    """The route of EP on one model's app: read the body, decode it on the worker pool, answer with
    SERVING."""

    async def route(request: Request) -> Response:
        t0 = time.perf_counter()
        body = await read_body(request, serving.settings.max_request_bytes)
        req = await WORK.run(decode_request, body, ep.schema)
        return await answer(serving, ep, request, req, t0)

    return route


def build_app(engine: EngineClient, tokenizer: Tokenizer, settings: ApiSettings) -> FastAPI:
    """The app. `app.state.metrics` is its Metrics; `app.state.set_startup_seconds(s)` sets the
    startup-duration gauge (the serve command calls it once the engine is ready); setting
    `app.state.prefetch_stats` to a callable adds its result under "prefetch" in /startup."""
    serving = OpenAIServing(engine, tokenizer, settings)
    app = FastAPI(title="hotstart", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = serving.metrics
    app.state.set_startup_seconds = serving.metrics.set_startup_duration
    app.state.prefetch_stats = None
    app.state.download_stats = None  # s3:// models: a callable, its result under "download" in /startup
    app.state.drain = serving.drain  # server/launch.py begins (and forces) it on SIGTERM
    app.add_middleware(Gate, api_key=settings.api_key, metrics=serving.metrics, drain=serving.drain,
                       memory=settings.memory_guard, access=settings.access, admin_key=settings.admin_key)
    if settings.access is not None:
        settings.access.add_cors(app)
    add_error_handlers(app)
    for ep in MODEL_ENDPOINTS:
        app.add_api_route(ep.path, model_route(serving, ep), methods=["POST"])
    retrieve, delete = store_routes(serving.store)
    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/models", serving.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", serving.get_model, methods=["GET"])
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/live", serving.live, methods=["GET"])
    app.add_api_route("/startup", serving.startup, methods=["GET"])
    app.add_api_route("/metrics", serving.prometheus, methods=["GET"])
    return app
