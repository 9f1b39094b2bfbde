"""Stop strings on streamed text (torch-free): linear in the text, whatever the strings' lengths.

Each stop string has a Knuth-Morris-Pratt automaton whose state is the longest prefix of the string that
the text seen so far ends with. A character moves every state in amortized O(1), so a token costs
O(len(delta) x number of strings), never a rescan of the text; the text that may still become a stop
string (held back, never released early) is the longest of those prefixes. A delta in which no string
is part-way matched and that holds none of their first characters leaves every state at 0 and costs one
set test (the common case).
"""

from __future__ import annotations


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = the longest proper prefix of s[:i+1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopStringFilter:
    """Cuts text at the first stop string; never releases text that may still become one.

    feed() returns what is safe to send: all but the longest suffix that is a prefix of some stop string
    (held back until later text proves it is not one, or finish()). When a delta completes stop strings,
    the text is cut where the earliest of them starts (as vLLM: each string's first occurrence in the new
    text). KEEP: the released text is kept (`text`, for whole answers); a stream passes False and only the
    held-back tail is kept.
    """

    def __init__(self, stops: list[str], keep: bool = True) -> None:
        self.stops = stops
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)
        self._firsts = frozenset(s[0] for s in stops if s)
        self._released: list[str] | None = [] if keep else None
        self._pending = ""  # text not released yet: a possible beginning of a stop string
        self.stopped = False

    @property
    def text(self) -> str:
        """The text released so far and what is held back (all of it once finished), when kept."""
        return "".join(self._released or ()) + self._pending

    def feed(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return self._release(delta, "")
        text, base = self._pending + delta, len(self._pending)
        if not any(self._state) and self._firsts.isdisjoint(delta):
            return self._release(text, "")
        cut = self._advance(delta, base)
        if cut is not None:
            self.stopped = True
            return self._release(text[:cut], "")
        hold = max(self._state)
        return self._release(text[:len(text) - hold], text[len(text) - hold:] if hold else "")

    def _advance(self, delta: str, base: int) -> int | None:
        """Moves every automaton over DELTA (which starts at BASE in the pending text); the start of the
        earliest stop string completed in DELTA, or None."""
        cut = None
        for i, s in enumerate(self.stops):
            k, fail, n = self._state[i], self._fail[i], len(s)
            for j, ch in enumerate(delta):
                while k and s[k] != ch:
                    k = fail[k - 1]
                if s[k] == ch:
                    k += 1
                if k == n:  # a whole stop string ends at base + j
                    start = base + j + 1 - n
                    cut = start if cut is None else min(cut, start)
                    k = fail[k - 1]
                    break  # its first occurrence is the one that counts
            self._state[i] = k
        return cut

    def finish(self) -> str:
        return self._release(self._pending, "")

    def _release(self, out: str, pending: str) -> str:
        self._pending = pending
        if self._released is not None and out:
            self._released.append(out)
        return out
