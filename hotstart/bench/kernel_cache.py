"""The CPU kernel library in a benchmark's fresh $HOTSTART_HOME.

`bench remote` gives every cold run an empty $HOTSTART_HOME (no weights cached). Left at that, each run
also compiles the kernel library (~15 s of g++ on 2 cores, beside the download and the first answers)
while the serial baseline's `hotstart serve FOLDER` finds the library its round's earlier run built: the
two configs would start from different states. So the library is built once, here, and copied into every
fresh home before its server starts, as on a node whose image was built with it; `--kernels cold` measures
the other case (every run builds it, the baseline's too).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hotstart.errors import HotstartError
from hotstart.trust import record_path

BUILD = "from hotstart.model.cpu_kernels import build, compiler; print(build() if compiler() else '')"


def built_library(timeout_s: float = 300.0) -> Path | None:
    """This host's kernel library in the user's $HOTSTART_HOME, built now if it is not (in a child: the
    bench process does not import torch). None where no compiler is installed (servers run without)."""
    got = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=timeout_s)
    if got.returncode != 0:
        why = got.stderr.strip()[-300:]
        raise HotstartError(f"bench remote: building the CPU kernel library failed: {why}")
    line = got.stdout.strip()
    return Path(line) if line else None


def seed_home(home: Path, library: Path | None) -> None:
    """Copy LIBRARY and its sha256 record into HOME/kernels (private, as the server makes it)."""
    if library is None:
        return
    dest = Path(home) / "kernels"
    if (dest / library.name).exists():
        return
    dest.mkdir(parents=True, exist_ok=True)
    for p in (Path(home), dest):
        os.chmod(p, 0o700)
    for src in (library, record_path(library)):
        if src.exists():
            shutil.copy2(src, dest / src.name)
