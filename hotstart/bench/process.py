"""A launched server process: its own session, /health, one greedy answer, stop and verify.

The one launcher of the startup benchmark (`hotstart bench startup`), the serving benchmarks
(`hotstart bench serve|load|over-time|prefix-cache`) and the end-to-end tests (tests/helpers/server.py).
Output goes to log files (nothing read while the server runs) or to a pipe that a thread reads into `lines`,
where a `--port 0` server's URL is found. Stdlib only (http.client, /proc): after a cold eviction the
harness must not import anything, or it would read the very files it just evicted and warm them for the
server it is timing. Every wait is bounded by a deadline; stop() ends the whole process group and checks
(hotstart/procs.py) that nothing of it is left.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from hotstart.bench.procgroup import group_members as _group_members
from hotstart.bench.procgroup import kill as _kill
from hotstart.procs import alive, descendants, die_with_parent, terminate_then_kill

POLL_S = 0.02  # /health poll period: the resolution of t_health, cheap on loopback
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL
URL_RE = re.compile(r"on (http://[\w.\[\]:-]+:\d+)")  # "serving MODEL on http://127.0.0.1:PORT"


class RunFailed(Exception):
    """The server exited, never became healthy, or never answered correctly before the deadline.
    `answer`: the text it gave, when that was the failure (a wrong answer)."""

    def __init__(self, message: str, answer: str | None = None):
        super().__init__(message)
        self.answer = answer


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Server:
    """A launched server command. Times are seconds since launch (perf_counter)."""

    def __init__(self, argv: list[str], proc: subprocess.Popen, t_launch: float, wall_launch: float,
                 url: str | None = None, stdout_path: Path | None = None, stderr_path: Path | None = None):
        self.argv, self.proc = argv, proc
        self.t_launch = t_launch  # perf_counter at launch
        self.wall_launch = wall_launch  # time.time() at launch (to align the server's own timeline)
        self.url = url  # None until wait_url() has read it from the output
        self.stdout_path, self.stderr_path = stdout_path, stderr_path
        self.lines: list[str] = []  # the output so far, when it goes to a pipe
        self.t_health: float | None = None  # set by wait_healthy()
        self.health_path = "/health"  # "/v1/models" for a server without /health (llama.cpp's: 404)
        self._pump: threading.Thread | None = None

    @classmethod
    def launch(cls, argv: list[str], port: int | None = None, env: dict[str, str] | None = None,
               log_dir: Path | None = None, tag: str = "server", *, url: str | None = None,
               pdeathsig: bool = True) -> Server:
        """Start ARGV in its own session with ENV (None: this process's).

        The server's URL: `url`, else http://127.0.0.1:PORT, else read from its output (wait_url).
        With `log_dir`, stdout and stderr go to log_dir/TAG.stdout and .stderr; without, both go to
        a pipe read into `lines` by a thread. `pdeathsig`: the server gets SIGTERM if this process
        dies (set in the child before exec; leave it off where other threads may hold locks).
        """
        if url is None and port is not None:
            url = f"http://127.0.0.1:{port}"
        # Own session = own process group, so stop() reaches every process it starts; the death
        # signal covers the launcher itself being killed (SIGKILL runs no cleanup).
        pre = (lambda: die_with_parent(signal.SIGTERM)) if pdeathsig else None
        try:
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                out, err = log_dir / f"{tag}.stdout", log_dir / f"{tag}.stderr"
                with open(out, "wb") as fo, open(err, "wb") as fe:
                    wall, t = time.time(), time.perf_counter()
                    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, env=env,
                                            start_new_session=True, preexec_fn=pre)  # noqa: PLW1509
                return cls(argv, proc, t, wall, url, out, err)
            wall, t = time.time(), time.perf_counter()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,  # noqa: PLW1509
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=pre,
                                    encoding="utf-8", errors="replace")
        except OSError as e:
            raise RunFailed(f"cannot start {argv[0]}: {e.strerror or e}") from None
        server = cls(argv, proc, t, wall, url)
        server._pump = threading.Thread(target=server._read_output, name=f"{tag} output", daemon=True)
        server._pump.start()
        return server

    def _read_output(self) -> None:
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        """Everything the server printed so far (both streams)."""
        if self.stdout_path is None:
            return "".join(self.lines)
        text = []
        for path in (self.stdout_path, self.stderr_path):
            try:
                text.append(path.read_text(errors="replace"))
            except OSError:
                pass
        return "".join(text)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_launch

    def descendants(self) -> list[int]:
        return descendants(self.proc.pid)

    def _check_running(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RunFailed(f"exited with code {code} after {self.elapsed():.1f} s")

    def wait_url(self, deadline: float) -> str:
        """The URL the server printed ("... on http://HOST:PORT"), waited for until `deadline`."""
        while self.url is None:
            m = URL_RE.search(self.output)
            if m:
                self.url = m.group(1)
                break
            self._check_running()
            if time.perf_counter() >= deadline:
                raise RunFailed(f"printed no URL within {deadline - self.t_launch:.0f} s")
            time.sleep(POLL_S)
        return self.url

    def _request(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        where = urlsplit(self.url)
        host = "127.0.0.1" if where.hostname in (None, "", "0.0.0.0") else where.hostname
        conn = http.client.HTTPConnection(host, where.port, timeout=max(0.05, timeout))
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_healthy(self, deadline: float) -> float:
        """Poll GET /health until 200 (GET /v1/models instead once /health answers 404, as llama.cpp's
        server does); returns (and keeps in t_health) seconds since launch."""
        self.wait_url(deadline)
        while True:
            self._check_running()
            left = deadline - time.perf_counter()
            if left <= 0:
                raise RunFailed(f"{self.health_path} not 200 within {deadline - self.t_launch:.0f} s")
            try:
                status, _ = self._request("GET", self.health_path, None, min(2.0, left))
                if status == 200:
                    self.t_health = self.elapsed()
                    return self.t_health
                if status == 404 and self.health_path == "/health":
                    self.health_path = "/v1/models"
                    continue
            except (OSError, http.client.HTTPException):
                pass  # not listening yet, or mid-startup
            time.sleep(POLL_S)

    def ask(self, prompt: str, max_tokens: int, expect: str | None, deadline: float) -> tuple[str, float]:
        """POST a greedy chat completion until it returns non-empty text; (text, seconds since launch).

        Errors and empty answers are retried until the deadline; a non-empty answer that does not
        contain `expect` fails at once (greedy decoding would only repeat it).
        """
        model, last = None, "no answer"
        while True:
            self._check_running()
            left = deadline - time.perf_counter()
            if left <= 0:
                raise RunFailed(f"no completion within {deadline - self.t_launch:.0f} s ({last})")
            try:
                if model is None:  # the name this server wants in "model" (hub id, path, alias...)
                    status, raw = self._request("GET", "/v1/models", None, left)
                    model = json.loads(raw)["data"][0]["id"] if status == 200 else None
                    if model is None:
                        last = f"/v1/models: HTTP {status}"
                        time.sleep(POLL_S)
                        continue
                body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                        "temperature": 0, "max_tokens": max_tokens}
                status, raw = self._request("POST", "/v1/chat/completions", body, left)
                text = json.loads(raw)["choices"][0]["message"]["content"] if status == 200 else None
                last = f"HTTP {status}: {raw[:120]!r}" if status != 200 else "empty answer"
            except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError) as e:
                text, last = None, f"{type(e).__name__}: {e}"
            if isinstance(text, str) and text:
                if expect is not None and expect not in text:
                    raise RunFailed(f"answer {text!r} does not contain {expect!r}", answer=text)
                return text, self.elapsed()
            time.sleep(POLL_S)

    def get_json(self, path: str, timeout: float = 5.0) -> dict | None:
        try:
            status, raw = self._request("GET", path, None, timeout)
            return json.loads(raw) if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None

    def stop(self, grace: float = STOP_GRACE_S, *, group: bool = True, sig: int = signal.SIGTERM) -> dict:
        """Signal the server (its whole process group with `group`, else the leader only, which must
        then end the rest itself), SIGKILL what is left after `grace`, then verify nothing of it is.

        `sig` other than SIGTERM is sent first and gets the grace alone; SIGTERM follows if needed.
        Returns {"stop_s" (until all were gone, or SIGKILL), "killed" (SIGKILL was needed),
        "stragglers" (pids alive when the grace ran out), "leftover" (pids alive at the end: should
        be []), "pgid", "returncode"}.
        """
        t = time.perf_counter()
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        # One full scan now, not while waiting: a process scan every poll would steal CPU from the
        # processes shutting down. Members that appear later are found by the final scan.
        members = _group_members(pgid, self.proc.pid) - {self.proc.pid}

        def others_alive() -> bool:
            return any(alive(p) for p in members)

        if sig != signal.SIGTERM:
            try:
                if group:
                    os.killpg(pgid, sig)
                else:
                    self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
            end = time.perf_counter() + grace
            while (self.proc.poll() is None or others_alive()) and time.perf_counter() < end:
                time.sleep(POLL_S)
            grace = end - time.perf_counter()
        gone = self.proc.poll() is not None and not others_alive()
        killed = not gone and terminate_then_kill([self.proc], max(0.0, grace), group=group,
                                                  others_alive=others_alive)
        stop_s = time.perf_counter() - t
        stragglers = sorted(p for p in members | _group_members(pgid, self.proc.pid) if alive(p))
        if stragglers:  # what terminate_then_kill did not reach: members outside the group, or
            _kill(set(stragglers), pgid)  # the rest of the group when only the leader was signalled
            killed = True
            time.sleep(0.05)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self._pump is not None:
            self._pump.join(timeout=2)  # the output is complete once every writer is gone
        leftover = sorted(p for p in members | _group_members(pgid, self.proc.pid) if alive(p))
        return {"stop_s": stop_s, "killed": killed, "stragglers": stragglers, "leftover": leftover,
                "pgid": pgid, "returncode": self.proc.returncode}

    def kill(self) -> None:
        """SIGKILL the whole process group at once (no verification)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self._pump is not None:
            self._pump.join(timeout=2)


def tail(path: Path, lines: int = 12, limit: int = 2000) -> str:
    """The last lines of a log file (for a failed run's report)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])[-limit:]
