"""Debezium change events (JSON, with or without the ``schema`` part): parsing, the column
types they declare, and their values as the Postgres text the apply stage takes. Pure: no I/O.

An event becomes staged changes the same way a pgoutput message does (see
``Images.changes``):

    op c -> insert      op r -> upsert (a snapshot read may be sent again)
    op u -> update by key; a changed key -> delete of the old key + insert of the new row
    op d -> delete by key            op t -> truncate
    a tombstone (null value, Kafka log compaction) -> nothing

Anything that cannot be applied raises ``BadRecord`` with the reason, for the dead letters.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, Mapping, Optional, Sequence

from walberg.model import UNCHANGED, Column, Op, Row, Value

# Postgres type OIDs (pg_type.oid) the events map to; the same numbers apply.types uses.
BOOL, BYTEA, INT8, INT2, INT4, TEXT = 16, 17, 20, 21, 23, 25
JSON, FLOAT4, FLOAT8, VARCHAR, DATE, TIME = 114, 700, 701, 1043, 1082, 1083
TIMESTAMP, TIMESTAMPTZ, NUMERIC, UUID, JSONB = 1114, 1184, 1700, 2950, 3802
BIT = 1560
# Each element type's array type (pg_type.typarray): a Debezium array whose schema gives its
# element type lands as a list of that type, as the Postgres source's arrays do.
ARRAY_OF = {BOOL: 1000, BYTEA: 1001, INT2: 1005, INT4: 1007, TEXT: 1009, VARCHAR: 1015,
            INT8: 1016, FLOAT4: 1021, FLOAT8: 1022, TIMESTAMP: 1115, DATE: 1182, TIME: 1183,
            TIMESTAMPTZ: 1185, NUMERIC: 1231, BIT: 1561, UUID: 2951, JSON: 199, JSONB: 3807}
ELEMENT_OF = {array: element for element, array in ARRAY_OF.items()}

# What Debezium sends for an unchanged TOASTed value it could not read: the lake keeps its own.
UNAVAILABLE = "__debezium_unavailable_value"
# The same placeholder as Debezium sends it for other column types: bytea (base64 of its bytes),
# arrays of text and of numbers (its bytes), hstore (a map of it to itself).
_UNAVAILABLE_BASE64 = base64.b64encode(UNAVAILABLE.encode()).decode()
_UNAVAILABLE_FORMS = ([UNAVAILABLE], list(UNAVAILABLE.encode()), {UNAVAILABLE: UNAVAILABLE})

_EPOCH = datetime(1970, 1, 1)
_EPOCH_DATE = date(1970, 1, 1)


class BadRecord(ValueError):
    """A record that cannot be applied; ``str()`` is the reason stored with the dead letter."""


# Debezium's op codes: create, read (snapshot), update, delete, truncate.
DbzOp = Literal["c", "r", "u", "d", "t"]


@dataclass(frozen=True, slots=True)
class FieldType:
    """A column's type: the Postgres type it lands as, and how its JSON values are encoded
    (``logical``: the Debezium/Kafka Connect semantic type name, when there is one)."""

    oid: int
    modifier: int = -1
    logical: Optional[str] = None
    scale: int = 0  # org.apache.kafka.connect.data.Decimal's scale parameter
    length: int = -1  # io.debezium.data.Bits' length parameter (bits), -1 if not given
    element: Optional["FieldType"] = None  # an array's element type, from its schema

    @property
    def items(self) -> "FieldType":
        """An array's element type (from the schema, else from the array's type alone)."""
        return self.element or FieldType(ELEMENT_OF[self.oid], self.modifier)


@dataclass(frozen=True, slots=True)
class Event:
    op: DbzOp
    before: Optional[Mapping[str, Any]]
    after: Optional[Mapping[str, Any]]
    fields: Optional[tuple[tuple[str, FieldType], ...]]  # from the schema part, if any
    ts_ms: Optional[int]
    lsn: Optional[int]  # source.lsn (Debezium's Postgres connector)

    @property
    def truncates(self) -> bool:
        return self.op == "t"


_OPS: dict[str, DbzOp] = {"c": "c", "r": "r", "u": "u", "d": "d", "t": "t"}

# Kafka Connect's primitive types.
_PRIMITIVES = {"int8": INT2, "int16": INT2, "int32": INT4, "int64": INT8, "float32": FLOAT4,
               "float64": FLOAT8, "float": FLOAT8, "double": FLOAT8, "boolean": BOOL,
               "string": TEXT, "bytes": BYTEA}
# Semantic types that change what a column is.
_LOGICAL = {
    "org.apache.kafka.connect.data.Decimal": NUMERIC,
    "io.debezium.data.VariableScaleDecimal": NUMERIC,
    "org.apache.kafka.connect.data.Date": DATE,
    "io.debezium.time.Date": DATE,
    "org.apache.kafka.connect.data.Timestamp": TIMESTAMP,
    "io.debezium.time.Timestamp": TIMESTAMP,
    "io.debezium.time.MicroTimestamp": TIMESTAMP,
    "io.debezium.time.NanoTimestamp": TIMESTAMP,
    "io.debezium.time.ZonedTimestamp": TIMESTAMPTZ,
    "io.debezium.time.Time": TIME,
    "org.apache.kafka.connect.data.Time": TIME,
    "io.debezium.time.MicroTime": TIME,
    "io.debezium.time.NanoTime": TIME,
    "io.debezium.data.Uuid": UUID,
    "io.debezium.data.Json": JSONB,
    "io.debezium.data.Enum": TEXT,
    "io.debezium.data.Bits": BIT,
}
# (io.debezium.time.Year, int32, and io.debezium.data.EnumSet, a string of comma-separated
# labels, are what their plain types say: an int and a string.)
# Units of the integer temporal types, per second.
_PER_SECOND = {"org.apache.kafka.connect.data.Timestamp": 1_000, "io.debezium.time.Timestamp": 1_000,
               "io.debezium.time.MicroTimestamp": 1_000_000,
               "io.debezium.time.NanoTimestamp": 1_000_000_000, "io.debezium.time.Time": 1_000,
               "org.apache.kafka.connect.data.Time": 1_000,
               "io.debezium.time.MicroTime": 1_000_000, "io.debezium.time.NanoTime": 1_000_000_000}

# Postgres type names for source.kafka.tables.<topic>.columns.
_NAMES = {"smallint": INT2, "int2": INT2, "integer": INT4, "int": INT4, "int4": INT4,
          "bigint": INT8, "int8": INT8, "real": FLOAT4, "float4": FLOAT4,
          "double precision": FLOAT8, "float8": FLOAT8, "boolean": BOOL, "bool": BOOL,
          "text": TEXT, "varchar": VARCHAR, "character varying": VARCHAR, "numeric": NUMERIC,
          "decimal": NUMERIC, "date": DATE, "time": TIME, "timestamp": TIMESTAMP,
          "timestamp without time zone": TIMESTAMP, "timestamptz": TIMESTAMPTZ,
          "timestamp with time zone": TIMESTAMPTZ, "uuid": UUID, "json": JSON, "jsonb": JSONB,
          "bytea": BYTEA, "bit varying": BIT, "varbit": BIT}
_NUMERIC = re.compile(r"^(?:numeric|decimal)\s*\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)$")


def numeric_modifier(precision: int, scale: int) -> int:
    """Postgres's type modifier of numeric(precision, scale)."""
    return ((precision << 16) | scale) + 4


