"""The forkserver's typed protocol, spoken directly: one forkserver forks several engines, each reports
ready on its own zmq addresses and answers; engines stop per generation; a bad frame or a closed
connection stops everything; messages round-trip through the framing helper."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import zmq

from hotstart.config import EngineConfig
from hotstart.framing import FrameError, FrameReader, frame, send
from hotstart.messages import (
    EngineAddresses,
    EngineExited,
    EngineReady,
    EngineRequest,
    EngineSpawned,
    FromForkserver,
    SamplingParams,
    ServerInfo,
    Span,
    SpawnEngine,
    StepOutputs,
    StopEngine,
    ToForkserver,
    encoder,
    from_engine_decoder,
)
from hotstart.model.files import weight_files
from hotstart.procs import alive


def test_frames_round_trip_and_split_anywhere():
    cfg = EngineConfig(model_path="/m", weight_files=("/m/a.safetensors",), max_model_len=64)
    msgs = [SpawnEngine(3, cfg, EngineAddresses("ipc://a", "ipc://b"), world_size=2), StopEngine(3)]
    data = b"".join(frame(m) for m in msgs)
    reader = FrameReader(ToForkserver)
    got = []
    for i in range(len(data)):  # one byte at a time: frames reassemble across any split
        got += reader.feed(data[i:i + 1])
    assert got == msgs and got[0].config == cfg
    with pytest.raises(FrameError):
        FrameReader(ToForkserver).feed(b"\xff\xff\xff\xff")
    with pytest.raises(FrameError):
        FrameReader(ToForkserver).feed(b"\x00\x00\x00\x02\xc1\xc1")


def test_a_send_to_a_peer_that_stopped_reading_gives_up_in_time():
    """A frozen forkserver (or client) reads nothing: once its buffer is full, a bounded send raises
    within its timeout instead of blocking forever, and leaves the socket's mode as it was."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    msg = StopEngine(1)
    sent, t = 0, time.monotonic()
    with pytest.raises(TimeoutError):
        while True:  # the peer never reads
            t = time.monotonic()
            send(ours, msg, 0.2)
            sent += 1
    assert sent > 10 and 0.15 < time.monotonic() - t < 2, (sent, time.monotonic() - t)
    assert ours.gettimeout() == 0.0
    ours.close()
    theirs.close()


class Forkserver:
    """`python -m hotstart.forkserver FD` over a socketpair, read with the framing helper."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "hotstart.forkserver", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.sock.settimeout(60)
        self.reader = FrameReader(FromForkserver)
        self.pending: list = []

    def next(self, kind, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            for i, msg in enumerate(self.pending):
                if isinstance(msg, kind):
                    return self.pending.pop(i)
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(1 << 16)
            assert chunk, "the forkserver closed the connection"
            self.pending += self.reader.feed(chunk)


def _engine_sockets(ctx: zmq.Context, addresses: EngineAddresses):
    push = ctx.socket(zmq.PUSH)
    push.bind(addresses.requests)
    pull = ctx.socket(zmq.PULL)
    pull.bind(addresses.outputs)
    return push, pull


def _until(pull, kind, timeout: float = 60.0):
    pull.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    seen = []
    while True:
        msg = from_engine_decoder.decode(pull.recv())
        if isinstance(msg, kind):
            return msg, seen
        seen.append(msg)


def test_one_forkserver_forks_two_engines_that_both_serve(tiny_checkpoint):
    model = tiny_checkpoint("qwen2")
    cfg = EngineConfig(model_path=str(model), weight_files=tuple(map(str, weight_files(model))), device="cpu",
                       dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    ipc = tempfile.mkdtemp(prefix="hotstart-test-ipc-")
    ctx = zmq.Context()
    fs = Forkserver()
    engines = {}
    try:
        info = fs.next(ServerInfo)
        assert info.pid == fs.proc.pid and info.torch_version and info.python == sys.executable
        assert info.preload.end > info.preload.start
        for gen in (1, 2):
            addresses = EngineAddresses(f"ipc://{ipc}/in-{gen}", f"ipc://{ipc}/out-{gen}")
            engines[gen] = _engine_sockets(ctx, addresses)
            send(fs.sock, SpawnEngine(gen, cfg, addresses))
        spawned = {ev.generation: ev for ev in (fs.next(EngineSpawned), fs.next(EngineSpawned))}
        assert set(spawned) == {1, 2} and spawned[1].pid != spawned[2].pid
        assert {ev.rank for ev in spawned.values()} == {0}
        assert all(psutil.Process(ev.pid).ppid() == fs.proc.pid for ev in spawned.values())
        answers = {}
        for gen, (push, pull) in engines.items():
            ready, phases = _until(pull, EngineReady)
            assert ready.pid == spawned[gen].pid
            assert [p.name for p in phases if isinstance(p, Span)][-1] == "KV cache allocated"
            push.send(
                encoder.encode(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0)))
            )
            tokens = []
            while True:
                out, _ = _until(pull, StepOutputs)
                tokens += out.outputs[0].new_token_ids
                if out.outputs[0].finish_reason:
                    break
            answers[gen] = tokens
        assert answers[1] == answers[2] and len(answers[1]) == 4  # same model, greedy: same tokens

        send(fs.sock, StopEngine(1))  # one generation goes; the other keeps running
        exited = fs.next(EngineExited)
        assert (exited.generation, exited.pid) == (1, spawned[1].pid)
        assert not alive(spawned[1].pid)
        assert psutil.pid_exists(spawned[2].pid)

        fs.sock.close()  # the API process goes away: the forkserver stops its engines and exits
        assert fs.proc.wait(10) == 0
        _, left = psutil.wait_procs(
            [psutil.Process(spawned[2].pid)] if psutil.pid_exists(spawned[2].pid) else [], timeout=5
        )
        assert not left
    finally:
        if fs.proc.poll() is None:
            fs.proc.kill()
            fs.proc.wait()
        for push, pull in engines.values():
            push.close(0)
            pull.close(0)
        ctx.term()


def test_a_bad_frame_drops_the_client_and_the_server_exits():
    fs = Forkserver()
    try:
        fs.next(ServerInfo)
        fs.sock.sendall(b"\x00\x00\x00\x03abc")  # a frame whose body is not a message
        assert fs.proc.wait(10) == 0
    finally:
        if fs.proc.poll() is None:
            fs.proc.kill()
            fs.proc.wait()
