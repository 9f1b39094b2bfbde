"""Engine deaths as one engine's supervisor counts them (torch-free): the crash-loop backoff, the requests
in flight at each death, and poison requests.

- `record(what, in_flight)` at each death names the requests that were in flight (the log line) (their ids and
  fingerprints: a hash of the prompt's token ids and the sampling parameters; never their text) and marks
  a fingerprint that was in flight at this death and at the one before as poison (POISON_S).
- `refusal(ids, params)`: the 422 `poison_request` a poison request's retry gets, before it reaches the
  engine (the client's own retries, openai's included, would kill it again).
- `backoff(now)`: past the crash-loop limit (more than MAX_DEATHS within WINDOW_S) the next engine starts
  only after a delay: --engine-restart-backoff, doubled each time the loop goes on (a death of an engine
  that has not served WINDOW_S since the last backoff), at most BACKOFF_MAX_S.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import msgspec

from hotstart.errors import RequestError

if TYPE_CHECKING:
    from hotstart.sampling_params import SamplingParams

log = logging.getLogger("hotstart")
WINDOW_S = 60.0
MAX_DEATHS = 5  # more deaths than this within WINDOW_S: a crash loop
BACKOFF_MAX_S = 300.0
POISON_S = 600.0  # a poison request is refused this long after its last death
MAX_POISON = 1024  # fingerprints kept (the oldest go first)
LISTED = 8  # requests named in a death's log line (the count is always given)
_encode = msgspec.msgpack.Encoder().encode


def fingerprint(prompt_token_ids: list[int], params: SamplingParams) -> str:
    """16 hex digits naming a request by its prompt and parameters (the same retry, the same name)."""
    return hashlib.blake2b(_encode([prompt_token_ids, params]), digest_size=8).hexdigest()


class CrashLog:
    """One engine's deaths. IN_FLIGHT at a death: {request id: (prompt ids, params)}."""

    def __init__(self, backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self.deaths = 0  # since start
        self.recent: list[float] = []  # monotonic times of the deaths within WINDOW_S
        self.level = 0  # backoffs in a row (the delay doubles with each)
        self.probation = False  # the engine started after a backoff has not served WINDOW_S yet
        self.ready_since: float | None = None
        self.backoff_until: float | None = None  # monotonic; None: not backing off
        self.last_death = ""
        self._seen: dict[str, int] = {}  # fingerprint -> deaths in a row it was in flight at
        self._last: set[str] = set()  # fingerprints in flight at the last death
        self._poison: OrderedDict[str, tuple[float, int, str]] = OrderedDict()  # fp -> (until, deaths, why)

    def ready(self, now: float) -> None:
        self.ready_since = now

    def record(self, what: str, in_flight: dict[str, tuple[list[int], SamplingParams]], now: float) -> str:
        """A death (WHAT ended the engine) with IN_FLIGHT requests: count them, mark poison; returns the
        log line naming them."""
        self.deaths += 1
        self.last_death = what
        if self.ready_since is not None and now - self.ready_since >= WINDOW_S:
            self.level, self.probation = 0, False  # it served a whole window: the loop is over
        self.ready_since = None
        self.recent = [t for t in self.recent if now - t < WINDOW_S] + [now]
        prints = {rid: fingerprint(*req) for rid, req in in_flight.items()}
        seen = {}
        for fp in set(prints.values()):
            seen[fp] = self._seen.get(fp, 0) + 1 if fp in self._last else 1
            if seen[fp] >= 2:
                self._poison[fp] = (now + POISON_S, seen[fp], what)
                self._poison.move_to_end(fp)
                while len(self._poison) > MAX_POISON:
                    self._poison.popitem(last=False)
        self._seen, self._last = seen, set(seen)
        named = ", ".join(f"{rid} [{fp}]" for rid, fp in list(prints.items())[:LISTED])
        more = f" and {len(prints) - LISTED} more" if len(prints) > LISTED else ""
        poison = sorted(fp for fp, n in seen.items() if n >= 2)
        return (f"hotstart: engine death {self.deaths}: {len(prints)} requests in flight"
                f"{f': {named}' if named else ''}{more}"
                + (f"; poison (in flight at 2+ deaths in a row, refused for {POISON_S:.0f} s): "
                   f"{', '.join(poison)}" if poison else ""))

    def crash_loop(self) -> bool:
        """This death makes a crash loop: too many within the window, or one during the probation."""
        return len(self.recent) > MAX_DEATHS or self.probation

    def backoff(self, now: float) -> float:
        """Enter a backoff: the delay before the next engine start (it grows while the loop goes on)."""
        delay = min(BACKOFF_MAX_S, self.backoff_s * 2 ** self.level)
        self.level += 1
        self.recent, self.probation = [], True
        self.backoff_until = now + delay
        return delay

    def retry_after(self, now: float) -> float | None:
        """Seconds until the next engine start while backing off, else None."""
        if self.backoff_until is None:
            return None
        return max(1.0, self.backoff_until - now)

    def refusal(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestError | None:
        """The 422 for a poison request, else None (no cost while nothing is poison)."""
        if not self._poison:
            return None
        fp = fingerprint(prompt_token_ids, params)
        entry = self._poison.get(fp)
        if entry is None:
            return None
        until, deaths, what = entry
        if time.monotonic() > until:
            del self._poison[fp]
            return None
        return RequestError(
            422, f"this request (fingerprint {fp}) was in flight at {deaths} engine deaths in a row, the "
                 f"last: {what}; it is refused for {until - time.monotonic():.0f} s more to keep the engine "
                 "up (a poison request: change the prompt or the parameters, or report it)",
            code="poison_request")
