"""The OpenAI endpoints of one model (torch-free): OpenAIServing, over one engine client and tokenizer.

OpenAIServing holds the endpoints and their checks; server/routes.py's build_app adds the HTTP shell
around it (routes, exception handlers, the gate middleware (server/gate.py): API key, request counting,
last-resort 500).

Bodies are read and decoded by hand (size limit, content type, msgspec schemas) instead of through
FastAPI's pydantic body parameters: no model building at startup, and every error is OpenAI's JSON
shape with the offending `param` rather than FastAPI's 422 detail list.

The event loop only does I/O: a request's preparation (checks, chat template, tokens, grammar) and a whole
answer's formatting run on the worker pool (server/offload.py); a stream's chunks are small and formatted
as they go, and a stream keeps neither its text nor its logprobs (frontend/generation.py `keep`).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import Request
from starlette.responses import Response

from hotstart.errors import RequestError, bad_param, describe
from hotstart.frontend.client import EngineDeadError
from hotstart.frontend.generation import Generation, GenerationError, close_shielded, unless_disconnected
from hotstart.frontend.metrics import CONTENT_TYPE, Metrics
from hotstart.frontend.protocol import ChatCompletionRequest, CompletionRequest
from hotstart.frontend.sampling import EngineLimits, from_request, resolve
from hotstart.frontend.structured import request_grammar
from hotstart.frontend.tools import chat_grammar, chat_message, detect_parser, template_messages
from hotstart.frontend.validation import (
    chat_messages,
    check_chat,
    check_completion,
    check_prompt_chars,
    check_token_ids,
    completion_prompt,
    prompt_chars,
    template_kwargs,
)
from hotstart.sampling_params import check_logprob_entries
from hotstart.server.gate import Drain, json_response
from hotstart.server.logprobs import LogprobsFormat
from hotstart.server.offload import WORK, ensure_imported
from hotstart.server.responses import ResponseStore
from hotstart.server.sse import SSEResponse, sse_events
from hotstart.text.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from hotstart.frontend.client import EngineClient
    from hotstart.sampling_params import SamplingParams
    from hotstart.text.tokenizer import Tokenizer

log = logging.getLogger("hotstart")
_json = msgspec.json.Encoder()


@dataclass
class ApiSettings:
    """What the HTTP layer needs beyond the engine and the tokenizer."""

    served_model_names: list[str]
    """Names accepted in `model` (the first is the one reported in responses)."""
    api_key: str | None = None
    """If set, every path but /health and /live requires `Authorization: Bearer KEY` (/metrics too: its
    counters describe the traffic; --metrics-port serves it keyless on a port of its own)."""
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
    """hermes | llama3_json (hotstart/frontend/tools.py); None: chosen from the chat template's text."""
    auto_tool_choice: bool = True
    """Parse tool calls out of answers to tool_choice auto (else they stay text)."""
    memory_guard: Any = None
    """A frontend/memory.py MemoryGuard: new requests wait, then get 503, while memory is short (None:
    none)."""
    access: Any = None
    """A server/access.py Access (Host, Origin, content type, CORS) for the gate; None: no such checks."""
    admin_key: str | None = None
    """If set, loading and unloading models and `keep_alive` need `Authorization: Bearer ADMIN_KEY`."""


