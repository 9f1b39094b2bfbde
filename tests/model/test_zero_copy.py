"""On CPU in the checkpoint's dtype, the weights are views of the page-cached files: every parameter's
bytes lie inside a mapping of a safetensors file, and loading grows anonymous memory by much less than
the weights' size (no second copy). Measured in a fresh process so nothing else of the suite counts."""

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from hotstart.config import load_model_config
    from hotstart.model.files import weight_files
    from hotstart.model.loader import load_model

    def status(field):
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith(field + ":")).split()[1]) * 1024

    model_dir = sys.argv[1]
    files = [str(p) for p in weight_files(model_dir)]
    cfg = load_model_config(model_dir)
    torch.ones(1) + 1  # torch's own lazy allocations happen before the baseline
    anon0, file0 = status("RssAnon"), status("RssFile")
    model = load_model(cfg, files, "cpu", torch.bfloat16)
    anon1, file1 = status("RssAnon"), status("RssFile")
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] in files:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    params = list(model.parameters())
    outside = [n for n, p in model.named_parameters()
               if not any(lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi for lo, hi in ranges)]
    dtypes = sorted({str(p.dtype) for p in params})
    print(json.dumps({"weights": sum(p.nbytes for p in params), "anon": anon1 - anon0, "file": file1 - file0,
                      "outside": outside, "mappings": len(ranges), "dtypes": dtypes}))
""")


def test_cpu_weights_are_views_of_the_file_mapping(default_model_dir):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(default_model_dir)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["dtypes"] == ["torch.bfloat16"] and r["mappings"] >= 1
    assert r["outside"] == []  # every parameter's bytes are inside a mapping of a weight file
    assert r["weights"] > 200e6
    assert r["anon"] < 0.1 * r["weights"], r  # no second copy in anonymous memory
    assert r["file"] > 0.9 * r["weights"], r  # populated: the mapped file pages are resident now
