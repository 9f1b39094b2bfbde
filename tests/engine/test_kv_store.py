"""The prefix cache on disk (engine/kv_store.py, model/kv_files.py): blocks written by one engine are read
back by the next one of the same model and layout, and change nothing but the work done (greedy tokens
equal, logprobs equal within float32's rounding), while a corrupt, foreign or group-writable file is never
loaded (and is deleted). Real engines in this process on a transformers-written float32 checkpoint."""

from __future__ import annotations

import os
import random
import shutil
import time

import pytest

from hotstart.config import EngineConfig
from hotstart.engine import kv_store
from hotstart.engine.block_manager import block_hash
from hotstart.engine.core import EngineCore
from hotstart.messages import EngineRequest
from hotstart.model import kv_files
from hotstart.sampling_params import SamplingParams

PROMPT = [random.Random(0).randrange(3, 250) for _ in range(83)]  # 5 full blocks of 16, then 3 tokens


@pytest.fixture()
def kv_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTSTART_KV_DIR", str(tmp_path / "kv"))
    return tmp_path / "kv"


def engine(path, disk: str = "64M", max_len: int = 256) -> EngineCore:
    cfg = EngineConfig(model_path=str(path), dtype="float32", max_model_len=max_len, max_num_seqs=2,
                       kv_cache_memory=1 << 22, prefix_cache_disk=disk, compile="off")
    return EngineCore.build(cfg)


def run(core: EngineCore, prompt=PROMPT) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens and each one's top-3 logprobs."""
    rid = f"r{time.monotonic_ns()}"
    core.add_request(EngineRequest(rid, list(prompt), SamplingParams(max_tokens=6, temperature=0,
                                                                      ignore_eos=True, logprobs=3)))
    tokens, lps = [], []
    while core.has_work():
        for out in core.step():
            tokens += out.new_token_ids
            lps += [dict(zip(lp.top_ids, lp.top_logprobs, strict=True)) for lp in out.logprobs or []]
    return tokens, lps


def written(core: EngineCore) -> list:
    core.store.close()
    return sorted(core.store.folder.glob("*.kv"))


def same(a, b) -> None:
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1], strict=True):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)  # float32: ~1e-6 apart


def test_a_restored_prefix_changes_nothing_but_the_work(tiny_checkpoint, kv_dir):
    path = tiny_checkpoint("qwen2")
    cold = run(engine(path, disk="0"))
    first = engine(path)
    assert first.store is not None and not first.store.on_disk
    same(run(first), cold)
    files = written(first)
    assert len(files) >= 5 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    again = engine(path)  # a restart
    assert len(again.store.on_disk) == len(files)
    same(run(again), cold)
    s = again.stats()
    assert s.prefix_disk_restored == 5 and s.prefix_cache_hits == 80  # the 5 prompt blocks, read back
    assert s.prompt_tokens_computed == len(PROMPT) - 80  # only the tail was computed
    again.store.close()


