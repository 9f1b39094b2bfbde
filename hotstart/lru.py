"""A least-recently-used cache bounded in entries and in bytes, keyed by a digest (torch-free, stdlib only).

Caches of request-derived values (grammars built from a request's schema, compiled matchers) must not hold
what a request sent as their key, nor grow with what it sent: the key is the SHA-256 of the parts that
define the value, and each entry counts the bytes its caller says it holds.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any


def digest(*parts: str | bytes) -> bytes:
    """SHA-256 of PARTS, each length-prefixed (so ("ab", "c") and ("a", "bc") differ)."""
    h = hashlib.sha256()
    for p in parts:
        raw = p.encode("utf-8", "surrogatepass") if isinstance(p, str) else p
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.digest()


class ByteLRU:
    """At most MAX_ITEMS entries and MAX_BYTES of their stated sizes; the least recently used go first. An
    entry larger than MAX_BYTES alone is not kept."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes, default: Any = None) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            return default
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, value: Any, size: int) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if size > self.max_bytes:
            return
        self._entries[key] = (value, size)
        self.bytes += size
        while len(self._entries) > self.max_items or self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
