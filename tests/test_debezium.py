"""The Debezium envelope parser and its values as Postgres text (pure, no broker)."""

from __future__ import annotations

import base64
import json
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Optional

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from walberg.apply.types import TypeMap, pg_type_for
from walberg.model import UNCHANGED, Column, Op
from walberg.source import debezium as dbz
from walberg.source import kafka
from walberg.source.debezium_columns import Columns


def _b64(unscaled: int) -> str:
    n = max(1, (unscaled.bit_length() + 8) // 8)
    return base64.b64encode(unscaled.to_bytes(n, "big", signed=True)).decode()


def _exact(unscaled: int, scale: int) -> str:
    """The decimal text of unscaled * 10^-scale, by moving the point in its digits (no
    arithmetic that could round)."""
    digits = str(abs(unscaled)).rjust(scale + 1, "0")
    whole, fraction = digits[:len(digits) - scale], digits[len(digits) - scale:]
    return ("-" if unscaled < 0 else "") + whole + ("." + fraction if scale else "")


_MOST = 10**38 - 1  # the largest unscaled value of a decimal(38, s)
_UNSCALED_38 = st.one_of(
    st.sampled_from([_MOST, -_MOST, 10**37, -(10**37), 10**28 + 1, -(10**29) + 1, 1, -1, 0]),
    st.integers(-_MOST, _MOST), st.integers(-(10**30), 10**30))


@settings(max_examples=300, deadline=None)
@given(_UNSCALED_38, st.sampled_from([0, 1, 2, 9, 10, 18, 27, 37, 38]))
def test_decimals_of_38_digits_land_exactly_by_every_path(unscaled: int, scale: int) -> None:
    """A decimal(38, s) value, whichever way Debezium sends it (Connect's base64 decimal,
    Debezium's variable-scale struct, decimal.handling.mode string, a JSON number), becomes
    its exact text, record by record and in columns, and lands in decimal(38, s) exactly:
    Python's decimal context holds 28 digits, and no step may round to it."""
    want = _exact(unscaled, scale)
    connect = dbz.type_from_schema({
        "type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
        "parameters": {"scale": str(scale), "connect.decimal.precision": "38"}})
    variable = dbz.type_from_schema({"type": "struct",
                                     "name": "io.debezium.data.VariableScaleDecimal"})
    plain = dbz.FieldType(dbz.NUMERIC, dbz.numeric_modifier(38, scale))
    number = dbz.parse_event(b'{"op": "c", "after": {"n": ' + want.encode() + b"}}").after
    assert number is not None
    for value, t in ((_b64(unscaled), connect), ({"scale": scale, "value": _b64(unscaled)},
                                                 variable), (want, plain),
                     (number["n"], plain)):
        assert dbz.to_text(value, t) == want.encode(), (value, t)
    # In columns (a Connect decimal and a string), as one record at a time gives it.
    column = Column("n", dbz.NUMERIC, dbz.numeric_modifier(38, scale))
    for value, t in ((_b64(unscaled), connect), (want, plain)):
        images = dbz.Images((Column("id", dbz.INT4, is_key=True), column),
                            (dbz.FieldType(dbz.INT4), t))
        record = json.dumps({"op": "c", "after": {"id": 1, "n": value}}).encode()
        [(_, _, decoded)] = list(Columns(images).decode([record], [None]))
        assert decoded is not None and decoded.fast[0], value
        assert decoded.values[1][0].as_py() == want
    # The apply stage takes that text into decimal(38, s) as it is.
    staged, dead = TypeMap().prep([column]).apply([pa.array([want])])
    assert dead is None and staged[0][0].as_py() == Decimal(want)


def _f(kind: str, name: Optional[str] = None, **parameters: str) -> dict[str, Any]:
    """A Kafka Connect field schema."""
    field: dict[str, Any] = {"type": kind}
    if name:
        field["name"] = name
    if parameters:
        field["parameters"] = parameters
    return field


def _list(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


_DAY = 19675  # 2023-11-14, as days since 1970
_NOON = 45_296_789  # 12:34:56.789 as milliseconds since midnight
_AT_MS = 1_700_000_000_123  # 2023-11-14 22:13:20.123 UTC
_AT = datetime(2023, 11, 14, 22, 13, 20, 123000)
_UTC = timezone.utc
_T, _DEC, _VAR = "io.debezium.time.", "org.apache.kafka.connect.data.Decimal", \
    "io.debezium.data.VariableScaleDecimal"
_CONNECT = "org.apache.kafka.connect.data."

# Debezium's type mappings (its PostgreSQL and MySQL connector docs: source type -> the
# field's Kafka Connect schema and value), and what each lands as in Iceberg: the type the
# Postgres source gives the same source type (docs/types.md), and the value read back.
# (connector, source type, field schema, JSON value, Iceberg type, value in Iceberg)
DEBEZIUM_TYPES: list[tuple[str, str, dict[str, Any], Any, str, Any]] = [
    ("postgresql", "boolean", _f("boolean"), True, "boolean", True),
    ("postgresql", "bit(1)", _f("boolean"), False, "boolean", False),
    ("postgresql", "bit(10)", _f("bytes", "io.debezium.data.Bits", length="10"),
     base64.b64encode(bytes([0b1, 0b10])).decode(), "string", "1000000001"),
    ("postgresql", "bit varying(16)", _f("bytes", "io.debezium.data.Bits", length="16"),
     base64.b64encode(bytes([0b101])).decode(), "string", "101"),
    ("postgresql", "smallint", _f("int16"), -7, "int", -7),
    ("postgresql", "integer", _f("int32"), 2**31 - 1, "int", 2**31 - 1),
    ("postgresql", "bigint", _f("int64"), -(2**63), "bigint", -(2**63)),
    ("postgresql", "real", _f("float32"), 0.5, "float", 0.5),
    ("postgresql", "double precision", _f("float64"), 1e300, "double", 1e300),
    ("postgresql", "varchar(10)", _f("string"), "é", "string", "é"),
    ("postgresql", "timestamptz", _f("string", _T + "ZonedTimestamp"),
     "2023-11-14T22:13:20.123Z", "timestamp", _AT.replace(tzinfo=_UTC)),
    ("postgresql", "timetz", _f("string", _T + "ZonedTime"), "10:15:30Z", "string",
     "10:15:30Z"),
    ("postgresql", "bytea", _f("bytes"), "AP8=", "binary", b"\x00\xff"),
    ("postgresql", "json", _f("string", "io.debezium.data.Json"), '{"a": [1]}', "string",
     '{"a": [1]}'),
    ("postgresql", "uuid", _f("string", "io.debezium.data.Uuid"),
     "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "string", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ("postgresql", "date", _f("int32", _T + "Date"), _DAY, "date", date(2023, 11, 14)),
    ("postgresql", "date (time.precision.mode connect)", _f("int32", _CONNECT + "Date"),
     _DAY, "date", date(2023, 11, 14)),
    ("postgresql", "time(3)", _f("int32", _T + "Time"), _NOON, "string", "12:34:56.789000"),
    ("postgresql", "time(6)", _f("int64", _T + "MicroTime"), _NOON * 1000 + 1, "string",
     "12:34:56.789001"),
    ("postgresql", "time (connect)", _f("int32", _CONNECT + "Time"), _NOON, "string",
     "12:34:56.789000"),
    ("postgresql", "timestamp(3)", _f("int64", _T + "Timestamp"), _AT_MS, "timestamp_ntz", _AT),
    ("postgresql", "timestamp(6)", _f("int64", _T + "MicroTimestamp"), _AT_MS * 1000 + 4,
     "timestamp_ntz", _AT + timedelta(microseconds=4)),
    ("postgresql", "timestamp (connect)", _f("int64", _CONNECT + "Timestamp"), _AT_MS,
     "timestamp_ntz", _AT),
    ("postgresql", "numeric(10,2)", _f("bytes", _DEC, scale="2",
                                       **{"connect.decimal.precision": "10"}),
     _b64(-1234), "decimal(10,2)", Decimal("-12.34")),
    ("postgresql", "numeric", _f("struct", _VAR), {"scale": 3, "value": _b64(12345)},
     "decimal(38,18)", Decimal("12.345")),
    ("postgresql", "enum mood", _f("string", "io.debezium.data.Enum", allowed="ok,sad"), "ok",
     "string", "ok"),
    ("postgresql", "integer[]", _list(_f("int32")), [1, None, 3], "array<int>", [1, None, 3]),
    ("postgresql", "text[]", _list(_f("string")), ["a", "b,c", "NULL", None, ""],
     "array<string>", ["a", "b,c", "NULL", None, ""]),
    ("postgresql", "date[]", _list(_f("int32", _T + "Date")), [_DAY, 0], "array<date>",
     [date(2023, 11, 14), date(1970, 1, 1)]),
    ("postgresql", "numeric(5,2)[]", _list(_f("bytes", _DEC, scale="2",
                                              **{"connect.decimal.precision": "5"})),
     [_b64(150), None], "array<decimal(5,2)>", [Decimal("1.50"), None]),
    ("postgresql", "numeric[]", _list(_f("struct", _VAR)), [{"scale": 1, "value": _b64(15)}],
     "array<decimal(38,18)>", [Decimal("1.5")]),
    ("postgresql", "timestamptz[]", _list(_f("string", _T + "ZonedTimestamp")),
     ["2023-11-14T22:13:20.123Z"], "array<timestamp>", [_AT.replace(tzinfo=_UTC)]),
    ("postgresql", "timestamp(6)[]", _list(_f("int64", _T + "MicroTimestamp")), [_AT_MS * 1000],
     "array<timestamp_ntz>", [_AT]),
    ("postgresql", "bytea[]", _list(_f("bytes")), ["AP8=", None], "array<binary>",
     [b"\x00\xff", None]),
    ("postgresql", "boolean[]", _list(_f("boolean")), [True, False], "array<boolean>",
     [True, False]),
    ("postgresql", "uuid[]", _list(_f("string", "io.debezium.data.Uuid")),
     ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"], "array<string>",
     ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
    ("postgresql", "time(6)[]", _list(_f("int64", _T + "MicroTime")), [1], "array<string>",
     ["00:00:00.000001"]),
    ("mysql", "boolean", _f("boolean"), True, "boolean", True),
    ("mysql", "bit(1)", _f("boolean"), True, "boolean", True),
    ("mysql", "bit(12)", _f("bytes", "io.debezium.data.Bits", length="12"),
     base64.b64encode((0b100000000011).to_bytes(2, "little")).decode(), "string",
     "100000000011"),
    ("mysql", "tinyint", _f("int16"), -128, "int", -128),
    ("mysql", "mediumint", _f("int32"), 8_388_607, "int", 8_388_607),
    ("mysql", "bigint", _f("int64"), 2**63 - 1, "bigint", 2**63 - 1),
    ("mysql", "float", _f("float32"), 1.5, "float", 1.5),
    ("mysql", "double", _f("float64"), -0.25, "double", -0.25),
    ("mysql", "decimal(38,10)", _f("bytes", _DEC, scale="10",
                                   **{"connect.decimal.precision": "38"}),
     _b64(-(10**38 - 1)), "decimal(38,10)", Decimal("-9999999999999999999999999999.9999999999")),
    ("mysql", "char(3)", _f("string"), "abc", "string", "abc"),
    ("mysql", "blob", _f("bytes"), "AP8=", "binary", b"\x00\xff"),
    ("mysql", "json", _f("string", "io.debezium.data.Json"), "[1, 2]", "string", "[1, 2]"),
    ("mysql", "enum('red','green')", _f("string", "io.debezium.data.Enum",
                                        allowed="red,green"), "green", "string", "green"),
    ("mysql", "set('a','b','c')", _f("string", "io.debezium.data.EnumSet", allowed="a,b,c"),
     "a,c", "string", "a,c"),
    ("mysql", "year", _f("int32", _T + "Year"), 2024, "int", 2024),
    ("mysql", "date", _f("int32", _T + "Date"), -1, "date", date(1969, 12, 31)),
    ("mysql", "time", _f("int64", _T + "MicroTime"), -3_600_000_000, "string",
     "-01:00:00.000000"),
    ("mysql", "time(6) 838:59:59", _f("int64", _T + "MicroTime"),
     (838 * 3600 + 59 * 60 + 59) * 1_000_000, "string", "838:59:59.000000"),
    ("mysql", "datetime", _f("int64", _T + "Timestamp"), _AT_MS, "timestamp_ntz", _AT),
    ("mysql", "datetime(6)", _f("int64", _T + "MicroTimestamp"), _AT_MS * 1000,
     "timestamp_ntz", _AT),
    ("mysql", "timestamp", _f("string", _T + "ZonedTimestamp"), "2018-06-20T13:37:03Z",
     "timestamp", datetime(2018, 6, 20, 13, 37, 3, tzinfo=_UTC)),
    # Nanosecond types (Debezium's connectors for databases with them)
    ("other", "time(9)", _f("int64", _T + "NanoTime"), _NOON * 1_000_000 + 999, "string",
     "12:34:56.789000"),
    ("other", "timestamp(9)", _f("int64", _T + "NanoTimestamp"), _AT_MS * 1_000_000 + 999,
     "timestamp_ntz", _AT),
]


@pytest.mark.parametrize(("connector", "source", "field", "value", "iceberg", "landed"),
                         DEBEZIUM_TYPES, ids=[f"{c}:{s}" for c, s, *_ in DEBEZIUM_TYPES])
def test_each_debezium_type_lands_as_its_source_type_does(
        connector: str, source: str, field: dict[str, Any], value: Any, iceberg: str,
        landed: Any) -> None:
    """A field of each Debezium type, with a value: the Iceberg column type it makes and the
    value that lands there, record by record and in columns alike."""
    t = dbz.type_from_schema(field)
    column = Column("v", t.oid, t.modifier)
    types = TypeMap()
    assert types.spark_type(column).describe() == iceberg
    text = dbz.to_text(value, t)
    assert isinstance(text, bytes)
    staged, dead = types.prep([column]).apply([pa.array([text.decode()])])
    assert dead is None and staged[0][0].as_py() == landed
    # In columns: the same text (or left to the per-record path).
    images = dbz.Images((Column("id", dbz.INT4, is_key=True), column),
                        (dbz.FieldType(dbz.INT4), t))
    decoder = Columns(images)
    record = json.dumps({"op": "c", "after": {"id": 1, "v": value}}).encode()
    if decoder.usable:
        [(_, _, decoded)] = list(decoder.decode([record], [None]))
        if decoded is not None and decoded.fast[0]:
            assert decoded.values[1][0].as_py() == text.decode()
    # A table that exists reads its column's type back for records without schema.
    assert types.spark_type(Column("v", *pg_type_for(iceberg, "v"))).describe() == iceberg


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(st.characters(codec="utf-8",
                                                          exclude_characters="\x00"),
                                             max_size=6)), max_size=6),
       st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), max_size=6))
