"""The soak's client side of one request (`hotstart bench soak`): send it, bounded by the request timeout,
and judge what came back (streamed, hung up on, or whole); and the /metrics read of the sampler."""

from __future__ import annotations

import asyncio
import re

from hotstart.bench.load import aborted_request, stream_problem
from hotstart.bench.soak_checks import answer_problem, bad_problem
from hotstart.bench.soak_workload import CHAT, Req
from hotstart.bench.streams import stream_request


async def send(client, url: str, req: Req, timeout: float) -> dict:
    """Send REQ; {status, ttft, error} (soak_checks applied to the answer)."""
    import httpx

    if req.stream and req.kind == "hangup":
        rec = await aborted_request(client, url + req.path, req.body, req.extra["after"], timeout)
        return {
            "status": _status(rec["error"]) or (None if rec["error"] else 200),
            "ttft": None,
            "error": rec["error"],
        }
    if req.stream:
        rec = await stream_request(client, url + req.path, req.body, timeout, chat=req.path == CHAT)
        error = rec["error"] or stream_problem(rec)
        return {
            "status": _status(rec["error"]) or (200 if rec["done"] or rec["chunks"] else None),
            "ttft": rec["ttft"],
            "error": error,
        }
    status, body = None, None
    try:
        async with asyncio.timeout(timeout):
            if req.raw is not None:
                r = await client.post(
                    url + req.path, content=req.raw, headers={"content-type": "application/json"}
                )
            else:
                r = await client.post(url + req.path, json=req.body)
            status = r.status_code
            try:
                body = r.json()
            except ValueError:
                body = r.text
    except TimeoutError:
        return {"status": None, "ttft": None, "error": f"timeout after {timeout:.0f} s"}
    except httpx.HTTPError as e:
        return {"status": None, "ttft": None, "error": f"{type(e).__name__}: {e}"}
    error = bad_problem(status, body) if req.kind == "bad" else answer_problem(req, status, body)
    return {"status": status, "ttft": None, "error": error}


def _status(error: str | None) -> int | None:
    m = re.match(r"HTTP (\d{3})", error or "")
    return int(m.group(1)) if m else None


async def read_metrics(client, url: str) -> str:
    import httpx

    try:
        r = await client.get(url + "/metrics", timeout=10)
        return r.text if r.status_code == 200 else ""
    except httpx.HTTPError:
        return ""
