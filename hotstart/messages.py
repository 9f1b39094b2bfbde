"""Typed messages between hotstart's processes (msgpack via msgspec; torch-free).

Two conversations:
  API process <-> engine (zmq PUSH/PULL over ipc):  ToEngine / FromEngine
  API process <-> forkserver or zygote (a stream socket, framed by hotstart.framing):  ToForkserver /
    FromForkserver
Times are time.time() seconds everywhere; a span always has `start` and `end`.
"""

from __future__ import annotations

import enum

import msgspec

from hotstart.config import EngineConfig
from hotstart.sampling_params import SamplingParams


class Span(msgspec.Struct, tag="span"):
    """One startup phase (start < end) or instant mark (start == end) of one process: the startup
    timeline's entry, also sent by the engine as its phases happen."""

    name: str
    start: float
    end: float
    process: str = "api"
    detail: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


# ---- API process <-> engine ---------------------------------------------------------------------

class EngineRequest(msgspec.Struct, tag="req"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    index: int | None = None  # only this choice of each (ended by a stop string): nothing is reported


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Raw model logprobs (log-softmax of the logits, before temperature and penalties) at one position:
    the chosen token's and the top ones' (descending)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class TokenOutput(msgspec.Struct):
    request_id: str
    new_token_ids: list[int]
    # None while running; "stop" (eos / stop token), "length" (max_tokens or max_model_len),
    # "abort" (aborted by the client), "error" (the engine could not run it; see error)
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0  # the choice (0..n-1); "error" and "abort" outputs end every choice of the request
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when params.logprobs is set
    # prompt tokens 1..P-1 (the first has none), once, with choice 0's first output (params.prompt_logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None


class EngineStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    # engine totals since it started (tokens): prompt tokens looked up in the prefix cache / found there,
    # and prompt tokens actually computed (prefill work; n > 1 prefills once)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_computed: int = 0
    # speculative decoding (engine totals): drafts verified, their tokens, and of those the accepted ones
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # the prefix cache on disk (engine/kv_store.py): blocks of this model's layout there, blocks read back
    # into the cache and written since the engine started
    prefix_disk_blocks: int = 0
    prefix_disk_restored: int = 0
    prefix_disk_written: int = 0


class StepOutputs(msgspec.Struct, tag="out"):
    outputs: list[TokenOutput]
    stats: EngineStats


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


class FastPathState(enum.StrEnum):
    """Where a stage of the fast path (packing, compile) or one token bucket stands. The engine moves
    them only along engine/fastpath/state.py transition(); the API process reads the values as they are
    (metric labels, /startup), never parses them."""

    PLANNED = "planned"  # will be built, not started yet
    PACKING = "packing"  # oneDNN prepacking of the linear weights under way (a stage)
    PACKED = "packed"  # the prepacked weights serve (a stage; final)
    COMPILING = "compiling"  # the compile worker is building the layer graphs (a stage, or a queued bucket)
    READY = "ready"  # compiled and loaded (a bucket), every bucket settled (the compile stage); final
    FAILED = "failed"  # final; the detail says why; serving goes on eagerly
    OFF = "off"  # not built here; the detail says why; final


class BucketState(msgspec.Struct, array_like=True):
    """One token bucket of the layer graphs: [tokens, state, steps, detail] in /startup."""

    tokens: int  # steps of up to this many tokens can run on it
    state: FastPathState  # PLANNED -> COMPILING -> READY | FAILED
    steps: int = 0  # steps it ran
    detail: str = ""  # FAILED: why; READY: "compiled" or "from the compile cache"


class FastPathStatus(msgspec.Struct, tag="fastpath"):
    """What is built behind READY to serve faster (engine/fastpath/); sent when it changes."""

    mode: str  # the --compile setting: auto | eager-only | graphs | off
    packing: FastPathState  # PLANNED -> PACKING -> PACKED | FAILED, or OFF
    compile: FastPathState  # PLANNED -> COMPILING -> READY | FAILED, or OFF
    packing_detail: str = ""  # OFF / FAILED: why; PACKED: the size of the prepacked copies
    compile_detail: str = ""  # OFF / FAILED: why
    buckets: list[BucketState] = []
    eager_steps: int = 0  # steps that ran the eager forward

    def settled(self) -> bool:
        """Nothing more will be built (bench and tests wait for this)."""
        final = (FastPathState.PACKED, FastPathState.READY, FastPathState.FAILED, FastPathState.OFF)
        return self.packing in final and self.compile in final


ToEngine = EngineRequest | AbortRequest | Shutdown
FromEngine = StepOutputs | Span | EngineReady | EngineFailed | FastPathStatus


# ---- API process <-> forkserver -----------------------------------------------------------------

class EngineAddresses(msgspec.Struct, frozen=True):
    """zmq addresses of one engine generation: requests in, outputs out (private ipc paths)."""

    requests: str
    outputs: str


class SpawnEngine(msgspec.Struct, tag="spawn"):
    """Fork one engine: WORLD_SIZE rank processes (tensor parallel); rank 0 talks to the API process
    at ADDRESSES. A generation number is never reused, so nothing of a dead engine reaches its
    replacement."""

    generation: int
    config: EngineConfig
    addresses: EngineAddresses
    world_size: int = 1


class StopEngine(msgspec.Struct, tag="stop-engine"):
    """Terminate every rank of GENERATION (SIGTERM, SIGKILL after a grace period)."""

    generation: int


class StopServer(msgspec.Struct, tag="stop"):
    """Stop the forkserver: it terminates its engines and exits."""


class ServerInfo(msgspec.Struct, tag="info"):
    """The forkserver's first message: its preload (torch + engine imported) is done."""

    pid: int
    preload: Span
    hotstart_version: str
    python: str  # sys.executable
    torch_version: str
    # Filled by a zygote (hotstart.forkserver.zygote); what a client compares before using it.
    uid: int = -1
    started: float = 0.0  # time.time() when the zygote started
    hotstart_path: str = ""  # the hotstart package folder it imported
    torch_path: str = ""  # the torch package folder it imported
    import_env: dict[str, str] = {}  # environment variables read at import time (runtime.IMPORT_ENV)
    stale: str = ""  # non-empty: its hotstart or torch files changed on disk since it imported them (which)


class EngineSpawned(msgspec.Struct, tag="spawned"):
    generation: int
    rank: int
    pid: int
    fork: Span  # the fork itself, as seen by the forkserver


class EngineExited(msgspec.Struct, tag="exited"):
    generation: int
    rank: int
    pid: int
    code: int  # < 0: killed by signal -code; RANK_LEFT: it left because another rank of its group exited


RANK_LEFT = 3  # exit code of a tensor-parallel rank that followed another rank of its group out


class ForkserverExited(msgspec.Struct, tag="server-exited"):
    """Made by the client, never sent: the forkserver's socket closed (it died or was killed)."""

    code: int | None = None


# ---- API process / `hotstart zygote` <-> zygote (the same framing, over its Unix socket) ----------

class EngineContext(msgspec.Struct, tag="context"):
    """A zygote client's second message (after ServerInfo arrived), sent with three descriptors
    (SCM_RIGHTS): a lifeline (the read end of a pipe whose write end only the API process holds),
    stdout and stderr. The engines of this connection run with ENV in CWD, write to those streams and
    exit when the lifeline reads EOF, i.e. when the API process is gone, whatever the zygote does."""

    env: dict[str, str]
    cwd: str


class SpawnRefused(msgspec.Struct, tag="spawn-refused"):
    """The zygote did not fork GENERATION (its config failed validation, or no EngineContext came first)."""

    generation: int
    reason: str


class ZygoteQuery(msgspec.Struct, tag="zygote-query"):
    """`hotstart zygote status|stop`: answered with ZygoteStatus; STOP: then stop every engine and exit."""

    stop: bool = False


class KeptModel(msgspec.Struct):
    """A model whose weight files (and sidecars) `zygote start --keep` maps and locks in memory."""

    path: str
    files: int
    bytes_total: int
    bytes_resident: int  # in the page cache now (mincore)
    bytes_locked: int  # mlock'ed by the zygote
    note: str = ""  # why not (all) locked


class ZygoteStatus(msgspec.Struct, tag="zygote-status"):
    pid: int
    started: float
    rss_bytes: int
    rss_anon_bytes: int
    rss_file_bytes: int
    cpu_seconds: float  # the zygote's own user + system time
    clients: int  # API processes connected (the querying connection not counted)
    engines: int
    kept: list[KeptModel] = []
    stale: str = ""


ToForkserver = SpawnEngine | StopEngine | StopServer | EngineContext | ZygoteQuery
FromForkserver = ServerInfo | EngineSpawned | EngineExited | SpawnRefused | ZygoteStatus

encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
