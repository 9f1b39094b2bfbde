"""The soak's answer checks (`hotstart bench soak`): what is wrong with an answer to a good request, a
bad request's 4xx, and the outcome each record is counted under (soak_report.OUTCOMES)."""

from __future__ import annotations

import json

from hotstart.bench.soak_workload import COLORS, TEXT, Req


def answer_problem(req: Req, status: int, body) -> str | None:
    """What is wrong with a non-streamed answer to a good request (None: nothing). Cut answers
    (finish_reason length) are checked for shape only; whole ones for content."""
    if status != 200:
        return f"HTTP {status}: {json.dumps(body)[:300] if not isinstance(body, str) else body[:300]}"
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        return f"no choices: {str(body)[:300]}"
    choices = body["choices"]
    want = req.extra.get("n", 1)
    if sorted(c.get("index") for c in choices) != list(range(want)):
        return f"expected {want} choices indexed 0..{want - 1}, got {[c.get('index') for c in choices]}"
    if not isinstance(body.get("usage"), dict) or not body["usage"].get("completion_tokens"):
        return f"no usage: {body.get('usage')}"
    for c in choices:
        finish = c.get("finish_reason")
        if finish not in ("stop", "length", "tool_calls"):
            return f"finish_reason {finish!r}"
        if req.path == TEXT:
            if not isinstance(c.get("text"), str):
                return f"no text: {str(c)[:200]}"
            continue
        msg = c.get("message") or {}
        if req.kind == "tools":
            problem = _tool_problem(msg, finish)
            if problem:
                return problem
        elif not isinstance(msg.get("content"), str):
            return f"no message content: {str(msg)[:200]}"
        elif req.kind == "json_schema" and finish == "stop":
            try:
                got = json.loads(msg["content"])
            except ValueError:
                return f"not JSON under response_format json_schema: {msg['content'][:200]!r}"
            if not isinstance(got, dict) or got.get("color") not in COLORS or set(got) != {"color"}:
                return f"JSON not of the schema: {msg['content'][:200]!r}"
    return None


def _tool_problem(msg: dict, finish: str) -> str | None:
    if finish == "length":
        return None  # cut inside the forced call: nothing whole to check
    calls = msg.get("tool_calls") or []
    if finish != "tool_calls" or not calls:
        return f"forced tool_choice answered without a call (finish_reason {finish!r}): {str(msg)[:200]}"
    fn = calls[0].get("function") or {}
    if fn.get("name") != "get_weather":
        return f"called {fn.get('name')!r}, not the forced get_weather"
    try:
        args = json.loads(fn.get("arguments") or "")
    except ValueError:
        return f"arguments not JSON: {fn.get('arguments')!r:.200}"
    return (
        None if isinstance(args, dict) and isinstance(args.get("city"), str) else f"arguments {args!r:.200}"
    )


def bad_problem(status: int, body) -> str | None:
    """A bad request must get a 4xx with OpenAI's error object."""
    if not 400 <= status < 500:
        return f"HTTP {status} (expected 4xx): {str(body)[:200]}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return f"HTTP {status} without OpenAI's error object: {str(body)[:200]}"
    return None


def classify(kind: str, status: int | None, error: str | None) -> str:
    """The outcome (soak_report.OUTCOMES) of a request of KIND that got STATUS (None: no answer) and
    ERROR (None: the answer was right)."""
    if error is not None and error.startswith("timeout after"):
        return "hung"
    if status is not None and status >= 500:
        return "5xx"
    if kind == "bad":
        if error is None:
            return "ok"
        return "not_4xx" if status is not None and status < 400 else "failed"
    if error is None:
        return "hangup" if kind == "hangup" else "ok"
    return "failed"
