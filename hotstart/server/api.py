"""The OpenAI-compatible HTTP API (torch-free): build_app(engine, tokenizer, settings) -> FastAPI.

Bodies are read and decoded by hand (size limit, content type, msgspec schemas) instead of through
FastAPI's pydantic body parameters: no model building at startup, and every error is OpenAI's JSON
shape with the offending `param` rather than FastAPI's 422 detail list.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from hotstart.server import protocol as P
from hotstart.server.engine_client import EngineDeadError
from hotstart.server.generation import (
    Generation,
    GenerationError,
    SSEResponse,
    close_shielded,
    sse_events,
    unless_disconnected,
)
from hotstart.server.metrics import CONTENT_TYPE, Metrics
from hotstart.text.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from hotstart.messages import SamplingParams
    from hotstart.server.engine_client import EngineClient
    from hotstart.text.tokenizer import Tokenizer

log = logging.getLogger("hotstart")
_json = msgspec.json.Encoder()
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/startup", "/metrics"}
# chat_template_kwargs may set template variables, not the arguments the server itself controls
# ("self" too: it would collide with the tokenizer method's own parameter)
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "chat_template",
                             "continue_final_message", "self"}


@dataclass
class ApiSettings:
    """What the HTTP layer needs beyond the engine and the tokenizer."""

    served_model_names: list[str]
    """Names accepted in `model` (the first is the one reported in responses)."""
    api_key: str | None = None
    """If set, every path but /health requires `Authorization: Bearer KEY` (/metrics too: its counters
    and token totals describe the traffic; a Prometheus scrape config can send the key)."""
    max_model_len: int | None = None
    """Used only until the engine reports its own (EngineReady.max_model_len)."""
    max_request_bytes: int = 1 << 20
    """Larger request bodies are refused with 413."""
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    """temperature / top_p / top_k when a request omits them (protocol.read_generation_config)."""
    vocab_size: int | None = None
    """Token ids in prompts and stop_token_ids must be below it (default: the tokenizer's)."""
    prefetch_stats: Callable[[], dict] | None = None
    """Shown under "prefetch" in /startup (setting app.state.prefetch_stats later works too)."""


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def error_response(err: P.ApiError) -> Response:
    return json_response(err.body(), err.status)


def describe(exc: BaseException) -> str:
    """An unexpected exception for the log: its type and where it was raised. Not its message, nor a
    traceback with locals: either can hold request data (prompt text, keys)."""
    tb, where = exc.__traceback__, "?"
    while tb is not None:
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{type(exc).__name__} at {where}"


class _Gate:
    """Pure ASGI middleware: the API-key check (every path but /health), request counting by status,
    and the last resort for unexpected exceptions: a one-line log and an OpenAI-shaped 500, never a
    traceback (Starlette's ServerErrorMiddleware would answer, then re-raise it to uvicorn's log)."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app, settings: ApiSettings, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.key = settings.api_key.encode() if settings.api_key else None

    def authorized(self, scope) -> bool:
        """`Authorization: Bearer KEY`, compared in constant time (hmac.compare_digest)."""
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.strip().partition(b" ")
        # compare even when the scheme is wrong, so the timing does not tell which part failed
        ok = hmac.compare_digest(token.strip(), self.key)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        # a fixed label set: unknown paths must not grow the metric's cardinality
        endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
        status = 499  # stays if the client leaves before a response starts
        started = False

        async def send_counted(message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            if self.key is not None and path not in self.OPEN_PATHS and not self.authorized(scope):
                err = P.ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                                 code="invalid_api_key")
                return await error_response(err)(scope, receive, send_counted)
            await self.app(scope, receive, send_counted)
        except Exception as exc:  # noqa: BLE001 - the last resort: answer, log one line, keep serving
            log.error("hotstart: internal error on %s: %s", path, describe(exc))
            if not started:
                err = P.ApiError(500, "internal server error", code="internal_error")
                await error_response(err)(scope, receive, send_counted)
            else:
                status = 500
        finally:
            self.metrics.observe_request(endpoint, status)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body: JSON content type (or none), at most LIMIT bytes (413), counted while streaming."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise P.ApiError(415, f"Content-Type must be application/json, got `{ctype}`",
                         code="unsupported_media_type")
    too_big = P.ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(engine: EngineClient, tokenizer: Tokenizer, settings: ApiSettings) -> FastAPI:
    """The app. `app.state.metrics` is its Metrics; `app.state.set_startup_seconds(s)` sets the
    startup-duration gauge (the serve command calls it once the engine is ready)."""
    if not settings.served_model_names:
        raise ValueError("ApiSettings.served_model_names must name at least one model")
    app = FastAPI(title="hotstart", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics()
    app.state.metrics = metrics
    app.state.set_startup_seconds = metrics.set_startup_duration
    app.state.prefetch_stats = settings.prefetch_stats
    app.add_middleware(_Gate, settings=settings, metrics=metrics)
    created = int(time.time())
    names = list(settings.served_model_names)
    vocab_size = settings.vocab_size or getattr(tokenizer, "vocab_size", None)
    served_once: list[str] = []

    @app.exception_handler(P.ApiError)
    async def _api_error(request: Request, exc: P.ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(P.ApiError(exc.status_code, msg, code=code))

    def max_model_len() -> int | None:
        return engine.info.max_model_len if engine.info is not None else settings.max_model_len

    def check_model(name: str) -> str:
        if name not in names:
            raise P.ApiError(404, f"The model `{name}` does not exist. Served: {', '.join(names)}",
                             param="model", code="model_not_found")
        return names[0]

    def require_ready() -> None:
        if not engine.ready:
            raise P.ApiError(503, f"the engine is not ready ({engine.phase})", code="engine_not_ready")

    def sampling(req: Any, max_tokens: int | None, max_param: str, n_prompt: int, prompt_param: str
                 ) -> SamplingParams:
        return P.sampling_params(req, max_tokens, max_param, n_prompt, prompt_param, max_model_len(),
                                 settings.sampling_defaults, vocab_size)

    def engine_error(e: Exception) -> P.ApiError:
        if isinstance(e, EngineDeadError):
            return P.ApiError(503, f"the engine stopped while running this request ({e})", code="engine_dead")
        if isinstance(e, GenerationError):
            return P.ApiError(500, f"the engine could not run this request: {e}", code="engine_error")
        log.error("hotstart: internal error while generating: %s", describe(e))
        return P.ApiError(500, "internal server error", code="internal_error")

    def mark_served(reason: str) -> None:
        if not served_once:
            served_once.append(reason)
            engine.timeline.mark("first request served")

    async def run(request: Request, req: Any, model: str, ids: list[int], params: SamplingParams,
                  t0: float, chat: bool, echo: str = "") -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        metrics.prompt_tokens.inc(len(ids))
        gen = Generation(engine, tokenizer, rid, ids, params, P.stop_strings(req), metrics, t0, mark_served)
        head: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": int(time.time()), "model": model}
        if chat:
            head["system_fingerprint"] = None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(sse_events(gen, head, chat, include_usage, prefix=echo,
                                          on_error=lambda e: engine_error(e).body()))

        async def collect() -> str:
            stream = gen.deltas()
            try:
                return "".join([piece async for piece in stream])
            finally:
                await close_shielded(stream)

        try:
            finished, text = await unless_disconnected(request.receive, collect)
        except (EngineDeadError, GenerationError) as e:
            raise engine_error(e) from None
        if not finished:
            return Response(status_code=499)  # nobody reads it; the status shows in /metrics
        if chat:
            head["object"] = "chat.completion"
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": gen.finish_reason}
        else:
            choice = {"index": 0, "text": echo + text, "logprobs": None, "finish_reason": gen.finish_reason}
        return json_response({**head, "choices": [choice], "usage": gen.usage()})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t0 = time.perf_counter()
        body = await read_body(request, settings.max_request_bytes)
        req = P.decode_request(body, P.ChatCompletionRequest)
        model = check_model(req.model)
        P.check_chat(req)
        messages = P.chat_messages(req)
        kwargs = dict(req.chat_template_kwargs or {})
        if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys()):
            raise P.bad_param("chat_template_kwargs", f"cannot set {', '.join(reserved)} here")
        require_ready()
        tools = req.tools if req.tool_choice != "none" else None
        try:
            ids = tokenizer.encode_chat(messages, req.add_generation_prompt, tools, **kwargs)
        except ChatTemplateError as e:
            raise P.ApiError(400, str(e), param="messages", code="chat_template_error") from None
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = sampling(req, req.max_completion_tokens or req.max_tokens, max_param, len(ids), "messages")
        return await run(request, req, model, ids, params, t0, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t0 = time.perf_counter()
        req = P.decode_request(await read_body(request, settings.max_request_bytes), P.CompletionRequest)
        model = check_model(req.model)
        P.check_completion(req)
        prompt = P.completion_prompt(req.prompt)
        require_ready()
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        else:
            P.check_token_ids(prompt, vocab_size, "prompt")
            ids = prompt
        if not ids:
            raise P.bad_param("prompt", "the prompt encodes to no tokens")
        params = sampling(req, req.max_tokens, "max_tokens", len(ids), "prompt")
        echo = "" if not req.echo else prompt if isinstance(prompt, str) else tokenizer.decode(ids)
        return await run(request, req, model, ids, params, t0, chat=False, echo=echo)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "hotstart",
                "root": names[0], "parent": None, "max_model_len": max_model_len()}

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [model_card(n) for n in names]})

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> Response:
        check_model(name)
        return json_response(model_card(name))

    @app.get("/health")
    async def health() -> Response:
        if engine.ready:
            return json_response({"status": "ready"})
        return json_response({"status": engine.phase}, 503)

    @app.get("/startup")
    async def startup() -> Response:
        body = dict(engine.timeline.to_json())
        stats = app.state.prefetch_stats
        if stats is not None:
            body["prefetch"] = stats() if callable(stats) else stats
        return json_response(body)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.update_engine(engine.stats, engine.ready)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
