"""Typed messages between the API process and the engine process (msgpack via msgspec; torch-free)."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class EngineRequest(msgspec.Struct, tag="req"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class TokenOutput(msgspec.Struct):
    request_id: str
    new_token_ids: list[int]
    # None while running; "stop" (eos / stop token), "length" (max_tokens or max_model_len),
    # "abort" (aborted by the client), "error" (the engine could not run it; see error)
    finish_reason: str | None = None
    error: str | None = None


class EngineStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0


class StepOutputs(msgspec.Struct, tag="out"):
    outputs: list[TokenOutput]
    stats: EngineStats


class Phase(msgspec.Struct, tag="phase"):
    """A startup phase of the engine process; times are time.time() seconds."""

    name: str
    start: float
    end: float
    process: str = "engine"
    detail: str = ""


class EngineReady(msgspec.Struct, tag="ready"):
    pid: int
    device: str
    dtype: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int


class EngineFailed(msgspec.Struct, tag="failed"):
    """Fatal engine error (bad weights, out of memory, ...): a one-line message for the user."""

    message: str


ToEngine = EngineRequest | AbortRequest | Shutdown
FromEngine = StepOutputs | Phase | EngineReady | EngineFailed

encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