class OpenAIServing:
    """The OpenAI endpoints over one engine handle and one tokenizer, one method per endpoint.

    No HTTP plumbing here (build_app registers the bound methods as routes): each endpoint returns a
    Response or raises RequestError, and its pieces (check_model, model_card, prepare_chat, ...) can be
    called directly. The engine handle is an EngineClient (frontend/client.py: in process or over zmq).
    The endpoints that a request's `model` picks are MODEL_ENDPOINTS (server/routes.py), which the
    many-models app (server/multi_api.py) calls on the model's own OpenAIServing.

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
        self.store = store or ResponseStore()  # the Responses API's past conversations (server/routes.py)
        self.names = list(settings.served_model_names)
        self.created = int(time.time())
        self.vocab_size = settings.vocab_size or getattr(tokenizer, "vocab_size", None)
        template = getattr(tokenizer, "chat_template_source", lambda tools: None)(True)
        self.tool_parser = settings.tool_call_parser or detect_parser(template)
        self._served_once = self._received_once = False

    # --- checks and helpers --------------------------------------------------------------------
    @property
    def limits(self) -> EngineLimits:
        info = self.engine.info
        if info is None:
            return EngineLimits(self.settings.max_model_len, None, self.vocab_size)
        return EngineLimits(info.max_model_len, info.max_num_seqs, self.vocab_size)

    @property
    def max_model_len(self) -> int | None:
        return self.limits.max_model_len

    def check_model(self, name: str) -> str:
        """The name reported in responses (the first served one), or 404 if NAME is not served."""
        if name not in self.names:
            raise RequestError(404, f"The model `{name}` does not exist. Served: {', '.join(self.names)}",
                               param="model", code="model_not_found")
        return self.names[0]

    def require_ready(self) -> None:
        if not self.engine.ready:  # Retry-After while backing off from a crash loop (frontend/crashes.py)
            raise RequestError(503, f"the engine is not ready ({self.engine.status})",
                               code="engine_not_ready", retry_after=self._retry_after())

    def _retry_after(self) -> float | None:
        seconds = getattr(self.engine, "retry_after", None)
        return None if seconds is None else float(round(seconds))

    def sampling(self, req: Any, max_tokens: int | None, max_param: str, n_prompt: int, prompt_param: str,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 grammar: str | None = None, logprobs_param: str = "logprobs") -> SamplingParams:
        """REQ's SamplingParams for a prompt of N_PROMPT tokens, resolved against the engine; a whole
        (not streamed) answer carries at most MAX_LOGPROB_ENTRIES logprobs (400 naming LOGPROBS_PARAM)."""
        params = from_request(req, self.settings.sampling_defaults, max_tokens=max_tokens,
                              max_param=max_param, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        params = resolve(params, n_prompt, self.limits, prompt_param=prompt_param, max_param=max_param,
                         grammar=grammar)
        if not getattr(req, "stream", False):
            check_logprob_entries(params, n_prompt, logprobs_param)
        return params

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """A prompt of CHARS characters that cannot fit the context is refused before it is tokenized."""
        token_chars = getattr(self.tokenizer, "max_token_chars", lambda: None)()
        check_prompt_chars(chars, self.max_model_len, token_chars, param)

    @staticmethod
    def engine_error(e: Exception) -> RequestError:
        """What a failure while generating is answered with."""
        if isinstance(e, EngineDeadError):
            return RequestError(503, f"the engine stopped while running this request ({e})",
                                code="engine_dead")
        if isinstance(e, GenerationError):
            return RequestError(500, f"the engine could not run this request: {e}", code="engine_error")
        log.error("hotstart: internal error while generating: %s", describe(e))
        return RequestError(500, "internal server error", code="internal_error")

    def mark_served(self, reason: str) -> None:
        """Generation's callback: the first served request is a timeline event."""
        if not self._served_once:
            self._served_once = True
            self.engine.timeline.mark("first request served")

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "hotstart",
                "root": self.names[0], "parent": None, "max_model_len": self.max_model_len}

    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams]:
        """(model, prompt ids, sampling params) of a chat request, or RequestError."""
        model = self.check_model(req.model)
        check_chat(req)
        messages = template_messages(chat_messages(req))
        kwargs = template_kwargs(req)
        grammar = chat_grammar(req, self.tool_parser)
        self.require_ready()
        self.check_prompt_chars(prompt_chars(messages), "messages")
        tools = req.tools if req.tool_choice != "none" else None
        try:
            ids = self.tokenizer.encode_chat(messages, req.add_generation_prompt, tools, **kwargs)
        except ChatTemplateError as e:
            raise RequestError(400, str(e), param="messages", code="chat_template_error") from None
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling(req, req.max_completion_tokens or req.max_tokens, max_param, len(ids),
                               "messages", logprobs, grammar=grammar,
                               logprobs_param="top_logprobs" if req.top_logprobs else "logprobs")
        return model, ids, params

    def prepare_completion(self, req: CompletionRequest) -> tuple[str, list[int], SamplingParams, str]:
        """(model, prompt ids, sampling params, echoed prompt text) of a completion request; RequestError
        if it is refused."""
        model = self.check_model(req.model)
        check_completion(req)
        prompt = completion_prompt(req.prompt)
        grammar = request_grammar(req)
        self.require_ready()
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            check_token_ids(prompt, self.vocab_size, "prompt")
            ids = prompt
        if not ids:
            raise bad_param("prompt", "the prompt encodes to no tokens")
        prompt_logprobs = req.logprobs if req.echo else None
        params = self.sampling(req, req.max_tokens, "max_tokens", len(ids), "prompt", req.logprobs,
                               prompt_logprobs, grammar=grammar)
        echo = "" if not req.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        return model, ids, params, echo

    def generation(self, rid: str, ids: list[int], params: SamplingParams, stops: list[str],
                   t0: float, keep: bool = True) -> Generation:
        """An accepted request's Generation (its prompt tokens counted; a forced drain interrupts it);
        KEEP False for a stream (its choices keep neither text nor logprobs). A poison request (in flight
        at two engine deaths in a row) is refused here, before any reply."""
        if (refused := self.engine.refusal(ids, params)) is not None:
            raise refused
        if not self._received_once:  # with "first request served": the first request's own time
            self._received_once = True
            self.engine.timeline.add("first request received", time.time() - (time.perf_counter() - t0),
                                     time.time(), "api", f"{len(ids)} prompt tokens")
        self.metrics.prompt_tokens.inc(len(ids))
        self.metrics.vllm.prompt_tokens.labels(self.metrics.model_name).inc(len(ids))
        gen = Generation(self.engine, self.tokenizer, rid, ids, params, stops, self.metrics, t0,
                         self.mark_served, keep=keep)
        gen.interrupted = lambda: self.drain.forced
        return gen

    async def run(self, request: Request, req: Any, model: str, ids: list[int], params: SamplingParams,
                  t0: float, chat: bool, echo: str = "") -> Response:
        """Generate: an SSE stream if `req.stream`, else the whole answer (499 if the client left)."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        gen = self.generation(rid, ids, params, params.stop_strings, t0, keep=not req.stream)
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
        body = await WORK.run(self.answer, gen, head, chat, fmt, parser, echo)
        return Response(body, media_type="application/json")

    def answer(self, gen: Generation, head: dict[str, Any], chat: bool, fmt: LogprobsFormat | None,
               parser: str | None, echo: str) -> bytes:
        """A whole answer's JSON (on the worker pool: up to MAX_LOGPROB_ENTRIES logprobs to format)."""
        choices = []
        for c in gen.choices:
            if chat:
                lps = fmt.chat(c.logprobs) if fmt is not None else None
                message, reason = chat_message(parser, c.text, c.finish_reason)
                choices.append(
                    {"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason}
                )
            else:
                echoed = gen.params.prompt_logprobs is not None
                prompt = (gen.prompt_ids, gen.prompt_logprobs or []) if echoed else None
                lps = fmt.completion(c.index, c.logprobs, prompt) if fmt is not None else None
                choices.append({"index": c.index, "text": echo + c.text, "logprobs": lps,
                                "finish_reason": c.finish_reason})
        if chat:
            head["object"] = "chat.completion"
        return msgspec.json.encode({**head, "choices": choices, "usage": gen.usage()})

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
        ensure_imported(req)
        model, ids, params = await WORK.run(self.prepare_chat, req)
        return await self.run(request, req, model, ids, params, t0, chat=True)

    async def completions(self, request: Request, req: CompletionRequest, t0: float) -> Response:
        ensure_imported(req)
        model, ids, params, echo = await WORK.run(self.prepare_completion, req)
        return await self.run(request, req, model, ids, params, t0, chat=False, echo=echo)

    async def list_models(self) -> Response:
        return json_response({"object": "list", "data": [self.model_card(n) for n in self.names]})

    async def get_model(self, name: str) -> Response:
        self.check_model(name)
        return json_response(self.model_card(name))

    async def health(self) -> Response:
        if self.engine.ready:
            return json_response({"status": "ready"})
        resp = json_response({"status": self.engine.status}, 503)
        if (seconds := self._retry_after()) is not None:  # backing off from a crash loop
            resp.headers["Retry-After"] = f"{seconds:g}"
        return resp

    async def live(self) -> Response:
        """Liveness: 200 while the process serves HTTP at all (starting, ready or draining)."""
        return json_response({"status": "alive"})

    async def startup(self, request: Request) -> Response:
        # app.state.prefetch_stats: the serve command sets it once the prefetcher exists
        from hotstart.system import memory_report  # noqa: PLC0415 - stdlib only

        state = request.app.state
        body = self.startup_body(state.prefetch_stats, state.download_stats)
        return json_response({**body, "memory": memory_report()})  # the limit and where it comes from

    async def prometheus(self) -> Response:
        self.metrics.update_engine(self.engine.stats, self.engine.ready)
        self.metrics.draining.set(1 if self.drain.draining else 0)
        self.metrics.update_fast_path(self.engine.fast_path)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
