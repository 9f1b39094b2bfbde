"""One benchmark CLI: every verb parses its --help without importing torch, numpy, httpx or tokenizers
(`hotstart --help` stays light: each verb's module is imported only when it runs)."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO

from hotstart.bench.args import BENCH_COMMANDS

VERBS = ("startup", "remote", "serve", "load", "soak", "over-time", "prefix-cache", "step", "roofline")


def test_every_verb_is_registered_lazily():
    assert tuple(BENCH_COMMANDS) == VERBS
    code = ("import sys\nfrom hotstart.cli import build_parser\n"
            f"for verb in {VERBS!r}:\n"
            "    try: build_parser().parse_args(['bench', verb, '--help'])\n"
            "    except SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'numpy', 'httpx', 'tokenizers', 'psutil') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert not [m for m in sys.modules if m.startswith('hotstart.bench.') and m.split('.')[-1] in "
            "('serve', 'load', 'soak', 'soak_report', 'over_time', 'prefix_cache', 'step', 'roofline', "
            "'startup', 'remote')]\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("usage: ") == len(VERBS)