def type_from_name(name: str) -> FieldType:
    """A Postgres type name as written in the pipeline file (``bigint``, ``numeric(10,2)``)."""
    text = " ".join(name.lower().split())
    if text.endswith("[]"):
        element = type_from_name(text[:-2])
        if element.oid not in ARRAY_OF:
            raise ValueError(f"no array type of {text[:-2]!r}")
        return FieldType(ARRAY_OF[element.oid], element.modifier)
    m = _NUMERIC.match(text)
    if m:
        return FieldType(NUMERIC, numeric_modifier(int(m.group(1)), int(m.group(2) or 0)))
    if text.startswith("varchar(") or text.startswith("character varying("):
        return FieldType(VARCHAR)
    if text not in _NAMES:
        raise ValueError(f"unknown type {name!r}; use one of {', '.join(sorted(_NAMES))}, or "
                         "numeric(p,s)")
    return FieldType(_NAMES[text])


def type_from_schema(field: Mapping[str, Any]) -> FieldType:
    """A Kafka Connect field schema (``{"type": "int32", "name": ..., "parameters": ...}``)."""
    logical = field.get("name")
    params = field.get("parameters") or {}
    if logical in _LOGICAL:
        oid = _LOGICAL[logical]
        if logical == "org.apache.kafka.connect.data.Decimal":
            scale = int(params.get("scale", 0))
            precision = params.get("connect.decimal.precision")
            modifier = numeric_modifier(int(precision), scale) if precision else -1
            return FieldType(oid, modifier, logical, scale)
        if logical == "io.debezium.data.Bits":
            return FieldType(oid, -1, logical, length=int(params.get("length", -1)))
        return FieldType(oid, -1, logical)
    kind = field.get("type")
    if kind in ("struct", "map"):
        return FieldType(JSONB, -1, kind)
    if kind == "array":
        element = _element_type(field.get("items"))
        if element is None or element.oid not in ARRAY_OF:
            return FieldType(JSONB, -1, "array")
        return FieldType(ARRAY_OF[element.oid], element.modifier, "array", element=element)
    if kind not in _PRIMITIVES:
        raise BadRecord(f"the schema has a field of unknown type {kind!r}")
    return FieldType(_PRIMITIVES[kind])