def test_arrays_land_as_lists_of_their_elements(texts: list[Optional[str]],
                                                numbers: list[Optional[int]]) -> None:
    """Any text[] and bigint[] (quotes, braces, commas, backslashes, white space, NULL and
    the text 'NULL' among the elements) lands as the list Debezium sent."""
    for value, items in ((texts, _f("string")), (numbers, _f("int64"))):
        t = dbz.type_from_schema(_list(items))
        column = Column("v", t.oid, t.modifier)
        text = dbz.to_text(value, t)
        assert isinstance(text, bytes)
        staged, dead = TypeMap().prep([column]).apply([pa.array([text.decode()])])
        assert dead is None and staged[0][0].as_py() == value


def test_odd_debezium_values_are_dead_letters_not_errors() -> None:
    """Values that cannot be read stop nothing: a VariableScaleDecimal with a null scale,
    JSON nested as deep as the reader goes, an array holding what its type cannot."""
    variable = dbz.type_from_schema(_f("struct", _VAR))
    for odd in ({"scale": None, "value": _b64(5)}, {"scale": 1, "value": None},
                {"scale": "2", "value": _b64(5)}):
        with pytest.raises(dbz.BadRecord, match="VariableScaleDecimal"):
            dbz.to_text(odd, variable)
    dates = dbz.type_from_schema(_list(_f("int32", _T + "Date")))
    for bad in ("[1]", [[1]], ["x"], [dbz.UNAVAILABLE, 1]):
        with pytest.raises(dbz.BadRecord):
            dbz.to_text(bad, dates)
    assert dbz.to_text([dbz.UNAVAILABLE], dbz.type_from_schema(_list(_f("string")))) \
        is UNCHANGED
    for bad in ({"h": 1}, [1], 1.5):  # (not its text in Python's spelling)
        with pytest.raises(dbz.BadRecord, match="not a time"):
            dbz.to_text(bad, dbz.type_from_schema(_f("int64", _T + "MicroTime")))
    images = dbz.Images((Column("id", dbz.INT4, is_key=True), Column("doc", dbz.JSONB)),
                        (dbz.FieldType(dbz.INT4), dbz.FieldType(dbz.JSONB)))
    # The deepest value the envelope's reader takes here, then made text a few frames
    # further down the stack (as the stager does).
    low, high = 1, 5000
    while low < high:
        depth = (low + high + 1) // 2
        try:
            dbz.parse_event(_nested(depth))
            low = depth
        except dbz.BadRecord:
            high = depth - 1
    event = dbz.parse_event(_nested(low))

    def deeper(frames: int) -> list[tuple[Op, Any]]:
        return deeper(frames - 1) if frames else images.changes(event, None)

    with pytest.raises(dbz.BadRecord, match="too deeply"):
        deeper(20)