def test_corrupt_foreign_or_unsafe_files_are_never_loaded(tiny_checkpoint, tmp_path, kv_dir):
    path = tiny_checkpoint("qwen2")
    cold = run(engine(path, disk="0"))
    writer = engine(path)
    run(writer)
    folder, layout, nbytes = writer.store.folder, writer.store.layout, writer.store.block_bytes
    written(writer)
    chain = [block_hash(b"", PROMPT[:16])]
    for j in range(1, 5):
        chain.append(block_hash(chain[-1], PROMPT[16 * j:16 * j + 16]))
    # a flipped payload byte in the second block: the first is read back, the rest computed
    second = kv_files.block_path(folder, chain[1])
    data = bytearray(second.read_bytes())
    data[-1] ^= 0x40
    second.write_bytes(data)
    again = engine(path)
    same(run(again), cold)
    assert again.stats().prefix_disk_restored == 1 and not second.exists()  # deleted, never loaded
    # writable by others, or not ours: refused the same way
    third = kv_files.block_path(folder, chain[2])
    third.chmod(0o666)
    assert kv_files.read_block(folder, layout, chain[2], nbytes) is None and not third.exists()
    # another snapshot (the same files rewritten) and another layout get folders of their own
    other = shutil.copytree(path, tmp_path / "other")
    os.utime(other / "model.safetensors", (1, 1))
    foreign = engine(other)
    longer = engine(path, max_len=512)
    assert len({folder, foreign.store.folder, longer.store.folder}) == 3
    # this model's files under the other snapshot's names: the header names another layout
    for f in folder.glob("*.kv"):
        shutil.copy(f, foreign.store.folder / f.name)
    foreign.store.on_disk = kv_files.list_blocks(foreign.store.folder)
    assert len(foreign.store.on_disk) >= 3
    same(run(foreign), cold)
    assert foreign.stats().prefix_disk_restored == 0
    assert not kv_files.block_path(foreign.store.folder, chain[0]).exists()
    for core in (again, foreign, longer):
        core.store.close()


def test_the_size_budget_drops_the_least_recently_used(tmp_path):
    folder = tmp_path / "snap" / "layout"
    assert kv_files.usable_folder(folder)
    layout = b"L" * 32
    for i in range(4):
        kv_files.write_block(folder, layout, bytes([i]) * 32, bytes(1000))
        os.utime(kv_files.block_path(folder, bytes([i]) * 32), (100 + i, 100 + i))
    assert kv_files.read_block(folder, layout, bytes([0]) * 32, 1000) == bytes(1000)  # touched: recent
    size = kv_files.HEADER.size + 1000
    assert kv_files.enforce_budget(tmp_path, 2 * size) == 2 * size
    assert kv_files.list_blocks(folder) == {bytes([0]) * 32, bytes([3]) * 32}
    assert kv_files.count_blocks(tmp_path, "snap") == 2


def test_a_gguf_models_prefixes_survive_a_restart_and_not_a_rewrite(tmp_path, kv_dir):
    """A GGUF file is its own config: its snapshot key reads its metadata (no config.json beside it), blocks
    written by one engine are read back by the next, and the same file rewritten keys another folder."""
    from helpers.gguf import make

    path, _ = make("llama", "Q4_0", tmp_path)
    first = engine(path)
    assert first.store is not None
    cold = run(first)
    files = written(first)
    assert len(files) >= 5
    again = engine(path)
    assert len(again.store.on_disk) == len(files)
    same(run(again), cold)
    assert again.stats().prefix_disk_restored == 5
    again.store.close()
    key = kv_files.snapshot_key(path, [path])
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert kv_files.snapshot_key(path, [path]) != key


def test_a_new_engine_preloads_the_most_recent_prefixes_from_its_start(tiny_checkpoint, kv_dir):
    """A restarted engine reads the most recently used block files from the store's opening on, and idle
    ticks copy them in between steps (a busy one copies none): the first request finds its whole prefix in
    memory (no hold, no read of its own), and its output is the one computed without the store. The reads
    pause while requests run."""
    import threading  # noqa: PLC0415

    path = tiny_checkpoint("qwen2")
    cold = run(engine(path, disk="0"))
    first = engine(path)
    run(first)
    files = written(first)
    again = engine(path)
    assert again.store.preloading and again.store.preloaded == 0  # read, not copied in before a tick
    deadline = time.monotonic() + 30
    while again.store._preload.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    again.store.tick(False)  # busy (a tick after a step): a batch read, none copied in
    assert again.store.preloaded == 0
    while again.store.preloading and time.monotonic() < deadline:
        again.store.tick(True)
        time.sleep(0.01)
    assert again.store.preloaded == len(files) and again.store.restored == 0 and not again.store.preloading
    assert again.blocks.num_cached == len(files)
    same(run(again), cold)
    s = again.stats()
    assert again.store.restored == 0 and s.prefix_cache_hits == 80  # found in memory, nothing held
    assert s.prompt_tokens_computed == len(PROMPT) - 80
    # busy (a tick after a step): a preload batch waits before its next read, and reads once idle again
    store = engine(path).store
    while store.preloading and time.monotonic() < deadline:  # what the opening queued, copied at ticks
        store.tick(True)
        time.sleep(0.01)
    store.tick(False)
    reader = threading.Thread(target=store._read_loose, args=(sorted(store.on_disk),))
    store._preload_left += 1
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive() and store._preload.empty()  # paused
    store.tick(True)
    reader.join(10)
    assert not reader.is_alive() and not store._preload.empty()
    again.store.close()
    store.close()


