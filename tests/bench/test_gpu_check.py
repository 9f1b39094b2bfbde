"""The GPU check's CPU dry run (benchmarks/gpu_check.py --device cpu --quick): every step runs and
writes its results, so the one GPU run that GPU time allows is not the first run of the script."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO

from hotstart import families


def test_gpu_check_dry_run_on_cpu(default_model_dir, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                        "--quick",
                        "--fadvise", "--out", str(out), "--tokenizer", str(default_model_dir)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    steps = result["steps"]
    names = ("env", "correctness", "checkpoint", "floor", "startup", "serving")
    assert all(steps[s]["ok"] for s in names), steps
    assert steps["correctness"]["all_ok"]
    for family in families.names():
        assert steps["correctness"][family]["float32"]["tokens_equal"]
    assert steps["startup"]["cold_t_first_median"] > steps["startup"]["cold_t_health_median"] > 0
    assert "warm_start_cost_median" in steps["startup"]
    assert steps["floor"]["floor_s"] > 0 and steps["serving"]["tok_s_2_streams"] > 0
    assert all(not run["stop"]["leftover"] for run in steps["startup"]["runs"])
    assert (out / "gpu_check.log").read_text().count("---") == 6
