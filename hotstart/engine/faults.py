"""`--debug-fault`: requests that fail or crash the engine on purpose (off unless set).

For rehearsing what clients, proxies and monitoring see when one request breaks the engine, without
waiting for a real bug (docs/reliability.md): `ACTION@TOKEN_ID[,ACTION@TOKEN_ID...]`, where a request
whose prompt holds token id TOKEN_ID makes the engine
  add    raise while adding it (that request fails: a 500, or an SSE error event)
  step   raise in the forward of every step that runs it (it fails; the others of the step run again
         without it, engine/step_guard.py)
  crash  SIGKILL its own process in such a step (the server replaces the engine and fails the requests in
         flight; one in flight at two deaths in a row is then refused as a poison request)
Parsed by config.parse_debug_faults (stdlib); checked here on the engine's thread (no cost when unset:
the engine calls these only when the table is not empty).
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

from hotstart.config import parse_debug_faults

if TYPE_CHECKING:
    from hotstart.engine.sequence import Sequence

parse = parse_debug_faults


class InjectedFault(RuntimeError):
    """The failure --debug-fault asked for."""


def check(faults: dict[int, str], stage: str, token_ids: list[int]) -> None:
    """Raise (STAGE "add"), or kill this process ("crash"), if TOKEN_IDS hold a token of that action."""
    hit = [t for t in set(token_ids) if t in faults]
    for token in hit:
        if faults[token] == "crash" and stage == "step":
            os.kill(os.getpid(), signal.SIGKILL)
        if faults[token] == stage:
            raise InjectedFault(f"--debug-fault {stage}@{token}")


def check_step(faults: dict[int, str], batch: list[tuple[Sequence, int]]) -> None:
    """The step's check: every sequence of BATCH by its prompt."""
    for seq, _ in batch:
        check(faults, "step", seq.token_ids[:seq.prompt_len])
