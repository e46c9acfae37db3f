"""Decoder for PostgreSQL's pgoutput logical replication messages.

This module owns the pgoutput wire format (protocol versions 1 to 4, without two-phase
messages) and the state that format makes a reader keep: the relation cache, which gives a
tuple's columns their meaning, and whether the stream is inside a streamed chunk, where most
messages carry an extra xid. It turns one XLogData payload into one ``walberg.model`` message
and does no I/O; the replication connection lives elsewhere.

Column values stay the bytes Postgres sent (text or binary representation, depending on how
the slot was started): converting them is the apply stage's business, and not doing it here
keeps the hot path to a single slice per value.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any, Callable, Final, Optional, Union

from walberg.errors import DecodeError
from walberg.model import (
    UNCHANGED,
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Lsn,
    Message,
    Origin,
    Relation,
    Row,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    TypeInfo,
    Update,
    Value,
)

__all__ = ["Decoder", "Tag", "TupleKind", "TupleMarker", "TruncateOption", "Payload"]

Payload = Union[bytes, bytearray, memoryview]


class Tag(IntEnum):
    """The first byte of every pgoutput message."""

    BEGIN = ord("B")
    COMMIT = ord("C")
    ORIGIN = ord("O")
    RELATION = ord("R")
    TYPE = ord("Y")
    INSERT = ord("I")
    UPDATE = ord("U")
    DELETE = ord("D")
    TRUNCATE = ord("T")
    MESSAGE = ord("M")
    STREAM_START = ord("S")
    STREAM_STOP = ord("E")
    STREAM_COMMIT = ord("c")
    STREAM_ABORT = ord("A")


class TupleKind(IntEnum):
    """The byte in front of each column of a TupleData."""

    NULL = ord("n")
    UNCHANGED = ord("u")
    TEXT = ord("t")
    BINARY = ord("b")


class TupleMarker(IntEnum):
    """The byte in front of a TupleData inside Insert, Update and Delete."""

    NEW = ord("N")
    KEY = ord("K")
    OLD = ord("O")


class TruncateOption(IntEnum):
    CASCADE = 1
    RESTART_IDENTITY = 2


_COLUMN_IS_KEY: Final = 1
_MESSAGE_TRANSACTIONAL: Final = 1
_REPLICA_IDENTITIES: Final = frozenset(ord(c) for c in "dnfi")

# Plain ints, bound once: comparing an int against an IntEnum member goes through
# IntEnum.__eq__ machinery and attribute lookups, which the per-column loop cannot afford.
_KIND_TEXT: Final = int(TupleKind.TEXT)
_KIND_BINARY: Final = int(TupleKind.BINARY)
_KIND_NULL: Final = int(TupleKind.NULL)
_KIND_UNCHANGED: Final = int(TupleKind.UNCHANGED)
_MARK_NEW: Final = int(TupleMarker.NEW)
_MARK_KEY: Final = int(TupleMarker.KEY)
_MARK_OLD: Final = int(TupleMarker.OLD)

# Fixed parts, compiled once. Oids, xids and LSNs are unsigned in Postgres; timestamps,
# type modifiers and byte lengths are signed.
_U16 = struct.Struct("!H").unpack_from
_I32 = struct.Struct("!i").unpack_from
_U32 = struct.Struct("!I").unpack_from
_U64 = struct.Struct("!Q").unpack_from
_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!BQQq")
_RELATION_TAIL = struct.Struct("!BH")  # replica identity, number of columns
_COLUMN_TYPE = struct.Struct("!Ii")  # type oid, type modifier
_TRUNCATE_HEAD = struct.Struct("!iB")  # number of relations, options
_MESSAGE_HEAD = struct.Struct("!BQ")  # flags, LSN
_STREAM_START = struct.Struct("!IB")
_STREAM_COMMIT = struct.Struct("!IBQQq")
_STREAM_ABORT = struct.Struct("!II")
_RELATION_TAIL_UNPACK = _RELATION_TAIL.unpack_from
_COLUMN_TYPE_UNPACK = _COLUMN_TYPE.unpack_from

_NAMES: Final[dict[int, str]] = {
    Tag.BEGIN: "a Begin",
    Tag.COMMIT: "a Commit",
    Tag.ORIGIN: "an Origin",
    Tag.RELATION: "a Relation",
    Tag.TYPE: "a Type",
    Tag.INSERT: "an Insert",
    Tag.UPDATE: "an Update",
    Tag.DELETE: "a Delete",
    Tag.TRUNCATE: "a Truncate",
    Tag.MESSAGE: "a logical decoding Message",
    Tag.STREAM_START: "a Stream Start",
    Tag.STREAM_STOP: "a Stream Stop",
    Tag.STREAM_COMMIT: "a Stream Commit",
    Tag.STREAM_ABORT: "a Stream Abort",
}

_ADVICE: Final = (
    "The replication stream is corrupt or not pgoutput; check that the replication slot was "
    "created with the pgoutput plugin, and if it was, report this message as a walberg bug."
)

# Tags pgoutput sends only with options walberg never asks for (two_phase); naming them
# turns "unknown tag" into something a person can act on.
_TWO_PHASE_TAGS: Final = frozenset(ord(c) for c in "bPKrp")


class _Malformed(Exception):
    """Raised inside the decoder with what is wrong and where; decode() adds the context."""

    def __init__(self, detail: str, offset: int) -> None:
        super().__init__(detail)
        self.detail = detail
        self.offset = offset


def _read_string(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.find(b"\x00", pos)
    if end < 0:
        raise _Malformed("a string has no terminating NUL byte", pos)
    try:
        return buf[pos:end].decode("utf-8"), end + 1
    except UnicodeDecodeError as exc:
        raise _Malformed(f"a string is not valid UTF-8 ({exc.reason})", pos + exc.start) from None


def _read_tuple(buf: bytes, pos: int, width: int) -> tuple[Row, int]:
    """Read a TupleData at ``pos`` for a relation of ``width`` columns; return it and its end."""
    end = len(buf)
    try:
        (ncols,) = _U16(buf, pos)
    except struct.error:
        raise _Malformed("the message ends before the tuple's column count", end) from None
    if ncols != width:
        raise _Malformed(
            f"the tuple has {ncols} columns but the Relation message declared {width}", pos
        )
    pos += 2
    # Preallocated with None, so a NULL column costs nothing but the offset step.
    values: list[Value] = [None] * ncols
    text, binary, null, unchanged = _KIND_TEXT, _KIND_BINARY, _KIND_NULL, _KIND_UNCHANGED
    unpack_length = _I32
    i = 0
    try:
        for i in range(ncols):
            kind = buf[pos]
            if kind == text or kind == binary:
                (length,) = unpack_length(buf, pos + 1)
                start = pos + 5
                pos = start + length
                # Slicing past the end silently returns less, so the length is checked here.
                if length < 0 or pos > end:
                    raise _Malformed(
                        f"column {i + 1} of {ncols} claims {length} bytes but {end - start} remain",
                        start - 4,
                    )
                values[i] = buf[start:pos]
            elif kind == null:
                pos += 1
            elif kind == unchanged:
                values[i] = UNCHANGED
                pos += 1
            else:
                raise _Malformed(
                    f"column {i + 1} of {ncols} has unknown kind {_show_byte(kind)}"
                    " (expected n, u, t or b)",
                    pos,
                )
    except (IndexError, struct.error):
        raise _Malformed(f"the tuple ends after {i} of {ncols} columns", end) from None
    return tuple(values), pos


def _show_byte(value: int) -> str:
    if 0x20 < value < 0x7F:
        return f"{chr(value)!r} (0x{value:02X})"
    return f"0x{value:02X}"


def _trailing(buf: bytes, pos: int) -> _Malformed:
    return _Malformed(f"{len(buf) - pos} unexpected bytes follow the end of the message", pos)


def _fixed(buf: bytes, layout: struct.Struct) -> tuple[Any, ...]:
    """Unpack a message that is the tag plus one fixed layout, nothing more and nothing less."""
    size = 1 + layout.size
    if len(buf) != size:
        if len(buf) < size:
            raise _Malformed(f"the message ends early: it needs {size} bytes", len(buf))
        raise _trailing(buf, size)
    return layout.unpack_from(buf, 1)


class Decoder:
    """Decodes one pgoutput message at a time, keeping the state the protocol relies on.

    ``relations`` maps relation oid to the latest ``Relation`` seen for it and ``types`` maps
    type oid to ``TypeInfo``. ``stream_xid`` is the xid of the streamed transaction whose
    chunk is open (between Stream Start and Stream Stop), else None. ``message_xid`` is the
    xid field the last decoded change carried inside a chunk, else None: it can be a
    subtransaction's xid, which is what a Stream Abort with ``subxid != xid`` refers to.
    """

    __slots__ = ("relations", "types", "stream_xid", "message_xid", "_body", "_handlers")

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self.types: dict[int, TypeInfo] = {}
        self.stream_xid: Optional[int] = None
        self.message_xid: Optional[int] = None
        # Offset of a message's first field after the tag: the xid takes 4 bytes in a chunk.
        self._body = 1
        self._handlers: dict[int, Callable[[bytes], Message]] = {
            Tag.BEGIN: self._begin,
            Tag.COMMIT: self._commit,
            Tag.ORIGIN: self._origin,
            Tag.RELATION: self._relation,
            Tag.TYPE: self._type,
            Tag.INSERT: self._insert,
            Tag.UPDATE: self._update,
            Tag.DELETE: self._delete,
            Tag.TRUNCATE: self._truncate,
            Tag.MESSAGE: self._message,
            Tag.STREAM_START: self._stream_start,
            Tag.STREAM_STOP: self._stream_stop,
            Tag.STREAM_COMMIT: self._stream_commit,
            Tag.STREAM_ABORT: self._stream_abort,
        }

    def reset(self) -> None:
        """Forget all state, as a new replication connection must: the server's pgoutput
        starts afresh too, resending Relation messages and never resuming inside a chunk."""
        self.relations.clear()
        self.types.clear()
        self._set_stream(None)
        self.message_xid = None

    def decode(self, payload: Payload, lsn: int = 0) -> Message:
        """Decode one message; ``lsn`` (the XLogData start) only serves error messages.

        Raises DecodeError for anything that is not one complete, well-formed message.
        """
        # One copy up front buys slices that are already the final bytes objects.
        buf = payload if type(payload) is bytes else bytes(payload)
        try:
            handler = self._handlers[buf[0]]
        except (IndexError, KeyError):
            raise self._unknown_tag(buf, lsn) from None
        try:
            return handler(buf)
        except _Malformed as exc:
            raise self._error(buf, lsn, exc.detail, exc.offset) from None
        except (IndexError, struct.error):
            raise self._error(
                buf, lsn, "the message ends before all of its fields were read", len(buf)
            ) from None

    # ---- transaction framing --------------------------------------------------------------

    def _begin(self, buf: bytes) -> Begin:
        final_lsn, commit_ts, xid = _fixed(buf, _BEGIN)
        return Begin(Lsn(final_lsn), commit_ts, xid)

    def _commit(self, buf: bytes) -> Commit:
        flags, commit_lsn, end_lsn, commit_ts = _fixed(buf, _COMMIT)
        return Commit(flags, Lsn(commit_lsn), Lsn(end_lsn), commit_ts)

    def _origin(self, buf: bytes) -> Origin:
        (commit_lsn,) = _U64(buf, 1)
        name, pos = _read_string(buf, 9)
        if pos != len(buf):
            raise _trailing(buf, pos)
        return Origin(Lsn(commit_lsn), name)

    # ---- schema ---------------------------------------------------------------------------

    def _relation(self, buf: bytes) -> Relation:
        pos = self._body
        xid = _U32(buf, 1)[0] if pos != 1 else None
        (oid,) = _U32(buf, pos)
        schema, pos = _read_string(buf, pos + 4)
        name, pos = _read_string(buf, pos)
        identity, ncols = _RELATION_TAIL_UNPACK(buf, pos)
        if identity not in _REPLICA_IDENTITIES:
            raise _Malformed(
                f"replica identity {_show_byte(identity)} is not one of d, n, f, i", pos
            )
        pos += _RELATION_TAIL.size
        columns: list[Column] = []
        for _ in range(ncols):
            flags = buf[pos]
            column_name, pos = _read_string(buf, pos + 1)
            type_oid, type_modifier = _COLUMN_TYPE_UNPACK(buf, pos)
            pos += _COLUMN_TYPE.size
            columns.append(
                Column(column_name, type_oid, type_modifier, bool(flags & _COLUMN_IS_KEY))
            )
        if pos != len(buf):
            raise _trailing(buf, pos)
        relation = Relation(oid, schema, name, chr(identity), tuple(columns))
        # Last writer wins: pgoutput resends a Relation whenever the table's shape may have
        # changed, before the first change that depends on it.
        self.relations[oid] = relation
        self.message_xid = xid
        return relation

    def _type(self, buf: bytes) -> TypeInfo:
        pos = self._body
        xid = _U32(buf, 1)[0] if pos != 1 else None
        (oid,) = _U32(buf, pos)
        schema, pos = _read_string(buf, pos + 4)
        name, pos = _read_string(buf, pos)
        if pos != len(buf):
            raise _trailing(buf, pos)
        info = TypeInfo(oid, schema, name)
        self.types[oid] = info
        self.message_xid = xid
        return info

    # ---- changes --------------------------------------------------------------------------

    def _width(self, oid: int, pos: int) -> int:
        relation = self.relations.get(oid)
        if relation is None:
            raise _Malformed(
                f"relation oid {oid} has not been described by a Relation message"
                " (pgoutput sends one before a table's first change on every connection,"
                " so part of the stream was skipped or the decoder was reset mid-stream)",
                pos,
            )
        return len(relation.columns)

    def _change_head(self, buf: bytes) -> tuple[Optional[int], int, int, int]:
        """The part every Insert/Update/Delete starts with: (xid in a streamed chunk, relation
        oid, the relation's column count, the offset after them)."""
        pos = self._body
        xid = _U32(buf, 1)[0] if pos != 1 else None
        (oid,) = _U32(buf, pos)
        return xid, oid, self._width(oid, pos), pos + 4

    def _insert(self, buf: bytes) -> Insert:
        xid, oid, width, pos = self._change_head(buf)
        if buf[pos] != _MARK_NEW:
            raise _Malformed(
                f"expected 'N' before the new tuple, found {_show_byte(buf[pos])}", pos
            )
        new, pos = _read_tuple(buf, pos + 1, width)
        if pos != len(buf):
            raise _trailing(buf, pos)
        self.message_xid = xid
        return Insert(oid, new)

    def _update(self, buf: bytes) -> Update:
        xid, oid, width, pos = self._change_head(buf)
        marker = buf[pos]
        old: Optional[Row] = None
        old_kind: Optional[str] = None
        if marker == _MARK_KEY or marker == _MARK_OLD:
            old, pos = _read_tuple(buf, pos + 1, width)
            old_kind = chr(marker)
            marker = buf[pos]
        if marker != _MARK_NEW:
            raise _Malformed(
                f"expected 'N' before the new tuple, found {_show_byte(marker)}"
                + ("" if old_kind else " (nor 'K' or 'O' before an old one)"),
                pos,
            )
        new, pos = _read_tuple(buf, pos + 1, width)
        if pos != len(buf):
            raise _trailing(buf, pos)
        self.message_xid = xid
        return Update(oid, new, old, old_kind)

    def _delete(self, buf: bytes) -> Delete:
        xid, oid, width, pos = self._change_head(buf)
        marker = buf[pos]
        if marker != _MARK_KEY and marker != _MARK_OLD:
            raise _Malformed(
                f"expected 'K' or 'O' before the old tuple, found {_show_byte(marker)}", pos
            )
        old, pos = _read_tuple(buf, pos + 1, width)
        if pos != len(buf):
            raise _trailing(buf, pos)
        self.message_xid = xid
        return Delete(oid, old, chr(marker))

    def _truncate(self, buf: bytes) -> Truncate:
        pos = self._body
        xid = _U32(buf, 1)[0] if pos != 1 else None
        count, options = _TRUNCATE_HEAD.unpack_from(buf, pos)
        pos += _TRUNCATE_HEAD.size
        if count < 0:
            raise _Malformed(f"the relation count is negative ({count})", pos - 5)
        end = pos + 4 * count
        if end > len(buf):
            raise _Malformed(f"the message ends early: it lists {count} relations", len(buf))
        if end != len(buf):
            raise _trailing(buf, end)
        # Variable length, so no precompiled Struct; the struct module caches this format.
        oids: tuple[int, ...] = struct.unpack_from(f"!{count}I", buf, pos)
        self.message_xid = xid
        return Truncate(
            oids,
            cascade=bool(options & TruncateOption.CASCADE),
            restart_identity=bool(options & TruncateOption.RESTART_IDENTITY),
        )

    def _message(self, buf: bytes) -> LogicalMessage:
        pos = self._body
        xid = _U32(buf, 1)[0] if pos != 1 else None
        flags, message_lsn = _MESSAGE_HEAD.unpack_from(buf, pos)
        prefix, pos = _read_string(buf, pos + _MESSAGE_HEAD.size)
        (length,) = _I32(buf, pos)
        pos += 4
        end = pos + length
        if length < 0 or end > len(buf):
            raise _Malformed(
                f"the content claims {length} bytes but {len(buf) - pos} remain", pos - 4
            )
        if end != len(buf):
            raise _trailing(buf, end)
        self.message_xid = xid
        return LogicalMessage(
            bool(flags & _MESSAGE_TRANSACTIONAL), Lsn(message_lsn), prefix, buf[pos:end]
        )

    # ---- streaming of in-progress transactions (protocol 2+) -------------------------------

    def _set_stream(self, xid: Optional[int]) -> None:
        self.stream_xid = xid
        self._body = 1 if xid is None else 5

    def _stream_start(self, buf: bytes) -> StreamStart:
        xid, first = _fixed(buf, _STREAM_START)
        if self.stream_xid is not None:
            # Whether later messages carry an xid depends on this state, so a framing slip
            # would misread everything after it; better to stop here.
            raise _Malformed(
                f"a chunk of transaction {xid} starts while the chunk of transaction"
                f" {self.stream_xid} is still open",
                0,
            )
        self._set_stream(xid)
        self.message_xid = None
        return StreamStart(xid, first == 1)

    def _stream_stop(self, buf: bytes) -> StreamStop:
        if len(buf) != 1:
            raise _trailing(buf, 1)
        if self.stream_xid is None:
            raise _Malformed("no streamed chunk is open", 0)
        self._set_stream(None)
        self.message_xid = None
        return StreamStop()

    def _stream_commit(self, buf: bytes) -> StreamCommit:
        xid, flags, commit_lsn, end_lsn, commit_ts = _fixed(buf, _STREAM_COMMIT)
        return StreamCommit(xid, flags, Lsn(commit_lsn), Lsn(end_lsn), commit_ts)

    def _stream_abort(self, buf: bytes) -> StreamAbort:
        # Protocol 4 with parallel apply appends the abort LSN and timestamp; walberg does not
        # need them, so any tail is accepted rather than tying the decoder to one version.
        xid, subxid = _STREAM_ABORT.unpack_from(buf, 1)
        return StreamAbort(xid, subxid)

    # ---- error reporting (cold path) -------------------------------------------------------

    def _unknown_tag(self, buf: bytes, lsn: int) -> DecodeError:
        if not buf:
            what = "the message is empty"
        else:
            tag = buf[0]
            what = f"unknown message tag {_show_byte(tag)} at byte 0"
            if tag in _TWO_PHASE_TAGS:
                what += (
                    " (a two-phase commit message: the slot was used with two_phase enabled,"
                    " which walberg does not support)"
                )
            else:
                known = " ".join(chr(t) for t in Tag)
                what += f" (pgoutput tags walberg knows: {known})"
        return DecodeError(f"could not decode a message at LSN {Lsn(lsn)}: {what}. {_ADVICE}")

    def _error(self, buf: bytes, lsn: int, detail: str, offset: int) -> DecodeError:
        name = _NAMES.get(buf[0], "a message")
        relation = self._relation_name(buf)
        where = f" for {relation}" if relation else ""
        chunk = (
            f" in a streamed chunk of transaction {self.stream_xid}"
            if self.stream_xid is not None
            else ""
        )
        return DecodeError(
            f"could not decode {name}{where} at LSN {Lsn(lsn)}{chunk}:"
            f" {detail} at byte {offset}. {_ADVICE}"
        )

    def _relation_name(self, buf: bytes) -> Optional[str]:
        """Best effort: the qualified name of the relation a broken message is about."""
        tag = buf[0]
        pos = self._body
        try:
            if tag in (Tag.INSERT, Tag.UPDATE, Tag.DELETE):
                relation = self.relations.get(_U32(buf, pos)[0])
                return relation.qualified_name if relation is not None else None
            if tag == Tag.RELATION:
                schema, pos = _read_string(buf, pos + 4)
                name, _ = _read_string(buf, pos)
                return f"{schema}.{name}"
        except (struct.error, _Malformed):
            pass
        return None