def _nested(depth: int) -> bytes:
    return b'{"op": "c", "after": {"id": 1, "doc": ' + b"[" * depth + b"]" * depth + b"}}"


@given(st.dates())
def test_a_debezium_date_is_its_iso_day(day: date) -> None:
    t = dbz.type_from_schema({"type": "int32", "name": "io.debezium.time.Date"})
    assert dbz.to_text((day - date(1970, 1, 1)).days, t) == day.isoformat().encode()


@given(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)))
def test_micro_timestamps_and_zoned_timestamps_read_back(moment: datetime) -> None:
    micros = (moment - datetime(1970, 1, 1)) // timedelta(microseconds=1)
    t = dbz.type_from_schema({"type": "int64", "name": "io.debezium.time.MicroTimestamp"})
    assert dbz.to_text(micros, t) == moment.isoformat(" ", "microseconds").encode()
    z = dbz.type_from_schema({"type": "string", "name": "io.debezium.time.ZonedTimestamp"})
    aware = moment.replace(tzinfo=timezone(timedelta(hours=2)))
    text = dbz.to_text(aware.isoformat(), z)
    assert isinstance(text, bytes) and text.endswith(b"+00")
    back = datetime.fromisoformat(text.decode() + ":00")
    assert back == aware


@given(st.builds(kafka.Record, st.text(min_size=1, max_size=30), st.integers(0, 2**31 - 1),
                 st.integers(0, 2**62), st.integers(-1, 2**62),
                 st.one_of(st.none(), st.binary()), st.one_of(st.none(), st.binary())))
