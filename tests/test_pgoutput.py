"""Tests for walberg.source.pgoutput: round trips, hand-written bytes, and malformed input."""

from __future__ import annotations

import struct
from typing import Any, Callable, Optional

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

# tests/ is not a package: pytest puts this directory on sys.path.
import pgoutput_encoder as enc
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
from walberg.source.pgoutput import Decoder, Tag

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
lsns = u64.map(Lsn)

names = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=16),
    # Always in the mix: outside the BMP (4-byte UTF-8), CJK, emoji, empty.
    st.sampled_from(["employee", "𝔢𝔪𝔭𝔩𝔬𝔶𝔢𝔢", "社員", "😀 table", "", "public"]),
)
columns = st.builds(Column, names, u32, i32, st.booleans())
relations = st.builds(
    Relation,
    u32,
    names,
    names,
    st.sampled_from("dnfi"),
    st.lists(columns, max_size=24).map(tuple),
)

BIG = 1 << 20


@st.composite
def values(draw: st.DrawFn, *, big: bool = True) -> Value:
    choice = draw(st.integers(0, 99))
    if choice < 20:
        return None
    if choice < 35:
        return UNCHANGED
    if choice < 42:
        return b""
    if big and choice == 99:
        # > 1 MB without making Hypothesis generate a megabyte of random data.
        return b"\xab" * (BIG + draw(st.integers(1, 64)))
    return draw(st.binary(min_size=1, max_size=40))


def rows(width: int, *, big: bool = True) -> st.SearchStrategy[Row]:
    return st.tuples(*[values(big=big) for _ in range(width)])


@st.composite
def relation_and_change(draw: st.DrawFn, *, big: bool = True) -> tuple[Relation, Message]:
    relation = draw(relations)
    width = len(relation.columns)
    kind = draw(st.sampled_from(["I", "U", "D"]))
    if kind == "I":
        return relation, Insert(relation.oid, draw(rows(width, big=big)))
    if kind == "U":
        old_kind = draw(st.sampled_from([None, "K", "O"]))
        old = None if old_kind is None else draw(rows(width, big=big))
        return relation, Update(relation.oid, draw(rows(width, big=big)), old, old_kind)
    return relation, Delete(relation.oid, draw(rows(width, big=big)), draw(st.sampled_from("KO")))


streamable_simple = st.one_of(
    st.builds(TypeInfo, u32, names, names),
    st.builds(Truncate, st.lists(u32, max_size=20).map(tuple), st.booleans(), st.booleans()),
    st.builds(LogicalMessage, st.booleans(), lsns, names, st.binary(max_size=64)),
)
framing = st.one_of(
    st.builds(Begin, lsns, i64, u32),
    st.builds(Commit, st.integers(0, 255), lsns, lsns, i64),
    st.builds(Origin, lsns, names),
    st.builds(StreamCommit, u32, st.integers(0, 255), lsns, lsns, i64),
    st.builds(StreamAbort, u32, u32),
)
chunk_xids = st.one_of(st.none(), u32)


def open_chunk(decoder: Decoder, xid: Optional[int]) -> None:
    if xid is not None:
        assert decoder.decode(enc.encode(StreamStart(xid, True))) == StreamStart(xid, True)
        assert decoder.stream_xid == xid


def decoder_with(relation: Relation, xid: Optional[int] = None) -> Decoder:
    decoder = Decoder()
    open_chunk(decoder, xid)
    assert decoder.decode(enc.encode(relation, xid=xid)) == relation
    return decoder


def raises_decode_error(call: Callable[[], Any]) -> str:
    with pytest.raises(DecodeError) as info:
        call()
    return str(info.value)


# ---- round trips ---------------------------------------------------------------------------


@FAST
@given(relations, chunk_xids)
def test_relation_round_trip_fills_the_cache(relation: Relation, xid: Optional[int]) -> None:
    decoder = Decoder()
    open_chunk(decoder, xid)
    decoded = decoder.decode(enc.encode(relation, xid=xid))
    assert decoded == relation
    assert decoder.relations == {relation.oid: relation}
    assert decoder.message_xid == xid


@FAST
@given(relation_and_change(), chunk_xids, st.booleans())
def test_change_round_trip(
    case: tuple[Relation, Message], xid: Optional[int], binary: bool
) -> None:
    relation, change = case
    decoder = decoder_with(relation, xid)
    decoded = decoder.decode(enc.encode(change, xid=xid, binary=binary))
    assert decoded == change
    for row in (getattr(decoded, "new", None), getattr(decoded, "old", None)):
        for value in row or ():
            # The hot path must hand out bytes, never memoryviews or str.
            assert value is None or value is UNCHANGED or type(value) is bytes
    assert decoder.message_xid == xid


