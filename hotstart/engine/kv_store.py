"""The prefix cache that survives: full KV blocks of cached prefixes written to disk (model/kv_files.py)
while the engine idles, periodically while it is busy, and when it stops (an unload, a restart), and
read back, lazily per prefix, before the request that needs them is scheduled; and, on a new engine, the
most recently used of them are read back ahead of any request (preload).

Writing: on the step thread, copy_out() gathers the K/V of cached blocks not on disk yet into one host
tensor [n, layers, 2, KVH, block size, D]; the writer thread writes a file per block (plain file I/O, no
imports) and keeps the root within its budget.
Reading: a new sequence whose hash chain goes on, past the blocks in memory, into blocks on disk is held
(the Scheduler's gate: hold()); the reader thread reads and verifies their files; admit(), on the step
thread before scheduling, copies them into free KV blocks, registers those as cached free blocks
(BlockManager.restore) and lets the sequence in, whose lookup then finds the whole chain. A block that
fails its checks ends the chain there: the rest is computed, as it would be without the store.
Preload: from the store's opening (the engine's last steps before READY) threads of their own read the
most recently used files (up to PRELOAD_FRACTION of the KV blocks and PRELOAD_BYTES in all) in batches of
PRELOAD_BATCH_BYTES, each into one buffer, and an idle tick() copies a finished batch into never-used KV
blocks as cached free blocks (the chains were written together, so whole prefixes come back): the first
request after a swap or a restart finds its prefix read already. The reads pause while requests run or wait
for reads of their own, and a request's hold() copies in only the batches read already that hold its own
blocks (the rest wait for idle ticks). Copying every batch read at a request's hold(), and a batch at any
tick, busy or not, held a restarted default model's first request (37 tokens: 2 blocks of its own) behind
up to 256 MB of copies: 0.51 s median from READY against 0.25 s without a store.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hotstart.engine.block_manager import BlockManager
from hotstart.engine.sequence import Sequence
from hotstart.model import kv_files

log = logging.getLogger("hotstart.engine")
DEFAULT_BUDGET = 4 << 30
DISK_RESERVE = 0.1  # the store never fills its filesystem past 90 %
FLUSH_IDLE_S = 0.5  # idle this long: write what is new
FLUSH_BUSY_S = 30.0  # busy: write what is new this often, at most FLUSH_BUSY_BYTES of it
FLUSH_IDLE_BYTES, FLUSH_BUSY_BYTES = 64 << 20, 8 << 20
QUEUED_MAX_BYTES = 256 << 20  # host copies waiting for the writer: past this, no new copies
CLOSE_S = 1.5  # at close: copying and writing what is left stops after this long
# preloaded at most: this share of the KV blocks, these bytes
PRELOAD_FRACTION, PRELOAD_BYTES = 0.25, 256 << 20
PRELOAD_BATCH_BYTES = 16 << 20  # read per job, copied per tick
PRELOAD_PAUSE_S = 0.05  # the preload's reads wait while requests run: checked this often
PRELOAD_THREADS = 2  # batches read side by side (the copies and checksums of page-cached files: CPU)


def budget_bytes(text: str | int | None) -> int:
    """--prefix-cache-disk: bytes (4G, 512M, 0); auto = $HOTSTART_PREFIX_CACHE_DISK, else 4 GiB."""
    text = str(text if text is not None else "auto").strip().lower()
    if text == "auto":
        env = os.environ.get("HOTSTART_PREFIX_CACHE_DISK", "").strip().lower()
        if not env or env == "auto":
            return DEFAULT_BUDGET
        text = env
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    body = text.removesuffix("b").removesuffix("i")
    scale = units.get(body[-1:], 1)
    try:
        return max(0, int(float(body[:-1] if scale > 1 else body) * scale))
    except ValueError:
        return 0


class _Thread(threading.Thread):
    """Runs the callables put on its queue, one at a time (I/O only)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: queue.Queue = queue.Queue()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                job()
            except Exception as e:  # noqa: BLE001 - a cache: a failed read or write is a miss
                log.warning("hotstart: engine: prefix cache on disk: %s", e)


class _Read:
    def __init__(self, seq: Sequence, then: Callable[[Sequence], None], chain: list[bytes],
                 wanted: list[bytes]) -> None:
        self.seq, self.then, self.chain, self.wanted = seq, then, chain, wanted
        self.buffer: bytearray | None = None  # wanted's payloads side by side (one buffer, no stacking)
        self.payloads: list[memoryview] = []  # of wanted's first blocks, as far as they read back
        self.done, self.cancelled = False, False


