"""The HTTP layer's test kit: a FakeEngine stand-in, an in-memory client of the app, request and
response helpers."""

from __future__ import annotations

import asyncio
import json
import time

from hotstart.boot.timeline import Timeline
from hotstart.messages import EngineReady, EngineStats, TokenOutput
from hotstart.server.api import ApiSettings, build_app
from hotstart.server.engine_client import EngineDeadError

MODEL = "smol"
TEXT = "The capital of France is Paris. STOP here, then more text follows."


class FakeEngine:
    def __init__(self, eos: int, max_model_len: int = 256, ready: bool = True) -> None:
        self.eos, self.max_model_len = eos, max_model_len
        self.ready, self.status, self.info = False, "loading weights", None
        if ready:
            self.set_ready()
        self.stats = EngineStats(num_running=1, num_waiting=2, kv_blocks_used=25, kv_blocks_total=100)
        self.timeline = Timeline(time.time())
        self.requests: dict = {}
        self.aborted: list[str] = []
        self.script: list[int] | None = None  # ids to generate instead of the reversed prompt
        self.delay = 0.0
        self.die_after: int | None = None  # EngineDeadError after this many tokens
        self.error_after: int | None = None  # finish_reason "error" after this many tokens

    def set_ready(self) -> None:
        self.ready, self.status = True, "ready"
        self.info = EngineReady(pid=1, device="cpu", dtype="bfloat16", max_model_len=self.max_model_len,
                                block_size=16, num_kv_blocks=100, max_num_seqs=8)

    async def generate(self, request_id, prompt_token_ids, params):
        self.requests[request_id] = (list(prompt_token_ids), params)
        out = list(self.script) if self.script is not None else [*reversed(prompt_token_ids), self.eos]
        finished = False
        try:
            for n, tok in enumerate(out, 1):
                await asyncio.sleep(self.delay)
                if self.die_after is not None and n > self.die_after:
                    finished = True
                    raise EngineDeadError("engine process exited (code -9)")
                if self.error_after is not None and n > self.error_after:
                    finished = True
                    yield TokenOutput(request_id, [], "error", "CUDA error: out of memory")
                    return
                stop = tok in params.stop_token_ids or (tok == self.eos and not params.ignore_eos)
                reason = "stop" if stop else "length" if n >= params.max_tokens else None
                finished = reason is not None
                yield TokenOutput(request_id, [tok], reason)
                if finished:
                    return
            finished = True
            yield TokenOutput(request_id, [], "length")
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def make_client(engine, tok, prefetch_stats=None, **kw):
    from starlette.testclient import TestClient

    settings = ApiSettings(served_model_names=[MODEL, "alias"], **kw)
    app = build_app(engine, tok, settings)
    app.state.prefetch_stats = prefetch_stats  # as the serve command sets it after build_app
    return TestClient(app, raise_server_exceptions=False)


def chat_body(content="What is the capital of France?", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err