def _element_type(items: Any) -> Optional[FieldType]:
    """An array's element type from its ``items`` schema; None for an array of structs, maps
    or arrays (which stays JSON text), but for Debezium's variable-scale decimal struct."""
    if not isinstance(items, dict):
        return None
    if items.get("type") in ("array", "map", "struct") and items.get("name") not in _LOGICAL:
        return None
    return type_from_schema(items)


def infer_type(value: Any) -> FieldType:
    """A column's type guessed from one JSON value (no schema, no configured columns)."""
    if isinstance(value, bool):
        return FieldType(BOOL)
    if isinstance(value, int):
        return FieldType(INT8)
    if isinstance(value, float):
        return FieldType(FLOAT8)
    if isinstance(value, (dict, list)):
        return FieldType(JSONB)
    return FieldType(TEXT)


class _Number(float):
    """A JSON number with a fraction or exponent, as a float that keeps its text: a decimal
    sent as a number (Kafka Connect's ``decimal.format: NUMERIC``, a record without schema)
    is read from its digits, not through a double."""

    __slots__ = ("text",)
    text: str

    def __new__(cls, text: str) -> "_Number":
        number = float.__new__(cls, text)
        number.text = text
        return number


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw, parse_float=_Number)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRecord(f"the {what} is not JSON: {exc}") from None
    except RecursionError:
        raise BadRecord(f"the {what} nests JSON too deeply to read") from None


