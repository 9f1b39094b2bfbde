"""Slow and idle clients cannot starve the server (torch-free): uvicorn's HTTP protocol with a read deadline
per request, a write deadline, and caps on open connections (in all and per client).

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
idle sockets are shed quickly and a real client learns why. A client (one peer address) past
--max-connections-per-client gets the same, as a 429.

Writes: a client that stops reading fills the socket's buffers, then asyncio's write buffer past its high
mark (pause_writing), and the app's next send waits. If the buffer does not drain below its low mark within
--write-timeout, the connection is aborted (its buffer dropped): the app sees a disconnect, so a stream's
engine request is aborted and its drain slot and model lease are released. The deadline runs whatever the
phase, a finished response too (a whole answer the client never reads).
"""

from __future__ import annotations

import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass

import msgspec

from hotstart.errors import HotstartError, RequestError

log = logging.getLogger("hotstart")
OVER_CAP_HEADER_S = 2.0  # header deadline of a connection opened past the cap
RETRY_AFTER_S = 1
WARN_EVERY_S = 10.0  # the "connections over the cap" warning, at most this often
FILES_BESIDE_CONNECTIONS = 256  # descriptors kept for the rest: model files, engine sockets, pipes, logs


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 512
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    write_timeout: float = 10.0  # 0: none
    max_per_client: int | None = None  # None: half of max_connections; 0: no cap

    @property
    def per_client(self) -> int:
        """The per-client cap in force (0: none)."""
        if self.max_per_client is None:
            return max(1, self.max_connections // 2)
        return self.max_per_client


def over_capacity_body(limit: int, per_client: bool = False) -> bytes:
    if per_client:
        err = RequestError(429, f"this client has too many open connections (--max-connections-per-client "
                                f"{limit}): retry the request shortly", code="too_many_connections")
    else:
        err = RequestError(503, f"the server has too many open connections (--max-connections {limit}): "
                                f"retry the request shortly", code="too_many_connections")
    return msgspec.json.encode(err.body())


def over_capacity_app(limit: int, per_client: bool = False):
    """The ASGI app a connection opened past a cap runs its request with: 503 (429 past the per-client
    cap), Retry-After, close."""
    body = over_capacity_body(limit, per_client)
    status = 429 if per_client else 503
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]

    async def app(scope, receive, send) -> None:  # noqa: ARG001 - the request is not read
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def protocol_class(limits: ConnectionLimits, base: type | None = None) -> type:
    """A subclass of BASE (default: the HTTP protocol uvicorn picks) enforcing LIMITS; pass it as
    uvicorn.Config(http=...)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base  # noqa: PLC0415, N813
    refuse = over_capacity_app(limits.max_connections)
    per_client = limits.per_client
    refuse_client = over_capacity_app(per_client, per_client=True)
    warned = {"cap": 0.0, "client": 0.0, "write": 0.0}
    open_by_peer: Counter[str] = Counter()

    def warn(kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - warned[kind] > WARN_EVERY_S:
            warned[kind] = now
            log.warning(message, *args)

    class DeadlineProtocol(base):
        _phase: str | None = None
        _timer = None
        _write_timer = None
        _peer: str | None = None
        _header_timeout = limits.header_timeout

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._peer = peer[0] if isinstance(peer, tuple) and peer else None
            if self._peer is not None:
                open_by_peer[self._peer] += 1
            if len(self.connections) > limits.max_connections:
                self._refuse(refuse)  # its request, if it sends one in time, is answered 503
                warn("cap", "hotstart: WARNING: %d connections open (--max-connections %d): new ones are "
                            "answered 503", len(self.connections), limits.max_connections)
            elif per_client and self._peer is not None and open_by_peer[self._peer] > per_client:
                self._refuse(refuse_client)
                warn("client", "hotstart: WARNING: a client has %d connections open "
                               "(--max-connections-per-client %d): its new ones are answered 429",
                     open_by_peer[self._peer], per_client)
            self._track()

        def _refuse(self, app) -> None:
            self.app = app
            self._header_timeout = min(limits.header_timeout, OVER_CAP_HEADER_S)

        def pause_writing(self) -> None:
            super().pause_writing()
            if limits.write_timeout and self._write_timer is None:
                self._write_timer = self.loop.call_later(limits.write_timeout, self._write_expired)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop_write_timer()

        def _stop_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_expired(self) -> None:
            self._write_timer = None
            warn("write", "hotstart: WARNING: a client read nothing for %g s (--write-timeout): its "
                          "connection was closed", limits.write_timeout)
            if self.cycle is not None:
                self.cycle.keep_alive = False
            self.transport.abort()  # close() would wait for the unread buffer to drain

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()

        def connection_lost(self, exc) -> None:
            self._arm(None)
            self._stop_write_timer()
            if self._peer is not None:
                open_by_peer[self._peer] -= 1
                if open_by_peer[self._peer] <= 0:
                    del open_by_peer[self._peer]
                self._peer = None
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
            if self.transport.get_write_buffer_size():
                self.transport.abort()  # a response nobody reads: close() would wait for it to drain
            elif not self.transport.is_closing():
                self.transport.close()  # connection_lost follows: an app reading the body sees a disconnect

    DeadlineProtocol.__qualname__ = DeadlineProtocol.__name__ = f"Deadline{base.__name__}"
    return DeadlineProtocol


def open_files_for(max_connections: int) -> int:
    """Raise this process's NOFILE soft limit to fit MAX_CONNECTIONS sockets beside the descriptors the rest
    needs (FILES_BESIDE_CONNECTIONS); the soft limit in force. HotstartError if the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FILES_BESIDE_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise HotstartError(
                f"--max-connections {max_connections} needs {need} open files, but this process may open "
                f"at most {hard} (the hard NOFILE limit, `ulimit -Hn`): lower --max-connections or raise it"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        soft = need
    return soft
