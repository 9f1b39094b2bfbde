"""Prefetch methods (populate.py), the RAM guard's bound ahead of the loader, the auto policy and the
--prefetch-method flag. Real files, evicted with posix_fadvise(DONTNEED), residency from mincore.
(Per-method residency, window and skip checks are parametrized in test_prefetch.py.)"""

import os
import time
from pathlib import Path

import pytest
from helpers.disk import disk_backed_dir

from hotstart.boot import populate, storage
from hotstart.boot.populate import METHODS
from hotstart.boot.prefetch import Prefetcher
from hotstart.boot.storage import MiB, PrefetchOverrides, PrefetchPlan, StorageInfo
from hotstart.model.cursor import LoadCursor
from hotstart.residency import PAGE_SIZE, evict, resident_bytes, resident_map

SIZE = 64 * MiB
SLACK = 2 * MiB  # see test_prefetch.py: this VM sometimes drops a few clean pages


@pytest.fixture(scope="module")
def cold_file(tmp_path_factory):
    with disk_backed_dir(tmp_path_factory, "methods") as d:
        path = d / "f.bin"
        with open(path, "wb") as f:
            f.write(os.urandom(SIZE))
            os.fsync(f.fileno())
        yield path


def _cold(path: Path) -> None:
    evict(path)
    assert resident_bytes(path)[0] <= 64 * PAGE_SIZE


def _plan(method: str, ahead_mib=None, block_mib=4, threads=2) -> PrefetchPlan:
    ahead = ahead_mib * MiB if ahead_mib is not None else None
    return PrefetchPlan(True, threads, block_mib * MiB, "test", 1024 * MiB, method, 2 * MiB, ahead)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.parametrize("method", ["readahead", "fadvise", "madvise"])
def test_zero_copy_methods_populate_without_growing_this_process(cold_file, method):
    """The page cache fills, but neither anonymous memory (no buffer copies) nor mapped file pages
    (madvise drops its page-table entries after each block) grow in the prefetching process."""
    _cold(cold_file)
    anon, mapped = _status_kb("RssAnon"), _status_kb("RssFile")
    pf = Prefetcher([cold_file], _plan(method, block_mib=16)).start()
    assert pf.wait(30)
    s = pf.stats()
    assert s["state"] == "done" and s["errors"] == 0 and s["method"] == method
    assert resident_bytes(cold_file)[0] >= SIZE - SLACK
    assert s["bytes_read"] + s["bytes_skipped_resident"] == SIZE
    assert (_status_kb("RssAnon") - anon) * 1024 < 8 * MiB
    assert (_status_kb("RssFile") - mapped) * 1024 < 8 * MiB


def test_populators_wait_for_the_data(cold_file):
    """populate() returns only once every page of the runs is resident (the methods are synchronous
    per block, which bounds the reads in flight to threads x block)."""
    from hotstart.residency import FileMap

    for method in METHODS:
        _cold(cold_file)
        fd = os.open(cold_file, os.O_RDONLY)
        try:
            with FileMap(fd, SIZE) as fmap:
                runs = [(0, 4 * MiB), (20 * MiB, 12 * MiB + 123 * PAGE_SIZE)]
                got = []
                populate.populator(method, 16 * MiB, 8 * MiB).populate(fd, fmap, runs, got.append)
                for start, length in runs:
                    assert all(fmap.vector(start, length)), method
                assert sum(got) == sum(n for _, n in runs)
        finally:
            os.close(fd)


