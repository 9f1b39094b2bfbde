"""Request bodies (torch-free): read_body(request) (size, content type) and decode_request(body, cls) into
the request types of frontend/protocol.py, every failure an OpenAI error naming the parameter. Decoding runs
on the worker pool (server/offload.py), not on the event loop."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

from hotstart.errors import RequestError
from hotstart.frontend.protocol import MAX_JSON_DEPTH
from hotstart.frontend.validation import check_nesting

if TYPE_CHECKING:
    from starlette.requests import Request

_AT = re.compile(r" - at `\$\.?(.*)`$")


def decode_request(body: bytes, cls: type[msgspec.Struct]) -> Any:
    """bytes -> CLS, or RequestError 400 naming the offending parameter; no JSON value in it (any field)
    nests more than MAX_JSON_DEPTH deep."""
    try:
        req = msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _AT.search(msg)
        param = m.group(1) if m else None
        if msg.startswith("Object missing required field"):
            missing = msg.split("`")[1]
            param = f"{param}.{missing}" if param else missing
        return_msg = _AT.sub("", msg) + (f" (parameter `{param}`)" if param else "")
        raise RequestError(400, return_msg, param=param, code="invalid_type") from None
    except msgspec.DecodeError as e:
        raise RequestError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # past the interpreter's recursion limit (~1000 levels)
        raise RequestError(400, f"the body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                           code="invalid_json") from None
    check_nesting(req)
    return req


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body: JSON content type (or none), at most LIMIT bytes (413), counted while streaming."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise RequestError(415, f"Content-Type must be application/json, got `{ctype}`",
                           code="unsupported_media_type")
    too_big = RequestError(413, f"request body is larger than {limit} bytes", code="request_too_large")
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
