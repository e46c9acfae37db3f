"""Low-level file work for the segment store, and a look at a segment directory from outside:
reading a segment through a memory map, writing a buffer whole, the lock file's pid, and
``inspect_directory`` for `walberg status` (no lock taken, nothing changed)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from walberg.buffer.segment import MAGIC

LOCK_NAME = "LOCK"


class Mapped:
    """A read-only memory map of a file, or plain bytes for a file too small to map."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._map: Optional[mmap.mmap] = None

    def __enter__(self) -> bytes | mmap.mmap:
        with open(self._path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(MAGIC):
                return f.read()
            # The map keeps its own reference to the file; closing f does not unmap it.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            self._map.madvise(mmap.MADV_SEQUENTIAL)
        return self._map

    def __exit__(self, *exc: object) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def write_all(fd: int, data: bytearray) -> None:
    n = os.write(fd, data)
    if n < len(data):
        # Rare (a signal, a nearly full disk): finish without copying the rest.
        with memoryview(data) as view:
            while n < len(view):
                n += os.write(fd, view[n:])


def read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


def os_reason(exc: OSError) -> str:
    if exc.errno is not None:
        name = errno.errorcode.get(exc.errno, exc.errno)
        return f"{exc.strerror or os.strerror(exc.errno)} ({name})"
    return str(exc)


@dataclass(frozen=True)
class DirectoryState:
    """What a segment directory holds, seen from outside (no lock taken, nothing changed)."""

    sealed_segments: int
    sealed_bytes: int
    active_bytes: int
    holder_pid: Optional[str]  # the walberg process holding the directory, if any


def inspect_directory(directory: Path) -> DirectoryState:
    """Look at a segment directory without taking it: for `walberg status`."""
    sealed = [p for p in directory.glob("*.sealed")] if directory.is_dir() else []
    active = [p for p in directory.glob("*.active")] if directory.is_dir() else []
    holder: Optional[str] = None
    lock = directory / LOCK_NAME
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            holder = read_pid(fd)
        finally:
            os.close(fd)
    return DirectoryState(len(sealed), sum(p.stat().st_size for p in sealed),
                          sum(p.stat().st_size for p in active), holder)


FRESHNESS_NAME = "freshness"


def write_freshness(directory: Path, oldest: Optional[float]) -> None:
    """Record, for `walberg status`, when the oldest transaction the running walberg holds
    but the lake does not committed (Unix time; None: none waits), and when this was said.
    A best effort: a status that cannot be told is no reason to stop."""
    path = directory / FRESHNESS_NAME
    temp = path.with_name(path.name + ".tmp")
    try:
        temp.write_text(f"{time.time():.3f} {'-' if oldest is None else f'{oldest:.3f}'}\n")
        os.replace(temp, path)
    except OSError:
        pass


def read_freshness(directory: Path) -> Optional[tuple[float, Optional[float]]]:
    """(when it was said, the oldest waiting commit's Unix time or None), or None if never."""
    try:
        said, oldest = (directory / FRESHNESS_NAME).read_text().split()
        return float(said), None if oldest == "-" else float(oldest)
    except (OSError, ValueError):
        return None
