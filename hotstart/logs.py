"""One logging setup for every hotstart process (the API process, the forkserver, the engine ranks).

Records go to stderr as their bare message: the lines read "hotstart: ..." as they always have (tests
and users grep for them). Each process logs through its own child of the "hotstart" logger (its name
is the record's %(name)s). Torch-free, stdlib only.
"""

from __future__ import annotations

import logging
import sys

ROOT = "hotstart"


def setup(process: str, level: str = "info") -> logging.Logger:
    """Send log records at LEVEL and above to this process's stderr (a no-op if logging is configured
    already: a forked engine keeps its parent's setup); the logger of PROCESS ("api", "engine", ...)."""
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(message)s", stream=sys.stderr)
    return logging.getLogger(f"{ROOT}.{process}")