class PrefixStore:
    """One engine's blocks on disk (one layout folder). BLOCKS / RUNNER: the engine's block manager and
    model runner."""

    def __init__(self, blocks: BlockManager, runner, folder: Path, layout: bytes, budget: int) -> None:
        self.blocks, self.runner, self.folder, self.layout = blocks, runner, folder, layout
        self.budget = budget
        cache = runner.kv_cache  # [layers, 2, KVH, slots, D]
        self.block_shape = (*cache.shape[:3], blocks.block_size, cache.shape[4])
        self.block_bytes = cache[:, :, :, :blocks.block_size].numel() * cache.element_size()
        self.on_disk = kv_files.list_blocks(folder)
        self.restored = self.written = 0
        self._held: list[_Read] = []
        self._ready = threading.Event()
        self._queued = 0  # bytes copied out, not written yet
        self._lock = threading.Lock()
        self._last_flush = self._last_step = time.monotonic()
        self._seen = -1  # blocks.registered at the last flush: nothing new, no scan
        # a request's reads never queue behind a preload batch: the reader is theirs alone, the preloaders
        # read the most recent blocks (below) and pause while requests run
        self.reader, self.writer = _Thread("kv-read"), _Thread("kv-write")
        self.preloaders = [_Thread(f"kv-preload-{i}") for i in range(PRELOAD_THREADS)]
        for t in (self.reader, *self.preloaders):
            t.start()
        self.writer.start()
        limit = min(int(blocks.num_blocks * PRELOAD_FRACTION), PRELOAD_BYTES // max(1, self.block_bytes))
        recent = kv_files.recent_blocks(folder)[:limit] if blocks.enable_prefix_caching else []
        batch = max(1, PRELOAD_BATCH_BYTES // max(1, self.block_bytes))
        self.preloaded = 0
        self._preload: queue.SimpleQueue = queue.SimpleQueue()  # a batch read: [(hash, payload)], to copy in
        self._read_batches: list[tuple[set[bytes], tuple]] = []  # taken off _preload: (its hashes, batch)
        # every batch queued now, read back to back from the engine's start on (a swap's first request comes
        # right after READY, often for these very blocks); the reads pause while requests run or wait for
        # reads of their own, and stop when the never-used blocks run out or the store closes
        self._preload_left = 0  # batches not copied in yet
        self._preload_stop = False
        self._busy = False
        for j, i in enumerate(range(0, len(recent), batch)):
            self._preload_left += 1
            self.preloaders[j % PRELOAD_THREADS].jobs.put(lambda b=recent[i:i + batch]: self._read_loose(b))

    @classmethod
    def open(cls, core) -> PrefixStore | None:
        """The store of CORE's model and layout, or None (off: 0 bytes, no prefix caching, tensor
        parallel, or no private folder for it)."""
        cfg = core.cfg
        budget = budget_bytes(getattr(cfg, "prefix_cache_disk", "auto"))
        if not (budget and cfg.enable_prefix_caching and core.executor.world_size == 1):
            return None
        try:
            snapshot = kv_files.snapshot_key(cfg.model_path, list(cfg.weight_files))
            root = kv_files.kv_root()
            cache = core.runner.kv_cache
            shape = (*cache.shape[:3], cfg.block_size, cache.shape[4])
            layout = kv_files.layout_key(snapshot, shape, str(cache.dtype).removeprefix("torch."),
                                         cache.device.type, core.max_model_len)
            folder = kv_files.layout_folder(root, snapshot, layout)
            if not kv_files.usable_folder(folder):
                log.warning("hotstart: engine: prefix cache on disk off: %s is not a private folder of "
                            "this user", folder)
                return None
        except OSError as e:
            log.warning("hotstart: engine: prefix cache on disk off: %s", e)
            return None
        return cls(core.blocks, core.runner, folder, layout, budget)

    # ---- reading: the scheduler's gate ---------------------------------------------------------
    @property
    def pending(self) -> bool:
        return bool(self._held)

    def hold(self, seq: Sequence, then: Callable[[Sequence], None]) -> bool:
        """Hold SEQ (True) while the blocks of its prefix that are on disk and not in memory are read;
        THEN(seq) lets it in once they are in the cache."""
        blocks = self.blocks
        self._busy = True  # a request: the preload's reads pause before its first step (tick() resumes them)
        if not self.on_disk or not blocks.enable_prefix_caching or seq.skip_prefix_cache or seq.block_table:
            return False
        hashes = blocks._hashes(seq, (seq.num_tokens - 1) // blocks.block_size)  # noqa: SLF001
        if self._preload_left:  # batches read already that hold its blocks: copying beats reading
            self._take_read()
            need = {h for h in hashes if h not in blocks._cached}  # noqa: SLF001
            for entry in [e for e in self._read_batches if e[0] & need]:
                self._copy_read(entry)
        chain, wanted = [], []
        for h in hashes:
            if h not in blocks._cached:  # noqa: SLF001
                if h not in self.on_disk:
                    break
                wanted.append(h)
            chain.append(h)
        if not wanted:
            return False
        job = _Read(seq, then, chain, wanted)
        self._held.append(job)
        self.reader.jobs.put(lambda: self._read(job))
        return True

    def _read(self, job: _Read) -> None:
        try:
            n = self.block_bytes
            job.buffer = bytearray(len(job.wanted) * n)
            whole = memoryview(job.buffer)
            for i, h in enumerate(job.wanted):
                if job.cancelled:
                    break
                payload = whole[i * n:(i + 1) * n]
                if not kv_files.read_block_into(self.folder, self.layout, h, payload):
                    self.on_disk.discard(h)
                    break
                job.payloads.append(payload)
        finally:
            job.done = True
            self._ready.set()

    def _read_loose(self, hashes: list[bytes]) -> None:
        got: list[tuple[bytes, memoryview]] = []
        try:
            n = self.block_bytes
            whole = memoryview(bytearray(len(hashes) * n))  # read side by side: copied in without a stack
            for h in hashes:
                while (self._held or self._busy) and not self._preload_stop:  # requests have the cores
                    time.sleep(PRELOAD_PAUSE_S)  # (hints: no lock)
                if self._preload_stop:
                    break
                if h in self.blocks._cached:  # noqa: SLF001 - a request brought it back first (a hint: no lock)
                    continue
                at = len(got) * n
                if kv_files.read_block_into(self.folder, self.layout, h, whole[at:at + n]):
                    got.append((h, whole[at:at + n]))
                else:
                    self.on_disk.discard(h)
        finally:
            self._preload.put((got, whole if got else None))

    @property
    def preloading(self) -> bool:
        """Blocks are left to preload (the engine's idle wait should stay short)."""
        return self._preload_left > 0

    def _take_read(self) -> None:
        """Move the batches the preloaders finished into _read_batches."""
        while True:
            try:
                got = self._preload.get_nowait()
            except queue.Empty:
                return
            self._read_batches.append(({h for h, _ in got[0]}, got))

    def _preload_tick(self) -> bool:
        """Copy in one batch the preloaders finished (an idle engine's next request waits for one batch's
        copy at most); False: none."""
        self._take_read()
        if not self._read_batches:
            return False
        self._copy_read(self._read_batches[0])
        return True

    def _copy_read(self, entry: tuple[set[bytes], tuple]) -> None:
        """Copy in ENTRY, one of _read_batches, and drop it from them."""
        self._read_batches.remove(entry)
        self._preload_left -= 1
        self._copy_preloaded(entry[1])

    def _copy_preloaded(self, batch: tuple[list[tuple[bytes, memoryview]], memoryview | None]) -> None:
        """Copy a batch read into free KV blocks (never in use, never evicting a cached block: only while
        blocks that were never used are left; else the rest of the preload is dropped)."""
        blocks = self.blocks
        got, whole = batch
        ids, data, where = [], [], []
        for i, (h, payload) in enumerate(got):
            if h in blocks._cached:  # noqa: SLF001
                continue
            if blocks._fresh > blocks.num_blocks:  # noqa: SLF001 - no never-used block left: evict none
                self._preload_stop = True
                break
            block = blocks.restore(h)
            if block is None:
                break
            ids.append(block)
            data.append(payload)
            where.append(i)
        if ids:
            self.runner.write_blocks(ids, self._host(data, where, whole))
            self.preloaded += len(ids)

    def cancel(self, seq: Sequence) -> None:
        for job in self._held:
            if job.seq is seq:
                job.cancelled = True

    def admit(self, wait: float) -> None:
        """Copy the blocks read since the last call into the cache and let their sequences in; with
        WAIT > 0 and nothing read yet, wait that long for a read first."""
        if not any(job.done for job in self._held) and wait > 0:
            self._ready.wait(wait)
        self._ready.clear()
        done = [job for job in self._held if job.done]
        if not done:
            return
        self._held = [job for job in self._held if not job.done]
        for job in done:
            self._restore(job)
            if not job.cancelled:
                job.then(job.seq)

    def _restore(self, job: _Read) -> None:
        blocks = self.blocks
        got = {h: (i, p) for i, (h, p) in enumerate(zip(job.wanted, job.payloads))}
        ids, data, where = [], [], []
        for h in job.chain:  # in chain order, each most recently freed: restoring the rest evicts none
            if h in blocks._cached:  # noqa: SLF001
                blocks.touch(h)
                continue
            i, payload = got.get(h, (-1, None))
            block = blocks.restore(h) if payload is not None else None
            if block is None:
                break
            ids.append(block)
            data.append(payload)
            where.append(i)
        if ids:
            self.runner.write_blocks(ids, self._host(data, where, memoryview(job.buffer)))
            self.restored += len(ids)

    def _host(self, data: list[memoryview], where: list[int], whole: memoryview | None) -> torch.Tensor:
        """DATA's payloads as one tensor [n, layers, 2, KVH, block size, D]: a view of WHOLE, the buffer
        they were read into side by side, where they are its first n (WHERE: their places in it), else a
        stacked copy."""
        dtype, n = self.runner.kv_cache.dtype, len(data)
        if whole is not None and where == list(range(n)):
            return torch.frombuffer(whole[:n * self.block_bytes], dtype=dtype).view(n, *self.block_shape)
        return torch.stack([torch.frombuffer(p, dtype=dtype) for p in data]).view(n, *self.block_shape)

    # ---- writing -------------------------------------------------------------------------------
    def tick(self, idle: bool) -> None:
        """Between steps: write what is new once idle for FLUSH_IDLE_S, else every FLUSH_BUSY_S."""
        now = time.monotonic()
        self._busy = not idle
        if self._preload_left and idle:
            self._preload_tick()
        if not idle:
            self._last_step = now
        if idle and now - self._last_step >= FLUSH_IDLE_S and now - self._last_flush >= FLUSH_IDLE_S:
            self.flush(FLUSH_IDLE_BYTES)
        elif now - self._last_flush >= FLUSH_BUSY_S:
            self.flush(FLUSH_BUSY_BYTES)

    def flush(self, max_bytes: int) -> int:
        """Copy up to MAX_BYTES of cached blocks not on disk yet to the host and queue their writes."""
        self._last_flush = time.monotonic()
        if self.blocks.registered == self._seen:
            return 0
        with self._lock:
            room = QUEUED_MAX_BYTES - self._queued
        n = min(max_bytes, room) // self.block_bytes
        todo = [(h, b) for h, b in self.blocks._cached.items() if h not in self.on_disk][:n]  # noqa: SLF001
        if len(todo) < n:
            self._seen = self.blocks.registered  # everything registered is on disk or queued
        if not todo:
            return 0
        host = self.runner.read_blocks([b for _, b in todo])  # [n, layers, 2, KVH, bs, D], a copy
        raw = host.view(torch.uint8).numpy()
        self.on_disk.update(h for h, _ in todo)
        with self._lock:
            self._queued += raw.nbytes
        self.writer.jobs.put(lambda: self._write([h for h, _ in todo], raw))
        return len(todo)

    def _write(self, hashes: list[bytes], raw) -> None:
        try:
            for i, h in enumerate(hashes):
                try:
                    kv_files.write_block(self.folder, self.layout, h, raw[i])
                    self.written += 1
                except OSError as e:
                    self.on_disk.difference_update(hashes[i:])
                    log.warning("hotstart: engine: prefix cache on disk: writing a block: %s", e)
                    break
            kv_files.enforce_budget(self.folder.parent.parent, self.budget, DISK_RESERVE)
        finally:
            with self._lock:
                self._queued -= raw.nbytes

    def sync(self, timeout: float = CLOSE_S) -> None:
        """Write what is left and wait for the writer (both bounded by TIMEOUT)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.flush(FLUSH_IDLE_BYTES):
            pass
        written = threading.Event()
        self.writer.jobs.put(written.set)
        written.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """sync(), then stop its threads."""
        self._preload_stop = True
        self.sync()
        for t in (self.reader, *self.preloaders, self.writer):
            t.jobs.put(None)

    def stats(self) -> dict[str, int]:
        return {"prefix_disk_blocks": len(self.on_disk),
                "prefix_disk_restored": self.restored + self.preloaded,
                "prefix_disk_written": self.written}
