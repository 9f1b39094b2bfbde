"""One request's generation as text: engine ids -> detokenized deltas -> stop strings (torch-free; the
SSE framing is hotstart/server/sse.py).

The engine knows token ids only; stop strings are applied here, on the text. A stop string ends the
request (its text and everything after it are dropped, finish_reason "stop") and closes the engine's
iterator, which aborts the request in the engine so it stops spending steps on it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from hotstart.frontend.client import EngineDeadError
from hotstart.frontend.stops import StopStringFilter
from hotstart.messages import TokenOutput
from hotstart.text.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from hotstart.frontend.client import EngineClient
    from hotstart.frontend.metrics import Metrics
    from hotstart.messages import TokenLogprobs
    from hotstart.sampling_params import SamplingParams

__all__ = ["Choice", "Delta", "Generation", "GenerationError", "StopStringFilter"]


class GenerationError(Exception):
    """The engine finished the request with finish_reason "error"."""


class Choice:
    """One choice's text: detokenizer, stop strings, finish reason, its tokens (and their logprobs).

    KEEP: the text and the logprobs are kept for the whole answer (`text`, `logprobs`); a stream passes
    False and each delta carries its own, so that nothing grows with the answer but the token count."""

    def __init__(self, index: int, tokenizer: Any, prompt_ids: list[int], stops: list[str],
                 stop_ids: set[int], keep: bool = True) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, prompt_ids=prompt_ids)
        self.filter = StopStringFilter(stops, keep=keep)
        self.stop_ids = stop_ids
        self.keep = keep
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.logprobs: list[tuple[int, TokenLogprobs]] = []  # (token id, its logprobs), every token if kept
        self._unsent: list[tuple[int, TokenLogprobs]] = []  # logprobs not yet handed out with a delta

    @property
    def text(self) -> str:
        return self.filter.text

    def feed(self, out: TokenOutput) -> Delta:
        """The text (and logprobs) one engine output adds; sets finish_reason when it ends the choice."""
        ids = out.new_token_ids
        reason = out.finish_reason
        # a user stop token ends the text without appearing in it (eos is special: decode skips it)
        text_ids = ids[:-1] if reason == "stop" and ids and ids[-1] in self.stop_ids else ids
        # several tokens in one output (speculative decoding) with stop strings: fed one at a time, so the
        # count and the logprobs end with the token that completes a stop string, as with plain decoding
        groups = [[t] for t in text_ids] if len(text_ids) > 1 and self.filter.stops else [text_ids]
        piece, used = "", len(ids)
        for n, group in enumerate(groups):
            if group:
                piece += self.filter.feed(self.detok.add(group))
            if self.filter.stopped:
                used = n + len(group)
                break
        if reason is not None and not self.filter.stopped:
            piece += self.filter.feed(self.detok.flush())
        self.completion_tokens += used
        if out.logprobs:
            new = list(zip(ids[:used], out.logprobs[:used]))
            self._unsent += new
            if self.keep:
                self.logprobs += new
        if self.filter.stopped:
            reason = "stop"
        elif reason is not None:
            piece += self.filter.finish()
        self.finish_reason = reason
        lps = None
        if (piece or reason is not None) and self._unsent:
            lps, self._unsent = self._unsent, []
        return Delta(self.index, piece, lps, reason)


@dataclass
class Delta:
    """What one engine output adds to choice INDEX: text (maybe empty), the logprobs of the tokens it
    releases (None if none or not asked for), and the finish reason if the choice ended."""

    index: int
    text: str
    logprobs: list[tuple[int, TokenLogprobs]] | None = None
    finish_reason: str | None = None


class Generation:
    """Runs one request (n choices) in the engine; `deltas()` yields what each output adds, then every
    choice's finish_reason is set, the counts and logprobs too."""

    def __init__(self, engine: EngineClient, tokenizer: Any, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, stops: list[str], metrics: Metrics, t_arrival: float,
                 on_finish: Callable[[str], None] | None = None, keep: bool = True) -> None:
        self.engine, self.request_id, self.prompt_ids, self.params = engine, request_id, prompt_ids, params
        stop_ids = set(params.stop_token_ids)
        # KEEP False (a stream): each delta carries its text and logprobs, the choices keep neither
        self.choices = [Choice(i, tokenizer, prompt_ids, stops, stop_ids, keep) for i in range(params.n)]
        self.metrics, self.t_arrival, self.on_finish = metrics, t_arrival, on_finish
        # prompt tokens 1..P-1 (echo with logprobs), from the engine's first output
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self._first_token = True
        self.t_first: float | None = None  # perf_counter of the first token
        self._t_last = 0.0
        # the server's drain was forced (server/gate.py Drain): end with an error instead of generating on
        self.interrupted: Callable[[], bool] | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas, one per engine output that adds text, logprobs or a finish. Raises EngineDeadError or
        GenerationError on failure."""
        agen = self.engine.generate(self.request_id, self.prompt_ids, self.params)
        open_choices = len(self.choices)
        try:
            async for out in agen:
                if self.interrupted is not None and self.interrupted():
                    raise EngineDeadError("the server is shutting down")
                if out.finish_reason == "error":
                    raise GenerationError(out.error or "the engine could not run this request")
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs = out.prompt_logprobs
                if out.new_token_ids:
                    self._count_tokens(len(out.new_token_ids))
                # an engine abort (it is shutting down) ends every choice
                targets = (
                    [c for c in self.choices if c.finish_reason is None]
                    if out.finish_reason == "abort"
                    else [self.choices[out.index]]
                    if 0 <= out.index < len(self.choices)
                    else []
                )
                for choice in targets:
                    if choice.finish_reason is not None:
                        continue  # already ended by a stop string: the engine's late tokens are dropped
                    delta = choice.feed(
                        out if choice.index == out.index else TokenOutput(out.request_id, [], "abort")
                    )
                    if delta.text or delta.logprobs or delta.finish_reason:
                        yield delta
                    if delta.finish_reason is not None:
                        open_choices -= 1
                        self.metrics.finished.labels(delta.finish_reason).inc()
                        self.metrics.vllm.success.labels(self.metrics.model_name, delta.finish_reason).inc()
                        if open_choices and out.finish_reason is None:  # a stop string: stop that choice only
                            await self.engine.abort(self.request_id, choice.index)
                if not open_choices:
                    self._finish()
                    return
            raise GenerationError("the engine ended the request without a finish reason")
        finally:
            # Shielded: when the client disconnects this runs inside a cancelled scope, and the
            # abort must still reach the engine so the request's KV blocks are freed
            await close_shielded(agen)

    def _count_tokens(self, n: int) -> None:
        """Token counters, TTFT (the first output) and inter-token latency (the others, per token)."""
        now, m = time.perf_counter(), self.metrics
        v, model = m.vllm, m.model_name
        if self._first_token:
            self._first_token, self.t_first = False, now
            m.ttft.observe(now - self.t_arrival)
            v.ttft.labels(model).observe(now - self.t_arrival)
        else:
            v.itl.labels(model).observe((now - self._t_last) / n)
        self._t_last = now
        m.generation_tokens.inc(n)
        v.generation_tokens.labels(model).inc(n)

    def _finish(self) -> None:
        now = time.perf_counter()
        self.metrics.e2e.observe(now - self.t_arrival)
        ttft = None if self.t_first is None else self.t_first - self.t_arrival
        tokens = max(c.completion_tokens for c in self.choices)
        self.metrics.vllm.request_done(now - self.t_arrival, ttft, tokens)
        if self.on_finish is not None:
            self.on_finish(self.finish_reason or "stop")

    def usage(self) -> dict[str, int]:
        """OpenAI's: the prompt once, the completion tokens of every choice."""
        n, m = len(self.prompt_ids), self.completion_tokens
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


async def close_shielded(it: Any) -> None:
    """Close an async iterator even inside a cancelled scope (a gone client cancels the handler)."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def unless_disconnected(receive: Callable[[], Any], run: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, await run()), or (False, None) if the client disconnects first.

    RECEIVE is the ASGI receive of a request whose body was read: its next message is
    http.disconnect. run() is then cancelled, which closes the engine iterator (abort)."""
    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        async def work() -> None:
            try:
                outcome["value"] = await run()
            except Exception as e:  # noqa: BLE001 - re-raised below, not wrapped in the task group's ExceptionGroup
                outcome["error"] = e
            finally:
                tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(work)
        tg.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    return "value" in outcome, outcome.get("value")
