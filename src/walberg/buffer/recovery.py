"""What a segment directory holds when a store opens it: the names of its files, each file
validated frame by frame (and a torn tail measured), and the report ``SegmentStore.recover()``
gives. Reads only; the store makes the changes (truncate, seal, remove) under its lock."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from walberg.buffer.files import Mapped
from walberg.buffer.kinds import KNOWN, refuse_unknown
from walberg.buffer.segment import KIND_PREAMBLE_END, MAGIC, FrameCorrupt, Scanner, check_magic
from walberg.errors import SegmentCorrupt, Terminal
from walberg.model import Lsn

NAME = re.compile(r"^(\d{16})\.(active|sealed)$")
TEMP_SUFFIX = ".tmp"

ADVICE = (
    "delete this file and everything after it{after}; walberg re-reads those changes from "
    "the replication slot, which has not advanced past them"
)


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A sealed segment. ``first_lsn``/``last_lsn`` are those of its first and last
    appended frames (the preamble is not counted); ``frames`` counts the appended frames."""

    path: Path
    seq: int
    size_bytes: int
    first_lsn: Lsn
    last_lsn: Lsn
    frames: int


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What ``recover()`` found.

    ``sealed_segments`` and ``frames`` count what is now waiting to be applied, including a
    segment sealed from a leftover active file (``recovered_active``); ``frames`` counts
    appended frames only. ``dropped_bytes`` is the torn tail cut from the active file and
    ``max_lsn`` the highest lsn in any frame, preamble included (None when there were no
    frames at all).
    """

    sealed_segments: int
    frames: int
    dropped_bytes: int
    max_lsn: Optional[Lsn]
    recovered_active: Optional[Path] = None
    removed_files: tuple[Path, ...] = ()

    def summary(self) -> str:
        lsn = "none" if self.max_lsn is None else str(self.max_lsn)
        text = (
            f"{self.sealed_segments} sealed segment(s) with {self.frames} change frame(s) "
            f"pending, highest lsn {lsn}"
        )
        if self.recovered_active is not None:
            text += f"; sealed the interrupted active segment {self.recovered_active.name}"
        if self.dropped_bytes:
            text += f"; dropped a torn tail of {self.dropped_bytes} byte(s)"
        return text


def list_directory(directory: Path) -> tuple[dict[int, Path], dict[int, Path], list[Path]]:
    """The sealed and active segments by sequence number; temp files of state changes that
    crashed before their rename are removed (the originals are intact). Raises OSError."""
    sealed: dict[int, Path] = {}
    active: dict[int, Path] = {}
    removed: list[Path] = []
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        match = NAME.match(entry)
        if match:
            (active if match.group(2) == "active" else sealed)[int(match.group(1))] = path
        elif entry.endswith(TEMP_SUFFIX):
            path.unlink()
            removed.append(path)
    for seq in active.keys() & sealed.keys():
        raise Terminal(
            f"segment {seq:016d} exists both as {active[seq].name} and "
            f"{sealed[seq].name} in {directory}, which walberg never does; "
            "some other process changed this directory. Move the directory away and "
            "restart walberg; it re-reads the changes from the replication slot"
        )
    return sealed, active, removed


def validate(path: Path, *, sealed: bool) -> Stats:
    """Read a segment file through: its frames counted, a torn tail (an active file's only)
    measured. Raises SegmentCorrupt naming the file, the offset and what to do;
    UnknownFrameKind for a frame a newer walberg wrote (at start, before anything is read);
    OSError."""
    stats = Stats()
    try:
        with Mapped(path) as data:
            stats.size = len(data)
            if not sealed and len(data) < len(MAGIC) and bytes(data) == MAGIC[: len(data)]:
                # Cut short before its magic was complete: nothing in it yet.
                stats.dropped, stats.size = len(data), 0
                return stats
            check_magic(data)
            scanner = Scanner(data, sealed=sealed)
            for lsn, kind, _ in scanner:
                if kind not in KNOWN:
                    raise refuse_unknown(path, kind, scanner.valid_end)
                stats.add(lsn, kind)
            if scanner.torn:
                stats.dropped = len(data) - scanner.valid_end
                stats.size = scanner.valid_end
    except FrameCorrupt as exc:
        raise corrupt(path, exc) from exc
    return stats


def corrupt(path: Path, exc: FrameCorrupt) -> SegmentCorrupt:
    """The error for a segment file that fails its checks, with what to do."""
    match = NAME.match(path.name)
    after = ""
    if match:
        after = f" (every segment file in {path.parent} numbered above {match.group(1)})"
    return SegmentCorrupt(
        f"the segment file {path} is corrupt: {exc.reason} at byte offset {exc.offset}. "
        f"To continue, {ADVICE.format(after=after)}"
    )


class Stats:
    """What validating one segment file found."""

    __slots__ = ("size", "dropped", "frames", "first_lsn", "last_lsn", "max_lsn")

    def __init__(self) -> None:
        self.size = 0
        self.dropped = 0
        self.frames = 0  # appended frames, after the preamble marker
        self.first_lsn = 0
        self.last_lsn = 0
        self.max_lsn = -1

    def add(self, lsn: int, kind: int) -> None:
        if lsn > self.max_lsn:
            self.max_lsn = lsn
        if kind == KIND_PREAMBLE_END:
            # Everything before the marker was preamble, not appended changes.
            self.frames = 0
            return
        if not self.frames:
            self.first_lsn = lsn
        self.last_lsn = lsn
        self.frames += 1

    def info(self, path: Path, seq: int) -> Optional[SegmentInfo]:
        if not self.frames:
            return None
        return SegmentInfo(
            path=path,
            seq=seq,
            size_bytes=self.size,
            first_lsn=Lsn(self.first_lsn),
            last_lsn=Lsn(self.last_lsn),
            frames=self.frames,
        )
