"""The ASGI gate in front of every endpoint: who may reach it (server/access.py: Host, Origin, content
type), API key and admin key, request counting, the drain (SIGTERM), memory pressure (frontend/memory.py),
last-resort 500 (torch-free)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
from typing import Any, NamedTuple

import msgspec
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from hotstart.errors import RequestError, describe
from hotstart.frontend.metrics import Metrics

log = logging.getLogger("hotstart")
_json = msgspec.json.Encoder()
# the endpoints counted by name in /metrics; anything else is "other" (a fixed label set)
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize",
             "/v1/models", "/health", "/live", "/startup", "/metrics"}
# answered while draining: the probes and what observes the server; every other path is refused then
PROBE_PATHS = frozenset({"/health", "/live", "/startup", "/metrics"})
RETRY_AFTER_S = 1
ADMIN_PATHS = re.compile(r"/v1/models/.+/(load|unload)")  # with --admin-key, its holder's alone


class Caller(NamedTuple):
    """Who sent a request, as the gate found it: ADMIN (may load, unload, set keep_alive: the admin key's
    holder, or anyone the gate admits when no admin key is set), OWNER (whose stored responses it sees: a
    digest of the key it sent; None on a keyless server)."""

    admin: bool
    owner: str | None


def caller(scope) -> Caller:
    """The gate's Caller of a request's scope (without a gate, as in an in-process app: an admin)."""
    return scope.get("hotstart.caller") or Caller(True, None)


def _owner(key: bytes) -> str:
    return hashlib.sha256(b"hotstart-owner\0" + key).hexdigest()[:16]


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def error_response(err: RequestError) -> Response:
    resp = json_response(err.body(), err.status)
    if err.retry_after is not None:
        resp.headers["Retry-After"] = f"{err.retry_after:g}"
    return resp


async def _request_error(request: Request, exc: RequestError) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(RequestError(exc.status_code, msg, code=code))


def add_error_handlers(app) -> None:
    """Refused requests (RequestError, its subclasses included) and Starlette's own 404 / 405 in OpenAI's
    error shape."""
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


class Drain:
    """The server's drain (SIGTERM, server/launch.py): from begin() on, /health answers 503 "draining" and
    new requests 503 with Retry-After, while the requests in flight (counted by the gate: every path but
    PROBE_PATHS, a stream until its last byte) run to their end. `forced` (a second signal, or the
    shutdown timeout): what is still generating ends with an error (Generation's `interrupted`)."""

    def __init__(self) -> None:
        self.draining = False
        self.forced = False
        self.in_flight = 0
        self.began_at: float | None = None  # time.monotonic() of begin()

    def begin(self) -> None:
        if not self.draining:
            self.draining, self.began_at = True, time.monotonic()

    def force(self) -> None:
        self.begin()
        self.forced = True

    async def wait_idle(self, timeout: float, poll: float = 0.01) -> bool:
        """True once nothing is in flight, False if TIMEOUT passes (or the drain is forced) first."""
        deadline = time.monotonic() + timeout
        while self.in_flight and not self.forced and time.monotonic() < deadline:
            await asyncio.sleep(poll)
        return not self.in_flight

    def refusal(self) -> Response:
        err = RequestError(503, "the server is shutting down: retry the request (on another replica)",
                           code="server_draining")
        resp = error_response(err)
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
        return resp

    def health(self) -> Response:
        resp = json_response({"status": "draining", "in_flight": self.in_flight}, 503)
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
        return resp


class Gate:
    """Pure ASGI middleware: who may reach the server (ACCESS, a server/access.py Access: Host, Origin,
    content type; None: no such checks, for apps built in process), the API-key check (every path but
    /health and /live; /metrics without it on the --metrics-port listener), the admin key (ADMIN_PATHS;
    the Caller it sets in the scope), request counting by status, the drain (Drain above), memory pressure
    (MEMORY, a frontend/memory.py MemoryGuard: a POST waits briefly, then 503, while memory is short),
    and the last resort for unexpected exceptions: a one-line log and an OpenAI-shaped 500, never a
    traceback (Starlette's ServerErrorMiddleware would answer, then re-raise it to uvicorn's log)."""

    OPEN_PATHS = frozenset({"/health", "/live"})

    def __init__(self, app, api_key: str | None, metrics: Metrics, drain: Drain | None = None,
                 memory=None, access=None, admin_key: str | None = None) -> None:
        self.app, self.metrics, self.memory, self.access = app, metrics, memory, access
        self.drain = drain if drain is not None else Drain()
        self.key = api_key.encode() if api_key else None
        self.admin_key = admin_key.encode() if admin_key else None

    def identify(self, scope) -> Caller | None:
        """The Caller, or None when a key is required and `Authorization: Bearer KEY` has none of ours
        (compared in constant time: hmac.compare_digest, both keys always)."""
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.strip().partition(b" ")
        token = token.strip()
        # compare even when the scheme is wrong, so the timing does not tell which part failed
        api = hmac.compare_digest(token, self.key) if self.key is not None else False
        admin = hmac.compare_digest(token, self.admin_key) if self.admin_key is not None else False
        bearer = scheme.lower() == b"bearer"
        if admin and bearer:
            return Caller(True, _owner(self.admin_key))
        if self.key is None:  # keyless: this machine's users (any token a client sends is no key)
            return Caller(self.admin_key is None, None)
        return Caller(self.admin_key is None, _owner(self.key)) if api and bearer else None

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

        counted = path not in PROBE_PATHS
        drain = self.drain
        try:
            refusal = self.access.refusal(scope) if self.access is not None else None
            if refusal is not None:
                return await error_response(refusal)(scope, receive, send_counted)
            who = self.identify(scope)
            if who is None and path not in self.OPEN_PATHS and scope.get("hotstart.listener") != "metrics":
                err = RequestError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                                   code="invalid_api_key")
                return await error_response(err)(scope, receive, send_counted)
            scope["hotstart.caller"] = who
            if who is not None and not who.admin and ADMIN_PATHS.fullmatch(path):
                err = RequestError(403, "loading and unloading models needs the admin key (--admin-key)",
                                   code="admin_key_required")
                return await error_response(err)(scope, receive, send_counted)
            refusal = self.access.content_refusal(scope) if self.access is not None else None
            if refusal is not None:
                return await error_response(refusal)(scope, receive, send_counted)
            if drain.draining and (counted or path == "/health"):
                resp = drain.refusal() if counted else drain.health()
                return await resp(scope, receive, send_counted)
            if self.memory is not None and scope["method"] == "POST":  # new work: generation, a load
                refusal = await self.memory.admit()
                if refusal is not None:
                    return await error_response(refusal)(scope, receive, send_counted)
            if counted:
                drain.in_flight += 1
            try:
                await self.app(scope, receive, send_counted)
            finally:
                if counted:
                    drain.in_flight -= 1
        except ClientDisconnect:  # the client left (or was cut at --body-timeout) while sending its body
            status = 499
        except Exception as exc:  # noqa: BLE001 - the last resort: answer, log one line, keep serving
            log.error("hotstart: internal error on %s: %s", path, describe(exc))
            if not started:
                err = RequestError(500, "internal server error", code="internal_error")
                await error_response(err)(scope, receive, send_counted)
            else:
                status = 500
        finally:
            self.metrics.observe_request(endpoint, status)
