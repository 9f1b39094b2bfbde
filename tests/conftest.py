"""Shared fixtures: the real default model, and small random-weight checkpoints written by transformers."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.families import tiny_checkpoints

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def pytest_configure(config):
    """Under pytest-xdist (make test runs the suite in one worker per core) each worker's torch, and every
    server it starts, computes on one thread: two workers x two OpenMP threads spinning on two cores made
    every CPU-bound test several times slower (OpenMP's busy waits under oversubscription). No engine of
    the suite keeps prefix-cache blocks on disk (in the user's $HOTSTART_HOME/kv) unless its test asks
    (tests/engine/test_kv_store.py, with a folder of its own)."""
    import os

    os.environ.setdefault("HOTSTART_PREFIX_CACHE_DISK", "0")
    # The default model (a Q4_1 GGUF) is served on its plain path (dequantize + F.linear, torch's ops): the
    # suite compares its greedy text across paths, batch sizes and servers, and the quantized kernels (int8
    # activations, as llama.cpp's) flip near-ties of this 135M model, and they would switch in mid-test
    # once a server's g++ finished. tests/model/test_quant_kernels.py tests the kernels, served included.
    os.environ.setdefault("HOTSTART_QUANT_KERNEL", "off")
    # ... and keeps its dequantized weights (the same products, bit for bit: model/quant.py): a step of the
    # default model dequantized 135M weights, ~0.25 s a token on one thread of an AVX2 host
    os.environ.setdefault("HOTSTART_QUANT_KEEP_DEQUANTIZED", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def private_runtime_dir():
    """Every server of the suite looks for a zygote in an empty folder of its own, so a zygote the user
    runs never takes part (tests/test_zygote.py starts its own, each in a folder of its own)."""
    import os
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="hotstart-test-run-")
    old = os.environ.get("HOTSTART_RUNTIME_DIR")
    os.environ["HOTSTART_RUNTIME_DIR"] = d
    yield d
    if old is None:
        os.environ.pop("HOTSTART_RUNTIME_DIR", None)
    else:
        os.environ["HOTSTART_RUNTIME_DIR"] = old
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_background_compiles():
    """Servers of the suite build the eager fast path (packed weights) but compile no graphs: a compile
    worker in every short-lived test server would only compete for the CPU. tests/test_fastpath.py
    turns compiling on where it tests it."""
    import os

    os.environ.setdefault("HOTSTART_COMPILE", "eager-only")
    yield


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from hotstart.bench.default_hf import ensure_default_model

    return ensure_default_model(quiet=True)


# test checkpoint name ("qwen2", "qwen2-tp", ...) -> (model_type, transformers config kwargs): every family's
# odd-shaped tiny config, and a tensor-parallel friendly one (heads and MLP divisible by 2): tests/helpers/
TINY = tiny_checkpoints()


def make_tiny_checkpoint(family: str, out: Path, shard: bool = False, dtype: str = "float32") -> Path:
    """Random-weight checkpoint saved by transformers itself (the reference writer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = TINY[family]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100KB" if shard else "10GB")
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def get(family: str, shard: bool = False) -> Path:
        key = (family, shard)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{family}{'-sharded' if shard else ''}")
            cache[key] = make_tiny_checkpoint(family, folder, shard)
        return cache[key]

    return get


# ---- test tiers -------------------------------------------------------------------------------------
# A test that starts a process (a server, a forkserver, a CLI run, a compile worker) is `e2e`, marked here
# at collection, never by hand: its source, its fixtures' and the test-local functions and classes they
# use (transitively) are scanned for a process start. `make test-fast` (-m "not e2e") runs the rest, and
# there a process started while a test runs fails that test, naming the starter to add below.
STARTERS = re.compile(
    r"\bsubprocess\.(Popen|run|call|check_call|check_output)\b|\bos\.(fork|posix_spawn|spawn\w*|exec\w*)\b"
    r"|\bmultiprocessing\b|\bcreate_subprocess_\w+\b"
    # hotstart entry points that start processes: the launcher (forkserver / engine), the zygote, the
    # compile worker of the graphs fast path
    r"|\bEngineLauncher\b|\bzygote\b|\"graphs\""
    # the test kit's own starters (also when imported inside the test, where the name scan cannot follow)
    r"|\b(Server|serving|Pending|run_session|hotstart|no_torch_in|LoopbackCluster)\("
)


AUTOUSE = {"private_runtime_dir", "no_background_compiles", "fast_tier_starts_no_process",
           "torch_decode_attention_after_each_test"}


_STARTS: dict[int, bool] = {}  # id(test-local function or class) -> whether it starts a process


def _scanned(obj) -> bool:
    """Whether OBJ's source (a test-local function or class) or what it references starts a process."""
    key = id(obj)
    if key in _STARTS:
        return _STARTS[key]
    _STARTS[key] = False  # while scanning: a cycle adds nothing
    try:
        src = inspect.getsource(obj)
        file = inspect.getsourcefile(obj) or ""
    except (OSError, TypeError):
        return False
    if not file.startswith(str(TESTS)):
        return False
    found = bool(STARTERS.search(src))
    if not found:
        scope = getattr(obj, "__globals__", None) or vars(sys.modules.get(obj.__module__, object))
        refs = (scope.get(name) for name in set(re.findall(r"\b[A-Za-z_]\w*\b", src)))
        found = any((inspect.isfunction(r) or inspect.isclass(r)) and _scanned(r) for r in refs)
    _STARTS[key] = found
    return found


def starts_processes(item) -> bool:
    if _scanned(getattr(item, "function", None)):
        return True
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixturedef in defs:
            if inspect.getsourcefile(fixturedef.func) == __file__ and fixturedef.argname in AUTOUSE:
                continue  # this file's own autouse fixtures (runtime folder, tiers) start nothing
            if _scanned(fixturedef.func):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("e2e") is None and starts_processes(item):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def torch_decode_attention_after_each_test():
    """A test that enables the paged decode kernel (a process-wide switch, hotstart/model/cpu_kernels.py:
    the engine's fast path turns it on) leaves the next test in this process on the torch path."""
    yield
    from hotstart.model import cpu_kernels

    cpu_kernels.enable_attention(False)


@pytest.fixture(autouse=True)
def fast_tier_starts_no_process(request, monkeypatch):
    """In the fast tier (-m "not e2e"), a process started by the test itself (not by a session fixture
    preparing data) fails the test: the collection scan above missed a starter. Only python / hotstart
    processes count."""
    if "not e2e" not in (request.config.getoption("-m") or "") or request.node.get_closest_marker("e2e"):
        yield
        return
    real = subprocess.Popen._execute_child

    def refuse(self, args, *rest, **kw):
        argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
        if not any("python" in a or "hotstart" in a for a in argv[:3]):
            return real(self, args, *rest, **kw)  # a library's helper (openai runs `uname -p`), not ours
        pytest.fail(f"{request.node.nodeid} starts a process ({args!r:.120}) but was not marked e2e: add its "
                    "starter to STARTERS in tests/conftest.py", pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    yield
    monkeypatch.setattr(subprocess.Popen, "_execute_child", real)
