"""Errors meant for the user: the CLI prints them as one line, the server as an OpenAI error body, and
the offline `LLM` raises a refused request as the ValueError it is."""

from __future__ import annotations

from typing import Any


class HotstartError(Exception):
    """A problem the user can fix (bad file, bad flag, missing model). Printed as one line."""


class ModelConfigError(HotstartError):
    pass


class WeightsError(HotstartError):
    pass


class ModelNotFoundError(HotstartError):
    pass


class RequestError(ValueError):
    """A request refused before it runs (a bad or unsupported parameter, an unknown model, an engine not
    ready, a full queue). Raised by the one validator (hotstart/sampling_params.py, frontend/validation.py);
    the HTTP layer answers STATUS with OpenAI's body {"error": {"message", "type", "param", "code"}}, the
    offline LLM lets it through as a ValueError. RETRY_AFTER: seconds, sent as Retry-After (a 503 that
    a client or proxy may retry: nothing ran)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_param(param: str, message: str) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


def unsupported(param: str, what: str) -> RequestError:
    return RequestError(400, f"{what} is not supported by hotstart", param=param,
                        code="unsupported_parameter")


def describe(exc: BaseException) -> str:
    """An unexpected exception for the log: its type and where it was raised. Not its message, nor a
    traceback with locals: either can hold request data (prompt text, keys)."""
    tb, where = exc.__traceback__, "?"
    while tb is not None:
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{type(exc).__name__} at {where}"