def parse_event(value: bytes) -> Event:
    """A Debezium envelope, with the ``schema``/``payload`` wrapper or without it."""
    doc = _json(value, "value")
    schema: Optional[Mapping[str, Any]] = None
    if isinstance(doc, dict) and "payload" in doc and "schema" in doc:
        schema, doc = doc["schema"], doc["payload"]
    if not isinstance(doc, dict):
        raise BadRecord("the value is not a Debezium envelope (a JSON object with op, before, "
                        "after)")
    given = doc.get("op")
    if given is None:
        raise BadRecord("the envelope has no op")
    op = _OPS.get(given) if isinstance(given, str) else None
    if op is None:
        raise BadRecord(f"unknown op {given!r} (expected c, r, u, d or t)")
    before, after = doc.get("before"), doc.get("after")
    if before is not None and type(before) is not dict:
        raise BadRecord("before is not a JSON object")
    if after is not None and type(after) is not dict:
        raise BadRecord("after is not a JSON object")
    if after is None and op in "cru":
        raise BadRecord(f"op {op} without after")
    source = doc.get("source")
    lsn = source.get("lsn") if type(source) is dict else None
    ts = doc.get("ts_ms")
    try:
        fields = _fields(schema) if schema is not None else None
    except BadRecord:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        # (a producer other than Debezium: a record the rest cannot follow is a dead letter,
        # not a batch that fails on every run)
        raise BadRecord(f"the envelope's schema is malformed ({type(exc).__name__}: "
                        f"{exc})") from None
    return Event(op, before, after, fields,
                 ts if isinstance(ts, int) else None, lsn if isinstance(lsn, int) else None)


def _fields(schema: Mapping[str, Any]) -> Optional[tuple[tuple[str, FieldType], ...]]:
    """The row's fields from the envelope schema (its ``after`` or ``before`` struct)."""
    parts = {f.get("field"): f for f in schema.get("fields") or [] if isinstance(f, dict)}
    row = parts.get("after") or parts.get("before")
    if row is None or not isinstance(row.get("fields"), list):
        return None
    return tuple((f["field"], type_from_schema(f)) for f in row["fields"])


def parse_key(key: Optional[bytes]) -> Optional[dict[str, Any]]:
    """The message key as field -> value (unwrapped from schema/payload), None if absent."""
    if key is None:
        return None
    doc = _json(key, "key")
    if isinstance(doc, dict) and "payload" in doc and "schema" in doc:
        doc = doc["payload"]
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise BadRecord("the key is not a JSON object of key columns")
    return doc


def _unscaled(text: str) -> int:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRecord(f"{text!r} is not a base64 decimal") from None
    return int.from_bytes(raw, "big", signed=True)


def _scaled(unscaled: int, scale: int) -> Decimal:
    """unscaled * 10^-scale, exactly: built from its text, since arithmetic (``scaleb``)
    rounds to the decimal context's 28 digits and a decimal(38, s) has up to 38."""
    return Decimal(f"{unscaled}E{-scale}")


def _decimal_text(value: Any, t: FieldType) -> str:
    if t.logical == "io.debezium.data.VariableScaleDecimal":
        if not isinstance(value, dict) or "value" not in value:
            raise BadRecord("a VariableScaleDecimal is not {scale, value}")
        scale = value.get("scale", 0)
        if isinstance(scale, bool) or not isinstance(scale, int):
            raise BadRecord(f"a VariableScaleDecimal whose scale is {scale!r}, not an "
                            "integer: its value cannot be read")
        if value["value"] is None:
            raise BadRecord("a VariableScaleDecimal without its value")
        number = _scaled(_unscaled(value["value"]), scale)
    elif isinstance(value, str) and t.logical == "org.apache.kafka.connect.data.Decimal":
        number = _scaled(_unscaled(value), t.scale)
    elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # decimal.handling.mode string or double, decimal.format NUMERIC
            number = Decimal(value.text if isinstance(value, _Number) else str(value))
        except InvalidOperation:
            raise BadRecord(f"{value!r} is not a number") from None
    else:
        raise BadRecord(f"{value!r} is not a number")
    if not number.is_finite():
        return "NaN" if number.is_nan() else ("Infinity" if number > 0 else "-Infinity")
    return format(number, "f")


