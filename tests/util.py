"""Helpers shared by tests (importable as `util`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def no_torch_in(module: str) -> tuple[bool, str]:
    """Import MODULE in a fresh interpreter; report whether torch/transformers got imported."""
    code = (f"import {module}, sys, json; "
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    heavy = json.loads(out.stdout.strip().splitlines()[-1])
    return not heavy, ",".join(heavy)


def deploy_metric_names() -> set[str]:
    """The Prometheus series names (vllm:*, hotstart_*) that deploy/'s files use."""
    import re

    metric = re.compile(r"\b(vllm:[a-z_:]+|hotstart_[a-z_]+)")
    return {n for f in (REPO / "deploy").rglob("*") if f.is_file() for n in metric.findall(f.read_text())}


def tagged(tag: str) -> list:
    """Live processes whose environment carries HOTSTART_TEST_TAG=TAG (inherited by every descendant,
    so leftovers are found even after they were re-parented)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("HOTSTART_TEST_TAG") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


class Server:
    """A real `hotstart serve` subprocess on a free port; stop() checks that nothing is left behind.

    A thin wrapper of hotstart.bench.process.Server (own session, output pumped into `lines`, URL read
    from it), with the interface the tests use: url, lines, output, descendants(), stop(), kill()."""

    def __init__(
        self, *args: str, env: dict | None = None, ready_timeout: float = 120.0, wait_ready: bool = True
    ):
        from hotstart.bench.process import RunFailed
        from hotstart.bench.process import Server as Launched

        # No death signal: it is set between fork and exec, unsafe while other servers' readers run.
        self._srv = Launched.launch([sys.executable, "-m", "hotstart", "serve", "--port", "0", *args],
                                    env={**os.environ, **(env or {})}, tag="hotstart serve", pdeathsig=False)
        deadline = self._srv.t_launch + ready_timeout
        try:
            self._srv.wait_url(deadline)
            if wait_ready:
                self._srv.wait_healthy(deadline)
        except RunFailed as e:
            self.kill()
            raise RuntimeError(f"server did not start: {e}\n{self.output}") from None

    @property
    def proc(self) -> subprocess.Popen:
        return self._srv.proc

    @property
    def url(self) -> str:
        return self._srv.url

    @property
    def lines(self) -> list[str]:
        return self._srv.lines

    @property
    def output(self) -> str:
        return self._srv.output

    def descendants(self) -> list[int]:
        return self._srv.descendants()

    def stop(self, sig: int = 15, timeout: float = 10.0) -> float:
        """Send SIG to the server alone; return seconds until it and all its processes are gone (it
        must end them itself within TIMEOUT; whatever is left then is killed and fails the test)."""
        r = self._srv.stop(timeout, group=False, sig=sig)
        assert not r["killed"] and not r["leftover"], (
            f"still alive {timeout} s after signal {sig}: {r['stragglers'] or [self.proc.pid]} "
            f"(exit code {r['returncode']})\n{self.output[-3000:]}")
        return r["stop_s"]

    def kill(self) -> None:
        self._srv.kill()


def serving(*args: str, **kwargs):
    """For a fixture: `yield from serving(ARGS...)` yields a started Server, then stops it (checking that
    nothing is left) unless a test already ended it."""
    s = Server(*args, **kwargs)
    yield s
    if s.proc.poll() is None:
        s.stop()


class Stream(threading.Thread):
    """One streaming chat request (BODY) to URL in a thread; `lines` as they come, `started` set after 3,
    `ended` the perf_counter of its last line, `error` what failed."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.lines, self.ended, self.error = url, body, [], 0.0, None
        self.started = threading.Event()

    def run(self) -> None:
        import httpx

        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                    if len(self.lines) >= 3:
                        self.started.set()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = repr(e)
        self.ended = time.perf_counter()
        self.started.set()

    def events(self) -> list[dict]:
        """The JSON events before `data: [DONE]`."""
        return [json.loads(x[6:]) for x in self.lines[:-1]]


def openai_client(server: Server, timeout: float = 120):
    """The openai client on SERVER, no retries (a failure must show, not be retried away)."""
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


@contextlib.contextmanager
def disk_backed_dir(tmp_path_factory, name: str):
    """A disk-backed directory to evict files from: pytest's tmp if it is not tmpfs, else one under
    /var/tmp (skips the test if that is memory too); removed afterwards."""
    import pytest

    from hotstart.boot import storage

    d = tmp_path_factory.mktemp(name)
    if storage.detect(d).kind == "memory":
        d = Path(tempfile.mkdtemp(prefix="hotstart-test-", dir="/var/tmp"))
        if storage.detect(d).kind == "memory":
            pytest.skip("no disk-backed directory to evict from")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_session(cmd: list[str], timeout: float, env: dict | None = None, merge_stderr: bool = False,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run CMD in its own session; past TIMEOUT the whole group is killed (nothing outlives a test) and
    TimeoutExpired is raised."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "" if merge_stderr else err)


def greedy_batch(core, logits: list | None = None, max_tokens: tuple[int, ...] = (24, 24, 24, 24),
                 ignore_eos: bool = False) -> dict[str, list[int]]:
    """Greedy requests of different prompt lengths (one per MAX_TOKENS entry, that many tokens each,
    fewer if one samples EOS unless IGNORE_EOS), batched on the EngineCore CORE until done: prefills,
    then decodes of as many sequences as are left. LOGITS, if given, gets the logits of every step (for
    tolerance checks). -> tokens per request index."""
    from hotstart.messages import EngineRequest
    from hotstart.sampling_params import SamplingParams

    tag = time.monotonic_ns()
    for i, n in enumerate(max_tokens):
        core.add_request(EngineRequest(f"{i}-{tag}", list(range(3, 11 + 3 * i)),
                                       SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)))
    out: dict[str, list[int]] = {}
    runner_forward = core.runner.forward

    def keep(batch, want, *rest):
        x = runner_forward(batch, want, *rest)
        if logits is not None and x is not None:
            logits.append(x.clone())
        return x

    core.runner.forward = keep
    try:
        while core.has_work():
            for o in core.step():
                out.setdefault(o.request_id.split("-")[0], []).extend(o.new_token_ids)
    finally:
        core.runner.forward = runner_forward
    return out
