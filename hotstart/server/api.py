"""The OpenAI-compatible HTTP API (torch-free): build_app(engine, tokenizer, settings) -> FastAPI.

OpenAIServing holds the endpoints and their checks; build_app adds the HTTP shell around it (routes,
exception handlers, the gate middleware (server/gate.py): API key, request counting, last-resort 500).

Bodies are read and decoded by hand (size limit, content type, msgspec schemas) instead of through
FastAPI's pydantic body parameters: no model building at startup, and every error is OpenAI's JSON
shape with the offending `param` rather than FastAPI's 422 detail list.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from hotstart.server.client import EngineDeadError
from hotstart.server.errors import ApiError, bad_param, describe
from hotstart.server.gate import Drain, Gate, error_response, json_response
from hotstart.server.generation import Generation, GenerationError, close_shielded, unless_disconnected
from hotstart.server.logprobs import LogprobsFormat
from hotstart.server.metrics import CONTENT_TYPE, Metrics
from hotstart.server.responses import ResponsesRequest, ResponseStore
from hotstart.server.responses_serving import ResponsesServing
from hotstart.server.schemas import ChatCompletionRequest, CompletionRequest, decode_request, read_body
from hotstart.server.sse import SSEResponse, sse_events
from hotstart.server.structured import request_grammar
from hotstart.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from hotstart.server.tools import chat_grammar, chat_message, detect_parser, template_messages
from hotstart.server.validation import (
    MAX_N,
    chat_messages,
    check_chat,
    check_completion,
    check_token_ids,
    completion_prompt,
    sampling_params,
    stop_strings,
    template_kwargs,
)
from hotstart.text.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from hotstart.messages import SamplingParams
    from hotstart.server.client import EngineClient
    from hotstart.text.tokenizer import Tokenizer

log = logging.getLogger("hotstart")
_json = msgspec.json.Encoder()


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
    """temperature / top_p / top_k / min_p / repetition_penalty when a request omits them
    (validation.sampling_defaults: generation_config.json's, with --generation-config auto)."""
    vocab_size: int | None = None
    """Token ids in prompts and stop_token_ids must be below it (default: the tokenizer's)."""
    tool_call_parser: str | None = None
    """hermes | llama3_json (hotstart/server/tools.py); None: chosen from the chat template's text."""
    auto_tool_choice: bool = True
    """Parse tool calls out of answers to tool_choice auto (else they stay text)."""
    memory_guard: Any = None
    """A server/memory.py MemoryGuard: new requests wait, then get 503, while memory is short (None: none)."""


class OpenAIServing:
    """The OpenAI endpoints over one engine handle and one tokenizer, one method per endpoint.

    No HTTP plumbing here (build_app registers the bound methods as routes): each endpoint returns a
    Response or raises ApiError, and its pieces (check_model, model_card, prepare_chat, ...) can be
    called directly. The engine handle is an EngineClient (server/client.py: in process or over zmq).
    The endpoints that a request's `model` picks are MODEL_ENDPOINTS (below), which the many-models app
    (server/multi_api.py) calls on the model's own OpenAIServing.

    METRICS, DRAIN, STORE: a many-models server's (kept across a model's loads, one drain for the server,
    one Responses store for all models); by default this serving's own."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, settings: ApiSettings, *,
                 metrics: Metrics | None = None, drain: Drain | None = None,
                 store: ResponseStore | None = None) -> None:
        if not settings.served_model_names:
            raise ValueError("ApiSettings.served_model_names must name at least one model")
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.metrics = metrics or Metrics(settings.served_model_names[0])
        # SIGTERM's (server/launch.py): the gate refuses new requests while it drains
        self.drain = drain or Drain()
        self.responses = ResponsesServing(self, store)
        self.names = list(settings.served_model_names)
        self.created = int(time.time())
        self.vocab_size = settings.vocab_size or getattr(tokenizer, "vocab_size", None)
        template = getattr(tokenizer, "chat_template_source", lambda tools: None)(True)
        self.tool_parser = settings.tool_call_parser or detect_parser(template)
        self._served_once = False

    # --- checks and helpers --------------------------------------------------------------------
    @property
    def max_model_len(self) -> int | None:
        info = self.engine.info
        return info.max_model_len if info is not None else self.settings.max_model_len

    @property
    def max_n(self) -> int:
        """Largest `n`: MAX_N, and no more than the engine batches (its max_num_seqs)."""
        info = self.engine.info
        return min(MAX_N, info.max_num_seqs) if info is not None else MAX_N

    def check_model(self, name: str) -> str:
        """The name reported in responses (the first served one), or 404 if NAME is not served."""
        if name not in self.names:
            raise ApiError(404, f"The model `{name}` does not exist. Served: {', '.join(self.names)}",
                           param="model", code="model_not_found")
        return self.names[0]

    def require_ready(self) -> None:
        if not self.engine.ready:
            raise ApiError(503, f"the engine is not ready ({self.engine.status})", code="engine_not_ready")

    def sampling(self, req: Any, max_tokens: int | None, max_param: str, n_prompt: int, prompt_param: str,
                 logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        return sampling_params(req, max_tokens, max_param, n_prompt, prompt_param, self.max_model_len,
                               self.settings.sampling_defaults, self.vocab_size, logprobs, prompt_logprobs)

    @staticmethod
    def engine_error(e: Exception) -> ApiError:
        """What a failure while generating is answered with."""
        if isinstance(e, EngineDeadError):
            return ApiError(503, f"the engine stopped while running this request ({e})", code="engine_dead")
        if isinstance(e, GenerationError):
            return ApiError(500, f"the engine could not run this request: {e}", code="engine_error")
        log.error("hotstart: internal error while generating: %s", describe(e))
        return ApiError(500, "internal server error", code="internal_error")

    def mark_served(self, reason: str) -> None:
        """Generation's callback: the first served request is a timeline event."""
        if not self._served_once:
            self._served_once = True
            self.engine.timeline.mark("first request served")

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "hotstart",
                "root": self.names[0], "parent": None, "max_model_len": self.max_model_len}

    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams]:
        """(model, prompt ids, sampling params) of a chat request, or ApiError."""
        model = self.check_model(req.model)
        check_chat(req, self.max_n)
        messages = template_messages(chat_messages(req))
        kwargs = template_kwargs(req)
        grammar = chat_grammar(req, self.tool_parser)
        self.require_ready()
        tools = req.tools if req.tool_choice != "none" else None
        try:
            ids = self.tokenizer.encode_chat(messages, req.add_generation_prompt, tools, **kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages", code="chat_template_error") from None
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling(
            req, req.max_completion_tokens or req.max_tokens, max_param, len(ids), "messages", logprobs
        )
        return model, ids, msgspec.structs.replace(params, grammar=grammar) if grammar else params

    def prepare_completion(self, req: CompletionRequest) -> tuple[str, list[int], SamplingParams, str]:
        """(model, prompt ids, sampling params, echoed prompt text) of a completion request, or ApiError."""
        model = self.check_model(req.model)
        check_completion(req, self.max_n)
        prompt = completion_prompt(req.prompt)
        grammar = request_grammar(req)
        self.require_ready()
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            check_token_ids(prompt, self.vocab_size, "prompt")
            ids = prompt
        if not ids:
            raise bad_param("prompt", "the prompt encodes to no tokens")
        prompt_logprobs = req.logprobs if req.echo else None
        params = self.sampling(
            req, req.max_tokens, "max_tokens", len(ids), "prompt", req.logprobs, prompt_logprobs
        )
        echo = "" if not req.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        return model, ids, msgspec.structs.replace(params, grammar=grammar) if grammar else params, echo

    def generation(self, rid: str, ids: list[int], params: SamplingParams, stops: list[str],
                   t0: float) -> Generation:
        """An accepted request's Generation (its prompt tokens counted; a forced drain interrupts it)."""
        self.metrics.prompt_tokens.inc(len(ids))
        self.metrics.vllm.prompt_tokens.labels(self.metrics.model_name).inc(len(ids))
        gen = Generation(self.engine, self.tokenizer, rid, ids, params, stops, self.metrics, t0,
                         self.mark_served)
        gen.interrupted = lambda: self.drain.forced
        return gen

    async def run(self, request: Request, req: Any, model: str, ids: list[int], params: SamplingParams,
                  t0: float, chat: bool, echo: str = "") -> Response:
        """Generate: an SSE stream if `req.stream`, else the whole answer (499 if the client left)."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        gen = self.generation(rid, ids, params, stop_strings(req), t0)
        head: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": int(time.time()), "model": model}
        if chat:
            head["system_fingerprint"] = None
        fmt = LogprobsFormat(self.tokenizer, params.n) if params.logprobs is not None else None
        forced = chat and req.tool_choice not in (None, "auto", "none")
        parse = (
            chat and req.tools and (forced or (req.tool_choice != "none" and self.settings.auto_tool_choice))
        )
        parser = self.tool_parser if parse else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(sse_events(gen, head, chat, include_usage, prefix=echo,
                                          on_error=lambda e: self.engine_error(e).body(), logprobs=fmt,
                                          tool_parser=parser))
        try:
            finished, _ = await unless_disconnected(request.receive, lambda: self.collect(gen))
        except (EngineDeadError, GenerationError) as e:
            raise self.engine_error(e) from None
        if not finished:
            return Response(status_code=499)  # nobody reads it; the status shows in /metrics
        choices = []
        for c in gen.choices:
            if chat:
                lps = fmt.chat(c.logprobs) if fmt is not None else None
                message, reason = chat_message(parser, c.text, c.finish_reason)
                choices.append(
                    {"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason}
                )
            else:
                prompt = (ids, gen.prompt_logprobs or []) if params.prompt_logprobs is not None else None
                lps = fmt.completion(c.index, c.logprobs, prompt) if fmt is not None else None
                choices.append({"index": c.index, "text": echo + c.text, "logprobs": lps,
                                "finish_reason": c.finish_reason})
        if chat:
            head["object"] = "chat.completion"
        return json_response({**head, "choices": choices, "usage": gen.usage()})

    @staticmethod
    async def collect(gen: Generation) -> None:
        """Run GEN to its end (its choices then hold text and logprobs); the engine iterator is closed
        however this ends."""
        stream = gen.deltas()
        try:
            async for _ in stream:
                pass
        finally:
            await close_shielded(stream)

    def startup_body(self, prefetch_stats: Any, download_stats: Any = None) -> dict[str, Any]:
        """The timeline, plus "prefetch": PREFETCH_STATS() (or the value itself) when it is set."""
        body = dict(self.engine.timeline.to_json())
        if prefetch_stats is not None:
            body["prefetch"] = prefetch_stats() if callable(prefetch_stats) else prefetch_stats
        if download_stats is not None:  # s3:// models: bytes, rate, ETA (boot/remote/)
            body["download"] = download_stats()
        fast = self.engine.fast_path
        if fast is not None:
            body["fast_path"] = msgspec.to_builtins(fast)  # what is built behind READY, per bucket
        return body

    # --- endpoints -----------------------------------------------------------------------------
    # (the POST ones a request's `model` picks take the decoded body and its arrival: MODEL_ENDPOINTS)
    async def chat_completions(self, request: Request, req: ChatCompletionRequest, t0: float) -> Response:
        model, ids, params = self.prepare_chat(req)
        return await self.run(request, req, model, ids, params, t0, chat=True)

    async def completions(self, request: Request, req: CompletionRequest, t0: float) -> Response:
        model, ids, params, echo = self.prepare_completion(req)
        return await self.run(request, req, model, ids, params, t0, chat=False, echo=echo)

    async def list_models(self) -> Response:
        return json_response({"object": "list", "data": [self.model_card(n) for n in self.names]})

    async def get_model(self, name: str) -> Response:
        self.check_model(name)
        return json_response(self.model_card(name))

    async def health(self) -> Response:
        if self.engine.ready:
            return json_response({"status": "ready"})
        return json_response({"status": self.engine.status}, 503)

    async def live(self) -> Response:
        """Liveness: 200 while the process serves HTTP at all (starting, ready or draining)."""
        return json_response({"status": "alive"})

    async def startup(self, request: Request) -> Response:
        # app.state.prefetch_stats: the serve command sets it once the prefetcher exists
        state = request.app.state
        return json_response(self.startup_body(state.prefetch_stats, state.download_stats))

    async def prometheus(self) -> Response:
        self.metrics.update_engine(self.engine.stats, self.engine.ready)
        self.metrics.draining.set(1 if self.drain.draining else 0)
        self.metrics.update_fast_path(self.engine.fast_path)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


@dataclass(frozen=True)
class ModelEndpoint:
    """A POST endpoint answered by one model's OpenAIServing: the body's schema (with a `model` field) and
    HANDLE(serving, request, decoded body, t0 = the request's arrival, time.perf_counter())."""

    path: str
    schema: type[msgspec.Struct]
    handle: Callable[[OpenAIServing, Request, Any, float], Awaitable[Response]]


async def _responses(s: OpenAIServing, request: Request, req: ResponsesRequest, t0: float) -> Response:
    return await s.responses.create(request, req, t0)


async def _tokenize(s: OpenAIServing, request: Request, req: TokenizeRequest, t0: float) -> Response:
    return tokenize(s, req)


async def _detokenize(s: OpenAIServing, request: Request, req: DetokenizeRequest, t0: float) -> Response:
    return detokenize(s, req)


# the endpoints of one model: the single-model app routes them to its serving, the many-models app to the
# serving of the model that a request's `model` names (server/multi_api.py)
MODEL_ENDPOINTS = (
    ModelEndpoint("/v1/chat/completions", ChatCompletionRequest, OpenAIServing.chat_completions),
    ModelEndpoint("/v1/completions", CompletionRequest, OpenAIServing.completions),
    ModelEndpoint("/v1/responses", ResponsesRequest, _responses),
    ModelEndpoint("/tokenize", TokenizeRequest, _tokenize),
    ModelEndpoint("/detokenize", DetokenizeRequest, _detokenize),
)


def model_route(serving: OpenAIServing, ep: ModelEndpoint) -> Callable[[Request], Awaitable[Response]]:
    """The route of EP on one model's app: read and decode the body, answer with SERVING."""

    async def route(request: Request) -> Response:
        t0 = time.perf_counter()
        req = decode_request(await read_body(request, serving.settings.max_request_bytes), ep.schema)
        return await ep.handle(serving, request, req, t0)

    return route


async def _api_error(request: Request, exc: ApiError) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, msg, code=code))


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
                       memory=settings.memory_guard)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for ep in MODEL_ENDPOINTS:
        app.add_api_route(ep.path, model_route(serving, ep), methods=["POST"])
    app.add_api_route("/v1/models", serving.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", serving.get_model, methods=["GET"])
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/live", serving.live, methods=["GET"])
    app.add_api_route("/startup", serving.startup, methods=["GET"])
    app.add_api_route("/metrics", serving.prometheus, methods=["GET"])
    return app
