"""The HTTP layer's test kit: the real in-process engine client with scripted outputs (ScriptedEngine),
an in-memory client of the app, request and response helpers."""

from __future__ import annotations

import json
import time

from hotstart.boot.timeline import Timeline
from hotstart.config import EngineConfig
from hotstart.frontend.client import EngineDeadError
from hotstart.frontend.inprocess import InProcessEngineClient
from hotstart.messages import TokenOutput
from hotstart.server.api import ApiSettings
from hotstart.server.routes import build_app

MODEL = "smol"
TEXT = "The capital of France is Paris. STOP here, then more text follows."
_CORES: dict = {}


def engine_core(model_dir, max_model_len: int = 256):
    """The EngineCore of the model in MODEL_DIR (built once per test session and context length)."""
    key = (str(model_dir), max_model_len)
    if key not in _CORES:
        from hotstart.engine.core import EngineCore

        cfg = EngineConfig(model_path=str(model_dir), max_model_len=max_model_len, max_num_seqs=8)
        _CORES[key] = EngineCore.build(cfg)
    return _CORES[key]


class ScriptedEngine(InProcessEngineClient):
    """The real in-process client over a real EngineCore, whose sampled tokens the test scripts.

    The sampler's choice is replaced by `script`'s next id, by default the prompt's ids reversed then eos
    (after the script: eos); a constrained row samples under its grammar, eos as soon as that allows it
    (a last sampler transform). Everything else is the engine's own: max_tokens, stop_token_ids, ignore_eos,
    finish reasons, aborts. Failures are injected here: `die_after` tokens then EngineDeadError,
    `error_after` tokens then an "error" output; `delay` seconds before each step. `requests` records
    (prompt ids, params) per request id, `aborted` the whole-request aborts."""

    def __init__(self, core, eos: int, ready: bool = True) -> None:
        super().__init__(core, Timeline(time.time()))
        self.eos = eos
        self.requests: dict = {}
        self.aborted: list[str] = []
        self.script: list[int] | None = None
        self.delay = 0.0
        self.die_after: int | None = None
        self.error_after: int | None = None
        core.sampler.transforms.append(self._eos_when_allowed)
        self._sample = core.sampler.sample
        core.sampler.sample = self._scripted
        self.start_stepping()
        if not ready:
            self.ready, self.status = False, "loading weights"

    def set_ready(self) -> None:
        self.ready, self.status = True, "ready"

    def stop(self, timeout: float = 3.0) -> None:
        super().stop(timeout)
        self.core.sampler.transforms.remove(self._eos_when_allowed)
        del self.core.sampler.sample

    def _eos_when_allowed(self, logits, seqs):
        for i, seq in enumerate(seqs):
            if seq.params.grammar is not None and logits[i, self.eos] > float("-inf"):
                logits[i].fill_(float("-inf"))
                logits[i, self.eos] = 0.0
        return logits

    def _scripted(self, logits, seqs):
        tokens, logprobs = self._sample(logits, seqs)
        for i, seq in enumerate(seqs):
            if seq.params.grammar is None:
                prompt = seq.token_ids[: seq.prompt_len]
                script = self.script if self.script is not None else [*reversed(prompt), self.eos]
                k = seq.num_generated
                tokens[i] = script[k] if k < len(script) else self.eos
        return tokens, logprobs

    def step(self):
        if self.delay:
            time.sleep(self.delay)
        return super().step()

    async def generate(self, request_id, prompt_token_ids, params):
        self.requests[request_id] = (list(prompt_token_ids), params)
        outputs = super().generate(request_id, prompt_token_ids, params)
        n = 0
        try:
            async for out in outputs:
                n += len(out.new_token_ids)
                if self.die_after is not None and n > self.die_after:
                    raise EngineDeadError("engine process exited (code -9)")
                if self.error_after is not None and n > self.error_after:
                    yield TokenOutput(request_id, [], "error", "CUDA error: out of memory")
                    return
                yield out
        finally:
            await outputs.aclose()  # before its end: the engine aborts the request

    async def abort(self, request_id: str, index: int | None = None) -> None:
        if index is None:
            self.aborted.append(request_id)
        await super().abort(request_id, index)


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