def test_a_record_frame_reads_back(record: kafka.Record) -> None:
    assert kafka.decode(kafka.encode(record)) == record


_RECORDS = st.builds(kafka.Record, st.sampled_from(["orders", "é.items", "t" * 300]),
                     st.integers(0, 2**31 - 1), st.integers(0, 2**62), st.integers(-1, 2**62),
                     st.one_of(st.none(), st.binary(max_size=50)),
                     st.one_of(st.none(), st.binary(max_size=200)))


@given(st.lists(_RECORDS, max_size=40))
def test_a_run_of_records_reads_back(records: list[kafka.Record]) -> None:
    frames = list(kafka.runs(records))
    assert [r for _, frame in frames for r in kafka.decode_run(frame)] == records
    assert [last for last, _ in frames] == ([max(r.offset for r in records)] if records else [])


def test_runs_hold_about_a_megabyte_each() -> None:
    big = [kafka.Record("t", 0, n, 0, b"k", bytes(400_000)) for n in range(7)]
    frames = list(kafka.runs(big))
    assert [last for last, _ in frames] == [1, 3, 5, 6]
    assert [r for _, frame in frames for r in kafka.decode_run(frame)] == big


def test_types_from_the_schema_part() -> None:
    assert dbz.type_from_schema({"type": "int16"}).oid == dbz.INT2
    assert dbz.type_from_schema({"type": "int64"}).oid == dbz.INT8
    assert dbz.type_from_schema({"type": "float64"}).oid == dbz.FLOAT8
    assert dbz.type_from_schema({"type": "boolean"}).oid == dbz.BOOL
    assert dbz.type_from_schema({"type": "string", "name": "io.debezium.data.Uuid"}).oid == dbz.UUID
    assert dbz.type_from_schema({"type": "string", "name": "io.debezium.data.Json"}).oid == dbz.JSONB
    d = dbz.type_from_schema({"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
                              "parameters": {"scale": "2", "connect.decimal.precision": "10"}})
    assert (d.oid, d.modifier, d.scale) == (dbz.NUMERIC, dbz.numeric_modifier(10, 2), 2)
    v = dbz.type_from_schema({"type": "struct", "name": "io.debezium.data.VariableScaleDecimal"})
    assert dbz.to_text({"scale": 3, "value": _b64(-12345)}, v) == b"-12.345"
    assert dbz.type_from_name("numeric(12, 4)").modifier == dbz.numeric_modifier(12, 4)
    with pytest.raises(ValueError, match="unknown type"):
        dbz.type_from_name("geometry")