@FAST
@given(streamable_simple, chunk_xids)
def test_streamable_round_trip(message: Message, xid: Optional[int]) -> None:
    decoder = Decoder()
    open_chunk(decoder, xid)
    assert decoder.decode(enc.encode(message, xid=xid)) == message
    if isinstance(message, TypeInfo):
        assert decoder.types[message.oid] == message


@FAST
@given(framing)
def test_framing_round_trip(message: Message) -> None:
    assert Decoder().decode(enc.encode(message)) == message


@FAST
@given(u32, u32, u64, i64)
def test_stream_abort_accepts_protocol_4_tail(xid: int, subxid: int, lsn: int, ts: int) -> None:
    payload = enc.encode(StreamAbort(xid, subxid), abort_tail=(lsn, ts))
    assert Decoder().decode(payload) == StreamAbort(xid, subxid)


@FAST
@given(u32, st.booleans(), st.lists(relation_and_change(big=False), max_size=4))
def test_streamed_chunk_sequence(
    xid: int, first: bool, cases: list[tuple[Relation, Message]]
) -> None:
    decoder = Decoder()
    assert decoder.decode(enc.encode(StreamStart(xid, first))) == StreamStart(xid, first)
    for n, (relation, change) in enumerate(cases):
        subxid = (xid + n) % 2**32  # changes of subtransactions carry the subxact's xid
        assert decoder.decode(enc.encode(relation, xid=subxid)) == relation
        assert decoder.decode(enc.encode(change, xid=subxid)) == change
        assert decoder.message_xid == subxid
        assert decoder.stream_xid == xid
    assert decoder.decode(b"E") == StreamStop()
    assert decoder.stream_xid is None and decoder.message_xid is None
    # Outside the chunk the same relations decode without an xid prefix.
    for relation, change in cases:
        decoder.decode(enc.encode(relation))
        assert decoder.decode(enc.encode(change)) == change


def test_wide_relation_and_memoryview_input() -> None:
    cols = tuple(Column(f"c{i}", 25) for i in range(1600))
    relation = Relation(16384, "public", "wide", "d", cols)
    row: Row = tuple(str(i).encode() if i % 3 else None for i in range(1600))
    decoder = Decoder()
    decoder.decode(memoryview(enc.encode(relation)))
    payload = enc.encode(Insert(16384, row))
    for form in (payload, bytearray(payload), memoryview(payload)):
        decoded = decoder.decode(form)
        assert decoded == Insert(16384, row)
        assert isinstance(decoded, Insert) and type(decoded.new[1]) is bytes


# ---- hand-written bytes (the encoder is not the only oracle) ----------------------------------


def test_begin_from_bytes() -> None:
    payload = bytes.fromhex("42000000010016B3780002B3F6C84A1A40000002E5")
    assert Decoder().decode(payload) == Begin(Lsn.parse("1/16B378"), 0x0002B3F6C84A1A40, 741)


def test_commit_from_bytes() -> None:
    payload = bytes.fromhex("4300000000000016B378000000000016B3A80002B3F6C84A1A40")
    msg = Decoder().decode(payload)
    assert msg == Commit(0, Lsn(0x16B378), Lsn(0x16B3A8), 0x0002B3F6C84A1A40)
    assert isinstance(msg, Commit) and str(msg.end_lsn) == "0/16B3A8"


RELATION_BYTES = (
    b"R"
    + b"\x00\x00\x40\x00"  # oid 16384
    + b"public\x00employee\x00"
    + b"d"
    + b"\x00\x03"
    + b"\x01id\x00"
    + b"\x00\x00\x00\x17"
    + b"\xff\xff\xff\xff"  # int4, key
    + b"\x00name\x00"
    + b"\x00\x00\x04\x13"
    + b"\x00\x00\x00\x44"  # varchar(64)
    + b"\x00bio\x00"
    + b"\x00\x00\x00\x19"
    + b"\xff\xff\xff\xff"  # text
)


def test_relation_and_insert_from_bytes() -> None:
    decoder = Decoder()
    relation = decoder.decode(RELATION_BYTES)
    assert relation == Relation(
        16384,
        "public",
        "employee",
        "d",
        (Column("id", 23, -1, True), Column("name", 1043, 68), Column("bio", 25)),
    )
    insert = b"I\x00\x00\x40\x00N\x00\x03" + b"t\x00\x00\x00\x0242" + b"t\x00\x00\x00\x00" + b"n"
    assert decoder.decode(insert) == Insert(16384, (b"42", b"", None))


