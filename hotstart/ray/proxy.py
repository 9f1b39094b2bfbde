"""OpenAI-shaped errors from Ray Serve's HTTP proxy (stdlib + starlette; no ray import, no torch), for what no
replica could answer:

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=hotstart.ray.proxy:middlewares   (in the environment of `ray
    start`)

Ray's proxy answers its own failures in plain text (503 "deployment unavailable", 408 on its request timeout)
and, when the replica serving a request dies, sends nothing more: a stream just stops mid-body (the client
sees a truncated chunked body) and an unanswered request gets "Internal Server Error". On the OpenAI paths of
the applications behind it (OPENAI_PATHS) this middleware, run in the proxy, makes them what `hotstart serve`
sends when its engine dies: a stream ends with an SSE error event and `data: [DONE]`; an unanswered request
gets 503 `replica_unavailable` in OpenAI's error JSON with Retry-After (nothing was returned: a client may
retry it); Ray's plain-text error statuses keep their code with OpenAI's JSON body. Every other path and
response passes untouched; answered responses are never buffered (only Ray's plain-text error bodies, a few
hundred bytes).
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware

log = logging.getLogger("ray.serve")
OPENAI_PATHS = ("/v1/", "/tokenize", "/detokenize")
RETRY_AFTER_S = 1
LOST = "the replica serving this request stopped before it ended (its node or process died)"


def _body(message: str, status: int, code: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def _openai_path(path: str) -> bool:
    return any(p in path for p in OPENAI_PATHS)


class OpenAIErrors:
    """Pure ASGI middleware (see the module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _openai_path(scope.get("path", "")):
            return await self.app(scope, receive, send)
        state = {"start": None, "sse": False, "done": False, "held": None, "text": b""}

        async def watch(message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                ctype = headers.get(b"content-type", b"")
                state["sse"] = ctype.startswith(b"text/event-stream")
                if message["status"] >= 400 and not ctype.startswith(b"application/json"):
                    state["held"] = message  # Ray's own plain-text error: rewritten once its body is in
                    return
                state["start"] = message
            elif kind == "http.response.body" and state["held"] is not None:
                state["text"] += message.get("body", b"")
                if message.get("more_body", False):
                    return
                await self._rewrite(state, send)
                state["done"] = True
                return
            elif kind == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        error = None
        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # noqa: BLE001 - answered below in OpenAI's shape, one log line
            error = e
        if state["done"]:
            return
        if error is not None:
            log.warning("hotstart proxy: %s %s: %s", scope.get("method"), scope.get("path"), error)
        if state["start"] is None:
            await self._send(send, 503, _body(LOST, 503, "replica_unavailable"), retry=True)
        elif state["sse"]:
            event = b"data: " + _body(LOST, 503, "replica_unavailable") + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})
        elif error is not None:
            raise error  # a JSON body cut short: the connection closes, the client sees it incomplete

    async def _rewrite(self, state, send) -> None:
        status = state["held"]["status"]
        text = state["text"].decode("utf-8", "replace").strip() or "the request could not be served"
        code = {408: "timeout", 429: "rate_limited", 503: "service_unavailable"}.get(status, "proxy_error")
        await self._send(send, status, _body(text, status, code), retry=status in (429, 503))

    @staticmethod
    async def _send(send, status: int, body: bytes, retry: bool = False) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if retry:
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list[Middleware]:
    """Ray Serve's HTTP proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    return [Middleware(OpenAIErrors)]
