"""hotstart.boot.resolve against real cache trees built in tmp_path (HF hub layout, ModelScope layouts)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotstart.boot.default_model import DEFAULT_MODEL_NAME
from hotstart.boot.resolve import ResolvedModel, resolve_model
from hotstart.errors import HotstartError, ModelNotFoundError, WeightsError
from hotstart.model.files import sidecar_files, weight_files

REPO = "Qwen/Qwen2.5-0.5B"
COMMIT = "a" * 40
OLD_COMMIT = "b" * 40
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    """Every cache location points into tmp_path, so the user's real caches never leak in; offline (the
    cache lookup; downloads: test_hub_protocol.py)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "MODELSCOPE_CACHE",
                "VLLM_USE_MODELSCOPE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOTSTART_HOME", str(tmp_path / "hotstart-home"))


def write_model(folder: Path, config: bool = True, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config:
        (folder / "config.json").write_text(json.dumps(CONFIG))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return folder


def hf_repo(cache: Path, repo_id: str, commit: str, refs: dict[str, str], weights: bool = True,
            config: bool = True) -> Path:
    """An HF hub cache entry as huggingface_hub writes it: blobs, refs/NAME -> commit, symlinked snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    files = {"config.json": json.dumps(CONFIG)} if config else {}
    if weights:
        files["model.safetensors"] = "w"
    for name, text in files.items():
        blob = repo / "blobs" / f"{commit[:8]}-{name}"
        blob.write_text(text)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    for ref, target in refs.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(target)  # no trailing newline, as huggingface_hub writes it
    return snapshot


# ---- Hugging Face cache ----

def test_hf_cache_main_ref(tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    snapshot = hf_repo(cache, REPO, COMMIT, {"main": COMMIT})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model(REPO) == ResolvedModel(path=snapshot, source="hf-cache", name=REPO)


def test_hf_cache_revision_by_ref_name_and_by_commit(tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    new = hf_repo(cache, REPO, COMMIT, {"main": COMMIT})
    old = hf_repo(cache, REPO, OLD_COMMIT, {"v1": OLD_COMMIT + "\n", "refs/pr/3": OLD_COMMIT})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model(REPO, revision="v1").path == old
    assert resolve_model(REPO, revision="refs/pr/3").path == old
    assert resolve_model(REPO, revision=OLD_COMMIT).path == old  # a commit hash, no ref file needed
    assert resolve_model(REPO, revision="main").path == new
    assert resolve_model(REPO).path == new


@pytest.mark.parametrize("env, cache_rel", [
    ({"HF_HUB_CACHE": "a/hub-x", "HF_HOME": "b"}, "a/hub-x"),
    ({"HUGGINGFACE_HUB_CACHE": "c/legacy"}, "c/legacy"),
    ({"HF_HOME": "d", "XDG_CACHE_HOME": "e"}, "d/hub"),
    ({"XDG_CACHE_HOME": "e"}, "e/huggingface/hub"),
    ({}, "home/.cache/huggingface/hub"),
])
def test_hf_cache_location_env_precedence(tmp_path, monkeypatch, env, cache_rel):
    for var, rel in env.items():
        monkeypatch.setenv(var, str(tmp_path / rel))
    snapshot = hf_repo(tmp_path / cache_rel, "gpt2", COMMIT, {"main": COMMIT})  # an org-less legacy id
    assert resolve_model("gpt2") == ResolvedModel(path=snapshot, source="hf-cache", name="gpt2")


def test_hf_cache_expands_tilde(tmp_path, monkeypatch):
    snapshot = hf_repo(tmp_path / "home" / "my-hub", REPO, COMMIT, {"main": COMMIT})
    monkeypatch.setenv("HF_HUB_CACHE", "~/my-hub")
    assert resolve_model(REPO).path == snapshot


def test_hf_missing_revision_says_which_refs_exist(tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    hf_repo(cache, REPO, COMMIT, {"main": COMMIT})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(REPO, revision="v2")
    msg = str(e.value)
    repo = cache / "models--Qwen--Qwen2.5-0.5B"
    assert f"{repo / 'snapshots' / 'v2'} (HF cache, revision 'v2' not cached; it has refs: main)" in msg
    assert "ModelScope cache skipped (it records no revisions)" in msg
    assert msg.endswith(f"Unset HF_HUB_OFFLINE to download it, or fetch it first with "
                        f"`hotstart pull {REPO} --revision v2`")


def test_an_incomplete_snapshot_is_never_served_offline(tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    bare = hf_repo(cache, "org/noweights", COMMIT, {"main": COMMIT}, weights=False)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("org/noweights")
    assert str(e.value) == (f"model 'org/noweights': the cached copy in {bare} is incomplete (no safetensors "
                            f"weights in {bare}) and HF_HUB_OFFLINE is set: unset it to finish the download")
    with pytest.raises(WeightsError, match=f"no safetensors weights in {bare}$"):
        weight_files(bare)
    partial = hf_repo(cache, "org/noconfig", COMMIT, {"main": COMMIT}, config=False)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("org/noconfig")
    assert str(e.value) == (f"model 'org/noconfig': the cached copy in {partial} is incomplete "
                            "(no config.json) and HF_HUB_OFFLINE is set: unset it to finish the download")


# ---- ModelScope cache ----

def test_modelscope_new_layout_masks_dots(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    folder = write_model(tmp_path / "ms" / "hub" / "models" / "Qwen" / "Qwen2___5-0___5B")
    assert resolve_model(REPO) == ResolvedModel(path=folder, source="modelscope", name=REPO)


def test_modelscope_old_layout_with_cache_var_naming_the_hub_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-hub"))
    folder = write_model(tmp_path / "ms-hub" / "Qwen" / "Qwen2.5-0.5B")
    assert resolve_model(REPO) == ResolvedModel(path=folder, source="modelscope", name=REPO)


def test_modelscope_default_location(tmp_path):
    folder = write_model(tmp_path / "home" / ".cache" / "modelscope" / "hub" / "Qwen" / "Qwen2___5-0___5B")
    assert resolve_model(REPO).path == folder
    assert resolve_model(REPO, revision="master").source == "modelscope"


def test_hf_cache_wins_over_modelscope(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    snapshot = hf_repo(tmp_path / "hf", REPO, COMMIT, {"main": COMMIT})
    write_model(tmp_path / "home" / ".cache" / "modelscope" / "hub" / "models" / "Qwen" / "Qwen2___5-0___5B")
    assert resolve_model(REPO).path == snapshot


# ---- not found anywhere ----

def test_not_found_offline_lists_every_place(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(REPO)
    msg = str(e.value)
    ms = tmp_path / "home" / ".cache" / "modelscope" / "hub"
    hf = tmp_path / "home/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B"
    current = tmp_path / "home/.cache/modelscope/models/Qwen--Qwen2.5-0.5B/snapshots/master"
    places = [f"{hf} (HF cache, revision 'main')", str(current),
              str(ms / "models/Qwen/Qwen2___5-0___5B"), str(ms / "models/Qwen/Qwen2.5-0.5B"),
              str(ms / "Qwen/Qwen2___5-0___5B"), str(ms / "Qwen/Qwen2.5-0.5B")]
    assert msg == (f"model '{REPO}' not found locally and HF_HUB_OFFLINE is set; looked in: "
                   f"{'; '.join(places)}. Unset HF_HUB_OFFLINE to download it, or fetch it first with "
                   f"`hotstart pull {REPO}`")
    assert "\n" not in msg


def test_not_found_with_modelscope_cache_var_tries_both_meanings(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("org/model")
    for place in ("ms/hub/models/org/model", "ms/hub/org/model", "ms/models/org/model", "ms/org/model"):
        assert f"{tmp_path / place};" in str(e.value) or f"{tmp_path / place}." in str(e.value)


def test_org_less_id_skips_modelscope(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"ModelScope cache skipped \(its ids are org/name\)"):
        resolve_model("gpt2")


@pytest.mark.parametrize("spec", ["org/na me", "org/x:y", "a b"])
def test_invalid_hub_id(spec):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(spec)
    assert str(e.value) == f"model '{spec}': not a folder and not a valid hub id (org/name)"


def test_long_name_is_a_clean_error():
    with pytest.raises(ModelNotFoundError, match="not a valid hub id"):
        resolve_model("x" * 5000 + "/y")


def test_invalid_revision():
    with pytest.raises(HotstartError, match=r"^model 'org/name': invalid revision '\.\./x'$"):
        resolve_model("org/name", revision="../x")


# ---- local folders and paths ----

def test_local_folder(tmp_path, monkeypatch):
    folder = write_model(tmp_path / "models" / "tiny")
    assert resolve_model(str(folder)) == ResolvedModel(path=folder, source="local", name="tiny")
    monkeypatch.chdir(folder)
    assert resolve_model(".") == ResolvedModel(path=folder, source="local", name="tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("models/tiny").path == folder  # an org/name-shaped spec that exists is a folder
    home_model = write_model(tmp_path / "home" / "m")
    assert resolve_model("~/m").path == home_model


def test_local_folder_without_config(tmp_path):
    folder = write_model(tmp_path / "empty", config=False)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(folder))
    assert str(e.value) == f"model '{folder}': folder {folder} has no config.json and no .gguf file"


def test_local_folder_rejects_revision(tmp_path):
    folder = write_model(tmp_path / "tiny")
    with pytest.raises(HotstartError, match="--revision applies to hub model ids, not to local folders"):
        resolve_model(str(folder), revision="main")


@pytest.mark.parametrize("spec", ["./nope", "/definitely/not/here", "~/nope", "a/b/c", "../x", ".hidden",
                                  "~no-such-user-xyz/m"])
def test_missing_path(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(spec)
    assert str(e.value) == f"model '{spec}': no such folder"


def test_file_is_not_a_model(tmp_path):
    other = tmp_path / "m.bin"
    other.write_bytes(b"PK\x03\x04")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(other))
    assert str(e.value) == (f"model '{other}': {other} is a file but not a GGUF file; give a GGUF file or "
                            "the folder holding config.json")


def test_gguf_file_and_folder_holding_one(tmp_path):
    gguf = tmp_path / "m" / "tiny.Q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")  # the header is read later (model_config), resolution only finds it
    assert resolve_model(str(gguf)) == ResolvedModel(gguf, "local", "tiny.Q8_0")
    assert resolve_model(str(gguf.parent)) == ResolvedModel(gguf, "local", "m")
    (gguf.parent / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="holds 2 GGUF files .*: name the file$"):
        resolve_model(str(gguf.parent))


def test_empty_spec():
    with pytest.raises(ModelNotFoundError, match="^model name is empty$"):
        resolve_model("  ")


# ---- default model ----

def test_default_model_is_its_shipped_gguf(tmp_path):
    from hotstart.boot.default_model import find_gguf

    assert resolve_model(None) == ResolvedModel(find_gguf(), "default", DEFAULT_MODEL_NAME)
    assert not (tmp_path / "hotstart-home").exists()  # nothing converted, nothing written
    with pytest.raises(HotstartError, match="--revision applies to hub model ids, not to the default model"):
        resolve_model(None, revision="main")


# ---- weight and sidecar files ----

def write_index(folder: Path, weight_map: dict[str, str]) -> Path:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    return index


def test_weight_files_sharded_order(tmp_path):
    folder = write_model(tmp_path / "m")  # model.safetensors too: the index wins
    names = ["model-00002-of-00003.safetensors", "model-00001-of-00003.safetensors",
             "model-00003-of-00003.safetensors"]
    for n in names:
        (folder / n).write_bytes(b"")
    write_index(folder, {"lm_head.weight": names[2], "embed.weight": names[1], "a": names[0], "b": names[1]})
    assert weight_files(folder) == [folder / n for n in sorted(names)]


def test_weight_files_missing_shard(tmp_path):
    folder = write_model(tmp_path / "m", weights=False)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index = write_index(folder, {"a": shard1, "b": shard2})
    with pytest.raises(WeightsError) as e:
        weight_files(folder)
    assert str(e.value) == f"{index} names shard {shard2}, which is missing from {folder}"


def test_weight_files_bad_index(tmp_path):
    folder = write_model(tmp_path / "m")
    index = folder / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(WeightsError, match=f"^{index}: invalid JSON"):
        weight_files(folder)
    index.write_text('["a list"]')
    with pytest.raises(WeightsError, match=f"^{index}: has no weight_map$"):
        weight_files(folder)


def test_weight_files_single_glob_and_none(tmp_path):
    folder = write_model(tmp_path / "m")
    assert weight_files(folder) == [folder / "model.safetensors"]
    (folder / "model.safetensors").rename(folder / "b.safetensors")
    (folder / "a.safetensors").write_bytes(b"")
    assert weight_files(folder) == [folder / "a.safetensors", folder / "b.safetensors"]
    for p in folder.glob("*.safetensors"):
        p.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError) as e:
        weight_files(folder)
    assert str(e.value) == (f"no safetensors weights in {folder} "
                            "(found pytorch_model.bin: hotstart loads safetensors only)")


def test_sidecar_files(tmp_path):
    folder = write_model(tmp_path / "m")
    for n in ("tokenizer.json", "chat_template.jinja", "special_tokens_map.json", "README.md"):
        (folder / n).write_text("{}")
    write_index(folder, {"a": "model.safetensors"})
    expected = ("config.json", "tokenizer.json", "chat_template.jinja", "special_tokens_map.json",
                "model.safetensors.index.json")
    assert sidecar_files(folder) == [folder / n for n in expected]


# ---- startup cost ----

def test_import_and_use_pull_no_heavy_modules(tmp_path):
    folder = write_model(tmp_path / "tiny")
    code = (
        "import sys\n"
        "from hotstart.boot.resolve import resolve_model\n"
        "from hotstart.model.files import weight_files, sidecar_files\n"
        f"r = resolve_model({str(folder)!r}); weight_files(r.path); sidecar_files(r.path)\n"
        "resolve_model(None)\n"
        "try:\n    resolve_model('org/absent')\nexcept Exception:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'huggingface_hub', 'numpy') if m in sys.modules]\n"
        "print(','.join(heavy) or 'clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "clean"


def test_resolution_takes_milliseconds(tmp_path, monkeypatch):
    folder = write_model(tmp_path / "tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    hf_repo(tmp_path / "hf", REPO, COMMIT, {"main": COMMIT})
    t0 = time.perf_counter()
    resolve_model(str(folder))
    resolve_model(REPO)
    assert time.perf_counter() - t0 < 0.05