def test_ahead_bound_without_cursor_stops_there(cold_file):
    _cold(cold_file)
    pf = Prefetcher([cold_file], _plan("fadvise", ahead_mib=16)).start()
    assert pf.wait(10)
    s = pf.stats()
    assert s["state"] == "stopped" and s["frontier"] == 16 * MiB and s["ahead_bytes"] == 16 * MiB
    vec = resident_map(cold_file)
    assert (
        sum(vec[16 * MiB // PAGE_SIZE + 3 * MiB // PAGE_SIZE :]) * PAGE_SIZE <= SLACK + 8 * MiB
    )  # kernel readahead


def test_ahead_bound_follows_the_loader(cold_file):
    _cold(cold_file)
    with LoadCursor.create() as cur:  # -1: the loader has not started, the bound counts from byte 0
        pf = Prefetcher([cold_file], _plan("madvise", ahead_mib=16), cursor=cur).start()
        deadline = time.monotonic() + 10
        while pf.stats()["frontier"] < 16 * MiB and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert pf.stats()["state"] == "running" and pf.stats()["frontier"] == 16 * MiB
        seen = []
        for pos in range(0, SIZE + 1, 2 * MiB):
            cur.advance(pos)
            time.sleep(0.01)
            seen.append((pf.stats()["frontier"], pos))
        assert pf.wait(10) and pf.stats()["state"] == "done"
    assert all(frontier <= pos + 16 * MiB for frontier, pos in seen)
    assert resident_bytes(cold_file)[0] >= SIZE - 16 * MiB - SLACK  # what the "loader" had not passed


def test_unknown_method_fails_in_the_caller(cold_file):
    with pytest.raises(ValueError, match="prefetch method"):
        Prefetcher([cold_file], _plan("mmap-copy"))
    with pytest.raises(ValueError, match="prefetch method"):
        storage.plan(
            StorageInfo("local", "ext4", "vda"), 10**9, 16 * 10**9, PrefetchOverrides(method="bogus")
        )


def test_auto_policy_and_chunk():
    gb = 10**9
    local = StorageInfo("local", "ext4", "vda", ra_bytes=8 * MiB)
    assert storage.choose_method("auto", local) == storage.AUTO_METHOD
    assert storage.AUTO_METHOD in METHODS and storage.AUTO_METHOD != "preadv"  # the default copies nothing
    assert (
        storage.choose_method("auto", StorageInfo("network", "nfs4", "srv:/x")) == storage.AUTO_NETWORK_METHOD
    )
    assert storage.choose_method("auto", StorageInfo("unknown", "", "")) == storage.AUTO_METHOD
    for m in METHODS:
        assert storage.choose_method(m, local) == m
    p = storage.plan(local, gb, 16 * gb)
    assert (p.method, p.chunk_bytes) == (storage.AUTO_METHOD, 8 * MiB) and storage.AUTO_METHOD in p.reason
    assert (
        storage.plan(StorageInfo("local", "ext4", "vda"), gb, 16 * gb).chunk_bytes == storage.FALLBACK_CHUNK
    )
    p = storage.plan(local, gb, 16 * gb, PrefetchOverrides(method="preadv", block_mib=4))
    assert (p.method, p.chunk_bytes) == ("preadv", 4 * MiB)  # a chunk never exceeds a block


def test_readahead_cap_from_sys(tmp_path):
    root = tmp_path / "sys"
    disk = root / "devices" / "virtio1" / "block" / "vda"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "read_ahead_kb").write_text("8192\n")
    (disk / "queue" / "max_sectors_kb").write_text("4096\n")
    (disk / "vda1").mkdir()
    (disk / "vda1" / "partition").write_text("1\n")
    (root / "dev" / "block").mkdir(parents=True)
    os.symlink(disk / "vda1", root / "dev" / "block" / "254:1")
    (root / "class" / "bdi" / "0:53").mkdir(parents=True)
    (root / "class" / "bdi" / "0:53" / "read_ahead_kb").write_text("15360\n")
    assert storage.readahead_bytes("254:1", str(root)) == 8 * MiB  # the partition's disk
    assert storage.readahead_bytes("0:53", str(root)) == 15 * MiB  # an NFS/FUSE bdi
    assert storage.readahead_bytes("9:9", str(root)) == 0
    assert storage.detect(__file__).ra_bytes >= 0


def test_method_flag_reaches_the_prefetcher(cold_file, monkeypatch):
    from hotstart.boot.resolve import ResolvedModel
    from hotstart.boot.timeline import Timeline
    from hotstart.cli import build_parser
    from hotstart.config import ServeConfig
    from hotstart.frontend.start import EngineStart

    args = build_parser().parse_args(["serve", "--prefetch-method", "madvise"])
    cfg = ServeConfig.from_args(args)
    assert cfg.prefetch_method == "madvise" and ServeConfig().prefetch_method == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefetch-method", "mmap"])
    monkeypatch.setattr("hotstart.model.files.sidecar_files", lambda path: [])
    timeline = Timeline(time.time())
    start = EngineStart(timeline, None, None, prefetch=cfg)
    start.model, start.files = ResolvedModel(cold_file.parent, "local", "cold"), [cold_file]
    pf = start.start_prefetch(cfg)
    assert pf is not None and pf.wait(30) and pf.stats()["method"] == "madvise"
    span = next(s for s in timeline.events if s.name == "prefetch started")
    assert "madvise" in span.detail
