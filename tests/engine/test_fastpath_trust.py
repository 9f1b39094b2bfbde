"""The engine loads hotstart's CPU kernels and compiled graphs from $HOTSTART_HOME only when they verify
(hotstart/trust.py): a library planted without its recorded hash, or changed since, is never dlopen'ed (a
build starts instead); one that verifies but fails to load is discarded and rebuilt, once; a compiled
package that does not match its record is not loaded, and is removed for the next start to compile."""

from __future__ import annotations

import time
import zipfile

import pytest
import torch

from hotstart import diskio, trust
from hotstart.config import EngineConfig
from hotstart.engine.core import EngineCore
from hotstart.engine.fastpath import FastPath
from hotstart.engine.fastpath.cache import usable
from hotstart.model import cpu_kernels
from hotstart.model.files import weight_files


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(diskio.HOME_ENV, raising=False)
    trust.make_private_dir(tmp_path / "home")
    return tmp_path / "home"


def _fast_path(model_dir) -> FastPath:
    if cpu_kernels.compiler() is None or not cpu_kernels.supported(torch.float32):
        pytest.skip("no C++ compiler or no AVX2 + FMA: the engine serves with oneDNN alone")
    cfg = EngineConfig(model_path=str(model_dir), weight_files=tuple(map(str, weight_files(model_dir))),
                       device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    return FastPath(EngineCore.build(cfg), "eager-only", (8,), lambda m: None)


def _publish(path, data: bytes) -> None:
    trust.make_private_dir(path.parent)
    tmp = diskio.temp_name(path)
    tmp.write_bytes(data)
    diskio.publish_recorded(tmp, path)


def test_a_kernel_library_loads_only_when_it_verifies(tiny_checkpoint, home):
    path = cpu_kernels.library_path()
    trust.make_private_dir(path.parent)
    path.write_bytes(b"\x7fELF planted by someone else")  # no recorded hash
    with pytest.raises(PermissionError, match="no recorded hash"):
        cpu_kernels.load(path)
    fast = _fast_path(tiny_checkpoint("llama"))
    try:
        fast.tick(idle=True)  # the packing stage starts: the cached library is not trusted, so g++ runs
        assert fast._kernels_build is not None and fast._kernels_path is None
    finally:
        fast.close()
    _publish(path, b"\x7fELF recorded")
    path.write_bytes(b"\x7fELF recorded, then changed")
    with pytest.raises(PermissionError, match="does not match its recorded hash"):
        cpu_kernels.load(path)


def test_a_library_that_fails_to_load_is_discarded_and_rebuilt_once(tiny_checkpoint, home):
    path = cpu_kernels.library_path()
    _publish(path, b"\x7fELF a torn build whose hash was recorded")  # verifies, cannot be dlopen'ed
    fast = _fast_path(tiny_checkpoint("llama"))
    try:
        deadline = time.monotonic() + 120
        while not fast._kernels_rebuilt and time.monotonic() < deadline:
            fast.tick(idle=True)
        assert fast._kernels_rebuilt, fast.status()
        assert not path.exists() and not trust.record_path(path).exists()  # discarded
        assert fast._kernels_build is not None  # and g++ builds it again
        assert fast.packing.pending()  # the stage settles once the rebuilt library loads
    finally:
        fast.close()


def test_a_compiled_package_that_does_not_match_its_record_is_not_loaded(home):
    package = home / "compile" / "0123abcd" / "layers-T8.pt2"
    trust.make_private_dir(package.parent)
    staged = diskio.temp_name(package, ".pt2")
    with zipfile.ZipFile(staged, "w") as z:
        z.writestr("data/aotinductor/model.so", b"\0" * 4096)
    diskio.publish_recorded(staged, package)
    assert usable(package)
    with zipfile.ZipFile(package, "a") as z:  # still a complete zip, no longer the recorded bytes
        z.writestr("data/aotinductor/planted.so", b"\1" * 64)
    assert not usable(package) and not package.exists() and not trust.record_path(package).exists()
