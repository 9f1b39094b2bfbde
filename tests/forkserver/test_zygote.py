"""The zygote: real zygote processes in private runtime folders (HOTSTART_RUNTIME_DIR), real servers,
the default model. Engines forked from it answer exactly as a local forkserver's do, die with the API
process that asked for them (SIGTERM or SIGKILL) and not with the zygote's other work; a zygote of
another version (a copy of the package upgraded in place under it) is ignored; a zygote killed
mid-start is replaced by a local forkserver; `zygote stop` leaves no process and no socket. The trust
checks (folder owner and mode, SO_PEERCRED, identity), the staleness check and the RAM guard / mlock
fallback of --keep are tested directly."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
from helpers.server import Server

from hotstart.forkserver import keep as keeping
from hotstart.forkserver.control import query
from hotstart.forkserver.runtime import (
    Identity,
    Paths,
    check_private_dir,
    connect,
    mismatch,
    paths,
    peer_problem,
    probe,
)
from hotstart.messages import ServerInfo, Span
from hotstart.procs import alive

REPO = Path(__file__).resolve().parents[2]
# The fast path's compile worker behind READY is another engineer's subject: off, so these servers do
# only what the zygote changes (and on two cores a compile beside them would slow every request).
ARGS = ("--max-model-len", "512", "--compile", "off")
QUESTION = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]}




@pytest.fixture(autouse=True)
def patient_probe(monkeypatch):
    """A loaded test machine may not schedule the zygote within serve's default 100 ms: wait longer."""
    monkeypatch.setenv("HOTSTART_ZYGOTE_ANSWER_MS", "3000")


