"""The client side of `hotstart bench serve`: streamed requests traced as `vllm bench serve` traces them.

One run = NUM_PROMPTS requests sent at once with at most C in flight (an asyncio semaphore, as vLLM's
--max-concurrency with --request-rate inf); each request records its send time and the arrival of
every SSE event that carries choices (hotstart.bench.metrics). httpx is imported by the caller's
AsyncClient; this module itself is stdlib only.
"""

from __future__ import annotations

import asyncio
import json
import time

from hotstart.bench.dataset import Prompt
from hotstart.bench.metrics import RequestTrace

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def request_body(endpoint: str, model: str | None, prompt: str, max_tokens: int, force: dict,
                 temperature: float | None, extra: dict | None) -> dict:
    """A streamed request with usage (FORCE: the fields that make this server generate all MAX_TOKENS).

    temperature None sends none (vLLM's bench does not: each server applies its own default)."""
    body: dict = {"stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if endpoint == CHAT:
        body.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=max_tokens)
    else:
        body.update(prompt=prompt, max_tokens=max_tokens)
    if temperature is not None:
        body["temperature"] = temperature
    body.update(force)
    body.update(extra or {})
    return {k: v for k, v in body.items() if v is not None}


async def traced_request(client, url: str, body: dict, prompt_len: int, timeout: float,
                         headers: dict | None = None) -> RequestTrace:
    """POST BODY and trace the stream (never raises: a failure is the trace's error)."""
    import httpx

    chat = "messages" in body
    trace = RequestTrace(sent=time.perf_counter(), prompt_len=prompt_len)
    pieces: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    trace.error = f"HTTP {r.status_code}: {text[:200]}"
                    return trace
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank lines, SSE comments (": ping")
                    data = line[5:].strip()
                    if data == "[DONE]":
                        continue
                    now = time.perf_counter()
                    ev = json.loads(data)
                    if "error" in ev and not ev.get("choices"):
                        trace.error = f"error event: {json.dumps(ev)[:200]}"
                        continue
                    if choices := ev.get("choices"):
                        trace.events.append(now)
                        first = choices[0]
                        piece = (first.get("delta") or {}).get("content") if chat else first.get("text")
                        pieces.append(piece or "")
                        trace.finish_reason = first.get("finish_reason") or trace.finish_reason
                    elif usage := ev.get("usage"):
                        trace.usage_completion_tokens = usage.get("completion_tokens")
                        trace.usage_prompt_tokens = usage.get("prompt_tokens")
        if trace.error is None and trace.finish_reason is None:  # e.g. a single-slot server cutting it short
            trace.error = f"the stream ended after {len(trace.events)} event(s) without a finish_reason"
    except TimeoutError:
        trace.error = f"timeout after {timeout:.0f} s"
    except (httpx.HTTPError, ValueError) as e:
        trace.error = f"{type(e).__name__}: {e}"[:300]
    trace.text = "".join(pieces)
    return trace


async def run(client, url: str, bodies: list[tuple[dict, Prompt]], concurrency: int, timeout: float,
              headers: dict | None = None) -> tuple[list[RequestTrace], float]:
    """Send every body, at most CONCURRENCY in flight; (traces in send order, duration in seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict, prompt: Prompt) -> RequestTrace:
        async with gate:
            return await traced_request(client, url, body, prompt.tokens, timeout, headers)

    t0 = time.perf_counter()
    traces = await asyncio.gather(*(one(b, p) for b, p in bodies))
    return list(traces), time.perf_counter() - t0
