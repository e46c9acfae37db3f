"""pgoutput framing (source/framing.py): protocol 2's in-progress transactions assembled into
ordinary ones, with the real spill files, and decoded back by the pgoutput decoder."""

from __future__ import annotations

import struct
from pathlib import Path

from walberg.buffer.spill import TxnSpill
from walberg.model import Begin, Commit, Lsn
from walberg.source.framing import StreamedTransactions, commit_end_lsn
from walberg.source.pgoutput import Decoder


def _start(xid: int, first: bool) -> bytes:
    return b"S" + struct.pack(">IB", xid, 1 if first else 0)


def _change(xid: int, body: bytes) -> bytes:
    return b"I" + struct.pack(">I", xid) + body  # the xid protocol 2 puts after the tag


def _commit(xid: int, commit_lsn: int, end_lsn: int, ts: int) -> bytes:
    return b"c" + struct.pack(">IBQQq", xid, 0, commit_lsn, end_lsn, ts)


def _abort(xid: int, subxid: int) -> bytes:
    return b"A" + struct.pack(">II", xid, subxid)


def test_a_streamed_transaction_is_written_as_an_ordinary_one(tmp_path: Path) -> None:
    txns = StreamedTransactions(lambda xid: TxnSpill(tmp_path, xid), skip_before=Lsn(0))
    for message, at in [(_start(7, True), 1), (_change(7, b"one"), 2), (_change(8, b"sub"), 3),
                        (b"E", 4), (_start(7, False), 5), (_change(7, b"two"), 6), (b"E", 7),
                        (_abort(7, 8), 8)]:
        assert txns.takes(message[0])
        assert txns.message(message[0], message, at) is None
    assert txns.pending
    done = txns.message(ord("c"), _commit(7, 100, 110, 5), 9)
    assert done is not None and done.end == Lsn(110)
    frames = list(done.frames)
    # Begin and Commit built for it; the changes without their xid; the aborted subxid gone.
    assert [payload for _, payload in frames[1:-1]] == [b"Ione", b"Itwo"]
    begin = Decoder().decode(frames[0][1], frames[0][0])
    commit = Decoder().decode(frames[-1][1], frames[-1][0])
    assert isinstance(begin, Begin) and (begin.final_lsn, begin.xid, begin.commit_ts) == (
        Lsn(100), 7, 5)
    assert isinstance(commit, Commit) and commit.end_lsn == Lsn(110)
    assert commit_end_lsn(frames[-1][1]) == Lsn(110)
    assert not txns.pending and not list(tmp_path.iterdir())  # the spill file is gone


def test_a_transaction_held_already_is_marked_so_at_its_commit(tmp_path: Path) -> None:
    txns = StreamedTransactions(lambda xid: TxnSpill(tmp_path, xid), skip_before=Lsn(500))
    for message in (_start(9, True), _change(9, b"x"), b"E"):
        txns.message(message[0], message, 1)
    held = txns.message(ord("c"), _commit(9, 400, 410, 0), 2)
    # (its frames are read for the relations they describe, which the server sends no more)
    assert held is not None and held.held and [f for _, f in held.frames][1] == b"Ix"
    assert not txns.pending and not list(tmp_path.iterdir())
    # An aborted top-level transaction is dropped whole.
    for message in (_start(10, True), _change(10, b"y"), b"E", _abort(10, 10)):
        txns.message(message[0], message, 3)
    assert not txns.pending
    assert not txns.takes(ord("B"))  # outside a streamed chunk, ordinary messages pass by
