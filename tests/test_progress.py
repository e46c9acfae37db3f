"""The initial copy's progress: a bar on a terminal, periodic log lines elsewhere."""

from __future__ import annotations

import io
import logging

import pytest

from walberg.progress import CopyProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_with_rate_and_eta() -> None:
    clock, out = Clock(), Terminal()
    p = CopyProgress("public.orders", 1_000_000, stream=out, clock=clock, width=10)
    clock.now += 10
    p.update(250_000)
    line = out.getvalue().split("\r")[-1]
    assert line.startswith("[##--------]  25% copying public.orders: 250,000 of ~1,000,000 rows")
    assert "25,000 rows/s, ETA 30s)" in line
    p.done(1_000_000)
    assert out.getvalue().endswith("\r\x1b[K")


def test_log_lines_when_not_on_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="walberg")
    clock, out = Clock(), io.StringIO()
    p = CopyProgress("public.orders", 0, stream=out, every=10, clock=clock)
    clock.now += 5
    p.update(100)  # too soon for a line
    clock.now += 6
    p.update(5_000)
    assert out.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [
        "copying public.orders: 5,000 rows (455 rows/s)"]
