"""The fast path's state machine: one enum (messages.FastPathState, shared with the API process) and
its transitions, all in transition(). Three kinds of things move along it:

  packing stage   PLANNED -> PACKING -> PACKED            (oneDNN-prepacked weights, pack.py)
  compile stage   PLANNED -> COMPILING -> READY           (every bucket settled, ready or failed)
  one bucket      PLANNED -> COMPILING -> READY           (its layer graph loaded, layer_graphs.py)
  any of them     PLANNED -> OFF (not built here: why),   PLANNED | PACKING | COMPILING -> FAILED (why)

Final states (PACKED, READY, FAILED, OFF) never move again.
"""

from __future__ import annotations

from hotstart.messages import FastPathState as S


class IllegalTransition(RuntimeError):
    pass


def transition(what: str, now: S, to: S) -> S:
    """The state after moving WHAT (a stage or bucket, for the error) from NOW to TO; raises
    IllegalTransition where the machine has no such edge."""
    match now, to:
        case S.PLANNED, S.PACKING | S.COMPILING | S.OFF | S.FAILED:
            return to
        case S.PACKING, S.PACKED | S.FAILED:
            return to
        case S.COMPILING, S.READY | S.FAILED:
            return to
    raise IllegalTransition(f"fast path: {what} cannot go from {now.value} to {to.value}")


class Stage:
    """One stage or bucket: its state and the detail that goes with it (why OFF / FAILED, what READY)."""

    def __init__(self, what: str, state: S = S.PLANNED, detail: str = ""):
        self.what, self.state, self.detail = what, state, detail

    def move(self, to: S, detail: str = "") -> None:
        self.state = transition(self.what, self.state, to)
        self.detail = detail

    def active(self) -> bool:
        return self.state in (S.PACKING, S.COMPILING)

    def pending(self) -> bool:
        """Not final yet."""
        return self.state in (S.PLANNED, S.PACKING, S.COMPILING)
