"""Resolve `hotstart serve MODEL` to a folder or a GGUF file on disk, torch-free, in milliseconds when cached.

MODEL is one of: nothing (the embedded default model: its shipped GGUF), a local folder or GGUF file,
s3://BUCKET/PREFIX, or a hub id ("org/name" or "name"; `modelscope://org/name` for ModelScope, or any id
with VLLM_USE_MODELSCOPE=true). A hub id is downloaded into the hub's own cache when it is not complete
there (boot/remote/: the weights stream in while the engine starts); with HF_HUB_OFFLINE set nothing is
requested and only the caches are read (the Hugging Face cache, then ModelScope's).

The HF cache lookup is written here rather than taken from huggingface_hub, because importing
`huggingface_hub.file_download` costs ~140-160 ms (it pulls its HTTP stack), measured with
`python -X importtime`, and this runs at t=0 of every start. It follows huggingface_hub's documented
layout: {cache}/models--{org}--{name}/refs/{revision} holds a commit hash, the files lie in
{cache}/models--{org}--{name}/snapshots/{commit}/, and a revision may be a commit hash directly.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hotstart.boot.hubcache import hf_hub_cache, hf_offline, modelscope_candidates, use_modelscope
from hotstart.errors import HotstartError, ModelNotFoundError
from hotstart.gguf_file import is_gguf

# huggingface_hub's repo-id alphabet (and, below, its 96-character limit): nothing else can be cached.
_HUB_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model lives and how it is named by default."""

    path: Path  # folder holding config.json and the weights
    source: str  # "local" | "default" | "hf-cache" | "modelscope" (found offline) | KIND, KIND-cache,
    # KIND-offline, KIND-follow with KIND s3, hf or modelscope (boot/remote/session.py)
    name: str  # default served model name: the hub id, the local folder's basename, or the default's name
    remote: object | None = None  # remote models: the RemoteModel (download progress), boot/remote/session.py


def resolve_model(spec: str | None, revision: str | None = None) -> ResolvedModel:
    """Resolve a model spec without importing torch.

    None -> the embedded default model: its GGUF file, served as it ships. A GGUF file -> that file.
    An existing folder -> that folder (with config.json), else the one .gguf file it holds. A
    path-looking spec that does not exist -> error. s3:// -> listed and downloading. Otherwise a hub id
    at `revision` (default: the hub's default branch): its complete copy in the hub's cache, else
    downloading (boot/remote/); with HF_HUB_OFFLINE, looked up in the HF cache, then in the ModelScope cache.
    Raises ModelNotFoundError (a HotstartError) with a one-line message.
    """
    if spec is not None and spec.startswith(("s3://", "s3:")) or "=s3://" in (spec or ""):
        return _resolve_remote(spec, revision)
    if spec is not None and spec.startswith("modelscope://"):
        repo_id = spec[len("modelscope://"):].strip("/")
        if repo_id.count("/") != 1:
            raise ModelNotFoundError(f"model '{spec}': ModelScope ids are org/name")
        return _resolve_hub_id(repo_id, revision, modelscope=True)
    if spec is None:
        if revision is not None:
            raise HotstartError("--revision applies to hub model ids, not to the default model")
        # Imported here: it pulls subprocess/tempfile (~8 ms) that a hub or local start never needs.
        from hotstart.boot import default_model  # noqa: PLC0415 - lazy, see above

        return ResolvedModel(path=default_model.find_gguf(), source="default",
                             name=default_model.DEFAULT_MODEL_NAME)
    if not spec.strip():
        raise ModelNotFoundError("model name is empty")

    try:
        local = Path(spec).expanduser()
    except RuntimeError:  # "~someone" with no such user
        raise ModelNotFoundError(f"model '{spec}': no such folder") from None
    # os.path.isdir/exists swallow every OSError (e.g. a name too long), unlike Path's on Python < 3.12.
    if os.path.isdir(local):
        if revision is not None:
            raise HotstartError(f"model '{spec}': --revision applies to hub model ids, not to local folders")
        local = local.resolve()
        if not (local / "config.json").is_file():
            return ResolvedModel(path=_gguf_in(spec, local), source="local", name=local.name)
        return ResolvedModel(path=local, source="local", name=local.name)
    if os.path.exists(local):
        if revision is not None:
            raise HotstartError(f"model '{spec}': --revision applies to hub model ids, not to local files")
        if not is_gguf(local):
            raise ModelNotFoundError(f"model '{spec}': {local} is a file but not a GGUF file; give a GGUF "
                                     "file or the folder holding config.json")
        local = local.resolve()
        return ResolvedModel(path=local, source="local", name=local.name.removesuffix(".gguf"))
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"model '{spec}': no such folder")
    return _resolve_hub_id(spec, revision)


