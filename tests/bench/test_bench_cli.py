"""One benchmark CLI: every verb parses its --help without importing torch, numpy, httpx or tokenizers
(`hotstart --help` stays light: each verb's module is imported only when it runs), and the docs list the
verbs the CLI has (BENCH_VERBS, the one list)."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO

from hotstart.bench.args import BENCH_VERBS, runner

DOCS = ("README.md", "docs/design.md", "benchmarks/investigations/README.md")


def test_every_verb_is_registered_lazily():
    code = ("import sys\nfrom hotstart.cli import build_parser\n"
            f"for verb in {BENCH_VERBS!r}:\n"
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
    assert res.stdout.count("usage: ") == len(BENCH_VERBS)


def test_every_verb_has_its_code():
    for verb in BENCH_VERBS:
        module, func = runner(verb)
        source = (REPO / (module.replace(".", "/") + ".py")).read_text()
        assert f"\ndef {func}(" in source, f"{module} has no {func}"


def doc_verb_lists(text: str) -> list[tuple[str, ...]]:
    """Every `hotstart bench a|b|c` list in TEXT (a table's cell escapes the bars), and the verbs of the
    README's `| verb | what it measures |` table, in order."""
    lists = [tuple(m.replace("\\|", "|").split("|"))
             for m in re.findall(r"hotstart bench\s+((?:[a-z-]+\\?\|)+[a-z-]+)", text)]
    if "| verb | what it measures |" in text:
        table = text.split("| verb | what it measures |", 1)[1].split("\n\n", 1)[0]
        lists.append(tuple(re.findall(r"^\| `([a-z-]+)` \|", table, re.MULTILINE)))
    return lists


def test_every_doc_lists_the_clis_verbs():
    for doc in DOCS:
        lists = doc_verb_lists((REPO / doc).read_text())
        assert lists, f"{doc}: no `hotstart bench VERB|VERB...` list found"
        for found in lists:
            assert found == BENCH_VERBS, f"{doc} lists {'|'.join(found)}, the CLI has {'|'.join(BENCH_VERBS)}"
