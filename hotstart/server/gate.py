"""The ASGI gate in front of every endpoint: API key, request counting, last-resort 500 (torch-free)."""

from __future__ import annotations

import hmac
import logging
from typing import Any

import msgspec
from starlette.responses import Response

from hotstart.server.errors import ApiError, describe
from hotstart.server.metrics import Metrics

log = logging.getLogger("hotstart")
_json = msgspec.json.Encoder()
# the endpoints counted by name in /metrics; anything else is "other" (a fixed label set)
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/startup", "/metrics"}


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


class Gate:
    """Pure ASGI middleware: the API-key check (every path but /health), request counting by status,
    and the last resort for unexpected exceptions: a one-line log and an OpenAI-shaped 500, never a
    traceback (Starlette's ServerErrorMiddleware would answer, then re-raise it to uvicorn's log)."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app, api_key: str | None, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.key = api_key.encode() if api_key else None

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
                err = ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                               code="invalid_api_key")
                return await error_response(err)(scope, receive, send_counted)
            await self.app(scope, receive, send_counted)
        except Exception as exc:  # noqa: BLE001 - the last resort: answer, log one line, keep serving
            log.error("hotstart: internal error on %s: %s", path, describe(exc))
            if not started:
                err = ApiError(500, "internal server error", code="internal_error")
                await error_response(err)(scope, receive, send_counted)
            else:
                status = 500
        finally:
            self.metrics.observe_request(endpoint, status)