def test_values_take_the_text_form_the_apply_stage_parses() -> None:
    assert dbz.to_text(True, dbz.FieldType(dbz.BOOL)) == b"t"
    assert dbz.to_text(float("inf"), dbz.FieldType(dbz.FLOAT8)) == b"Infinity"
    assert dbz.to_text({"a": [1]}, dbz.FieldType(dbz.JSONB)) == b'{"a":[1]}'
    assert dbz.to_text(base64.b64encode(b"\x01\xff").decode(), dbz.FieldType(dbz.BYTEA)) == b"\\x01ff"
    assert dbz.to_text(dbz.UNAVAILABLE, dbz.FieldType(dbz.TEXT)) is UNCHANGED
    for bad, t in (("x", dbz.INT4), (1, dbz.BOOL), ("2024-13-01", dbz.DATE)):
        with pytest.raises(dbz.BadRecord):
            dbz.to_text(bad, dbz.FieldType(t))


@given(st.one_of(st.decimals(allow_nan=False, allow_infinity=False).map(str),
                 st.from_regex(r"[-+]?[0-9]{1,6}(\.[0-9]{0,4})?(e[-+]?[0-9])?", fullmatch=True)))
def test_a_decimal_string_reads_as_its_number_whichever_way_it_is_written(text: str) -> None:
    """Decimals sent as text (decimal.handling.mode string) are passed on as they are when
    already canonical, else read as numbers: the same text either way."""
    assert dbz.to_text(text, dbz.FieldType(dbz.NUMERIC)) == format(Decimal(text), "f").encode()


