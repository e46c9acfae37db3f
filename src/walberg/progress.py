"""Progress of long work (the initial copy): rows done of the estimate, rate and ETA, as a bar
redrawn in place on a terminal, or as a log line every so often when not on one."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Optional, TextIO

log = logging.getLogger("walberg")


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class CopyProgress:
    def __init__(self, table: str, estimate: int, stream: Optional[TextIO] = None,
                 every: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 width: int = 30) -> None:
        self.table = table
        self.estimate = max(estimate, 0)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self.clock = clock
        self.width = width
        self.started = clock()
        self._last_report = self.started
        self._drawn = False

    def text(self, rows: int) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = rows / elapsed
        if self.estimate and rows < self.estimate and rate > 0:
            eta = f", ETA {_duration((self.estimate - rows) / rate)}"
        else:
            eta = ""
        of = f" of ~{self.estimate:,}" if self.estimate else ""
        return f"copying {self.table}: {rows:,}{of} rows ({rate:,.0f} rows/s{eta})"

    def update(self, rows: int) -> None:
        now = self.clock()
        if self.tty:
            share = min(rows / self.estimate, 1.0) if self.estimate else 0.0
            filled = int(share * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r[{bar}] {share:4.0%} {self.text(rows)}\x1b[K")
            self.stream.flush()
            self._drawn = True
        elif now - self._last_report >= self.every:
            log.info("%s", self.text(rows))
            self._last_report = now

    def done(self, rows: int) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
