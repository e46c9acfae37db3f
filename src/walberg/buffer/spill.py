"""Spill files for transactions the server streams while they are still in progress (pgoutput
protocol 2): their changes wait here, on disk, until the Stream Commit says they count, and are
then written to the segments as one ordinary transaction; a Stream Abort removes them (or, for a
subtransaction, marks its changes void). Memory stays flat whatever the transaction's size.

A spill file is a run of frames ``<IQI`` (subtransaction xid, WAL position, payload length) and
the payload. Spill files do not survive a restart: the server streams an uncommitted
transaction again from its start."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import BinaryIO, Iterator

_FRAME = struct.Struct("<IQI")


class TxnSpill:
    def __init__(self, directory: Path, xid: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{xid}.spill"
        self.file: BinaryIO = open(self.path, "wb")
        self.aborted: set[int] = set()
        self.frames = 0

    def add(self, subxid: int, lsn: int, payload: bytes) -> None:
        self.file.write(_FRAME.pack(subxid, lsn, len(payload)))
        self.file.write(payload)
        self.frames += 1

    def abort(self, subxid: int) -> None:
        self.aborted.add(subxid)

    def changes(self) -> Iterator[tuple[int, bytes]]:
        """(WAL position, payload) of every change that counts, in order."""
        self.file.flush()
        with open(self.path, "rb") as f:
            while True:
                head = f.read(_FRAME.size)
                if len(head) < _FRAME.size:
                    return
                subxid, lsn, length = _FRAME.unpack(head)
                payload = f.read(length)
                if subxid not in self.aborted:
                    yield lsn, payload

    def discard(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


def clear(directory: Path) -> None:
    """Forget every spill file (on start: their transactions will be streamed again)."""
    shutil.rmtree(directory, ignore_errors=True)