def test_a_request_copies_in_only_the_preloaded_batches_holding_its_blocks(tiny_checkpoint, kv_dir,
                                                                           monkeypatch):
    """Batches the preload read before a request came are copied in by its hold() only where they hold
    its blocks (the rest waits for idle ticks), and its output is the one computed without the store."""
    path = tiny_checkpoint("qwen2")
    other = [random.Random(1).randrange(3, 250) for _ in range(83)]
    cold = run(engine(path, disk="0"))
    first = engine(path)
    run(first)
    run(first, other)
    files = written(first)
    assert len(files) == 10
    monkeypatch.setattr(kv_store, "PRELOAD_BATCH_BYTES", 1)  # a batch per block
    again = engine(path)
    store = again.store
    deadline = time.monotonic() + 30
    while store._preload.qsize() < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    same(run(again), cold)
    assert store.preloaded == 5 and store.restored == 0 and store.preloading  # its 5 blocks, from batches
    assert again.stats().prefix_cache_hits == 80
    while store.preloading and time.monotonic() < deadline:
        store.tick(True)
    assert store.preloaded == 10 and again.blocks.num_cached >= 10
    store.close()


def test_blocks_written_in_runs_and_alone_read_back_the_same(tiny_checkpoint, kv_dir):
    """write_blocks copies a run of consecutive blocks in one op and the rest one by one: read_blocks gives
    back every block's bytes, wherever it landed."""
    import torch  # noqa: PLC0415

    runner = engine(tiny_checkpoint("qwen2"), disk="0").runner
    ids = [5, 6, 7, 10, 3, 4]
    data = torch.randn(len(ids), *runner.read_blocks([1]).shape[1:])
    runner.write_blocks(ids, data)
    assert torch.equal(runner.read_blocks(ids), data)
    assert torch.equal(runner.read_blocks([8, 9]), torch.zeros(2, *data.shape[1:]))  # zeroed, not written


def test_blocks_read_side_by_side_are_copied_in_from_their_buffer(tiny_checkpoint, kv_dir):
    """A prefix's blocks are read into one buffer: the cache is written from a view of it (no stacked
    copy) when they are its first ones in order, and from a copy in the order asked for otherwise."""
    import torch  # noqa: PLC0415

    store = engine(tiny_checkpoint("qwen2")).store
    n = store.block_bytes
    whole = memoryview(bytearray(os.urandom(2 * n)))
    first, second = whole[:n], whole[n:]
    view = store._host([first, second], [0, 1], whole)
    swapped = store._host([second, first], [1, 0], whole)
    assert view.shape == (2, *store.block_shape) and swapped.shape == view.shape
    as_bytes = lambda t: t.reshape(t.shape[0], -1).view(torch.uint8)  # noqa: E731 - random bits: NaNs
    assert torch.equal(as_bytes(view)[0], as_bytes(swapped)[1])
    assert torch.equal(as_bytes(view)[1], as_bytes(swapped)[0])
    whole[0] ^= 0xFF  # the view shares the buffer; the copy does not
    assert as_bytes(view)[0, 0].item() == whole[0] and as_bytes(swapped)[1, 0].item() != whole[0]
    store.close()
