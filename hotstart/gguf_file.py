"""A GGUF file's header: metadata and tensor layout, read torch-free and numpy-free (the API process reads
it for the config and the tokenizer; the engine maps the tensors, model/gguf_loader.py).

Why not the `gguf` package's GGUFReader: it builds numpy views for every element of every metadata
array, 2.2 s for the default model's 49,152 tokens and 48,900 merges on the dev machine, where this reads
the same header in ~0.1 s; its output is the reference in tests/model/test_gguf_file.py (every field
and tensor of several files equal). The format (GGUF v2 and v3, little-endian): magic "GGUF", version
u32, tensor count u64, metadata count u64; metadata as (key, type u32, value); tensor infos as (name,
n_dims u32, dims u64 x n_dims (fastest first), ggml type u32, offset u64); tensor data from the next
multiple of `general.alignment` (32) on, each tensor at its offset from there.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from hotstart.errors import WeightsError

MAGIC = b"GGUF"
MAX_COUNT = 1 << 24  # more tensors, keys or array items than this is a corrupt header, not a model
# ggml type id -> (name, elements per block, bytes per block): the types served (ggml.h / ggml.c)
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
TYPE_IDS = {name: i for i, (name, _, _) in TYPES.items()}
FLOAT_TYPES = ("F32", "F16", "BF16")
# ggml types that exist but are not served, for the refusal's wording
OTHER_TYPES = {9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
               19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
               26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
# metadata value type -> struct code (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # TYPES' name, e.g. "Q4_K"
    ggml_type: int
    shape: tuple[int, ...]  # torch order (rows first): GGUF's dims reversed
    start: int  # absolute byte offset in the file
    end: int

    @property
    def quantized(self) -> bool:
        return self.type_name not in FLOAT_TYPES

    @property
    def row_bytes(self) -> int:
        _, block, size = TYPES[self.ggml_type]
        return self.shape[-1] // block * size


def _short(x: float) -> float:
    """A float32 as the shortest decimal that rounds back to it (1e-05, not 9.999999747378752e-06: what
    the converter wrote, as the original config.json spelled it)."""
    for digits in range(6, 10):
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == struct.pack("<f", x):
            return y
    return x


_U64 = struct.Struct("<Q")


class SkippedStrings:
    """A string array a GGUFFile opened with text_arrays=False walked over without reading (its count)."""

    __slots__ = ("count",)

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"SkippedStrings({self.count})"


class _Header:
    """A bounds-checked cursor over the header bytes: a short read is a truncated file."""

    def __init__(self, buf, path: Path, text_arrays: bool = True):
        self.buf, self.pos, self.path, self.text_arrays = buf, 0, path, text_arrays

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise WeightsError(f"{self.path}: truncated GGUF header (needs byte {start + n}, file has "
                               f"{len(self.buf)})")
        self.pos = start + n
        return start

    def scalar(self, code: str):
        value = struct.unpack_from("<" + code, self.buf, self.take(struct.calcsize(code)))[0]
        return _short(value) if code == "f" else value

    def count(self, what: str) -> int:
        n = self.scalar("Q")
        if n > MAX_COUNT:
            raise WeightsError(f"{self.path}: corrupt GGUF header ({what} count {n})")
        return n

    def string(self, what: str) -> str:
        n = self.scalar("Q")
        start = self.take(n)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise WeightsError(f"{self.path}: GGUF {what} is not UTF-8 text") from None

    def value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string(f"key '{key}'")
        if vtype != 9:
            raise WeightsError(f"{self.path}: GGUF key '{key}' has an unknown value type {vtype}")
        item, n = self.scalar("I"), self.count(f"key '{key}' array")
        if item in _SCALARS:  # one slice, not n reads: vocabularies have 10^5 scores and types
            code = _SCALARS[item]
            size = struct.calcsize(code)
            start = self.take(n * size)
            return list(struct.unpack_from(f"<{n}{code}", self.buf, start))  # float32: exact values
        if item == 8:
            return self.strings(n, key)
        return [self.value(item, key) for _ in range(n)]

    def strings(self, n: int, key: str) -> list[str] | SkippedStrings:
        """N length-prefixed strings (a vocabulary's tokens and merges: 10^5 of them) in one loop; with
        text_arrays off only walked over (SkippedStrings): the engine reads none of them."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        out: list[str] | None = [] if self.text_arrays else None
        length = _U64.unpack_from
        for _ in range(n):
            if pos + 8 > end:
                self.pos = pos
                self.take(8)  # raises: truncated
            m = length(buf, pos)[0]
            pos += 8
            if pos + m > end:
                self.pos = pos
                self.take(m)  # raises: truncated
            if out is not None:
                try:
                    out.append(str(buf[pos:pos + m], "utf-8"))
                except UnicodeDecodeError:
                    raise WeightsError(f"{self.path}: GGUF key '{key}' array is not UTF-8 text") from None
            pos += m
        self.pos = pos
        return out if out is not None else SkippedStrings(n)


class GGUFFile:
    """PATH's header, validated on open: `fields` (key -> value; arrays as lists), `tensors` (name ->
    TensorInfo, in file order), `version`, `data_offset`, `size`. Raises WeightsError naming the file: not
    GGUF, another version, truncated, a tensor of a type not served or past the end of the file."""

    def __init__(self, path: str | Path, text_arrays: bool = True):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size < 24:
                    raise WeightsError(f"{self.path}: not a GGUF file ({self.size} bytes)")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot read: {e.strerror or e}") from None
        try:
            self._parse(mm, text_arrays)
        finally:
            mm.close()

    def _parse(self, mm: mmap.mmap, text_arrays: bool) -> None:
        h = _Header(memoryview(mm), self.path, text_arrays)
        try:
            self._read(h)
        finally:
            h.buf.release()

    def _read(self, h: _Header) -> None:
        magic = bytes(h.buf[h.take(4):4])
        if magic != MAGIC:
            raise WeightsError(f"{self.path}: not a GGUF file (starts with {magic!r}, not b'GGUF')")
        self.version = h.scalar("I")
        if self.version not in (2, 3):
            swapped = struct.unpack("<I", struct.pack(">I", self.version))[0]
            kind = "a big-endian GGUF file" if swapped in (2, 3) else f"GGUF version {self.version}"
            raise WeightsError(f"{self.path}: {kind} is not supported (little-endian GGUF v2 or v3)")
        n_tensors, n_keys = h.count("tensor"), h.count("metadata")
        self.fields: dict[str, object] = {}
        for _ in range(n_keys):
            key = h.string("key")
            self.fields[key] = h.value(h.scalar("I"), key)
        infos = []
        for _ in range(n_tensors):
            name = h.string("tensor name")
            n_dims = h.scalar("I")
            if n_dims > 4:
                raise WeightsError(f"{self.path}: tensor '{name}' has {n_dims} dimensions")
            dims = [h.scalar("Q") for _ in range(n_dims)]
            infos.append((name, tuple(reversed(dims)), h.scalar("I"), h.scalar("Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise WeightsError(f"{self.path}: GGUF key 'general.alignment' must be a power of 2, "
                               f"got {align!r}")
        self.data_offset = -(-h.pos // align) * align
        self.tensors = self._tensors(infos)

    def _tensors(self, infos: list) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for name, shape, gtype, offset in sorted(infos, key=lambda t: t[3]):
            if gtype not in TYPES:
                kind = OTHER_TYPES.get(gtype, f"ggml type {gtype}")
                raise WeightsError(f"{self.path}: tensor '{name}' has type {kind}, which hotstart does not "
                                   f"serve (served: {', '.join(TYPE_IDS)})")
            type_name, block, size = TYPES[gtype]
            if not shape or shape[-1] % block:
                raise WeightsError(f"{self.path}: tensor '{name}' of type {type_name} has {list(shape)} "
                                   f"elements: rows must be whole blocks of {block}")
            rows = 1
            for d in shape[:-1]:
                rows *= d
            start = self.data_offset + offset
            end = start + rows * (shape[-1] // block) * size
            if end > self.size:
                raise WeightsError(f"{self.path}: truncated: tensor '{name}' ends at byte {end}, the file "
                                   f"has {self.size}")
            if name in out:
                raise WeightsError(f"{self.path}: tensor '{name}' appears twice")
            out[name] = TensorInfo(name, type_name, gtype, shape, start, end)
        return out

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


@functools.lru_cache(maxsize=8)
def _lean(path: str, size: int, mtime_ns: int) -> GGUFFile:  # noqa: ARG001 - the key: this version of the file
    return GGUFFile(path, text_arrays=False)


def lean_header(path: str | Path) -> GGUFFile:
    """PATH's header without the vocabulary's text (text_arrays=False), parsed once per process for each
    version of the file: the engine reads it for its config and again for its loader (~20 ms each on
    the default model). Callers do not modify it."""
    try:
        st = os.stat(path)
    except OSError:
        return GGUFFile(path, text_arrays=False)  # raises the one-line error
    return _lean(str(path), st.st_size, st.st_mtime_ns)


def is_gguf(path: str | Path) -> bool:
    """PATH is a file that starts with GGUF's magic (or, unreadable, is named *.gguf)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return str(path).endswith(".gguf")
