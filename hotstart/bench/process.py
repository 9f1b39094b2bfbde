"""One benchmarked server process: launch in its own process group, wait for /health, ask, stop, verify.

Stdlib HTTP only (http.client): after a cold eviction the harness must not import anything, or it would
read the very files it just evicted and warm them for the server it is timing. Every wait is bounded by
a deadline; stop() kills the whole process group and checks with psutil that nothing of it is left.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hotstart.procs import die_with_parent

POLL_S = 0.02  # /health poll period: the resolution of t_health, cheap on loopback
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL


class RunFailed(Exception):
    """The server exited, never became healthy, or never answered correctly before the deadline."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _group_members(pgid: int, root_pid: int) -> set[int]:
    """Live pids in process group `pgid` plus the descendants of `root_pid` (which may have left the group)."""
    try:
        import psutil  # noqa: PLC0415 - imported before any eviction by the harness (see startup.py)
    except ImportError:
        return set()
    found: set[int] = set()
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                found.add(p.pid)
        except (OSError, psutil.Error):
            continue
    try:
        found.update(c.pid for c in psutil.Process(root_pid).children(recursive=True)
                     if c.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        pass
    return found


def _alive(pids: set[int]) -> set[int]:
    try:
        import psutil  # noqa: PLC0415
    except ImportError:
        return set()
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:  # a zombie is dead, only unreaped
                out.add(pid)
        except psutil.Error:
            continue
    return out


@dataclass
class Server:
    """A launched server command. Times are seconds since launch (perf_counter)."""

    argv: list[str]
    port: int
    proc: subprocess.Popen
    t_launch: float  # perf_counter at launch
    wall_launch: float  # time.time() at launch (to align the server's own timeline)
    stderr_path: Path

    @classmethod
    def launch(cls, argv: list[str], port: int, env: dict[str, str], log_dir: Path, tag: str) -> Server:
        log_dir.mkdir(parents=True, exist_ok=True)
        out, err = log_dir / f"{tag}.stdout", log_dir / f"{tag}.stderr"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            wall, t = time.time(), time.perf_counter()
            try:
                # Own session = own process group, so stop() reaches every process it starts; the
                # death signal covers the harness itself being killed (SIGKILL runs no cleanup).
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, env=env,
                                        start_new_session=True,
                                        preexec_fn=lambda: die_with_parent(signal.SIGTERM))  # noqa: PLW1509 - no threads here
            except OSError as e:
                raise RunFailed(f"cannot start {argv[0]}: {e.strerror or e}") from None
        return cls(argv, port, proc, t, wall, err)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_launch

    def _check_running(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RunFailed(f"exited with code {code} after {self.elapsed():.1f} s")

    def _request(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=max(0.05, timeout))
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_healthy(self, deadline: float) -> float:
        """Poll GET /health until 200; returns seconds since launch."""
        while True:
            self._check_running()
            left = deadline - time.perf_counter()
            if left <= 0:
                raise RunFailed(f"/health not 200 within {deadline - self.t_launch:.0f} s")
            try:
                status, _ = self._request("GET", "/health", None, min(2.0, left))
                if status == 200:
                    return self.elapsed()
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
                    raise RunFailed(f"answer {text!r} does not contain {expect!r}")
                return text, self.elapsed()
            time.sleep(POLL_S)

    def get_json(self, path: str, timeout: float = 5.0) -> dict | None:
        try:
            status, raw = self._request("GET", path, None, timeout)
            return json.loads(raw) if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None

    def stop(self, grace: float = STOP_GRACE_S) -> dict:
        """SIGTERM the group, SIGKILL it after `grace`; then verify nothing of it is left.

        Returns {"stop_s", "killed" (SIGKILL was needed), "leftover" (pids still alive: should be [])}.
        """
        t = time.perf_counter()
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        # Scanned now, not while timing: a process scan every poll would steal CPU from the server.
        members = _group_members(pgid, self.proc.pid)
        killed = False
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        end = time.perf_counter() + grace
        while time.perf_counter() < end:
            if self.proc.poll() is not None and not _alive(members | _group_members(pgid, self.proc.pid)):
                break
            time.sleep(0.02)
        else:
            killed = True
            for pid in _alive(members | _group_members(pgid, self.proc.pid)) | {pgid}:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.05)
        leftover = sorted(_alive(members | _group_members(pgid, self.proc.pid)))
        return {"stop_s": time.perf_counter() - t, "killed": killed, "leftover": leftover, "pgid": pgid,
                "returncode": self.proc.returncode}


def tail(path: Path, lines: int = 12, limit: int = 2000) -> str:
    """The last lines of a log file (for a failed run's report)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])[-limit:]
