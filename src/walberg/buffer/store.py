"""The directory of segment files that buffers changes between Postgres and Iceberg.

This module owns the files and their life cycle: ``<seq>.active`` (the one segment being
written) -> ``<seq>.sealed`` (complete, fsynced, waiting to be applied) -> removed (after
the apply stage has committed it). ``<seq>`` is a 16-digit zero-padded sequence number,
so the names sort in the order the changes arrived. The byte format is
``walberg.buffer.segment``'s.

Every state change is a rename of a file that was fsynced first, followed by an fsync of
the directory, so a crash leaves each file either in its old state or its new one. The
only thing a crash can damage is the unflushed tail of the active segment; ``recover()``
truncates it. The replication slot has not been confirmed past anything still in this
directory, so whatever is dropped is sent again by Postgres.

Each segment starts with the frames returned by ``preamble()`` (for example the relation
definitions in force) so it can be decoded on its own, then one ``KIND_PREAMBLE_END``
frame that marks where the preamble ends, then the appended frames. ``read()`` yields the
preamble frames and the appended frames, not the marker.

A ``LOCK`` file held with ``flock`` keeps a second walberg from writing to the same
directory. Reading what a directory holds at start (names, validation, torn tails) is
``walberg.buffer.recovery``'s; low-level file work is ``walberg.buffer.files``'s.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import NoReturn, Optional

from walberg.buffer.files import LOCK_NAME, Mapped, os_reason, read_pid, write_all
from walberg.buffer.kinds import KNOWN, refuse_unknown
from walberg.buffer.recovery import (
    TEMP_SUFFIX,
    RecoveryReport,
    SegmentInfo,
    Stats,
    corrupt,
    list_directory,
    validate,
)
from walberg.buffer.segment import (
    KIND_PREAMBLE_END,
    MAGIC,
    BytesLike,
    FrameCorrupt,
    Scanner,
    append_frame,
    check_magic,
)
from walberg.errors import Terminal
from walberg.model import Lsn

__all__ = ["Preamble", "RecoveryReport", "SegmentInfo", "SegmentStore"]

Preamble = Callable[[], Iterable[tuple[int, int, bytes]]]

# Appends collect in memory and go to the file in writes of about this size: one syscall
# per megabyte instead of one per change.
WRITE_CHUNK = 1 << 20


# fdatasync also persists the file size, which is all a reader needs; it skips the
# timestamps that fsync would write.
_datasync = getattr(os, "fdatasync", os.fsync)


class SegmentStore:
    """The segment files in one directory, owned exclusively by this object while open.

    Usage: construct (takes the lock), ``recover()`` once, then ``append()``/``flush()``/
    ``seal()`` on the receiving side and ``sealed()``/``read()``/``remove()`` on the
    applying side. Not thread-safe: callers serialize access.
    """

    def __init__(
        self,
        directory: Path,
        max_segment_bytes: int,
        preamble: Optional[Preamble] = None,
    ) -> None:
        if max_segment_bytes <= 0:
            raise ValueError(f"max_segment_bytes must be positive, got {max_segment_bytes}")
        self.directory = Path(directory)
        self.max_segment_bytes = max_segment_bytes
        self._preamble = preamble
        self._lock_fd: Optional[int] = None
        self._recovered = False
        self._failed: Optional[Terminal] = None
        self._next_seq = 1
        self._sealed: list[SegmentInfo] = []
        self._sealed_bytes = 0
        # The pipeline reads and seals in one thread and applies and removes in another.
        self._state_lock = threading.Lock()
        # The active segment; _buf is None while there is none.
        self._buf: Optional[bytearray] = None
        self._fd = -1
        self._seq = 0
        self._written = 0  # bytes of the active segment already in the file
        self._appended = 0
        self._first_lsn = 0
        self._last_lsn = 0
        self._first_append_at = 0.0
        self._lock()

    # ---- lock ---------------------------------------------------------------------------

    def _lock(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # os.open fds are not inherited by child processes (PEP 446), so a JVM started
            # by walberg cannot keep the lock alive after walberg exits.
            fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise self._io_error("open", exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise Terminal(
                    f"the segment directory {self.directory} is in use by another walberg "
                    f"process (pid {holder}, recorded in {self.directory / LOCK_NAME}); "
                    "stop that process first, or give this pipeline its own buffer directory"
                ) from None
            raise self._io_error("lock", exc) from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise self._io_error("write the lock file in", exc) from exc
        self._lock_fd = fd

    def close(self) -> None:
        """Flush buffered appends and release the directory. The active segment stays
        active; the next ``recover()`` seals it."""
        try:
            if self._buf is not None and self._failed is None and self._lock_fd is not None:
                self.flush()
        finally:
            self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._buf = None
        if self._lock_fd is not None:
            # Closing the fd releases the flock; the pid in the file goes stale, which is
            # harmless because only a held lock means anything.
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SegmentStore:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            # Do not let a second failure while flushing hide the one being raised.
            self._release()

    def __del__(self) -> None:
        # Dropped without close(): behave like a crash (no flush), but free the fds.
        if getattr(self, "_lock_fd", None) is not None or getattr(self, "_fd", -1) >= 0:
            self._release()

    # ---- recovery ---------------------------------------------------------------------------

    def recover(self) -> RecoveryReport:
        """Bring the directory to a clean state after a stop or a crash; call once at start.

        Validates every sealed segment, truncates a torn tail of a leftover active segment
        and seals it (or deletes it when it holds no appended frame), and removes temp files.
        Raises ``SegmentCorrupt`` naming the file, the offset and what to do.
        """
        self._check_open()
        if self._recovered:
            raise RuntimeError("recover() has already run on this SegmentStore")
        try:
            sealed, active, removed = list_directory(self.directory)
        except OSError as exc:
            self._fail("recover", exc)
        infos: dict[int, SegmentInfo] = {}
        max_lsn = -1
        for seq, path in sorted(sealed.items()):
            stats = self._validate(path, sealed=True)
            max_lsn = max(max_lsn, stats.max_lsn)
            info = stats.info(path, seq)
            if info is None:
                # Nothing but a preamble: no change to apply, so nothing to keep.
                self._unlink(path)
                removed.append(path)
            else:
                infos[seq] = info
        dropped, recovered_active, max_lsn = self._seal_leftovers(active, infos, removed, max_lsn)
        if removed or active:
            self._sync_dir()

        self._sealed = [infos[seq] for seq in sorted(infos)]
        self._sealed_bytes = sum(info.size_bytes for info in self._sealed)
        self._next_seq = max([*sealed, *active, 0]) + 1
        self._recovered = True
        return RecoveryReport(
            sealed_segments=len(self._sealed),
            frames=sum(info.frames for info in self._sealed),
            dropped_bytes=dropped,
            max_lsn=None if max_lsn < 0 else Lsn(max_lsn),
            recovered_active=recovered_active,
            removed_files=tuple(removed),
        )

    def _seal_leftovers(self, active: dict[int, Path], infos: dict[int, SegmentInfo],
                        removed: list[Path], max_lsn: int) -> tuple[int, Optional[Path], int]:
        """Active segments a stop or crash left: a torn tail truncated, then sealed (or
        removed when no change was appended). Returns the bytes dropped, the segment sealed
        last and the highest LSN seen."""
        dropped = 0
        recovered_active: Optional[Path] = None
        for seq, path in sorted(active.items()):
            stats = self._validate(path, sealed=False)
            max_lsn = max(max_lsn, stats.max_lsn)
            dropped += stats.dropped
            target = path.with_name(f"{seq:016d}.sealed")
            try:
                if stats.dropped:
                    with open(path, "r+b") as f:
                        f.truncate(stats.size)
                        os.fsync(f.fileno())
                info = stats.info(target, seq)
                if info is None:
                    path.unlink()
                    removed.append(path)
                else:
                    os.replace(path, target)
                    infos[seq] = info
                    recovered_active = target
            except OSError as exc:
                self._fail("recover", exc)
        return dropped, recovered_active, max_lsn

    def _validate(self, path: Path, *, sealed: bool) -> Stats:
        try:
            return validate(path, sealed=sealed)
        except OSError as exc:
            self._fail("read", exc)

    # ---- writing --------------------------------------------------------------------------

    def append(self, lsn: int, kind: int, payload: BytesLike) -> None:
        """Buffer one frame in the active segment, creating the segment on first use.

        Not durable until ``flush()``. Check ``should_seal()`` afterwards.
        """
        if kind == KIND_PREAMBLE_END:
            raise ValueError(f"frame kind {KIND_PREAMBLE_END} is reserved for the segment store")
        buf = self._buf
        if buf is None:
            buf = self._open_active()
        append_frame(buf, lsn, kind, payload)
        if not self._appended:
            self._first_lsn = lsn
            self._first_append_at = time.monotonic()
        self._last_lsn = lsn
        self._appended += 1
        if len(buf) >= WRITE_CHUNK:
            self._write_buffer()

    def flush(self) -> None:
        """Write buffered frames and fsync: everything appended so far survives a crash."""
        if self._buf is None:
            self._check_usable()
            return
        self._write_buffer()
        try:
            _datasync(self._fd)
        except OSError as exc:
            self._fail("fsync a segment in", exc)

    def should_seal(self) -> bool:
        """True when the active segment has reached ``max_segment_bytes``."""
        return self._appended > 0 and self.active_bytes() >= self.max_segment_bytes

    def seal(self) -> Optional[SegmentInfo]:
        """Make the active segment durable and sealed. None when nothing was appended."""
        if self._buf is None or not self._appended:
            self._check_usable()
            return None
        self.flush()
        active = self._path(self._seq, "active")
        sealed = self._path(self._seq, "sealed")
        try:
            os.close(self._fd)
            self._fd = -1
            os.replace(active, sealed)
        except OSError as exc:
            self._fail("seal a segment in", exc)
        self._sync_dir()
        info = SegmentInfo(
            path=sealed,
            seq=self._seq,
            size_bytes=self._written,
            first_lsn=Lsn(self._first_lsn),
            last_lsn=Lsn(self._last_lsn),
            frames=self._appended,
        )
        with self._state_lock:
            self._sealed.append(info)
            self._sealed_bytes += info.size_bytes
        self._buf = None
        self._next_seq = self._seq + 1
        return info

    def _open_active(self) -> bytearray:
        self._check_usable()
        seq = self._next_seq
        head = bytearray(MAGIC)
        if self._preamble is not None:
            for lsn, kind, payload in self._preamble():
                if kind == KIND_PREAMBLE_END:
                    raise ValueError(
                        f"preamble frame kind {KIND_PREAMBLE_END} is reserved for the segment store"
                    )
                append_frame(head, lsn, kind, payload)
        append_frame(head, 0, KIND_PREAMBLE_END, b"")
        temp = self._path(seq, "active" + TEMP_SUFFIX)
        path = self._path(seq, "active")
        # Written in full under a temp name first, so an .active file always starts with a
        # complete preamble and its end marker.
        fd = -1
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            write_all(fd, head)
            _datasync(fd)
            os.replace(temp, path)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(temp)
            except OSError:
                pass
            self._fail("create a segment in", exc)
        self._fd = fd
        self._sync_dir()
        self._seq = seq
        self._written = len(head)
        self._appended = 0
        self._buf = bytearray()
        return self._buf

    def _write_buffer(self) -> None:
        buf = self._buf
        if not buf:
            return
        try:
            write_all(self._fd, buf)
        except OSError as exc:
            # Part of buf may be in the file; recover() will cut it off as a torn tail.
            self._fail("write a segment in", exc)
        self._written += len(buf)
        buf.clear()

    # ---- reading and removing ----------------------------------------------------------------

    def sealed(self) -> list[SegmentInfo]:
        """The sealed segments not yet removed, oldest first."""
        self._check_recovered()
        with self._state_lock:
            return list(self._sealed)

    def read(self, info: SegmentInfo) -> Iterator[tuple[int, int, bytes]]:
        """The frames of a sealed segment, preamble first, checking every CRC.

        Streams from a memory map, so a large segment is never in memory at once. Raises
        ``SegmentCorrupt`` naming the file, the offset and what to do, and
        ``UnknownFrameKind`` for a frame of a kind this walberg does not know.
        """
        try:
            with Mapped(info.path) as data:
                if len(data) < len(MAGIC):
                    raise FrameCorrupt(0, "sealed segment is shorter than its magic")
                check_magic(data)
                scanner = Scanner(data, sealed=True)
                release = getattr(data, "madvise", None) if hasattr(mmap, "MADV_DONTNEED") else None
                released = 0
                for n, frame in enumerate(scanner, 1):
                    if frame[1] not in KNOWN:
                        raise refuse_unknown(info.path, frame[1], scanner.valid_end)
                    if frame[1] != KIND_PREAMBLE_END:
                        yield frame
                    if release is not None and n % 65536 == 0:
                        # Pages already read go back to the OS, so reading a large segment
                        # does not grow the process's resident memory with the file's size.
                        upto = scanner.valid_end - scanner.valid_end % mmap.PAGESIZE
                        if upto > released:
                            release(mmap.MADV_DONTNEED, 0, upto)
                            released = upto
        except FrameCorrupt as exc:
            raise corrupt(info.path, exc) from exc
        except OSError as exc:
            raise Terminal(
                f"cannot read the segment {info.path}: {os_reason(exc)}. Check that the "
                f"directory {self.directory} is intact and readable by walberg"
            ) from exc

    def remove(self, infos: Iterable[SegmentInfo]) -> None:
        """Delete sealed segments whose changes are committed to Iceberg."""
        self._check_recovered()
        doomed = {info.seq for info in infos}
        known = {info.seq for info in self._sealed}
        if doomed - known:
            raise ValueError(
                f"not sealed segments of this store: {sorted(doomed - known)} "
                f"(sealed: {sorted(known)})"
            )
        if not doomed:
            return
        with self._state_lock:
            for info in self._sealed:
                if info.seq in doomed:
                    self._unlink(info.path)
                    self._sealed_bytes -= info.size_bytes
            self._sealed = [info for info in self._sealed if info.seq not in doomed]
        self._sync_dir()

    # ---- sizes and age --------------------------------------------------------------------

    def active_bytes(self) -> int:
        """Size of the active segment, buffered bytes included; 0 when there is none."""
        return 0 if self._buf is None else self._written + len(self._buf)

    def pending_bytes(self) -> int:
        """Bytes in sealed and active segments: what is waiting to be applied."""
        return self._sealed_bytes + self.active_bytes()

    def active_age_seconds(self) -> float:
        """Seconds since the first frame was appended to the active segment; 0.0 if none."""
        if self._buf is None or not self._appended:
            return 0.0
        return time.monotonic() - self._first_append_at

    # ---- helpers --------------------------------------------------------------------------

    def _path(self, seq: int, state: str) -> Path:
        return self.directory / f"{seq:016d}.{state}"

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise RuntimeError(f"the SegmentStore for {self.directory} is closed")

    def _check_recovered(self) -> None:
        self._check_open()
        if not self._recovered:
            # Before recover() an old active segment would be overwritten or left behind.
            raise RuntimeError("call SegmentStore.recover() before using the store")

    def _check_usable(self) -> None:
        self._check_recovered()
        if self._failed is not None:
            raise Terminal(
                f"the segment store in {self.directory} stopped after an earlier error: "
                f"{self._failed}"
            )

    def _sync_dir(self) -> None:
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self._fail("fsync", exc)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._fail("delete a segment in", exc)

    def _io_error(self, action: str, exc: OSError) -> Terminal:
        return Terminal(
            f"cannot {action} the segment directory {self.directory}: {os_reason(exc)}. "
            "Make sure it is a directory on a disk with free space, writable by the user "
            "walberg runs as, then restart walberg; changes not yet flushed are re-read from "
            "the replication slot"
        )

    def _fail(self, action: str, exc: OSError) -> NoReturn:
        # After a failed write the file's tail is unknown: refuse further writes; a restart
        # runs recover(), which cuts the tail off.
        err = self._io_error(action, exc)
        self._failed = err
        self._buf = None  # so the next append() reaches the check in _open_active()
        raise err from exc