def test_envelopes_with_and_without_schema() -> None:
    bare = {"op": "u", "before": None, "after": {"id": 1}, "ts_ms": 5, "source": {"lsn": 42}}
    e = dbz.parse_event(json.dumps(bare).encode())
    assert (e.op, e.after, e.fields, e.lsn, e.ts_ms) == ("u", {"id": 1}, None, 42, 5)
    schema = {"type": "struct", "fields": [
        {"field": "after", "type": "struct", "fields": [{"field": "id", "type": "int32"}]}]}
    wrapped = dbz.parse_event(json.dumps({"schema": schema, "payload": bare}).encode())
    assert wrapped.fields == (("id", dbz.FieldType(dbz.INT4)),)
    assert dbz.parse_key(b'{"schema": {}, "payload": {"id": 1}}') == {"id": 1}
    for raw, why in ((b"{not json", "not JSON"), (b'{"after": {}}', "no op"),
                     (b'{"op": "x"}', "unknown op"), (b'{"op": "c", "after": null}', "without after"),
                     (b"[1]", "not a Debezium envelope")):
        with pytest.raises(dbz.BadRecord, match=why):
            dbz.parse_event(raw)


COLUMNS = (Column("id", dbz.INT4, is_key=True), Column("v", dbz.TEXT))
TYPES = (dbz.FieldType(dbz.INT4), dbz.FieldType(dbz.TEXT))
IMAGES = dbz.Images(COLUMNS, TYPES)