def test_update_and_delete_from_bytes() -> None:
    decoder = Decoder()
    decoder.decode(RELATION_BYTES)
    update = (
        b"U\x00\x00\x40\x00"
        + b"K\x00\x03t\x00\x00\x00\x017nn"
        + b"N\x00\x03t\x00\x00\x00\x018b\x00\x00\x00\x03Bobu"
    )
    assert decoder.decode(update) == Update(
        16384, (b"8", b"Bob", UNCHANGED), (b"7", None, None), "K"
    )
    delete = b"D\x00\x00\x40\x00O\x00\x03t\x00\x00\x00\x018nn"
    assert decoder.decode(delete) == Delete(16384, (b"8", None, None), "O")


def test_streamed_insert_from_bytes() -> None:
    decoder = Decoder()
    decoder.decode(RELATION_BYTES)
    assert decoder.decode(b"S\x00\x00\x03\xe9\x01") == StreamStart(1001, True)
    insert = b"I\x00\x00\x03\xea\x00\x00\x40\x00N\x00\x03nnn"
    assert decoder.decode(insert) == Insert(16384, (None, None, None))
    assert decoder.message_xid == 1002
    assert decoder.decode(b"E") == StreamStop()
    assert decoder.decode(b"A\x00\x00\x03\xe9\x00\x00\x03\xea") == StreamAbort(1001, 1002)


# ---- malformed input -------------------------------------------------------------------------


@st.composite
def encoded_messages(draw: st.DrawFn) -> tuple[Decoder, bytes]:
    """A decoder in some state and a valid, small message for that state."""
    xid = draw(chunk_xids)
    relation, change = draw(relation_and_change(big=False))
    decoder = decoder_with(relation, xid)
    kind = draw(st.integers(0, 3))
    if kind == 0:
        payload = enc.encode(change, xid=xid)
    elif kind == 1:
        payload = enc.encode(draw(relations), xid=xid)
    elif kind == 2:
        payload = enc.encode(draw(streamable_simple), xid=xid)
    elif xid is None:
        payload = enc.encode(draw(st.one_of(framing, st.builds(StreamStart, u32, st.booleans()))))
    else:
        payload = b"E"
    return decoder, payload


@settings(max_examples=80, deadline=None)
@given(encoded_messages())
def test_every_strict_prefix_is_a_decode_error(case: tuple[Decoder, bytes]) -> None:
    decoder, payload = case
    relations, stream_xid = dict(decoder.relations), decoder.stream_xid
    for end in range(len(payload)):
        with pytest.raises(DecodeError):
            decoder.decode(payload[:end])
    # A failed decode leaves the state alone...
    assert decoder.relations == relations and decoder.stream_xid == stream_xid
    # ...so the whole message still decodes afterwards.
    decoder.decode(payload)


@FAST
@given(encoded_messages(), st.binary(min_size=1, max_size=8))
def test_trailing_bytes_are_a_decode_error(case: tuple[Decoder, bytes], extra: bytes) -> None:
    decoder, payload = case
    assume(payload[0] != Tag.STREAM_ABORT)
    message = raises_decode_error(lambda: decoder.decode(payload + extra))
    assert "unexpected bytes" in message or "claims" in message


def _decode_or_decode_error(decoder: Decoder, payload: bytes) -> None:
    try:
        decoder.decode(payload)
    except DecodeError as exc:
        assert "could not decode" in str(exc)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([b""] + [bytes([t]) for t in Tag] + [b"Z", b"P"]),
    st.binary(max_size=48),
    chunk_xids,
)
def test_random_bytes_decode_or_raise_decode_error(
    tag: bytes, body: bytes, xid: Optional[int]
) -> None:
    decoder = Decoder()
    open_chunk(decoder, xid)
    # Small relations with low oids make random bodies reach the tuple decoder now and then.
    for oid in range(3):
        decoder.decode(enc.encode(Relation(oid, "s", "t", "d", (Column("a", 25),) * oid), xid=xid))
    _decode_or_decode_error(decoder, tag + body)


@settings(max_examples=200, deadline=None)
@given(encoded_messages(), st.data())
def test_corrupted_messages_decode_or_raise_decode_error(
    case: tuple[Decoder, bytes], data: st.DataObject
) -> None:
    decoder, payload = case
    at = data.draw(st.integers(0, len(payload)))
    how = data.draw(st.sampled_from(["flip", "insert", "delete"]))
    noise = data.draw(st.binary(min_size=1, max_size=4))
    if how == "flip" and at < len(payload):
        payload = payload[:at] + bytes([payload[at] ^ noise[0]]) + payload[at + 1 :]
    elif how == "insert":
        payload = payload[:at] + noise + payload[at:]
    else:
        payload = payload[:at] + payload[at + len(noise) :]
    _decode_or_decode_error(decoder, payload)


