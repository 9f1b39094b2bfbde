"""Progress of a download as people see it: the stderr line a second of `hotstart serve`, the bar of
`hotstart pull`, and the CPU time of the threads that did it (Linux /proc)."""

from __future__ import annotations

import os


def thread_cpu_seconds(tids: list[int]) -> float:
    """CPU time of the threads TIDS and of obstore's runtime (tokio) threads of this process."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                comm, fields = f.read().rsplit(")", 1)
        except OSError:
            continue
        if int(tid) in tids or "tokio" in comm:
            parts = fields.split()
            total += (int(parts[11]) + int(parts[12])) / tick
    return total


def progress_line(url: str, s: dict) -> str:
    """`hotstart: download URL:  62 % (168 of 269 MB), 25 MB/s, ETA 4 s` from Downloader.stats()."""
    pct = 100 * s["bytes_done"] / max(1, s["bytes_total"])
    eta = f", ETA {s['eta_s']:.0f} s" if s["eta_s"] else ""
    return (f"hotstart: download {url}: {pct:3.0f} % ({s['bytes_done'] / 1e6:.0f} of "
            f"{s['bytes_total'] / 1e6:.0f} MB), {s['rate_mbps']:.0f} MB/s{eta}")


def progress_bar(label: str, s: dict, width: int = 30) -> str:
    """Ollama's kind of bar: `pulling org/name  62% ▕██████████████████▏ 168 MB/269 MB  25 MB/s  4s`."""
    frac = min(1.0, s["bytes_done"] / max(1, s["bytes_total"]))
    full = int(frac * width)
    bar = "█" * full + " " * (width - full)
    eta = f"  {s['eta_s']:.0f}s" if s.get("eta_s") else ""
    return (f"pulling {label} {frac * 100:3.0f}% ▕{bar}▏ {s['bytes_done'] / 1e6:.0f} MB/"
            f"{s['bytes_total'] / 1e6:.0f} MB  {s['rate_mbps']:.0f} MB/s{eta}")