def _event(op: str, before: object, after: object) -> dbz.Event:
    return dbz.parse_event(json.dumps({"op": op, "before": before, "after": after}).encode())


def test_ops_become_staged_changes() -> None:
    assert IMAGES.changes(_event("c", None, {"id": 1, "v": "a"}), None) == \
        [(Op.INSERT, (b"1", b"a"))]
    assert IMAGES.changes(_event("r", None, {"id": 1, "v": "a"}), None) == \
        [(Op.UPDATE, (b"1", b"a"))]
    assert IMAGES.changes(_event("u", {"id": 1, "v": "a"}, {"id": 1, "v": "b"}), None) == \
        [(Op.UPDATE, (b"1", b"b"))]
    # A changed key: the old row goes, the new one comes.
    assert IMAGES.changes(_event("u", {"id": 1, "v": "a"}, {"id": 2, "v": "a"}), None) == \
        [(Op.DELETE, (b"1", b"a")), (Op.INSERT, (b"2", b"a"))]
    # A delete without a before image takes its key from the message key.
    assert IMAGES.changes(_event("d", None, None), {"id": 7}) == [(Op.DELETE, (b"7", None))]
    with pytest.raises(dbz.BadRecord, match="missing key"):
        IMAGES.changes(_event("d", None, None), None)
    with pytest.raises(dbz.BadRecord, match="schema mismatch"):
        IMAGES.changes(_event("c", None, {"id": 1, "extra": 2}), None)


def test_values_no_column_can_hold_are_dead_letters_not_errors() -> None:
    images = dbz.Images((Column("id", dbz.INT4, is_key=True), Column("v", dbz.TEXT),
                         Column("x", dbz.FLOAT8)),
                        (dbz.FieldType(dbz.INT4), dbz.FieldType(dbz.TEXT), dbz.FieldType(dbz.FLOAT8)))
    lone = dbz.parse_event(b'{"op": "c", "after": {"id": 1, "v": "\\ud800"}}')
    with pytest.raises(dbz.BadRecord, match="column v"):
        images.changes(lone, None)
    huge = dbz.parse_event(b'{"op": "c", "after": {"id": 1, "x": 1' + b"0" * 400 + b"}}")
    with pytest.raises(dbz.BadRecord, match="column x"):
        images.changes(huge, None)


def test_a_numeric_sent_as_a_string_reads_as_the_columns_numeric() -> None:
    price = Column("price", dbz.NUMERIC, dbz.numeric_modifier(10, 2))
    own = dbz.FieldType(dbz.NUMERIC, dbz.numeric_modifier(10, 2))
    assert dbz.as_column(dbz.FieldType(dbz.TEXT), price, own) == own
    assert dbz.to_text("1e2", own) == b"100"  # (then held to numeric(10,2) like any value)
    with pytest.raises(dbz.BadRecord):
        dbz.to_text("lots", own)
    # Other strings keep their type (and a text column takes a string as it is).
    note = Column("note", dbz.TEXT)
    assert dbz.as_column(dbz.FieldType(dbz.TEXT), note, dbz.FieldType(dbz.TEXT)) == \
        dbz.FieldType(dbz.TEXT)
    assert dbz.as_column(dbz.FieldType(dbz.INT8), price, own) == dbz.FieldType(dbz.INT8)