@pytest.mark.parametrize("tag", [b"Z", b"\x00", b"\xff", b"q"])
def test_unknown_tag_is_named(tag: bytes) -> None:
    message = raises_decode_error(lambda: Decoder().decode(tag + b"\x00" * 20, lsn=0x16B3748))
    assert "0/16B3748" in message
    assert f"0x{tag[0]:02X}" in message
    if tag.isalpha():
        assert repr(tag.decode()) in message


def test_two_phase_tag_says_why() -> None:
    message = raises_decode_error(lambda: Decoder().decode(b"P" + b"\x00" * 30))
    assert "'P'" in message and "two_phase" in message


def test_empty_payload() -> None:
    assert "empty" in raises_decode_error(lambda: Decoder().decode(b""))


@FAST
@given(u64)
def test_error_names_lsn_relation_and_position(lsn: int) -> None:
    decoder = Decoder()
    decoder.decode(RELATION_BYTES)
    full = enc.encode(Update(16384, (b"1", b"Ann", b"x" * 10)))
    message = raises_decode_error(lambda: decoder.decode(full[:-13], lsn=lsn))
    assert message.startswith(f"could not decode an Update for public.employee at LSN {Lsn(lsn)}:")
    assert "tuple ends after 2 of 3 columns" in message
    assert f"at byte {len(full) - 13}" in message
    assert "not pgoutput" in message


def test_error_example_from_the_brief() -> None:
    decoder = Decoder()
    decoder.decode(RELATION_BYTES)
    message = raises_decode_error(
        lambda: decoder.decode(b"D\x00\x00\x40\x00K\x00\x03t\x00\x00\x00\x05ab", lsn=0x16B3748)
    )
    assert "a Delete for public.employee at LSN 0/16B3748" in message
    assert "column 1 of 3 claims 5 bytes but 2 remain at byte 9" in message


def test_change_for_unknown_relation_names_the_oid() -> None:
    message = raises_decode_error(
        lambda: Decoder().decode(b"I\x00\x00\x40\x01N\x00\x00", lsn=Lsn.parse("2/A0"))
    )
    assert "relation oid 16385" in message and "2/A0" in message


def test_column_count_must_match_the_relation() -> None:
    decoder = Decoder()
    decoder.decode(RELATION_BYTES)
    message = raises_decode_error(lambda: decoder.decode(b"I\x00\x00\x40\x00N\x00\x02nn"))
    assert "2 columns but the Relation message declared 3" in message


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b"I\x00\x00\x40\x00X\x00\x03nnn", "expected 'N'"),
        (b"U\x00\x00\x40\x00X\x00\x03nnn", "expected 'N'"),
        (b"D\x00\x00\x40\x00N\x00\x03nnn", "expected 'K' or 'O'"),
        (b"I\x00\x00\x40\x00N\x00\x03nxn", "unknown kind 'x'"),
        (b"I\x00\x00\x40\x00N\x00\x03t\xff\xff\xff\xffnn", "claims -1 bytes"),
        (b"T\xff\xff\xff\xff\x00", "negative"),
        (b"M\x01" + b"\x00" * 8 + b"p\x00\xff\xff\xff\xff", "claims -1 bytes"),
        (b"R\x00\x00\x00\x01s\x00t\x00x\x00\x00", "replica identity 'x'"),
        (b"R\x00\x00\x00\x01s\xff\x00t\x00d\x00\x00", "not valid UTF-8"),
        (b"R\x00\x00\x00\x01s", "no terminating NUL"),
        (b"E", "no streamed chunk is open"),
    ],
)
def test_specific_corruptions(payload: bytes, needle: str) -> None:
    decoder = Decoder()
    decoder.decode(RELATION_BYTES)
    assert needle in raises_decode_error(lambda: decoder.decode(payload))


def test_nested_stream_start_is_refused() -> None:
    decoder = Decoder()
    decoder.decode(enc.encode(StreamStart(7, True)))
    message = raises_decode_error(lambda: decoder.decode(enc.encode(StreamStart(8, True))))
    assert "transaction 8" in message and "transaction 7" in message
    assert decoder.stream_xid == 7


def test_failed_relation_leaves_cache_and_reset_clears_it() -> None:
    decoder = Decoder()
    decoder.decode(RELATION_BYTES)
    before = decoder.relations[16384]
    with pytest.raises(DecodeError):
        decoder.decode(RELATION_BYTES[:-1])
    assert decoder.relations[16384] is before
    decoder.decode(enc.encode(StreamStart(5, False)))
    decoder.reset()
    assert decoder.relations == {} and decoder.stream_xid is None
    decoder.decode(RELATION_BYTES)  # no xid prefix expected after reset


@pytest.mark.parametrize("size", range(9))
def test_short_stream_abort_is_an_error(size: int) -> None:
    payload = b"A" + struct.pack("!II", 1, 2)
    with pytest.raises(DecodeError):
        Decoder().decode(payload[:size])
