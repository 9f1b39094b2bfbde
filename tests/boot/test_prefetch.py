"""Page-cache prefetch: residency, storage policy, load cursor, prefetcher. Real files, real reads.

Files are evicted with posix_fadvise(DONTNEED) and residency is checked with mincore, so these tests
need a disk-backed directory (not tmpfs); they skip where none is found.
"""

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers.disk import disk_backed_dir

from hotstart.boot import storage
from hotstart.boot.populate import METHODS
from hotstart.boot.prefetch import Prefetcher
from hotstart.boot.storage import MiB, PrefetchOverrides, PrefetchPlan, StorageInfo
from hotstart.model.cursor import LoadCursor
from hotstart.residency import PAGE_SIZE, evict, resident_bytes, resident_map

SIZE = 96 * MiB
# This VM occasionally drops a few dozen clean page-cache pages with no reclaim counted in /proc/vmstat
# (seen ~1 run in 150: 80 pages read, resident, then gone). Residency checks allow that much.
SLACK = 2 * MiB


def _plan(threads=2, block_mib=4, window_mib=1024, enabled=True, method="preadv", ahead_mib=None):
    ahead = ahead_mib * MiB if ahead_mib is not None else None
    return PrefetchPlan(enabled, threads, block_mib * MiB, "test", window_mib * MiB, method, 2 * MiB, ahead)


