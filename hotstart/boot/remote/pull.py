"""`hotstart pull MODEL [--revision R]` (Ollama's verb): a hub id (or s3://...) into its cache without
serving it, through the same pipeline as `serve`, with a progress bar on stderr; the folder on stdout."""

from __future__ import annotations

import sys
import time

from hotstart.errors import HotstartError

TICK_S = 0.25


def run_pull(model: str, revision: str | None, out=sys.stdout, err=sys.stderr) -> int:
    from hotstart.boot.hubcache import hf_offline  # noqa: PLC0415
    from hotstart.boot.remote.progress import progress_bar  # noqa: PLC0415
    from hotstart.boot.resolve import resolve_model  # noqa: PLC0415

    if hf_offline() and not model.startswith("s3://"):
        raise HotstartError(f"pull {model}: HF_HUB_OFFLINE is set, so nothing may be downloaded: unset it")
    resolved = resolve_model(model, revision)
    remote = resolved.remote
    if remote is None:
        raise HotstartError(f"pull {model}: a local folder ({resolved.path}): nothing to pull")
    dl = remote.downloader
    if dl is None:
        print(f"{model}: complete in {resolved.path} ({resolved.source})", file=err)
        print(resolved.path, file=out)
        return 0
    dl.progress_to = None  # the bar below instead of serve's line a second
    tty = err.isatty()
    last_line = 0.0
    try:
        while not dl.wait(TICK_S):
            now = time.monotonic()
            if tty:
                err.write("\r" + progress_bar(model, dl.stats()))
                err.flush()
            elif now - last_line >= 5:
                last_line = now
                print(progress_bar(model, dl.stats()), file=err, flush=True)
    except KeyboardInterrupt:
        dl.stop()
        dl.wait(10)
        print(f"\nhotstart: pull {model} interrupted: the same command resumes it", file=err, flush=True)
        return 130
    stats = dl.stats()
    print(("\r" if tty else "") + progress_bar(model, stats), file=err, flush=True)
    if stats["state"] != "done":
        raise HotstartError(stats["error"] or f"pull {model}: the download stopped")
    print(f"{model}: {stats['bytes_total'] / 1e6:.0f} MB in {stats['elapsed_s']:.1f} s, verified, in "
          f"{resolved.path}", file=err)
    print(resolved.path, file=out)
    return 0