def test_a_table_made_before_takes_a_type_as_it_did_then() -> None:
    """A Kafka table whose columns were made when arrays landed as JSON text, bits as bytes
    and Connect's time as an int (its columns read back from Iceberg) keeps taking them so,
    rather than refusing every later record as a schema mismatch."""
    for field, value, iceberg, then in (
            (_list(_f("int32", _T + "Date")), [1, None], "string", b"[1,null]"),
            (_f("bytes", "io.debezium.data.Bits", length="8"), "BQ==", "binary", b"\\x05"),
            (_f("int32", _CONNECT + "Time"), 1000, "int", b"1000")):
        column = Column("v", *pg_type_for(iceberg, "v"))
        t = dbz.as_column(dbz.type_from_schema(field), column,
                          dbz.FieldType(column.type_oid, column.type_modifier))
        assert TypeMap().spark_type(Column("v", t.oid, t.modifier)).describe() == iceberg
        assert dbz.to_text(value, t) == then


def test_the_unavailable_placeholder_in_every_form_debezium_sends_is_unchanged() -> None:
    """Debezium's placeholder for a TOASTed value an update left alone: a string for text, and
    other forms for other types (bytea, arrays of text and of numbers, hstore). Each keeps the
    lake's value; none is stored as data."""
    placeholder = dbz.UNAVAILABLE
    forms = [(base64.b64encode(placeholder.encode()).decode(), dbz.BYTEA),
             ([placeholder], dbz.JSONB), (list(placeholder.encode()), dbz.JSONB),
             ({placeholder: placeholder}, dbz.JSONB), (placeholder, dbz.NUMERIC)]
    for value, oid in forms:
        assert dbz.to_text(value, dbz.FieldType(oid)) is UNCHANGED, (value, oid)
    assert dbz.to_text(["x"], dbz.FieldType(dbz.JSONB)) == b'["x"]'
    event = dbz.parse_event(json.dumps(
        {"op": "u", "before": None, "after": {"id": 1, "b": forms[0][0], "a": [placeholder]}}
    ).encode())
    assert event.after is not None
    assert dbz.to_text(event.after["a"], dbz.FieldType(dbz.JSONB)) is UNCHANGED


def test_a_decimal_sent_as_a_json_number_keeps_its_digits() -> None:
    """Kafka Connect's ``decimal.format: NUMERIC`` writes a decimal as a JSON number: read from
    its digits, not through a double (which holds about 16)."""
    numeric = dbz.FieldType(dbz.NUMERIC, dbz.numeric_modifier(20, 2), None, 2)
    event = dbz.parse_event(b'{"op": "c", "before": null, "after": {"id": 123456789012345678.91, '
                            b'"n": 1.123456789012345678, "f": 0.1}}')
    assert event.after is not None
    assert dbz.to_text(event.after["id"], numeric) == b"123456789012345678.91"
    assert dbz.to_text(event.after["n"], dbz.FieldType(dbz.NUMERIC)) == b"1.123456789012345678"
    assert dbz.to_text(event.after["f"], dbz.FieldType(dbz.FLOAT8)) == b"0.1"
    key = dbz.parse_key(b'{"id": 123456789012345678.91}')
    assert key is not None and dbz.to_text(key["id"], numeric) == b"123456789012345678.91"


def test_a_time_past_a_day_or_below_zero_is_not_wrapped() -> None:
    """Postgres's time 24:00:00 and MySQL's TIME of -838 to 838 hours, as Debezium sends them
    (microseconds, or milliseconds for Connect's Time)."""
    micro = dbz.FieldType(dbz.TIME, -1, "io.debezium.time.MicroTime")
    assert dbz.to_text(86_400_000_000, micro) == b"24:00:00.000000"
    assert dbz.to_text(-3_600_000_000, micro) == b"-01:00:00.000000"
    assert dbz.to_text(838 * 3_600_000_000 + 59 * 60_000_000 + 59_000_001, micro) == \
        b"838:59:59.000001"
    assert dbz.to_text(45_296_789, dbz.FieldType(dbz.TIME, -1, "io.debezium.time.Time")) == \
        b"12:34:56.789000"