def _instant(value: int, per_second: int) -> datetime:
    seconds, rest = divmod(value, per_second)
    return _EPOCH + timedelta(seconds=seconds, microseconds=rest * 1_000_000 // per_second)


def _temporal(value: Any, t: FieldType) -> str:
    try:
        if t.oid == DATE:
            if isinstance(value, int) and not isinstance(value, bool):
                return (_EPOCH_DATE + timedelta(days=value)).isoformat()
            return date.fromisoformat(str(value)).isoformat()
        if t.oid == TIMESTAMP:
            if isinstance(value, int) and not isinstance(value, bool):
                # No schema: microseconds, Debezium's default for timestamp(6).
                moment = _instant(value, _PER_SECOND.get(t.logical or "", 1_000_000))
            else:
                moment = datetime.fromisoformat(str(value)).replace(tzinfo=None)
            return moment.isoformat(" ", "microseconds")
        if t.oid == TIMESTAMPTZ:
            if isinstance(value, int) and not isinstance(value, bool):
                moment = _instant(value, 1_000_000).replace(tzinfo=timezone.utc)
            else:
                moment = datetime.fromisoformat(str(value))
                if moment.tzinfo is None:
                    raise BadRecord(f"{value!r} has no time zone")
            return moment.astimezone(timezone.utc).replace(tzinfo=None).isoformat(
                " ", "microseconds") + "+00"
        # TIME: hours past 24 and below 0 as they are (Postgres's 24:00:00, MySQL's TIME of
        # -838 to 838 hours), not wrapped around a day
        if isinstance(value, int) and not isinstance(value, bool):
            per_second = _PER_SECOND.get(t.logical or "", 1_000_000)
            micros = abs(value) * 1_000_000 // per_second
            seconds, fraction = divmod(micros, 1_000_000)
            minutes, second = divmod(seconds, 60)
            hours, minute = divmod(minutes, 60)
            return (f"{'-' if value < 0 else ''}{hours:02d}:{minute:02d}:{second:02d}."
                    f"{fraction:06d}")
        if not isinstance(value, str):
            raise BadRecord(f"{value!r:.60} is not a time")
        return value
    except (ValueError, OverflowError) as exc:
        if isinstance(exc, BadRecord):
            raise
        raise BadRecord(f"{value!r} is not a valid {_type_name(t.oid)}: {exc}") from None


def _type_name(oid: int) -> str:
    return {v: k for k, v in _NAMES.items()}.get(oid, str(oid))


def _bits_text(value: Any, t: FieldType) -> bytes:
    """io.debezium.data.Bits (base64 of the bits, little-endian) as Postgres writes a bit
    string: ``length`` digits, the first the highest bit. Where the bytes hold fewer bits
    than ``length`` (bit varying: its longest), the string starts at the highest bit set."""
    if not isinstance(value, str):
        raise BadRecord(f"{value!r:.60} is not base64 bits")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRecord(f"{value[:40]!r} is not base64 bits") from None
    number = int.from_bytes(raw, "little")
    if 0 <= t.length <= 8 * len(raw):
        width = t.length
    else:
        width = max(number.bit_length(), 1) if raw else 0
    if number >> width:
        raise BadRecord(f"{value[:40]!r} holds more than {width} bits")
    return format(number, "b").rjust(width, "0").encode() if width else b""


# An array element Postgres quotes in an array literal: empty, spelled NULL, or holding a
# brace, quote, comma, backslash or white space.
_QUOTE = re.compile(rb'[{}",\\\s]|^$|^null$', re.IGNORECASE)


def _array_text(value: Any, t: FieldType) -> bytes:
    """A JSON array as Postgres's array literal of its elements' text (``{1,NULL,"a b"}``),
    which the apply stage makes a list of the element type."""
    if not isinstance(value, list):
        raise BadRecord(f"{value!r:.60} is not an array")
    element = t.items
    parts: list[bytes] = []
    for item in value:
        text = to_text(item, element)
        if text is None:
            parts.append(b"NULL")
        elif not isinstance(text, bytes):
            raise BadRecord("an array holds Debezium's unavailable-value placeholder among "
                            "other elements")
        elif _QUOTE.search(text):
            parts.append(b'"' + text.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"')
        else:
            parts.append(text)
    return b"{" + b",".join(parts) + b"}"


# Column types whose JSON values are read by more than their text (see to_text).
TYPED = frozenset({BOOL, INT2, INT4, INT8, FLOAT4, FLOAT8, NUMERIC, DATE, TIMESTAMP,
                   TIMESTAMPTZ, TIME, BYTEA, BIT, *ELEMENT_OF})
_INTEGERS = frozenset({INT2, INT4, INT8})
# A decimal written as its own canonical text (decimal.handling.mode string): kept as it is.
PLAIN_DECIMAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")


def to_text(value: Any, t: FieldType) -> Value:
    """One JSON value as the Postgres text form of its column type (bytes), None for NULL,
    UNCHANGED for Debezium's unavailable-value placeholder."""
    if value is None:
        return None
    # The common cases first (a record's values go through here one by one).
    kind = type(value)
    if kind is str:
        if t.oid not in TYPED and value != UNAVAILABLE:
            return str.encode(value)
        if t.oid == NUMERIC and t.logical is None and PLAIN_DECIMAL.fullmatch(value):
            return str.encode(value)
    elif kind is int and t.oid in _INTEGERS:
        return str(value).encode()
    if value == UNAVAILABLE or (kind is not str and value in _UNAVAILABLE_FORMS):
        return UNCHANGED
    oid = t.oid
    if oid == BOOL:
        if not isinstance(value, bool):
            raise BadRecord(f"{value!r} is not a boolean")
        return b"t" if value else b"f"
    if oid in (INT2, INT4, INT8):
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRecord(f"{value!r} is not an integer")
        return str(value).encode()
    if oid in (FLOAT4, FLOAT8):
        if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
            return value.encode()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRecord(f"{value!r} is not a number")
        number = float(value)
        if math.isnan(number):
            return b"NaN"
        if math.isinf(number):
            return b"Infinity" if number > 0 else b"-Infinity"
        return repr(number).encode()
    if oid == NUMERIC:
        return _decimal_text(value, t).encode()
    if oid in (DATE, TIMESTAMP, TIMESTAMPTZ, TIME):
        return _temporal(value, t).encode()
    if oid == BYTEA:
        if value == _UNAVAILABLE_BASE64:
            return UNCHANGED
        if not isinstance(value, str):
            raise BadRecord(f"{value!r} is not base64 bytes")
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise BadRecord(f"{value[:40]!r} is not base64 bytes") from None
        return b"\\x" + raw.hex().encode()
    if oid == BIT:
        return _bits_text(value, t)
    if oid in ELEMENT_OF:
        return _array_text(value, t)
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
        except RecursionError:
            # (read a few frames up the stack: a value json.loads took may not go back out)
            raise BadRecord("the value nests JSON too deeply to store") from None
    if isinstance(value, bool):
        return b"true" if value else b"false"
    return str(value).encode()


def as_column(t: FieldType, column: Column, own: FieldType) -> FieldType:
    """The type a record's field is read as in ``column`` (whose own type is ``own``): the
    field's type, except a string for a numeric column, which Debezium sends with
    ``decimal.handling.mode: string``: read as the column's numeric (exact, and checked
    against its precision and scale like any other). A column made before walberg read a
    type as it does now keeps taking it as it did then: an array as JSON text in a string
    column, bits as bytes in a binary column, Connect's time as milliseconds in an int one."""
    if column.type_oid == NUMERIC and t.oid in (TEXT, VARCHAR) and t.logical is None:
        return own
    if t.oid in ELEMENT_OF and column.type_oid == TEXT:
        return FieldType(JSONB, -1, "array")
    if t.oid == BIT and column.type_oid == BYTEA:
        return FieldType(BYTEA)
    if t.logical == "org.apache.kafka.connect.data.Time" and column.type_oid == INT4:
        return FieldType(INT4)
    return t


def check_fields(fields: Sequence[tuple[str, FieldType]], columns: Sequence[Column],
                 same_type: Any) -> None:
    """Refuse a record whose schema does not fit the table: a field the table lacks, or one
    whose type lands as another Iceberg type (``same_type(field_type, column)``)."""
    by_name = {c.name: c for c in columns}
    for name, t in fields:
        col = by_name.get(name)
        if col is None:
            raise BadRecord(f"schema mismatch: field {name} is not a column of the table "
                            f"({', '.join(by_name)})")
        if not same_type(t, col):
            raise BadRecord(f"schema mismatch: field {name} is {_type_name(t.oid)} in the "
                            f"record, the table's column is {_type_name(col.type_oid)}")


class Images:
    """How a table's before/after objects become staged rows: its columns, their types and its
    key, worked out once for all the records that share them."""

    def __init__(self, columns: Sequence[Column], types: Sequence[FieldType]) -> None:
        self.columns = tuple(columns)
        self.names = frozenset(c.name for c in columns)
        self.fields = tuple((c.name, t) for c, t in zip(columns, types, strict=True))
        self.keys = tuple((i, c.name) for i, c in enumerate(columns) if c.is_key)
        self._key_at = frozenset(i for i, _ in self.keys)

    def row(self, values: Optional[Mapping[str, Any]], old: bool = False) -> Row:
        """A before/after object as a staged row in the table's column order. A field the
        table lacks is a schema mismatch; a column the record lacks is NULL. ``old``: the row
        a change replaces or deletes, needed only for its key: a value outside the key that
        cannot be stored is NULL rather than the record's refusal."""
        values = values or {}
        if not values.keys() <= self.names:
            extra = set(values) - self.names
            raise BadRecord(f"schema mismatch: field(s) {', '.join(sorted(extra))} not in the "
                            f"table ({', '.join(c.name for c in self.columns)})")
        out: list[Value] = []
        spare = old and bool(self.keys)
        for i, (name, t) in enumerate(self.fields):
            try:
                out.append(to_text(values.get(name), t))
            except (BadRecord, ValueError, OverflowError) as exc:
                if spare and i not in self._key_at:
                    out.append(None)
                    continue
                if isinstance(exc, BadRecord):
                    raise BadRecord(f"column {name}: {exc}") from None
                # A lone surrogate escape (no UTF-8 text holds it), an integer no double
                # holds: the record cannot be stored, and must not stop the run.
                raise BadRecord(f"column {name}: {values.get(name)!r:.60} cannot be stored as "
                                f"{_type_name(t.oid)}: {exc}") from None
        return tuple(out)

    def image(self, values: Optional[Mapping[str, Any]], key: Optional[Mapping[str, Any]],
              old: bool = False) -> Row:
        """``row``, with key columns missing from the object taken from the message key."""
        if key is not None:
            given = values or {}
            missing = {n: key[n] for _, n in self.keys
                       if given.get(n) is None and key.get(n) is not None}
            if missing:
                values = {**given, **missing}
        staged = self.row(values, old)
        for i, n in self.keys:
            if staged[i] is None or staged[i] is UNCHANGED:
                raise BadRecord(f"missing key: key column {n} has no value in the record "
                                "or its message key")
        return staged

    def changes(self, event: Event, key: Optional[Mapping[str, Any]]) -> list[tuple[Op, Row]]:
        """The staged changes of one event, in order: (op, row). Key columns missing from
        the before/after image come from the message key."""
        op = event.op
        if op == "t":
            return []
        if op == "c":
            return [(Op.INSERT, self.image(event.after, key))]
        if op == "r":
            return [(Op.UPDATE, self.image(event.after, key))]
        if op == "d":
            return [(Op.DELETE, self.image(event.before, key, old=True))]
        new = self.image(event.after, key)
        if event.before is not None:
            old = self.image(event.before, key, old=True)
            if any(old[i] != new[i] for i, _ in self.keys):
                # A changed key: the old row goes, the new one comes (like pgoutput's key change).
                return [(Op.DELETE, old), (Op.INSERT, new)]
        return [(Op.UPDATE, new)]