def _gguf_in(spec: str, folder: Path) -> Path:
    """The one GGUF file of FOLDER (a folder without config.json), or one line saying why not."""
    found = sorted(p for p in folder.glob("*.gguf") if p.is_file() and not p.name.startswith("mmproj"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise ModelNotFoundError(f"model '{spec}': folder {folder} has no config.json and no .gguf file")
    names = ", ".join(p.name for p in found[:4]) + (" ..." if len(found) > 4 else "")
    raise ModelNotFoundError(f"model '{spec}': folder {folder} holds {len(found)} GGUF files ({names}): "
                             "name the file")


def _resolve_remote(spec: str, revision: str | None) -> ResolvedModel:
    """s3://BUCKET/PREFIX or NAME=s3://...: listed, its sidecars fetched, its weights downloading."""
    from hotstart.boot.remote import is_remote  # noqa: PLC0415 - string parsing only

    try:
        from hotstart.boot.remote.session import open_remote  # noqa: PLC0415 - imports obstore: s3:// only
    except ImportError as e:
        raise HotstartError(f"s3:// models need obstore ({e.name} is missing): pip install obstore") from None
    if not is_remote(spec):
        raise ModelNotFoundError(f"model '{spec}': not a folder, hub id or s3://BUCKET/PREFIX")
    if revision is not None:
        raise HotstartError(f"model '{spec}': --revision applies to hub model ids, not to s3:// models")
    remote = open_remote(spec)
    return ResolvedModel(path=remote.path, source=remote.source, name=remote.spec.name, remote=remote)


def _looks_like_path(spec: str) -> bool:
    # A hub id has at most one "/" (org/name); anything more, or a native separator, is a path.
    native_sep = os.sep != "/" and os.sep in spec
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or native_sep


_REVISION = re.compile(r"^[A-Za-z0-9_.\-/]{1,200}$")


def _resolve_hub_id(repo_id: str, revision: str | None, modelscope: bool = False) -> ResolvedModel:
    parts = repo_id.split("/")
    if len(repo_id) > 96 or not all(_HUB_PART.match(p) and p not in (".", "..") for p in parts):
        raise ModelNotFoundError(f"model '{repo_id}': not a folder and not a valid hub id (org/name)")
    rev = revision or "main"
    if (rev.startswith("/") or ".." in rev.split("/") or not rev.strip() or not _REVISION.match(rev)
            or "//" in rev or rev.endswith("/")):
        raise HotstartError(f"model '{repo_id}': invalid revision '{rev}'")
    modelscope = modelscope or use_modelscope()
    if modelscope and len(parts) != 2:
        raise ModelNotFoundError(f"model '{repo_id}': ModelScope ids are org/name")
    if not hf_offline():
        return _download(repo_id, revision, modelscope)
    try:
        return _lookup(repo_id, rev, explicit_revision=revision is not None)
    except OSError as e:  # e.g. an unreadable cache folder: still one line, not a traceback
        raise ModelNotFoundError(f"model '{repo_id}': cannot read the model caches: {e}") from None


def _download(repo_id: str, revision: str | None, modelscope: bool) -> ResolvedModel:
    """The hub's copy: its cache when complete and current (one request at most), else downloading."""
    try:
        from hotstart.boot.remote.session import open_source  # noqa: PLC0415 - only for a hub id
        if modelscope:
            from hotstart.boot.remote.mshub import MsSource as Source  # noqa: PLC0415
        else:
            from hotstart.boot.remote.hfhub import HfSource as Source  # noqa: PLC0415
    except ImportError as e:
        raise HotstartError(f"downloading a model needs obstore ({e.name} is missing): pip install obstore") \
            from None
    remote = open_source(Source(repo_id, revision))
    return ResolvedModel(path=remote.path, source=remote.source, name=repo_id, remote=remote)


def _lookup(repo_id: str, rev: str, explicit_revision: bool) -> ResolvedModel:
    parts = repo_id.split("/")
    looked: list[str] = []
    snapshot, note = _hf_snapshot(hf_hub_cache(), repo_id, rev)
    looked.append(note)
    if snapshot is not None:
        return _checked(repo_id, snapshot, "hf-cache")
    # ModelScope keeps one unnamed revision per folder, so it can only answer for the default branch.
    in_modelscope = len(parts) == 2 and rev in ("main", "master")
    if in_modelscope:
        for candidate in modelscope_candidates(repo_id):
            if candidate.is_dir():
                return _checked(repo_id, candidate, "modelscope")
            looked.append(str(candidate))
    else:
        looked.append("ModelScope cache skipped (it records no revisions)" if len(parts) == 2
                      else "ModelScope cache skipped (its ids are org/name)")
    rev_flag = f" --revision {rev}" if explicit_revision else ""
    raise ModelNotFoundError(
        f"model '{repo_id}' not found locally and HF_HUB_OFFLINE is set; looked in: {'; '.join(looked)}. "
        f"Unset HF_HUB_OFFLINE to download it, or fetch it first with `hotstart pull {repo_id}{rev_flag}`"
    )


def _checked(repo_id: str, folder: Path, source: str) -> ResolvedModel:
    """FOLDER if it holds a complete model (an interrupted download never counts), else one line."""
    from hotstart.boot.remote.source import model_complete  # noqa: PLC0415 - stdlib only

    missing = model_complete(folder)
    if missing is not None:
        raise ModelNotFoundError(
            f"model '{repo_id}': the cached copy in {folder} is incomplete ({missing}) and HF_HUB_OFFLINE is "
            "set: unset it to finish the download")
    return ResolvedModel(path=folder, source=source, name=repo_id)


def _hf_snapshot(cache: Path, repo_id: str, revision: str) -> tuple[Path | None, str]:
    """(snapshot folder or None, a note on where it looked, for the not-found message)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    if not repo.is_dir():
        return None, f"{repo} (HF cache, revision '{revision}')"
    commit = revision
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    snapshot = repo / "snapshots" / commit
    if commit and snapshot.is_dir():
        return snapshot, ""
    refs = sorted(p.name for p in (repo / "refs").glob("*") if p.is_file())
    have = f"; it has refs: {', '.join(refs)}" if refs else ""
    return None, f"{snapshot} (HF cache, revision '{revision}' not cached{have})"