def _zygote(rundir: str, *args: str, env: dict | None = None, cwd: str | None = None, watch: bool = False,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """`hotstart zygote ARGS`. A zygote started here watches its files only with WATCH: the source tree may
    be edited while the suite runs, and one watching it would (rightly) turn stale and restart mid-test
    (watching is tested on a copy of the package: test_an_edit_restarts_the_zygote)."""
    if args[0] == "start" and not watch:
        args = (*args, "--no-watch")
    env = {**os.environ, "HOTSTART_RUNTIME_DIR": rundir, **(env or {})}
    return subprocess.run([sys.executable, "-m", "hotstart", "zygote", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd, check=False)


def _package_copy(tmp_path: Path) -> Path:
    """A copy of the hotstart package, to edit: run with PYTHONPATH and the working folder at the returned
    root, its processes import the copy (and their zygote is the copy's: runtime.paths() keys it)."""
    root = tmp_path / "src"
    shutil.copytree(REPO / "hotstart", root / "hotstart", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture
def rundir():
    """A private runtime folder; whatever zygote is left in it (of any interpreter or checkout: a
    failed test's) is stopped afterwards."""
    d = tempfile.mkdtemp(prefix="hz-")  # short: a Unix socket path has at most 107 bytes
    yield d
    for name in os.listdir(d):
        if name.endswith(".sock"):
            base = os.path.join(d, name.removesuffix(".sock"))
            info, _ = query(Paths(d, base + ".sock", base + ".lock", base + ".log"), stop=True)
            if info is not None and not _wait_gone(info.pid):
                os.kill(info.pid, 9)
    shutil.rmtree(d, ignore_errors=True)


def _info(rundir: str) -> ServerInfo | None:
    sock, info, _ = connect(paths(rundir).sock, 2.0)
    if sock is not None:
        sock.close()
    return info


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def _answer(url: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", json=QUESTION, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _forkservers(s: Server) -> list[psutil.Process]:
    return [p for p in psutil.Process(s.proc.pid).children() if "forkserver" in " ".join(p.cmdline())]


def _ready_line(s: Server) -> str:
    return next((line.strip() for line in s.lines if "ready in" in line), "?")


def test_zygote_serves_the_same_answers_and_leaves_nothing(default_model_dir, rundir, tmp_path):
    out = _zygote(rundir, "start", "--keep", str(default_model_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"started, pid \d+", out.stdout) and "locked" in out.stdout, out.stdout
    zygote = psutil.Process(_info(rundir).pid)
    status = _zygote(rundir, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    for needle in (f"running, pid {zygote.pid}", "cpu ", "rss ", "0 engine(s)", f"kept {default_model_dir}",
                   "resident (100%)"):
        assert needle in status.stdout, (needle, status.stdout)
    env = {"HOTSTART_RUNTIME_DIR": rundir}

    audit = tmp_path / "audit.json"
    s = Server(*ARGS, env={**env, "HOTSTART_AUDIT_IMPORTS": str(audit)})
    engines = zygote.children()
    try:
        assert "zygote used" in s.output and not _forkservers(s), s.output
        assert len(engines) == 1 and not s.descendants()  # the engine is the zygote's child, not ours
        phases = {p["name"]: p for p in httpx.get(s.url + "/startup").json()["phases"]}
        assert f"pid {zygote.pid}" in phases["zygote used"]["detail"] and "forkserver launched" not in phases
        assert phases["engine forked"]["process"] == "zygote"
        with_zygote = _answer(s.url)
        print(f"with a zygote: {_ready_line(s)}")
    finally:
        s.stop()  # SIGTERM
    assert _wait_gone(engines[0].pid, 10), "the engine outlived its server"
    assert alive(zygote.pid)
    report = json.loads(audit.read_text())
    assert report["torch_imported"] is False and report["off_main_thread"] == []

    s = Server(*ARGS, "--zygote", "off", env=env)
    try:
        assert "zygote" not in s.output and len(_forkservers(s)) == 1 and not zygote.children()
        assert _answer(s.url) == with_zygote  # greedy: the same tokens either way
        print(f"without: {_ready_line(s)}")
    finally:
        s.stop()

    s = Server(*ARGS, env=env)
    engines = zygote.children()
    assert len(engines) == 1 and _answer(s.url) == with_zygote
    s.kill()  # SIGKILL: nothing of the server runs any cleanup
    assert _wait_gone(engines[0].pid, 10), "the engine outlived its killed server"
    assert zygote.is_running()

    out = _zygote(rundir, "stop")
    assert out.returncode == 0 and f"stopped pid {zygote.pid}" in out.stdout, out.stdout + out.stderr
    assert _wait_gone(zygote.pid, 5)
    assert not [f for f in os.listdir(rundir) if f.endswith(".sock")]
    out = _zygote(rundir, "status")
    assert out.returncode == 3 and "not running" in out.stdout, out.stdout


def test_a_zygote_of_another_version_is_ignored(default_model_dir, rundir, tmp_path, monkeypatch):
    """A zygote left running (--no-watch) while hotstart is upgraded in place under it."""
    root = _package_copy(tmp_path)
    init = root / "hotstart" / "__init__.py"
    upgraded = init.read_text()
    init.write_text(re.sub(r'__version__ = "[^"]*"', '__version__ = "0.0.0-other"', upgraded, count=1))
    env = {"PYTHONPATH": str(root)}
    out = _zygote(rundir, "start", env=env, cwd=str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    zygote = psutil.Process(int(re.search(r"started, pid (\d+)", out.stdout).group(1)))
    init.write_text(upgraded)
    monkeypatch.chdir(root)  # `python -m hotstart` imports the copy
    s = Server(*ARGS, env={"HOTSTART_RUNTIME_DIR": rundir, **env})
    try:
        line = next(line for line in s.lines if "zygote not used" in line)
        assert "version mismatch (zygote: hotstart 0.0.0-other" in line, line
        assert len(_forkservers(s)) == 1 and not zygote.children()
    finally:
        s.stop()
    # one that serve would not use is not taken for "already running"
    again = _zygote(rundir, "start", env=env, cwd=str(root))
    assert again.returncode == 2 and "version mismatch" in again.stderr, again.stdout + again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr


def test_a_zygote_killed_mid_start_is_replaced_by_a_local_forkserver(default_model_dir, rundir):
    from hotstart.bench.process import Server as Launched

    out = _zygote(rundir, "start")
    assert out.returncode == 0, out.stdout + out.stderr
    zygote = psutil.Process(_info(rundir).pid)
    s = Launched.launch([sys.executable, "-m", "hotstart", "serve", "--port", "0", *ARGS],
                        env={**os.environ, "HOTSTART_RUNTIME_DIR": rundir}, tag="serve", pdeathsig=False)
    try:
        deadline = time.monotonic() + 30
        while not zygote.children() and time.monotonic() < deadline:  # the engine is forked: kill now
            time.sleep(0.002)
        engine = zygote.children()[0]
        zygote.kill()
        assert _wait_gone(engine.pid, 10), "the engine outlived its zygote"
        s.wait_healthy(time.perf_counter() + 60)
        r = httpx.post(s.url + "/v1/chat/completions", json=QUESTION, timeout=60)
        assert r.status_code == 200, r.text
        assert "zygote exited" in s.output and "Traceback" not in s.output, s.output
        assert (
            len([p for p in psutil.Process(s.pid).children() if "forkserver" in " ".join(p.cmdline())]) == 1
        )
    finally:
        r = s.stop(10, group=False)
    assert not r["killed"] and not r["leftover"], r
    assert os.path.exists(paths(rundir).sock)  # what the killed zygote left
    out = _zygote(rundir, "status")
    assert out.returncode == 3 and "stale socket removed" in out.stdout, out.stdout
    assert not os.path.exists(paths(rundir).sock)


def test_a_zygote_killed_while_serving_is_replaced_by_a_local_forkserver(default_model_dir, rundir):
    out = _zygote(rundir, "start")
    assert out.returncode == 0, out.stdout + out.stderr
    zygote = psutil.Process(_info(rundir).pid)
    s = Server(*ARGS, env={"HOTSTART_RUNTIME_DIR": rundir})
    try:
        before = _answer(s.url)
        engine = zygote.children()[0]
        zygote.kill()
        assert _wait_gone(engine.pid, 10), "the engine outlived its zygote"
        saw_503, deadline = False, time.monotonic() + 60
        while time.monotonic() < deadline:  # the forkserver-death path: 503, then a local forkserver
            code = httpx.get(s.url + "/health").status_code
            saw_503 |= code == 503
            if code == 200 and saw_503:
                break
            time.sleep(0.05)
        assert saw_503 and code == 200, s.output
        assert _answer(s.url) == before and len(_forkservers(s)) == 1
        assert "hotstart: zygote exited" in s.output and "Traceback" not in s.output, s.output
    finally:
        s.stop()


def test_runtime_folder_owner_and_mode_are_checked(tmp_path, monkeypatch):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    assert check_private_dir(str(d)) is None
    assert "owned by uid" in check_private_dir(str(d), uid=os.getuid() + 1)  # another user's folder
    d.chmod(0o755)
    assert "open to other users (mode 755" in check_private_dir(str(d))
    (tmp_path / "link").symlink_to(d)
    assert "symlink" in check_private_dir(str(tmp_path / "link"))
    (tmp_path / "file").write_text("")
    assert "not a folder" in check_private_dir(str(tmp_path / "file"))
    monkeypatch.setenv("HOTSTART_RUNTIME_DIR", str(d))
    assert "runtime folder not trusted" in probe().note and probe().sock is None
    out = _zygote(str(d), "start")  # refused before anything is started
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("hotstart: error: runtime folder not usable"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not list(d.iterdir())


def test_peer_credentials_and_identity_are_compared():
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        assert peer_problem(a) is None
        assert f"runs as uid {os.getuid()}, not {os.getuid() + 1}" in peer_problem(a, uid=os.getuid() + 1)
    finally:
        a.close()
        b.close()
    me = Identity.here()
    good = ServerInfo(1, Span("p", 0, 1), me.hotstart_version, me.python, me.torch_version, uid=me.uid,
                      hotstart_path=me.hotstart_path, torch_path=me.torch_path, import_env=me.import_env)
    assert mismatch(good, me) is None
    for change, needle in [({"uid": me.uid + 1}, "runs as uid"),
                           ({"hotstart_version": "9"}, "version mismatch"),
                           ({"python": "/usr/bin/python9"}, "another interpreter"),
                           ({"hotstart_path": "/elsewhere"}, "another hotstart checkout"),
                           ({"torch_version": "1.0"}, "another torch"),
                           ({"stale": "hotstart/engine/core.py"}, "stale: hotstart/engine/core.py"),
                           ({"import_env": {**me.import_env, "OMP_NUM_THREADS": "97"}}, "OMP_NUM_THREADS")]:
        assert needle in mismatch(msgspec.structs.replace(good, **change), me), change


def test_an_edit_restarts_the_zygote(tmp_path, rundir):
    """On a copy of the package (the real tree may be edited meanwhile): an edited engine file makes the
    zygote report itself stale (servers bypass it) and re-execute itself, fresh, once idle."""
    from hotstart.forkserver.checks import changed

    root = _package_copy(tmp_path)
    env = {"PYTHONPATH": str(root)}
    out = _zygote(rundir, "start", env=env, cwd=str(root), watch=True)
    assert out.returncode == 0, out.stdout + out.stderr
    pid = int(re.search(r"started, pid (\d+)", out.stdout).group(1))
    core = root / "hotstart" / "engine" / "core.py"
    st = core.stat()
    assert changed({str(core): (st.st_mtime_ns, st.st_size)}) == ""
    core.write_text(core.read_text() + "\n# edited\n")
    assert changed({str(core): (st.st_mtime_ns, st.st_size)}).endswith("hotstart/engine/core.py")
    status = _zygote(rundir, "status", env=env, cwd=str(root))
    assert "stale: hotstart/engine/core.py changed" in status.stdout, status.stdout
    deadline = time.monotonic() + 60  # it restarts once that status connection has closed
    while time.monotonic() < deadline:
        status = _zygote(rundir, "status", env=env, cwd=str(root))
        if status.returncode == 0 and "stale" not in status.stdout:
            break
        time.sleep(0.2)
    assert f"running, pid {pid}" in status.stdout and "stale" not in status.stdout, (
        status.stdout
    )  # execv: same pid
    assert _zygote(rundir, "stop", env=env, cwd=str(root)).returncode == 0
    assert _wait_gone(pid)


def test_keep_locks_within_the_ram_guard_and_falls_back_without_mlock(tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    files = []
    for name, n in (("a.safetensors", 3 << 20), ("tokenizer.json", 5000)):
        (model / name).write_bytes(os.urandom(n))
        files.append(str(model / name))
    lines = []
    kept = keeping.keep([(str(model), files)], lines.append, available=1 << 34)
    assert kept[0].bytes_locked == kept[0].bytes_total == (3 << 20) + 5000 and not lines, lines
    assert kept[0].resident() >= kept[0].bytes_total - 4096
    kept[0].unmap()

    kept = keeping.keep([(str(model), files)], lines.append, available=4 << 20)  # 50% of 4 MiB < 3 MiB
    assert kept[0].bytes_locked == 0 and not kept[0].maps and "exceed 50% of MemAvailable" in lines[-1]

    monkeypatch.setattr(keeping, "mlock", lambda addr, size: errno.ENOMEM)  # as RLIMIT_MEMLOCK refuses it
    kept = keeping.keep([(str(model), files)], lines.append, available=1 << 34)
    assert kept[0].bytes_locked == 0 and len(kept[0].maps) == 2
    assert "not locked (mlock: Cannot allocate memory; RLIMIT_MEMLOCK is" in lines[-1], lines[-1]
    assert kept[0].resident() >= kept[0].bytes_total - 4096  # still read in
    kept[0].unmap()
