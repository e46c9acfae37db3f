"""Debezium records decoded in columns give exactly what the per-record path gives, and
leave to it every record they cannot vouch for (pure, no broker)."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Any, Optional, Union

from hypothesis import given, settings
from hypothesis import strategies as st

from walberg.model import UNCHANGED, Column, Op, Value
from walberg.source import debezium as dbz
from walberg.source.debezium_columns import SMALLEST, Columns, is_envelope, split_envelope

COLUMNS = (Column("id", dbz.TEXT, is_key=True), Column("n", dbz.INT4, is_key=True),
           Column("amount", dbz.NUMERIC), Column("x", dbz.FLOAT8), Column("ok", dbz.BOOL),
           Column("day", dbz.DATE), Column("at", dbz.TIMESTAMP), Column("doc", dbz.JSONB),
           Column("big", dbz.INT8), Column("tz", dbz.TIMESTAMPTZ), Column("blob", dbz.BYTEA),
           Column("small", dbz.FLOAT4), Column("clock", dbz.TIME), Column("cost", dbz.NUMERIC),
           Column("days", dbz.ARRAY_OF[dbz.DATE]))
IMAGES = dbz.Images(COLUMNS, tuple(dbz.FieldType(c.type_oid) for c in COLUMNS))
UNAVAILABLE = dbz.UNAVAILABLE

Outcome = Union[str, list[tuple[Op, tuple[Value, ...]]]]


def _per_record(key: Optional[bytes], value: bytes, images: dbz.Images = IMAGES) -> Outcome:
    """The reference: the per-record path's changes, or "bad" for a dead letter."""
    try:
        event = dbz.parse_event(value)
        if event.truncates:
            return "other"  # (the stager takes these apart)
        if event.fields is not None:
            # The stager reads a record with a schema of its own by the schema's types.
            given = dict(event.fields)
            images = dbz.Images(COLUMNS, tuple(given[c.name] for c in COLUMNS))
        return images.changes(event, dbz.parse_key(key))
    except dbz.BadRecord:
        return "bad"


