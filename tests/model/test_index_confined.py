"""model.safetensors.index.json names files inside the model folder only (hotstart/model/files.py): an entry
that climbs out, is absolute or is no safetensors file is refused with one line naming the index, before
anything reads it; a shard that is a symlink (the Hugging Face cache's layout) still loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from hotstart.errors import WeightsError
from hotstart.model.files import weight_files

HOSTILE = ["../outside.safetensors", "/etc/passwd", "/abs/model.safetensors", "sub/../../outside.safetensors",
           "./model.safetensors", "..", "", "~/x.safetensors", "a\\..\\..\\outside.safetensors",
           "model.safetensors\0.txt", "config.json", "/dev/zero"]


@pytest.fixture
def sharded(tiny_checkpoint, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama", True), dst)
    # a real safetensors file beside the folder: what a climbing entry would reach
    shutil.copy(sorted(dst.glob("model-*.safetensors"))[0], tmp_path / "outside.safetensors")
    return dst


def _point(model, name: str) -> None:
    index = model / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = name
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("name", HOSTILE)
def test_an_index_entry_outside_the_folder_is_refused(sharded, name):
    _point(sharded, name)
    with pytest.raises(WeightsError, match="outside the model folder") as e:
        weight_files(sharded)
    assert "model.safetensors.index.json" in str(e.value)


def test_symlinked_shards_inside_the_folder_still_load(sharded, tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sorted(sharded.glob("model-*.safetensors")):  # as the Hugging Face cache lays them out
        shard.rename(blobs / shard.name)
        shard.symlink_to(blobs / shard.name)
    assert [p.name for p in weight_files(sharded)] == sorted(p.name for p in blobs.iterdir())


def test_the_server_refuses_it_in_one_line(sharded):
    _point(sharded, "../outside.safetensors")
    out = subprocess.run([sys.executable, "-m", "hotstart", "serve", str(sharded), "--port", "0", "--zygote",
                          "off"], capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and lines[-1].startswith("hotstart: error:"), out.stderr
    assert "outside the model folder" in lines[-1] and "Traceback" not in out.stderr
