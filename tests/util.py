"""Helpers shared by tests (importable as `util`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def no_torch_in(module: str) -> tuple[bool, str]:
    """Import MODULE in a fresh interpreter; report whether torch/transformers got imported."""
    code = (f"import {module}, sys, json; "
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    heavy = json.loads(out.stdout.strip().splitlines()[-1])
    return not heavy, ",".join(heavy)