def _write(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        os.fsync(f.fileno())  # dirty pages cannot be evicted
    return path


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    """A disk-backed directory: pytest's tmp if it is not tmpfs, else /var/tmp."""
    with disk_backed_dir(tmp_path_factory, "prefetch") as d:
        yield d


@pytest.fixture(scope="module")
def big(disk_dir):
    return _write(disk_dir / "big.bin", SIZE)


def _resident(path: Path) -> int:
    return resident_bytes(path)[0]


def _cold(path: Path) -> None:
    evict(path)
    assert resident_bytes(path)[0] <= 64 * PAGE_SIZE


# ---- residency --------------------------------------------------------------------------------------

def test_residency_evict_read_and_empty(big, disk_dir):
    _cold(big)
    with open(big, "rb") as f:
        f.read(8 * MiB)
    vec = resident_map(big)
    res, total = resident_bytes(big)  # >= vec's count: async readahead may still be adding pages
    assert total == SIZE and 8 * MiB <= res < SIZE
    assert len(vec) == SIZE // PAGE_SIZE and set(vec) <= {0, 1} and sum(vec) * PAGE_SIZE <= res
    assert all(vec[: 8 * MiB // PAGE_SIZE])
    empty = disk_dir / "empty.bin"
    empty.write_bytes(b"")
    assert resident_bytes(empty) == (0, 0) and resident_map(empty) == bytearray()


# ---- prefetcher ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_cold_then_warm(big, method):
    _cold(big)
    pf = Prefetcher([big], _plan(method=method)).start()
    assert pf.wait(30)
    s = pf.stats()
    assert s["state"] == "done" and s["errors"] == 0 and s["files_done"] == 1
    assert s["bytes_read"] + s["bytes_skipped_resident"] == SIZE
    # The rest were pages the kernel's own readahead (read_ahead_kb, 8 MiB here) had brought in by the
    # time a thread checked them: skipped, not read twice.
    assert s["bytes_read"] >= SIZE // 4
    assert s["gbps"] > 0 and s["elapsed_s"] > 0
    assert _resident(big) >= SIZE - SLACK
    again = Prefetcher([big], _plan(method=method)).start()
    assert again.wait(10)
    assert again.stats()["bytes_read"] <= SLACK and again.stats()["bytes_skipped_resident"] >= SIZE - SLACK


@pytest.mark.parametrize("method", METHODS)
def test_partially_resident_reads_only_missing(big, method):
    _cold(big)
    with open(big, "rb") as f:
        f.read(40 * MiB)
    before, _ = resident_bytes(big)
    missing = SIZE - before
    pf = Prefetcher([big], _plan(threads=1, method=method)).start()
    assert pf.wait(30)
    s = pf.stats()
    assert missing // 4 <= s["bytes_read"] <= missing + SLACK  # (readahead: see test_cold_then_warm)
    assert s["bytes_skipped_resident"] >= before - SLACK
    assert _resident(big) >= SIZE - SLACK


@pytest.mark.parametrize("method", METHODS)
def test_cursor_skips_passed_and_window_holds(big, method):
    _cold(big)
    window = 8 * MiB
    with LoadCursor.create() as cur:
        cur.advance(48 * MiB)  # the loader already passed the first half
        pf = Prefetcher([big], _plan(block_mib=4, method=method), cursor=cur, window_bytes=window).start()
        deadline = time.monotonic() + 10
        while pf.stats()["frontier"] < 56 * MiB and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # give it room to (wrongly) go further
        s = pf.stats()
        assert s["state"] == "running" and s["bytes_skipped_passed"] == 48 * MiB
        assert s["frontier"] == 48 * MiB + window and s["bytes_read"] <= window
        assert sum(resident_map(big)[: 48 * MiB // PAGE_SIZE]) * PAGE_SIZE <= 2 * MiB  # not read

        seen = []

        def loader():  # a fake loader walking the rest of the file
            for pos in range(48 * MiB, SIZE + 1, MiB):
                cur.advance(pos)
                time.sleep(0.003)
                seen.append((pf.stats()["frontier"], pos))

        t = threading.Thread(target=loader)
        t.start()
        t.join(30)
        assert pf.wait(10) and pf.stats()["state"] == "done"
    assert all(frontier <= pos + window for frontier, pos in seen)
    assert max(f - p for f, p in seen) > 0  # it did run ahead of the loader
    assert pf.stats()["bytes_read"] <= SIZE - 48 * MiB


@pytest.mark.parametrize("method", METHODS)
def test_bad_files_are_recorded_and_skipped(disk_dir, method):
    good = _write(disk_dir / "good.bin", 8 * MiB)
    vanished = _write(disk_dir / "vanished.bin", 4 * MiB)
    truncated = _write(disk_dir / "truncated.bin", 8 * MiB)
    _cold(good)
    pf = Prefetcher([disk_dir, vanished, truncated, good], _plan(block_mib=1, method=method))
    vanished.unlink()  # after planning
    os.truncate(truncated, MiB)
    pf.start()
    assert pf.wait(10)
    s = pf.stats()
    assert s["state"] == "done" and s["errors"] == 3 and s["files_done"] == 1
    assert str(disk_dir) in s["first_error"] and "not a regular file" in s["first_error"]
    assert _resident(good) >= 8 * MiB - SLACK and s["bytes_read"] > 0


def test_stop_is_prompt(big):
    with LoadCursor.create() as cur:
        cur.advance(0)  # loader at 0 with a small window: the threads are parked waiting
        pf = Prefetcher([big], _plan(threads=4, block_mib=1), cursor=cur, window_bytes=MiB).start()
        time.sleep(0.1)
        assert pf.stats()["state"] == "running"
        t = time.monotonic()
        pf.stop()
        assert pf.wait(2) and time.monotonic() - t < 0.5
        assert pf.stats()["state"] == "stopped"
    _cold(big)  # now while reading
    pf = Prefetcher([big], _plan(threads=2, block_mib=1)).start()
    time.sleep(0.02)
    pf.stop()
    assert pf.wait(5) and pf.stats()["state"] in ("stopped", "done")


def test_running_prefetch_does_not_block_exit(big):
    code = textwrap.dedent(f"""
        from pathlib import Path
        from hotstart.model.cursor import LoadCursor
        from hotstart.boot.prefetch import Prefetcher
        from hotstart.boot.storage import PrefetchPlan
        cur = LoadCursor.create()
        cur.unlink()  # the mapping stays valid; nothing is left behind in /tmp
        cur.advance(0)
        plan = PrefetchPlan(True, 4, 1 << 20, "t", 1 << 20)
        pf = Prefetcher([Path({str(big)!r})], plan, cursor=cur).start()
        assert pf.stats()["state"] == "running"
        print("exiting", flush=True)
    """)  # threads parked, never stopped or joined: interpreter exit must not wait for them
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "exiting", out.stderr
    assert time.monotonic() - t < 5


def test_disabled_plan_does_nothing(big):
    pf = Prefetcher([big], PrefetchPlan(False, 2, 4 * MiB, "already in RAM (tmpfs)")).start()
    assert pf.wait(0) and pf.stats()["state"] == "disabled" and pf.stats()["reason"].startswith("already")
    assert pf.stats()["bytes_read"] == 0


# ---- load cursor ---------------------------------------------------------------------------------------

def test_cursor_across_processes():
    cur = LoadCursor.create()
    assert cur.position() == -1 and os.path.getsize(cur.path) == 64
    assert (os.stat(os.path.dirname(cur.path)).st_mode & 0o777) == 0o700
    code = (
        f"from hotstart.model.cursor import LoadCursor; c = LoadCursor.open({cur.path!r}); c.advance(12345)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert cur.position() == 12345
    cur.advance(100)  # monotonic: going back is ignored
    assert cur.position() == 12345
    path = cur.path
    cur.close()
    assert not os.path.exists(path) and cur.position() == 12345  # closed: the last value
    cur.close()  # idempotent


# ---- storage policy ------------------------------------------------------------------------------------

MOUNTINFO = textwrap.dedent("""\
    22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
    30 22 0:40 / /data rw,relatime shared:5 - nfs4 server:/export rw,vers=4.2
    31 22 8:1 / /datasets rw,relatime - xfs /dev/sda1 rw
    32 22 0:41 / /dev/shm rw - tmpfs tmpfs rw
    33 22 0:42 / /mnt/s3 rw - fuse.s3fs s3fs rw
    34 22 254:0 / /mnt/with\\040space rw - ext4 /dev/vda rw
    35 22 0:43 / /datasets/cache rw - tmpfs tmpfs rw
    36 22 0:44 / /datasets/cache rw - ceph 10.0.0.1:/ rw
    """)


@pytest.fixture
def fake_sys(tmp_path):
    """/sys/dev/block links for an NVMe partition, a SATA disk partition and a virtio disk."""
    root = tmp_path / "sys"
    for majmin, dev, part, rot in [("259:2", "devices/pci0/nvme/nvme0n1", "nvme0n1p2", "0"),
                                   ("8:1", "devices/pci0/ata1/sda", "sda1", "1"),
                                   ("254:0", "devices/pci0/virtio1/block/vda", None, "1")]:
        disk = root / dev
        (disk / "queue").mkdir(parents=True)
        (disk / "queue" / "rotational").write_text(rot + "\n")
        target = disk
        if part:
            target = disk / part
            target.mkdir()
            (target / "partition").write_text("2\n")
        (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(target, root / "dev" / "block"), root / "dev" / "block" / majmin)
    return str(root)


def test_detect_from_fake_mountinfo(fake_sys):
    def kind(path):
        return storage.detect(path, mountinfo=MOUNTINFO, sys_root=fake_sys)

    assert kind("/home/u/model") == StorageInfo("local", "ext4", "nvme0n1")
    assert kind("/data/m/model.safetensors") == StorageInfo("network", "nfs4", "server:/export")
    assert kind("/datasets/llama") == StorageInfo("rotational", "xfs", "sda")  # partition -> its disk
    assert kind("/datasets2/x").kind == "local"  # a prefix of the name is not a mount-point prefix
    assert kind("/datasets/cache/x").fstype == "ceph"  # the later mount shadows the tmpfs
    assert kind("/dev/shm/m").kind == "memory"
    assert kind("/mnt/s3/m").kind == "network"
    virtio = kind("/mnt/with space/m")
    assert virtio.kind == "local" and virtio.device == "vda" and "virtio" in virtio.note
    assert storage.detect("/x", mountinfo="garbage\n").kind == "unknown"
    assert storage.detect(__file__).kind in ("local", "rotational", "network", "memory", "unknown")


def test_mem_available_parsing():
    assert storage.mem_available("MemTotal: 100 kB\nMemAvailable:   2048 kB\n") == 2 * MiB
    assert storage.mem_available("MemTotal: 100 kB\n") is None
    assert storage.mem_available() > 0  # the real /proc/meminfo


def test_plan_policies():
    gb = 10**9
    local, net = StorageInfo("local", "ext4", "vda"), StorageInfo("network", "nfs4", "srv:/x")
    p = storage.plan(local, 1 * gb, 16 * gb)
    assert p.enabled and p.threads == storage.LOCAL_THREADS and p.block_bytes == storage.LOCAL_BLOCK_MIB * MiB
    assert p.window_bytes == storage.DEFAULT_WINDOW_MIB * MiB
    assert storage.plan(net, gb, 16 * gb).threads == storage.NETWORK_THREADS >= 8
    assert storage.plan(StorageInfo("rotational", "xfs", "sda"), gb, 16 * gb).threads == 1
    mem = storage.plan(StorageInfo("memory", "tmpfs", "tmpfs"), gb, 16 * gb)
    assert not mem.enabled and "already in RAM" in mem.reason
    assert storage.plan(StorageInfo("unknown", "", ""), gb, None).enabled  # unknown RAM: no guard
    assert not storage.plan(local, 0, 16 * gb).enabled


def test_plan_ram_guard_and_overrides():
    gb = 10**9
    local = StorageInfo("local", "ext4", "vda")
    assert storage.plan(local, 7 * gb, 16 * gb).ahead_bytes is None  # fits in 50%: unbounded
    big = storage.plan(local, 9 * gb, 16 * gb)  # 9 GB > 50% of 16 GB: bounded ahead of the loader
    assert big.enabled and "MemAvailable" in big.reason and "ahead of the loader" in big.reason
    assert big.ahead_bytes == 8 * gb // (16 * MiB) * (16 * MiB)
    huge = storage.plan(local, 17 * gb, 16 * gb)  # more than RAM can hold: off
    assert not huge.enabled and "exceed MemAvailable" in huge.reason
    assert storage.plan(local, 9 * gb, 16 * gb, PrefetchOverrides(ram_fraction=0.6)).ahead_bytes is None
    o = PrefetchOverrides(threads=3, block_mib=32, window_mib=128)
    p = storage.plan(StorageInfo("rotational", "xfs", "sda"), gb, 16 * gb, o)
    assert (p.threads, p.block_bytes, p.window_bytes) == (3, 32 * MiB, 128 * MiB)
    assert not storage.plan(local, gb, 16 * gb, PrefetchOverrides(enabled=False)).enabled
    forced = PrefetchOverrides(enabled=True)
    assert storage.plan(StorageInfo("memory", "tmpfs", ""), gb, 16 * gb, forced).enabled
    with pytest.raises(ValueError):
        storage.plan(local, gb, 16 * gb, PrefetchOverrides(threads=0))


def test_plan_for_real_file(big):
    p = storage.plan_for([big])
    assert p.reason and (p.enabled or "RAM" in p.reason)


# ---- import hygiene ------------------------------------------------------------------------------------

def test_boot_modules_import_nothing_heavy():
    code = ("import sys; import hotstart.boot.prefetch, hotstart.boot.storage, hotstart.residency, "
            "hotstart.boot.populate, hotstart.model.cursor, hotstart.boot.timeline; "
            "print([m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'matplotlib', 'numpy', 'safetensors')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class _ImportRecorder:
    """A meta-path finder that records which thread asks for each module, and finds nothing."""

    def __init__(self):
        self.seen = []

    def find_spec(self, name, path=None, target=None):
        self.seen.append((name, threading.get_ident()))
        return None


@pytest.mark.parametrize("method", METHODS)
def test_no_imports_from_prefetch_threads(big, disk_dir, method):
    _cold(big)
    rec = _ImportRecorder()
    before = set(sys.modules)
    sys.meta_path.insert(0, rec)
    try:
        with LoadCursor.create() as cur:  # exercise claim, wait, jump, read and error paths
            pf = Prefetcher(
                [disk_dir / "missing-after-plan", big, disk_dir],
                _plan(block_mib=2, method=method),
                cursor=cur,
                window_bytes=16 * MiB,
            ).start()
            time.sleep(0.05)
            for pos in range(0, SIZE + 1, 4 * MiB):
                cur.advance(pos)
                pf.stats()
                time.sleep(0.002)
            assert pf.wait(10)
        pf.stop()
    finally:
        sys.meta_path.remove(rec)
    main = threading.main_thread().ident
    assert [name for name, ident in rec.seen if ident != main] == []
    assert set(sys.modules) - before == set()
    assert pf.stats()["state"] == "done" and pf.stats()["errors"] == 2


def test_env_read_back_after_cold_all(disk_dir):
    """Evicted files are resident again after warm_sets: a `weights` run after the `all` runs starts with
    the environment warm, whichever config comes first."""
    from hotstart.bench import evict as ev

    a = disk_dir / "a.bin"
    a.write_bytes(os.urandom(3 << 20))
    s = ev.FileSet("written")  # not "env": a file just written must be synced before it can be dropped
    s.add_file(a)
    s.add_file(disk_dir / "missing.bin")  # ignored: nothing to read
    ev.evict_sets([s])
    assert ev.residency(s) < 50.0
    assert ev.warm_sets([s]) >= 0.0
    assert ev.residency(s) == 100.0
