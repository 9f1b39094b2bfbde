"""HTTP for the hub backends (hfhub.py, mshub.py): metadata as JSON through urllib (stdlib, ~20 ms to
import; it gives the status and headers the Hub's errors are told by: X-Error-Code), file bytes through
obstore's HTTPStore (the same Rust client as s3://: ranged GETs on its own threads, the GIL released,
redirects followed, an Authorization header dropped when a redirect leaves the endpoint's host).
A token travels only in headers; no message, log line or exception carries it.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from datetime import timedelta
from urllib.parse import urlsplit

from hotstart.boot.remote.source import StoreError

CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 30
RETRIES = 5
USER_AGENT = "hotstart/0.1"


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    """urllib keeps every header across a redirect; the token must not follow one to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urlsplit(newurl).netloc != urlsplit(req.full_url).netloc:
            for k in ("Authorization", "Cookie"):
                new.remove_header(k)
        return new


_OPENER = urllib.request.build_opener(_SameHostRedirects)


def get_json(url: str, headers: dict[str, str], what: str, retries: int = 2, timeout_s: float = 10,
             describe=None):
    """The JSON at URL, or a StoreError (one line, naming WHAT). 5xx, 429, timeouts and refused
    connections are retried RETRIES times with backoff (0.2 s doubling); DESCRIBE(status, headers, body)
    words an HTTP error (the store's rules), else `HTTP N`."""
    req_headers = {"User-Agent": USER_AGENT, "Accept": "application/json", **headers}
    last: StoreError | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(5.0, 0.2 * 2 ** (attempt - 1)))
        try:
            with _OPENER.open(urllib.request.Request(url, headers=req_headers), timeout=timeout_s) as r:
                body = r.read(64 << 20)
            try:
                return json.loads(body)
            except ValueError:
                raise StoreError(f"{what}: the answer is not JSON ({len(body)} bytes)", 200) from None
        except urllib.error.HTTPError as e:
            body = e.read(65536) if e.fp is not None else b""
            text = describe(e.code, e.headers, body) if describe else f"HTTP {e.code}"
            last = StoreError(f"{what}: {text}", e.code, e.headers.get("X-Error-Code"))
            if e.code < 500 and e.code != 429:
                raise last from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            why = "timed out" if "timed out" in str(reason).lower() else f"cannot reach it ({reason})"
            last = StoreError(f"{what}: {why}")
    assert last is not None
    if last.status is None or last.status >= 500:
        last = StoreError(f"{last} after {retries + 1} tries", last.status, last.code)
    raise last


def open_http_store(endpoint: str, headers: dict[str, str], exact: bool = False):
    """obstore's HTTPStore over ENDPOINT (EXACT: that one URL, query included) with HEADERS on every
    request (and full retries)."""
    from obstore.store import HTTPStore  # noqa: PLC0415 - imported on the main thread, once per start

    client = {
        "connect_timeout": timedelta(seconds=CONNECT_TIMEOUT_S),
        "read_timeout": timedelta(seconds=READ_TIMEOUT_S),
        "timeout": timedelta(seconds=300),
        "user_agent": USER_AGENT,
        "default_headers": headers,
    }
    if endpoint.startswith("http://"):
        client["allow_http"] = True
    retry = {"max_retries": RETRIES, "retry_timeout": timedelta(seconds=60),
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5),
                         "base": 2}}
    url = endpoint if exact else endpoint.rstrip("/") + "/"
    return HTTPStore.from_url(url, client_options=client, retry_config=retry)


def status_of(e: BaseException) -> int | None:
    """The HTTP status in one of obstore's errors, if it has one."""
    m = re.search(r"status code: (\d{3})|non-2xx status code: (\d{3})", str(e))
    return int(m.group(1) or m.group(2)) if m else None
