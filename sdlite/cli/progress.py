"""The sampling progress line that ``generate`` and ``upscale`` (the SD x4 upscaler) draw on a terminal."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    """Steps, it/s and ETA on one self-rewriting line of a terminal; silent when stderr is not a terminal."""

    def __init__(self, label: str = "sampling", stream=None, width: int = 28):
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label, self.width = label, width
        self.start = None

    def __call__(self, step: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.start is None or step <= 1:
            self.start = now if self.start is None else self.start
        elapsed = now - self.start
        rate = step / elapsed if elapsed > 0 else 0.0
        eta = (total - step) / rate if rate > 0 else 0.0
        filled = int(self.width * step / total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} {step:>3}/{total} [{bar}] {rate:5.2f} it/s  ETA {eta:5.1f}s")
        if step >= total:
            self.stream.write(f"\r{self.label} {total:>3}/{total} [{'#' * self.width}] {rate:5.2f} it/s  "
                              f"{elapsed:.1f}s   \n")
        self.stream.flush()
