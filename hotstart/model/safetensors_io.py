"""A strict, zero-copy safetensors reader (header parsed here; tensors are views of an mmap).

Parsing the header ourselves gives the loader the byte layout (to read in file order, to report
progress to the prefetcher) and lets it detect truncated or inconsistent files with a clear message.
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hotstart.errors import WeightsError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
PAGE = mmap.PAGESIZE
TOUCH_IDLE_S = 10.0  # a PageToucher's thread ends after this long without work (a load that raised)
# Touching threads: the first touch of a page is CPU work (the hypervisor's, ~1.8 us per 4 KiB here), and
# a cold read's floor reader pays it on 4 threads; pieces of 32 MiB let them share a large tensor.
TOUCH_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2))
TOUCH_PIECE = 32 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One .safetensors file: header validated on open, tensors served as views of a private mmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot open: {e.strerror}") from None
        try:
            self.size = os.fstat(self._fd).st_size
            self.tensors = self._parse_header()
            # ACCESS_COPY (MAP_PRIVATE): writable views for torch.frombuffer without copying the file.
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY) if self.size else None
        except BaseException:
            os.close(self._fd)
            raise

    def _parse_header(self) -> dict[str, TensorInfo]:
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise WeightsError(f"{self.path}: truncated safetensors file ({self.size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > self.size:
            raise WeightsError(
                f"{self.path}: invalid or truncated safetensors header (header length {n}, file "
                f"{self.size} bytes)"
            )
        try:
            raw = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{self.path}: corrupt safetensors header: {e}") from None
        if not isinstance(raw, dict):
            raise WeightsError(f"{self.path}: corrupt safetensors header: not an object")
        base = 8 + n
        out: dict[str, TensorInfo] = {}
        for name, meta in raw.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"{self.path}: tensor '{name}' has a malformed header entry") from None
            if dtype not in DTYPES:
                raise WeightsError(f"{self.path}: tensor '{name}' has unsupported dtype {dtype}")
            numel = 1
            for d in shape:
                numel *= d
            itemsize = DTYPES[dtype].itemsize
            if end - begin != numel * itemsize or begin < 0:
                raise WeightsError(
                    f"{self.path}: tensor '{name}' byte range does not match shape {list(shape)} {dtype}"
                )
            if base + end > self.size:
                raise WeightsError(
                    f"{self.path}: truncated: tensor '{name}' ends at byte {base + end}, file has "
                    f"{self.size} bytes"
                )
            out[name] = TensorInfo(name, dtype, shape, base + begin, base + end)
        return out

    def in_file_order(self) -> list[TensorInfo]:
        return sorted(self.tensors.values(), key=lambda t: t.start)

    def get(self, info: TensorInfo) -> torch.Tensor:
        """A CPU tensor viewing the file's bytes (no copy; pages come from the page cache on touch)."""
        dtype = DTYPES[info.dtype]
        if info.end == info.start:
            return torch.empty(info.shape, dtype=dtype)
        flat = torch.frombuffer(
            self._mm, dtype=dtype, count=(info.end - info.start) // dtype.itemsize, offset=info.start
        )
        return flat.view(info.shape)

    def populate(self, info: TensorInfo) -> None:
        """Make the tensor's pages resident and mapped now (one syscall; a no-op cost when the
        prefetcher already read them), so the first forward pass does not fault them in from disk."""
        if self._mm is None or info.end == info.start:
            return
        start = info.start // PAGE * PAGE
        try:
            self._mm.madvise(MADV_POPULATE_READ, start, info.end - start)
        except (OSError, ValueError):  # older kernels: ask for readahead instead
            try:
                self._mm.madvise(mmap.MADV_WILLNEED, start, info.end - start)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        # The mmap stays alive as long as tensors view it (they hold a buffer reference).
        os.close(self._fd)


class PageToucher:
    """Reads one element per page of each tensor handed to it, in background threads (TOUCH_THREADS).

    On the dev VM the first CPU access to a page-cache page just filled from disk costs ~1.7 us per
    4 KiB page (the hypervisor maps the frame on that first access: 6.1 s to copy 13.8 GB of freshly
    read weights once, 0.43 s the second time). MADV_POPULATE_READ and the zero-copy prefetch never
    touch the data, so without this the first forward pass pays it, after READY (a 7B-shaped model:
    ~22 CPU-seconds in the first request, docs/prefetch.md). Touching each tensor as soon as the loader
    has populated it overlaps that cost with the disk reads of the tensors after it; on warm pages it
    is ~30 ms for 14 GB. The first tensor is touched in the caller's thread (so the op's first use,
    with whatever it initialises, never happens in the background). Never raises."""

    def __init__(self, threads: int | None = None):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._n = threads or TOUCH_THREADS
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.touched = 0  # bytes

    def touch(self, tensor: torch.Tensor) -> None:
        if not self._threads:
            self._touch(tensor)
            self._threads = [threading.Thread(target=self._run, name="hotstart-page-touch", daemon=True)
                             for _ in range(self._n)]
            for t in self._threads:
                t.start()
            return
        flat = tensor.view(-1)  # in pieces, so that the threads share a large tensor (an embedding)
        step = max(1, TOUCH_PIECE // max(1, tensor.element_size()))
        for i in range(0, flat.numel(), step):
            self._q.put(flat[i:i + step])

    def _touch(self, tensor: torch.Tensor) -> None:
        try:
            if tensor.numel():
                tensor.reshape(-1)[:: max(1, PAGE // tensor.element_size())].sum()
                with self._lock:
                    self.touched += tensor.nbytes
        except Exception:  # noqa: BLE001, S110 - best effort: the forward pass touches what this did not
            pass

    def _run(self) -> None:
        while True:
            try:
                tensor = self._q.get(timeout=TOUCH_IDLE_S)
            except queue.Empty:
                return
            if tensor is None:
                return
            self._touch(tensor)

    def close(self, timeout: float | None = None) -> None:
        """Wait until everything handed over is touched (at most TIMEOUT s in all)."""
        for _ in self._threads:
            self._q.put(None)
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
