"""Test-side encoder: walberg.model messages to pgoutput bytes, for round-trip tests.

Written from the PostgreSQL protocol documentation ("Logical Replication Message Formats"),
not from walberg's decoder, so that the two can check each other.
"""

from __future__ import annotations

import struct
from typing import Optional

from walberg.model import (
    UNCHANGED,
    Begin,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
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
)

# Messages that carry a leading xid when sent inside a streamed chunk.
STREAMABLE = (Relation, TypeInfo, Insert, Update, Delete, Truncate, LogicalMessage)


def string(text: str) -> bytes:
    data = text.encode("utf-8")
    if b"\x00" in data:
        raise ValueError("pgoutput strings cannot contain NUL")
    return data + b"\x00"


def tuple_data(row: Row, *, binary: bool = False) -> bytes:
    parts = [struct.pack("!H", len(row))]
    for value in row:
        if value is None:
            parts.append(b"n")
        elif value is UNCHANGED:
            parts.append(b"u")
        else:
            assert isinstance(value, bytes)
            parts.append((b"b" if binary else b"t") + struct.pack("!i", len(value)) + value)
    return b"".join(parts)


def encode(
    msg: Message,
    *,
    xid: Optional[int] = None,
    binary: bool = False,
    abort_tail: Optional[tuple[int, int]] = None,
) -> bytes:
    """Encode ``msg``; ``xid`` is the streamed-chunk xid prefix (only for STREAMABLE kinds).

    ``abort_tail`` adds protocol 4's abort LSN and timestamp to a StreamAbort.
    """
    if xid is not None and not isinstance(msg, STREAMABLE):
        raise ValueError(f"{type(msg).__name__} never carries a chunk xid")
    head = b"" if xid is None else struct.pack("!I", xid)
    if isinstance(msg, Begin):
        return b"B" + struct.pack("!QqI", msg.final_lsn, msg.commit_ts, msg.xid)
    if isinstance(msg, Commit):
        return b"C" + struct.pack("!BQQq", msg.flags, msg.commit_lsn, msg.end_lsn, msg.commit_ts)
    if isinstance(msg, Origin):
        return b"O" + struct.pack("!Q", msg.commit_lsn) + string(msg.name)
    if isinstance(msg, Relation):
        out = [
            b"R",
            head,
            struct.pack("!I", msg.oid),
            string(msg.schema),
            string(msg.name),
            msg.replica_identity.encode("ascii"),
            struct.pack("!H", len(msg.columns)),
        ]
        for column in msg.columns:
            out.append(struct.pack("!B", 1 if column.is_key else 0))
            out.append(string(column.name))
            out.append(struct.pack("!Ii", column.type_oid, column.type_modifier))
        return b"".join(out)
    if isinstance(msg, TypeInfo):
        return b"Y" + head + struct.pack("!I", msg.oid) + string(msg.schema) + string(msg.name)
    if isinstance(msg, Insert):
        return (
            b"I"
            + head
            + struct.pack("!I", msg.relation_oid)
            + b"N"
            + tuple_data(msg.new, binary=binary)
        )
    if isinstance(msg, Update):
        old = b""
        if msg.old is not None:
            assert msg.old_kind in ("K", "O")
            old = msg.old_kind.encode("ascii") + tuple_data(msg.old, binary=binary)
        return (
            b"U"
            + head
            + struct.pack("!I", msg.relation_oid)
            + old
            + b"N"
            + tuple_data(msg.new, binary=binary)
        )
    if isinstance(msg, Delete):
        return (
            b"D"
            + head
            + struct.pack("!I", msg.relation_oid)
            + msg.old_kind.encode("ascii")
            + tuple_data(msg.old, binary=binary)
        )
    if isinstance(msg, Truncate):
        options = (1 if msg.cascade else 0) | (2 if msg.restart_identity else 0)
        return (
            b"T"
            + head
            + struct.pack("!iB", len(msg.relation_oids), options)
            + b"".join(struct.pack("!I", oid) for oid in msg.relation_oids)
        )
    if isinstance(msg, LogicalMessage):
        return (
            b"M"
            + head
            + struct.pack("!BQ", 1 if msg.transactional else 0, msg.lsn)
            + string(msg.prefix)
            + struct.pack("!i", len(msg.content))
            + msg.content
        )
    if isinstance(msg, StreamStart):
        return b"S" + struct.pack("!IB", msg.xid, 1 if msg.first_segment else 0)
    if isinstance(msg, StreamStop):
        return b"E"
    if isinstance(msg, StreamCommit):
        return b"c" + struct.pack(
            "!IBQQq", msg.xid, msg.flags, msg.commit_lsn, msg.end_lsn, msg.commit_ts
        )
    if isinstance(msg, StreamAbort):
        tail = b"" if abort_tail is None else struct.pack("!Qq", *abort_tail)
        return b"A" + struct.pack("!II", msg.xid, msg.subxid) + tail
    raise TypeError(f"cannot encode {msg!r}")
