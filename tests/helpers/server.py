"""A real `hotstart serve` subprocess for the end-to-end tests, and clients of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from helpers import REPO


def deploy_metric_names() -> set[str]:
    """The Prometheus series names (vllm:*, hotstart_*) that deploy/'s files use."""
    import re

    metric = re.compile(r"\b(vllm:[a-z_:]+|hotstart_[a-z_]+)")
    return {n for f in (REPO / "deploy").rglob("*") if f.is_file() for n in metric.findall(f.read_text())}


class Server:
    """A real `hotstart serve` subprocess on a free port; stop() checks that nothing is left behind.

    A thin wrapper of hotstart.bench.process.Server (own session, output pumped into `lines`, URL read
    from it), with the interface the tests use: url, lines, output, descendants(), stop(), kill()."""

    def __init__(
        self, *args: str, env: dict | None = None, ready_timeout: float = 120.0, wait_ready: bool = True,
        prefix: tuple[str, ...] = (),
    ):
        from hotstart.bench.process import RunFailed
        from hotstart.bench.process import Server as Launched

        # No death signal: it is set between fork and exec, unsafe while other servers' readers run.
        # PREFIX: a command that execs the rest (e.g. one that first joins a cgroup: helpers/cgroup.py)
        argv = [*prefix, sys.executable, "-m", "hotstart", "serve", "--port", "0", *args]
        self._srv = Launched.launch(argv, env={**os.environ, **(env or {})}, tag="hotstart serve",
                                    pdeathsig=False)
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
    """One streaming chat request (BODY) to URL in a thread; `lines` as they come (`times`: the
    perf_counter of each), `started` set after 3, `ended` the perf_counter of its last line, `error` what
    failed; `halt.set()` makes it hang up (the server aborts the request)."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.lines, self.ended, self.error = url, body, [], 0.0, None
        self.times: list[float] = []
        self.started, self.halt = threading.Event(), threading.Event()

    def run(self) -> None:
        import httpx

        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.times.append(time.perf_counter())
                    if len(self.lines) >= 3:
                        self.started.set()
                    if self.halt.is_set():
                        break
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
