"""A progress bar on stderr: tqdm's if it is installed, else a plain one (no new dependency)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator


class _Plain:
    def __init__(self, total: int) -> None:
        self.total, self.n, self.t0, self.shown = total, 0, time.perf_counter(), 0.0

    def update_to(self, n: int) -> None:
        if n == self.n and time.perf_counter() - self.shown < 1.0:
            return
        self.n, self.shown = n, time.perf_counter()
        width = 30
        fill = width * n // max(self.total, 1)
        rate = n / max(self.shown - self.t0, 1e-9)
        sys.stderr.write(f"\rProcessed prompts: [{'#' * fill}{'.' * (width - fill)}] {n}/{self.total} "
                         f"{rate:.1f} it/s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


class _Tqdm:
    def __init__(self, total: int, tqdm) -> None:
        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)

    def update_to(self, n: int) -> None:
        if n > self.bar.n:
            self.bar.update(n - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class _Off:
    def update_to(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[_Plain | _Tqdm | _Off]:
    if not enabled:
        bar = _Off()
    else:
        try:
            from tqdm.auto import tqdm  # noqa: PLC0415 - optional
        except ImportError:
            bar = _Plain(total)
        else:
            bar = _Tqdm(total, tqdm)
    try:
        yield bar
    finally:
        bar.close()
