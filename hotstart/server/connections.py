"""Slow and idle clients cannot starve the server (torch-free): uvicorn's HTTP protocol with a read deadline
per request and a cap on open connections.

uvicorn's own limits do not cover it: its keep-alive timeout starts only after a first response, so a
socket that connects and sends nothing (or half a header, a byte at a time) is held for ever, and its
`limit_concurrency` answers a plain-text 503. `protocol_class(limits)` subclasses the HTTP protocol
uvicorn would pick (h11, or httptools where installed: both keep `self.cycle`, `self.app` and
`on_response_complete`) with one timer per connection, re-armed as the connection moves between phases:

  phase     from                                   until                          deadline
  header    the connection opens / a response ends the request's headers are read  --header-timeout
  body      the headers are read                   the body is read               --body-timeout
  (none)    the request is read                    its response ends              none: generation can be long

A connection whose deadline passes is closed (an app still reading its body sees a disconnect). A
connection opened while --max-connections are open gets a short header deadline (OVER_CAP_HEADER_S) and
its request, if one comes, is answered 503 in OpenAI's error shape with Retry-After and closed, so
idle sockets are shed quickly and a real client learns why.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from hotstart.errors import RequestError

log = logging.getLogger("hotstart")
OVER_CAP_HEADER_S = 2.0  # header deadline of a connection opened past the cap
RETRY_AFTER_S = 1
WARN_EVERY_S = 10.0  # the "connections over the cap" warning, at most this often


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 512
    header_timeout: float = 10.0
    body_timeout: float = 30.0


def over_capacity_body(limit: int) -> bytes:
    err = RequestError(
        503,
        f"the server has too many open connections (--max-connections {limit}): retry the request shortly",
        code="too_many_connections",
    )
    return msgspec.json.encode(err.body())


def over_capacity_app(limit: int):
    """The ASGI app a connection opened past the cap runs its request with: 503, Retry-After, close."""
    body = over_capacity_body(limit)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]

    async def app(scope, receive, send) -> None:  # noqa: ARG001 - the request is not read
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def protocol_class(limits: ConnectionLimits, base: type | None = None) -> type:
    """A subclass of BASE (default: the HTTP protocol uvicorn picks) enforcing LIMITS; pass it as
    uvicorn.Config(http=...)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base  # noqa: PLC0415, N813
    refuse = over_capacity_app(limits.max_connections)
    warned = [0.0]

    class DeadlineProtocol(base):
        _phase: str | None = None
        _timer = None
        _header_timeout = limits.header_timeout

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.app = refuse  # its request, if it sends one in time, is answered 503
                self._header_timeout = min(limits.header_timeout, OVER_CAP_HEADER_S)
                now = time.monotonic()
                if now - warned[0] > WARN_EVERY_S:
                    warned[0] = now
                    log.warning(
                        "hotstart: WARNING: %d connections open (--max-connections %d): new ones "
                        "are answered 503",
                        len(self.connections),
                        limits.max_connections,
                    )
            self._track()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()

        def connection_lost(self, exc) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def _track(self) -> None:
            """Arm the deadline of the phase the connection is in now (a phase keeps its first deadline)."""
            cycle = self.cycle
            if self.transport is None or self.transport.is_closing():
                phase = None
            elif cycle is None or cycle.response_complete:
                phase = "header"
            elif cycle.more_body:
                phase = "body"
            else:
                phase = None
            if phase != self._phase:
                self._arm(phase)

        def _arm(self, phase: str | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._phase, self._timer = phase, None
            if phase is not None:
                seconds = self._header_timeout if phase == "header" else limits.body_timeout
                self._timer = self.loop.call_later(seconds, self._expired)

        def _expired(self) -> None:
            self._timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
            if not self.transport.is_closing():
                self.transport.close()  # connection_lost follows: an app reading the body sees a disconnect

    DeadlineProtocol.__qualname__ = DeadlineProtocol.__name__ = f"Deadline{base.__name__}"
    return DeadlineProtocol
