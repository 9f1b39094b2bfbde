"""Model folders the tests build (beside tests/conftest.py's tiny transformers checkpoints)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"  # chat templates, the hostile-request corpus
EXTRA_IDS = 64  # make_tiny's logits are this much wider than the tokenizer's vocabulary


def make_tiny(out, template=None):
    """`hotstart make-model --family qwen2 --size tiny`: the default tokenizer (49152 ids) and logits 64
    ids wider, which no grammar may ever allow; TEMPLATE replaces its chat template."""
    cmd = [sys.executable, "-m", "hotstart", "make-model", "--family", "qwen2", "--size", "tiny", "--vocab",
           str(49152 + EXTRA_IDS), "--dtype", "float32", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if template is not None:
        (out / "chat_template.jinja").write_text(template)
    return out
