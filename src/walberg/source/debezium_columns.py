"""Debezium events decoded in columns: a run of one topic's records parsed at once by Arrow's
JSON reader into the table's columns, for the records whose staged change this gives exactly
as ``Images.changes`` gives it one record at a time. Pure: no I/O.

Decoding one record at a time in Python costs about 20 us a record (the JSON, the envelope's
checks, each value to its text, one tuple per row); in columns it is the reader's C++ and a
few vectorised steps for the whole run. The per-record path stays the reference: a record
this module cannot vouch for is left to it (``Decoded.fast`` is False), and so is any run of
records the reader refuses as a whole (a value that is not JSON, a field of another type, a
field the table lacks): the run is halved until the records it refuses are found. What is
left to the per-record path:

- a truncate, an unknown op, a create/read/update without ``after``, a delete without
  ``before``, and an envelope with its ``schema`` part (the stager hands over the payloads of
  those whose schema text it has seen, with that schema's types: ``split_envelope``);
- a key column that is null or unavailable in the image (the message key fills it), an
  update whose key changed (a delete and an insert), and an update whose ``before`` is not
  fit to stage (the per-record path reads it too);
- a value the per-record path reads as more than its text and the columns cannot match
  exactly: a numeric that is not plain decimal text, a date or timestamp outside years
  1-9999, a message key that is not a JSON object;
- a timestamptz not written as Debezium writes it (UTC, ``Z``, at most six digits of
  fraction);
- values the per-record path's ``to_text`` refuses, in columns it is called on a value at a
  time (Connect's base64 decimals, bytea, real, times, bits, arrays, nanosecond timestamps:
  types without vectorised steps here);
- tables with a variable-scale decimal column, or an array of them (a JSON object per value).

Each record is wrapped as ``{"r": <value>}`` on a line of its own, so that a value that is not
one JSON value (two objects, or none) makes its line invalid rather than shifting the rows;
values holding a line break are refused before the reader sees them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date, datetime
from typing import Iterator, Optional, Sequence, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from walberg.model import UNCHANGED, Op
from walberg.source import debezium as dbz
from walberg.source.debezium import BOOL, DATE, FLOAT8, INT2, INT4, INT8, NUMERIC, TIMESTAMP

# How the reader reads the JSON values of the types made text in vectorised steps.
_READS: dict[int, pa.DataType] = {INT2: pa.int64(), INT4: pa.int64(), INT8: pa.int64(),
                                  FLOAT8: pa.float64(), BOOL: pa.bool_(), NUMERIC: pa.string(),
                                  DATE: pa.int64(), TIMESTAMP: pa.int64(),
                                  dbz.TIMESTAMPTZ: pa.string()}
# Days and microseconds since 1970 of the first and last day Python's dates hold (years 1-9999).
_DAYS = ((date.min - date(1970, 1, 1)).days, (date.max - date(1970, 1, 1)).days)
_MICROS = (-62_135_596_800_000_000, 253_402_300_799_999_999)
assert _MICROS[0] == (datetime.min - datetime(1970, 1, 1)).days * 86_400_000_000
# Read in columns, then made text a value at a time: Connect's base64 decimals, bytea, real,
# times, bits and nanosecond timestamps (and arrays of any of the types read in columns).
_BY_VALUE: dict[int, pa.DataType] = {NUMERIC: pa.string(), dbz.BYTEA: pa.string(),
                                     dbz.FLOAT4: pa.float64(), dbz.TIME: pa.int64(),
                                     TIMESTAMP: pa.int64(), dbz.BIT: pa.string()}
_MILLIS = frozenset({"org.apache.kafka.connect.data.Timestamp", "io.debezium.time.Timestamp"})
_MICROS_LOGICAL = "io.debezium.time.MicroTimestamp"
_SCHEMA_HEAD, _PAYLOAD = b'{"schema":', b',"payload":'
# Debezium's ZonedTimestamp in UTC, as it sends a timestamptz: a moment with up to six digits
# of fraction (other forms are read one record at a time).
_ZONED = r"^(?P<at>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(?P<fraction>\d{1,6}))?Z$"
SMALLEST = 32  # a refused run is halved down to this many records, then left to the per-record path
_OPS = ("c", "r", "u", "d")  # create and read become an insert and an upsert, see Images


def _read_as(t: dbz.FieldType) -> Optional[pa.DataType]:
    """How the reader reads a column's JSON values; None: the table goes one record at a
    time."""
    if t.oid not in dbz.TYPED:
        return pa.string()  # kept as the JSON string it is (text, uuid, json sent as text)
    if _vectorised(t):
        return _READS[t.oid]
    if t.oid in dbz.ELEMENT_OF:  # an array: a list of its elements as they are read
        element = _read_as(t.items)
        return None if element is None else pa.list_(element)
    return None if t.logical == "io.debezium.data.VariableScaleDecimal" else _BY_VALUE.get(t.oid)


def _vectorised(t: dbz.FieldType) -> bool:
    """Whether a column's text is made in vectorised steps; else by the per-record path's own
    ``to_text``, a value at a time."""
    if t.oid not in dbz.TYPED or t.oid in (DATE, dbz.TIMESTAMPTZ):
        return True  # (dates are days, zoned timestamps strings, whatever the logical type)
    if t.oid == TIMESTAMP:
        return t.logical is None or t.logical in _MILLIS or t.logical == _MICROS_LOGICAL
    return t.logical is None and t.oid in _READS


def split_envelope(value: bytes) -> Optional[tuple[bytes, bytes]]:
    """A value laid out as Kafka Connect's JSON converter writes it, ``{"schema":S,
    "payload":P}``, as ``(S, P)``, cut where the first ``,"payload":`` falls; None for any
    other layout. The cut is right when S and P are each one JSON value (``is_envelope``):
    checked once for each schema text before records carrying it are decoded in columns."""
    if not value.startswith(_SCHEMA_HEAD) or not value.endswith(b"}"):
        return None
    at = value.find(_PAYLOAD, len(_SCHEMA_HEAD))
    if at < 0:
        return None
    return value[len(_SCHEMA_HEAD):at], value[at + len(_PAYLOAD):-1]


def is_envelope(parts: tuple[bytes, bytes]) -> bool:
    """Whether the schema and payload texts ``split_envelope`` cut are each one JSON value,
    so that the value was exactly ``{"schema": S, "payload": P}``."""
    try:
        json.loads(parts[0])
        json.loads(parts[1])
    except (ValueError, RecursionError):
        return False
    return True


@dataclass
class Decoded:
    """A run of records in columns; rows where ``fast`` is False are left to the per-record
    path (their other fields mean nothing)."""

    fast: npt.NDArray[np.bool_]
    ops: npt.NDArray[np.str_]  # the staged change's Op code
    lsn: npt.NDArray[np.int64]  # source.lsn, 0 when absent
    values: list[pa.Array]  # each column's Postgres text, null for NULL and for unavailable
    unchanged: list[Optional[npt.NDArray[np.bool_]]]  # per column: rows whose value is unavailable

    def slice(self, lo: int, hi: int
              ) -> tuple[npt.NDArray[np.str_], npt.NDArray[np.int64], list[pa.Array],
                         list[Optional[npt.NDArray[np.bool_]]]]:
        """The rows lo..hi as ``BatchBuilder.add_columns`` takes them (ops, lsn, values,
        unchanged)."""
        return (self.ops[lo:hi], self.lsn[lo:hi], [v.slice(lo, hi - lo) for v in self.values],
                [None if u is None or not u[lo:hi].any() else u[lo:hi] for u in self.unchanged])


class _Refused(Exception):
    """The reader cannot take the run as a whole."""


class Columns:
    """A table's records decoded in columns; ``usable`` is False when a column's type is read
    only one record at a time."""

    def __init__(self, images: dbz.Images) -> None:
        self.images = images
        reads = [_read_as(t) for _, t in images.fields]
        self.usable = all(r is not None for r in reads)
        self.types = [t for _, t in images.fields]
        self.keys = [i for i, _ in images.keys]
        row = pa.struct([pa.field(name, r or pa.null()) for (name, _), r in
                         zip(images.fields, reads, strict=True)])
        self.row_type = row
        self.schema = pa.schema([pa.field("r", pa.struct([
            pa.field("op", pa.string()), pa.field("before", row), pa.field("after", row)]))])

    def decode(self, values: Sequence[bytes], keys: Sequence[Optional[bytes]]
               ) -> Iterator[tuple[int, int, Optional[Decoded]]]:
        """The records (values and message keys, in order) as pieces ``(lo, hi, decoded)``
        covering them in order; ``decoded`` is None for a piece left to the per-record path."""
        if values:
            yield from self._pieces(values, keys, 0)

    def _pieces(self, values: Sequence[bytes], keys: Sequence[Optional[bytes]], at: int
                ) -> Iterator[tuple[int, int, Optional[Decoded]]]:
        n = len(values)
        try:
            yield at, at + n, self._decode(values, keys)
        except (_Refused, pa.ArrowInvalid, pa.ArrowNotImplementedError):
            if n <= SMALLEST:
                yield at, at + n, None
                return
            half = n // 2
            yield from self._pieces(values[:half], keys[:half], at)
            yield from self._pieces(values[half:], keys[half:], at + half)

    def _decode(self, values: Sequence[bytes], keys: Sequence[Optional[bytes]]) -> Decoded:
        n = len(values)
        envelope = _read_lines(b"r", values, self.schema).column("r").combine_chunks()
        parts = dict(zip((f.name for f in envelope.type), envelope.flatten(), strict=True))
        before, after = parts["before"], parts["after"]
        if before.type != self.row_type or after.type != self.row_type:
            raise _Refused  # a field the table lacks (the per-record path names it)
        op = parts["op"]
        is_d = _true(pc.equal(op, "d"))
        is_u = _true(pc.equal(op, "u"))
        known = _true(pc.is_in(op, value_set=pa.array(_OPS)))
        image = pc.if_else(is_d, before.is_valid(), after.is_valid())
        fast = _np(known) & _np(image) & self._keys_fit(keys, n)
        olds, news = before.flatten(), after.flatten()
        # An update with a before image is staged only when that image is fit to stage too
        # and the key did not change (else a delete and an insert, one record at a time).
        with_before = _np(is_u) & _np(before.is_valid())
        updates = np.flatnonzero(with_before)  # (their before images alone are read)
        taken = pa.array(updates)
        values_out: list[pa.Array] = []
        unchanged: list[Optional[npt.NDArray[np.bool_]]] = []
        old_fit = np.ones(len(updates), np.bool_)
        for i, t in enumerate(self.types):
            chosen = pc.if_else(is_d, olds[i], news[i])
            text, unavailable, ok = _text(chosen, t)
            fast &= ok
            values_out.append(text)
            unchanged.append(unavailable if unavailable.any() else None)
            if i in self.keys:
                fast &= _np(text.is_valid())  # null or unavailable: the message key fills it
            if len(updates):
                old, _, ok = _text(olds[i].take(taken), t)
                old_fit &= ok
                if i in self.keys:  # (null: unavailable or absent)
                    old_fit &= _np(_true(pc.equal(old, text.take(taken))))
        fast[updates[~old_fit]] = False
        ops = np.full(n, Op.UPDATE.value)
        ops[_np(_true(pc.equal(op, "c")))] = Op.INSERT.value
        ops[_np(is_d)] = Op.DELETE.value
        return Decoded(fast, ops, _lsn(parts.get("source"), n), values_out, unchanged)

    def _keys_fit(self, keys: Sequence[Optional[bytes]], n: int) -> npt.NDArray[np.bool_]:
        """Rows whose message key the per-record path reads without refusing the record: none,
        or a JSON object (whose ``payload``, if it has one, is an object too)."""
        fit = np.ones(n, np.bool_)
        if None in keys:
            at = np.flatnonzero(np.fromiter((k is not None for k in keys), np.bool_, n))
            given = [k for k in keys if k is not None]
        else:
            at, given = np.arange(n), cast("list[bytes]", list(keys))  # (the usual case)
        if not given:
            return fit
        parsed = _read_lines(b"k", given).column("k").combine_chunks()
        if pa.types.is_null(parsed.type):
            return fit  # JSON null: no key
        refused = parsed  # rows whose key is not an object
        if pa.types.is_struct(parsed.type):
            # A schema/payload wrapper is read for its payload, which must be an object.
            payload = parsed.type.get_field_index("payload")
            kind = parsed.type.field(payload).type if payload >= 0 else pa.null()
            if pa.types.is_null(kind) or pa.types.is_struct(kind):
                return fit
            refused = parsed.flatten()[payload]
        fit[at[_np(refused.is_valid())]] = False
        return fit


def _read_lines(name: bytes, values: Sequence[bytes],
                schema: Optional[pa.Schema] = None) -> pa.Table:
    """``values`` as the rows of one field ``name``, one row each, or _Refused."""
    data = b"".join((b'{"', name, b'":', (b'}\n{"' + name + b'":').join(values), b"}"))
    if data.count(b"\n") != len(values) - 1:
        raise _Refused  # a line break inside a value
    table = pj.read_json(pa.py_buffer(data), read_options=pj.ReadOptions(block_size=1 << 24),
                         parse_options=pj.ParseOptions(explicit_schema=schema,
                                                       unexpected_field_behavior="infer"))
    if table.num_rows != len(values) or table.num_columns != 1:
        raise _Refused  # (a second field beside ``name``: a value followed by more JSON)
    table.validate(full=True)  # (text that is not UTF-8 is refused here)
    return table


def _true(mask: pa.Array) -> pa.Array:
    return pc.fill_null(mask, False)


def _np(mask: pa.Array) -> npt.NDArray[np.bool_]:
    return np.asarray(mask.to_numpy(zero_copy_only=False), dtype=np.bool_)


def _text(values: pa.Array, t: dbz.FieldType
          ) -> tuple[pa.Array, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """A column's values as ``to_text`` gives them: (text, null for NULL and unavailable;
    which rows are unavailable; which rows it gives exactly)."""
    if not _vectorised(t):
        return _by_value(values, t)
    if t.oid == dbz.TIMESTAMPTZ:
        return _zoned(values)
    n = len(values)
    unavailable = np.zeros(n, np.bool_)
    ok = np.ones(n, np.bool_)
    if pa.types.is_string(values.type):
        flags = _true(pc.equal(values, dbz.UNAVAILABLE))
        unavailable = _np(flags)
        text = pc.if_else(flags, pa.scalar(None, pa.string()), values)
        if t.oid == NUMERIC:
            plain = pc.match_substring_regex(text, f"^(?:{dbz.PLAIN_DECIMAL.pattern})$")
            ok = _np(pc.or_(pc.fill_null(plain, True), flags))
        return text, unavailable, ok
    if pa.types.is_boolean(values.type):
        return pc.if_else(values, "t", "f"), unavailable, ok
    if t.oid in (DATE, TIMESTAMP):
        low, high = _DAYS if t.oid == DATE else _MICROS
        unit = 1000 if t.logical in _MILLIS else 1  # microseconds in each of the values' units
        low, high = -(-low // unit), high // unit
        inside = pc.and_(pc.greater_equal(values, low), pc.less_equal(values, high))
        ok = _np(pc.fill_null(inside, True))
        held = pc.if_else(inside, values, pa.scalar(None, pa.int64()))
        if unit != 1:
            held = pc.multiply(held, unit)
        typed = held.cast(pa.int32()).cast(pa.date32()) if t.oid == DATE \
            else held.cast(pa.timestamp("us"))
        return typed.cast(pa.string()), unavailable, ok
    return values.cast(pa.string()), unavailable, ok


def _by_value(values: pa.Array, t: dbz.FieldType
              ) -> tuple[pa.Array, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """``_text`` by ``to_text`` itself, a value at a time (a value it refuses leaves its
    record to the per-record path, which says why)."""
    n = len(values)
    unavailable = np.zeros(n, np.bool_)
    ok = np.ones(n, np.bool_)
    out: list[Optional[bytes]] = []
    for i, value in enumerate(values.to_pylist()):
        try:
            text = dbz.to_text(value, t)
        except dbz.BadRecord:
            ok[i] = False
            text = None
        if text is UNCHANGED:
            unavailable[i] = True
            text = None
        out.append(text)  # type: ignore[arg-type]
    return pa.array(out, pa.binary()).cast(pa.string()), unavailable, ok


def _zoned(values: pa.Array
           ) -> tuple[pa.Array, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """``_text`` of a timestamptz column's strings: ``2024-05-01T10:00:00.5Z`` as
    ``2024-05-01 10:00:00.500000+00``. A moment is given exactly only when it is a real one
    (Arrow's parser would move 30 February to March: the moment must print back as it came)."""
    flags = _true(pc.equal(values, dbz.UNAVAILABLE))
    parts = pc.extract_regex(pc.if_else(flags, pa.scalar(None, pa.string()), values), _ZONED)
    at = pc.struct_field(parts, "at")
    moment = pc.strptime(at, format="%Y-%m-%dT%H:%M:%S", unit="s", error_is_null=True)
    real = pc.and_(pc.equal(pc.strftime(moment, format="%Y-%m-%dT%H:%M:%S"), at),
                   pc.invert(pc.starts_with(at, "0000")))
    given = pc.or_(pc.is_null(values), flags)
    ok = _np(pc.or_(given, pc.fill_null(real, False)))
    fraction = pc.utf8_rpad(pc.struct_field(parts, "fraction"), width=6, padding="0")
    text = pc.binary_join_element_wise(pc.replace_substring(at, "T", " "), ".", fraction,
                                       "+00", "")
    return text, _np(flags), ok


def _lsn(source: Optional[pa.Array], n: int) -> npt.NDArray[np.int64]:
    """source.lsn of each record, 0 where there is none (as the per-record path reads it: an
    integer, else nothing)."""
    if source is None or not pa.types.is_struct(source.type) or \
            source.type.get_field_index("lsn") < 0:
        return np.zeros(n, np.int64)
    lsn = source.flatten()[source.type.get_field_index("lsn")]
    if pa.types.is_null(lsn.type) or pa.types.is_string(lsn.type):
        return np.zeros(n, np.int64)
    if not pa.types.is_int64(lsn.type):
        raise _Refused  # a float or a boolean: one record at a time decides
    return np.asarray(pc.fill_null(lsn, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