def _same(a: tuple[Value, ...], b: tuple[Value, ...]) -> bool:
    """Rows equal as the apply stage parses them (a double's text may be written two ways)."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if COLUMNS[i].type_oid == dbz.FLOAT8 and isinstance(x, bytes) and isinstance(y, bytes):
            if float(x) != float(y) or str(float(x)) != str(float(y)):
                return False
        elif x != y:
            return False
    return True


def _check(records: list[tuple[Optional[bytes], bytes]], images: dbz.Images = IMAGES,
           texts: Optional[list[bytes]] = None) -> int:
    """Decode the records in columns (``texts``: what the decoder reads of each, default their
    values) and check each decoded one against the per-record path; returns how many were
    decoded in columns."""
    decoder = Columns(images)
    assert decoder.usable
    covered = 0
    fast = 0
    given = texts if texts is not None else [v for _, v in records]
    for lo, hi, decoded in decoder.decode(given, [k for k, _ in records]):
        assert lo == covered
        covered = hi
        if decoded is None:
            continue
        for i in range(lo, hi):
            if not decoded.fast[i - lo]:
                continue
            fast += 1
            ops, _, values, unchanged = decoded.slice(i - lo, i - lo + 1)
            row = tuple(UNCHANGED if u is not None and u[0] else v[0].as_py() for v, u in
                        zip(values, unchanged, strict=True))
            row = tuple(v.encode() if isinstance(v, str) else v for v in row)
            want = _per_record(*records[i], images)
            assert isinstance(want, list) and len(want) == 1, (records[i], want)
            assert want[0][0].value == ops[0], (records[i], want, ops[0])
            assert _same(want[0][1], row), (records[i], want[0][1], row)
    assert covered == len(records)
    return fast


def _row(**values: Any) -> dict[str, Any]:
    row = {"id": "a", "n": 1, "amount": "1.50", "x": 0.5, "ok": True, "day": 19000,
           "at": 1_700_000_000_123_456, "doc": '{"k": 1}', "big": 2**40,
           "tz": "2024-05-01T10:00:00.5Z", "blob": "3q2+7w==", "small": 0.1,
           "clock": 45_296_000_001, "cost": "12.50", "days": [19000, None]}
    row.update(values)
    return row


def _envelope(op: Any, before: Any = None, after: Any = None, **more: Any) -> bytes:
    return json.dumps({"op": op, "before": before, "after": after, **more}).encode()


KEY = json.dumps({"id": "a", "n": 1}).encode()
EDGES: list[tuple[Optional[bytes], bytes]] = [
    (KEY, _envelope("c", after=_row())),
    (KEY, _envelope("r", after=_row(amount=None, x=None, ok=False, day=-719162))),
    (KEY, _envelope("u", before=_row(), after=_row(amount="2"))),
    (KEY, _envelope("u", before=None, after=_row(ok=None))),
    (KEY, _envelope("u", before=_row(), after=_row(id="b"))),  # a key change
    (KEY, _envelope("u", before=_row(id=UNAVAILABLE), after=_row())),
    (KEY, _envelope("u", before=_row(amount="1e5"), after=_row())),  # before not fit
    (KEY, _envelope("d", before=_row())),
    (KEY, _envelope("d", before={"id": "a", "n": 1})),
    (KEY, _envelope("d", before=None)),  # the key from the message key
    (None, _envelope("d", before=None)),  # a dead letter: no key at all
    (KEY, _envelope("c", after={"id": "a", "amount": "3"})),  # n from the message key
    (KEY, _envelope("c", after=_row(doc=UNAVAILABLE, amount=UNAVAILABLE))),
    (KEY, _envelope("c", after=_row(id=UNAVAILABLE))),
    (KEY, json.dumps({"schema": {"type": "struct", "fields": []},
                      "payload": json.loads(_envelope("c", after=_row()))}).encode()),
    (KEY, _envelope("t")),
    (KEY, _envelope("x", after=_row())),
    (KEY, json.dumps({"after": _row()}).encode()),
    (KEY, _envelope(5, after=_row())),
    (KEY, _envelope("c", after=[1, 2])),
    (KEY, b"{not json"),
    (KEY, b"null"),
    (KEY, b""),
    (KEY, b'{"op": "c"} {"op": "d"}'),
    (KEY, _envelope("c", after=_row()) + b', "more": 1'),
    (b'{"id": "a", "n": 1}, "more": 1', _envelope("c", after=_row())),
    (KEY, _envelope("c", after=_row(extra=1))),
    (KEY, _envelope("c", after=_row(n=1.5))),
    (KEY, _envelope("c", after=_row(n="7"))),
    (KEY, _envelope("c", after=_row(n=True))),
    (KEY, _envelope("c", after=_row(big=2**70))),
    (KEY, _envelope("c", after=_row(amount="+1"))),
    (KEY, _envelope("c", after=_row(amount="01.5"))),
    (KEY, _envelope("c", after=_row(amount=" 1"))),
    (KEY, _envelope("c", after=_row(amount=12.25))),
    (KEY, _envelope("c", after=_row(amount="-0.000"))),
    (KEY, _envelope("c", after=_row(day=2932897))),
    (KEY, _envelope("c", after=_row(at=-62135596800000001))),
    (KEY, _envelope("c", after=_row(at=-1))),
    (KEY, _envelope("c", after=_row(ok=1))),
    (KEY, _envelope("c", after=_row(tz="2024-02-29T23:59:59Z"))),
    (KEY, _envelope("c", after=_row(tz="2023-02-29T00:00:00Z"))),
    (KEY, _envelope("c", after=_row(tz="0000-01-01T00:00:00Z"))),
    (KEY, _envelope("c", after=_row(tz="2024-01-01T23:59:60Z"))),
    (KEY, _envelope("c", after=_row(tz="2024-01-01T00:00:00.1234567Z"))),
    (KEY, _envelope("c", after=_row(tz="2024-01-01T00:00:00+02:00"))),
    (KEY, _envelope("c", after=_row(tz="2024-01-01T00:00:00"))),
    (KEY, _envelope("c", after=_row(tz="2024-01-01 00:00:00Z"))),
    (KEY, _envelope("c", after=_row(tz=1_700_000_000_000_000))),
    (KEY, _envelope("c", after=_row(tz=UNAVAILABLE))),
    (KEY, _envelope("c", after=_row(blob="not base64!"))),
    (KEY, _envelope("c", after=_row(blob=UNAVAILABLE, small=None, clock=-1))),
    (KEY, _envelope("c", after=_row(small=3.4028235e38 * 10, clock=86_400_000_000))),
    (KEY, _envelope("c", after=_row(clock="10:00:00"))),
    (KEY, _envelope("c", after=_row(days=[UNAVAILABLE]))),
    (KEY, _envelope("c", after=_row(days=list(UNAVAILABLE.encode())))),
    (KEY, _envelope("c", after=_row(days=[], doc=None))),
    (KEY, _envelope("c", after=_row(days=[2932897]))),
    (KEY, _envelope("c", after=_row(days=[[1]]))),
    (KEY, _envelope("c", after=_row(days=[1.5]))),
    (KEY, _envelope("c", after=_row(days="{1}"))),
    (KEY, _envelope("c", after=_row(days=[UNAVAILABLE, 1]))),
    (KEY, _envelope("c", after=_row(x=3))),
    (KEY, _envelope("c", after=_row(x=1e300))),
    (KEY, _envelope("c", after=_row(x=-0.0))),
    (KEY, b'{"op": "c", "after": ' + json.dumps(_row()).encode()[:-1] + b', "x": NaN}}'),
    (KEY, _envelope("c", after=_row(doc={"nested": True}))),
    (KEY, _envelope("c", after=_row(id="é \\u00e9 \" \n\t"))),
    (KEY, b'{"op": "c", "after": {"id": "\xff", "n": 1}}'),
    (KEY, b'{"op": "c", "after": {"id": "\\ud800", "n": 1}}'),
    (KEY, json.dumps({"op": "c", "after": _row()}, indent=2).encode()),  # line breaks
    (KEY, b'{"op": "c", "after": {"id": "a", "id": "b", "n": 1}}'),
    (KEY, b'{"op": "d", "op": "c", "after": {"id": "a", "n": 1}}'),
    (b'"a"', _envelope("c", after=_row())),
    (b"{bad key", _envelope("c", after=_row())),
    (json.dumps({"schema": {}, "payload": {"id": "z", "n": 2}}).encode(),
     _envelope("c", after=_row())),
    (KEY, _envelope("c", after=_row(), source={"lsn": 42, "connector": "postgresql"})),
    (KEY, _envelope("c", after=_row(), source={"lsn": "42"})),
    (KEY, _envelope("c", after=_row(), source="pg")),
    (KEY, _envelope("c", after=_row(), source=None, transaction=None, ts_ms=1)),
]


def test_every_edge_is_decoded_as_one_record_at_a_time_or_left_to_it() -> None:
    _check(EDGES)
    # Each edge alone, and each amid plain records: the run is halved around an edge the
    # reader refuses, so that the plain records are still decoded in columns.
    plain = [(KEY, _envelope("c", after=_row(id=f"k{i}"))) for i in range(200)]
    for edge in EDGES:
        _check([edge])
        assert _check(plain[:100] + [edge] + plain[100:]) >= 200 - SMALLEST


def test_plain_records_are_all_decoded_in_columns() -> None:
    records = [(json.dumps({"id": f"c-{i}", "n": i}).encode(),
                _envelope("cud"[i % 3], before=_row(id=f"c-{i}", n=i) if i % 3 else None,
                          after=_row(id=f"c-{i}", n=i, amount=f"{i}.25") if i % 3 < 2 else None,
                          source={"connector": "postgresql", "lsn": 1000 + i, "xmin": None}))
               for i in range(3000)]
    assert _check(records) == 3000


_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=8)
_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65),
                   st.floats(allow_nan=False, allow_infinity=False), _TEXT,
                   st.sampled_from([UNAVAILABLE, "1.5", "-0", "007", "1e3", "12.", ".5"]),
                   st.lists(st.integers(), max_size=2))


_FIT = {  # values each column takes, the odd ones among them
    "id": st.sampled_from(["a", "b", "ü\n", UNAVAILABLE]), "n": st.sampled_from([1, 2]),
    "amount": st.one_of(st.decimals(allow_nan=False, allow_infinity=False, places=2).map(str),
                        st.sampled_from(["007", "1e3", "-0", UNAVAILABLE])),
    "x": st.floats(allow_nan=False, allow_infinity=False), "ok": st.booleans(),
    "day": st.integers(-800_000, 3_000_000), "at": st.integers(-(2**62), 2**62),
    "doc": _TEXT, "big": st.integers(-(2**63), 2**63 - 1),
    "blob": st.binary(max_size=6).map(lambda b: base64.b64encode(b).decode()),
    "small": st.floats(allow_nan=False, allow_infinity=False),
    "clock": st.integers(-(2**40), 2**40), "cost": st.sampled_from(["1", "2.50", "-0.01"]),
    "days": st.lists(st.one_of(st.none(), st.integers(-800_000, 3_000_000)), max_size=3),
    "tz": st.one_of(st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31))
                    .map(lambda d: d.isoformat() + "Z"),
                    st.sampled_from(["2023-02-29T00:00:00Z", "2024-01-01T00:00:00+01:00",
                                     "2024-01-01T10:00:00.1234567Z", UNAVAILABLE]))}


@st.composite
def _image(draw: st.DrawFn) -> Optional[dict[str, Any]]:
    odds = draw(st.randoms(use_true_random=True))  # (hypothesis favours its bounds)
    if odds.random() < 0.1:
        return None
    row: dict[str, Any] = {}
    for c in COLUMNS:
        if odds.random() < 0.002:
            continue  # (absent: NULL, or the message key's for a key column)
        odd = odds.random() < 0.002
        row[c.name] = draw(_VALUE if odd else st.one_of(st.none(), _FIT[c.name])
                           if not c.is_key else _FIT[c.name])
    if odds.random() < 0.002:
        row["extra"] = 1
    return row


@st.composite
def _record(draw: st.DrawFn) -> tuple[Optional[bytes], bytes]:
    odds = draw(st.randoms(use_true_random=True))
    key = KEY if odds.random() < 0.97 else draw(st.sampled_from([None, b'{"id": "q"}', b"[]"]))
    op = draw(st.sampled_from("cud" if odds.random() < 0.97 else "crudtz"))
    return key, _envelope(op, draw(_image()), draw(_image()))


_RECORD = _record()


@settings(max_examples=150, deadline=None)
@given(st.lists(_RECORD, min_size=1, max_size=80))
def test_any_run_of_records_decodes_as_one_record_at_a_time(records: list[tuple[Optional[bytes],
                                                                                 bytes]]) -> None:
    _check(records)


# The same table as Kafka Connect's JSON converter describes it, with Debezium's time types.
SCHEMA = {"type": "struct", "name": "t.Envelope", "fields": [
    {"field": part, "optional": True, "type": "struct", "name": "t.Value", "fields": [
        {"field": "id", "type": "string"}, {"field": "n", "type": "int32"},
        {"field": "amount", "type": "string", "optional": True},
        {"field": "x", "type": "double", "optional": True},
        {"field": "ok", "type": "boolean", "optional": True},
        {"field": "day", "type": "int32", "name": "io.debezium.time.Date", "optional": True},
        {"field": "at", "type": "int64", "name": "io.debezium.time.Timestamp",
         "optional": True},
        {"field": "doc", "type": "string", "name": "io.debezium.data.Json", "optional": True},
        {"field": "big", "type": "int64", "optional": True},
        {"field": "tz", "type": "string", "name": "io.debezium.time.ZonedTimestamp",
         "optional": True},
        {"field": "blob", "type": "bytes", "optional": True},
        {"field": "small", "type": "float", "optional": True},
        {"field": "clock", "type": "int64", "name": "io.debezium.time.MicroTime",
         "optional": True},
        {"field": "cost", "type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
         "parameters": {"scale": "2", "connect.decimal.precision": "12"}, "optional": True},
        {"field": "days", "type": "array", "optional": True,
         "items": {"type": "int32", "name": "io.debezium.time.Date", "optional": True}}]}
     for part in ("before", "after")]
    + [{"field": "op", "type": "string"}]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":")).encode()
SCHEMA_FIELDS = dbz.parse_event(b'{"schema":' + SCHEMA_TEXT + b',"payload":{"op":"t"}}').fields
assert SCHEMA_FIELDS is not None
SCHEMA_IMAGES = dbz.Images(COLUMNS, tuple(t for _, t in SCHEMA_FIELDS))


def _wrapped(payload: bytes) -> bytes:
    return b'{"schema":' + SCHEMA_TEXT + b',"payload":' + payload + b"}"


def test_a_schema_envelope_is_cut_into_its_schema_and_payload_texts() -> None:
    payload = _envelope("c", after=_row(at=1_700_000_000_123))
    parts = split_envelope(_wrapped(payload))
    assert parts == (SCHEMA_TEXT, payload) and is_envelope(parts)
    # Layouts it does not cut, or cuts wrongly (then the texts are not each one JSON value).
    assert split_envelope(payload) is None
    assert split_envelope(b'{"payload":' + payload + b',"schema":' + SCHEMA_TEXT + b"}") is None
    assert split_envelope(b'{"schema":' + SCHEMA_TEXT + b"}") is None
    nested = b'{"schema":{"a":{"b":1},"payload":2},"payload":' + payload + b"}"
    cut = split_envelope(nested)
    assert cut is not None and not is_envelope(cut)
    assert not is_envelope((SCHEMA_TEXT, payload + b',"more":1'))


def test_records_with_their_schema_decode_as_one_record_at_a_time() -> None:
    # (``at`` in milliseconds here: the default, in microseconds, is past year 9999 as such)
    cost = [base64.b64encode(i.to_bytes(3, "big", signed=True)).decode() for i in range(300)]
    payloads = [_envelope("cud"[i % 3],
                          before=_row(id=f"c-{i}", n=i, at=i, cost=cost[i]) if i % 3 else None,
                          after=_row(id=f"c-{i}", n=i, at=1_700_000_000_000 + i, cost=cost[-i])
                          if i % 3 < 2 else None) for i in range(300)]
    payloads.append(_envelope("c", after=_row(cost="?")))
    payloads += [p for _, p in EDGES]
    records = [(KEY, _wrapped(p)) for p in payloads]
    texts = []
    for _, value in records:
        parts = split_envelope(value)
        assert parts is not None and parts[0] == SCHEMA_TEXT
        texts.append(parts[1])
    assert _check(records, SCHEMA_IMAGES, texts) >= 300 - SMALLEST
