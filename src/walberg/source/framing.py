"""pgoutput framing as walberg stores it: which messages begin, end or belong to a
transaction, and the assembly of protocol 2's in-progress transactions into ordinary ones.

The segment files hold pgoutput messages as the server sent them, with one exception: a
transaction the server streamed while it was in progress (protocol 2) is written at its
Stream Commit as an ordinary transaction (Begin, its changes without the xid protocol 2 puts
after the tag, Commit) at its commit position. Nothing here does I/O: the spill files that hold
a streamed transaction until it commits are handed in by the caller."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

from walberg.model import Lsn
from walberg.source.pgoutput import Payload, Tag

CHANGE_TAGS = frozenset((Tag.INSERT, Tag.UPDATE, Tag.DELETE))
STREAM_TAGS = frozenset((Tag.STREAM_START, Tag.STREAM_STOP, Tag.STREAM_COMMIT,
                         Tag.STREAM_ABORT))

_XID = struct.Struct(">I")
_TWO_XIDS = struct.Struct(">II")
_STREAM_COMMIT = struct.Struct(">IBQQq")  # xid, flags, commit LSN, end LSN, commit time
_BEGIN_FINAL_LSN = struct.Struct(">Q")  # at offset 1 of a Begin
_COMMIT_END_LSN = struct.Struct(">Q")  # at offset 10 of a Commit (after flags, commit LSN)
_COMMIT_TIME = struct.Struct(">q")  # at offset 18 of a Commit (after the end LSN)
_RELATION_OID = struct.Struct(">I")  # at offset 1 of a Relation or a change (protocol v1)
_BEGIN = struct.Struct(">cQqI")  # tag, final LSN, commit time, xid
_COMMIT = struct.Struct(">cBQQq")  # tag, flags, commit LSN, end LSN, commit time


def begin_final_lsn(payload: Payload) -> Lsn:
    """The commit LSN a Begin announces."""
    return Lsn(_BEGIN_FINAL_LSN.unpack_from(payload, 1)[0])


def commit_end_lsn(payload: Payload) -> Lsn:
    """The end LSN of a Commit: where the next transaction may start."""
    return Lsn(_COMMIT_END_LSN.unpack_from(payload, 10)[0])


def commit_time(payload: Payload) -> int:
    """The commit time of a Commit: microseconds since 2000-01-01 UTC."""
    return int(_COMMIT_TIME.unpack_from(payload, 18)[0])


def relation_oid(payload: Payload) -> int:
    """The relation a Relation message describes, or an Insert/Update/Delete changes."""
    return int(_RELATION_OID.unpack_from(payload, 1)[0])


def begin_message(final_lsn: int, commit_ts: int, xid: int) -> bytes:
    return _BEGIN.pack(b"B", final_lsn, commit_ts, xid)


def commit_message(commit_lsn: int, end_lsn: int, commit_ts: int) -> bytes:
    return _COMMIT.pack(b"C", 0, commit_lsn, end_lsn, commit_ts)


class Spill(Protocol):
    """Where a streamed transaction's changes wait for its Stream Commit (buffer.spill)."""

    def add(self, subxid: int, lsn: int, payload: bytes) -> None: ...

    def abort(self, subxid: int) -> None: ...

    def changes(self) -> Iterator[tuple[int, bytes]]: ...

    def discard(self) -> None: ...


@dataclass
class Committed:
    """A streamed transaction that committed: its frames, Begin to Commit, to be read once."""

    end: Lsn
    frames: Iterator[tuple[int, bytes]]  # (WAL position, pgoutput message)
    # Already in the segments (sent again after a restart): only its Relation messages count,
    # which the reader must know as the server will not send them again.
    held: bool = False


class StreamedTransactions:
    """Protocol 2's in-progress transactions, assembled into ordinary ones.

    ``skip_before``: transactions committing before it are held already (a reconnect resends
    them) and are dropped at their Stream Commit."""

    def __init__(self, open_spill: Callable[[int], Spill], skip_before: Lsn) -> None:
        self._open_spill = open_spill
        self._skip_before = skip_before
        self._spills: dict[int, Spill] = {}
        # Inside a Stream Start .. Stream Stop block: its transaction (read by the reader's
        # fast path for ordinary changes, which must be None).
        self.chunk_xid: Optional[int] = None

    @property
    def pending(self) -> bool:
        """Some transaction is streamed but neither committed nor aborted yet."""
        return bool(self._spills)

    def takes(self, tag: int) -> bool:
        """Whether a message with this tag belongs to in-progress streaming."""
        return tag in STREAM_TAGS or self.chunk_xid is not None

    def message(self, tag: int, payload: Payload, wal_start: int) -> Optional[Committed]:
        """One message of in-progress streaming. Changes go to their transaction's spill;
        Stream Abort drops it, or a subtransaction's part of it; Stream Commit returns the
        transaction (unless it is held already)."""
        if tag == Tag.STREAM_START:
            xid, first = _XID.unpack_from(payload, 1)[0], payload[5] == 1
            if first or xid not in self._spills:  # (sent again from its start after a reconnect)
                if xid in self._spills:
                    self._spills[xid].discard()
                self._spills[xid] = self._open_spill(xid)
            self.chunk_xid = xid
        elif tag == Tag.STREAM_STOP:
            self.chunk_xid = None
        elif tag == Tag.STREAM_ABORT:
            xid, subxid = _TWO_XIDS.unpack_from(payload, 1)
            if xid == subxid:
                dropped = self._spills.pop(xid, None)
                if dropped is not None:
                    dropped.discard()
            elif xid in self._spills:
                self._spills[xid].abort(subxid)
        elif tag == Tag.STREAM_COMMIT:
            xid, _flags, commit_lsn, end_lsn, commit_ts = _STREAM_COMMIT.unpack_from(payload, 1)
            txn = self._spills.pop(xid, None)
            if txn is None:
                return None
            return Committed(Lsn(end_lsn), _frames(txn, xid, commit_lsn, end_lsn, commit_ts),
                             Lsn(commit_lsn) < self._skip_before)
        else:
            # A change (or relation, type, message) inside a streamed chunk: Int32 xid after
            # the tag.
            assert self.chunk_xid is not None
            spill = self._spills.get(self.chunk_xid)
            if spill is not None:
                subxid = _XID.unpack_from(payload, 1)[0]
                spill.add(subxid, wal_start, bytes(payload[:1]) + bytes(payload[5:]))
        return None


def _frames(txn: Spill, xid: int, commit_lsn: int, end_lsn: int,
            commit_ts: int) -> Iterator[tuple[int, bytes]]:
    try:
        yield commit_lsn, begin_message(commit_lsn, commit_ts, xid)
        yield from txn.changes()
        yield end_lsn, commit_message(commit_lsn, end_lsn, commit_ts)
    finally:
        txn.discard()
