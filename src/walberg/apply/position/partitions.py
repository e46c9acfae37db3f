"""The partition of each new row of a partitioned table, computed on the driver.

A batch applied by position writes its new rows on the driver (``apply.position.datafiles``);
in a partitioned table each data file holds the rows of one partition and says which. Here
Iceberg's transforms are computed over the staged Arrow columns, as the table format defines
them, so that Spark need not sort the batch into partitions:

- ``identity`` of an int, long, string, date or boolean column;
- ``year``, ``month``, ``day`` of a date or timestamp, ``hour`` of a timestamp: whole years,
  months, days, hours since 1970-01-01 00:00 UTC, floored (before 1970 they are negative);
- ``bucket[N]``: Murmur3 (x86, 32 bits, seed 0) of the value's bytes (ints, longs, dates and
  timestamps as a little-endian long, strings as UTF-8), its sign bit cleared, modulo N;
- ``truncate[W]``: an int or long less its remainder modulo W (floored), a string's first W
  code points;
- ``void``: always null.

Any other transform or source type (a timestamp identity, a decimal, a float bucket...) makes
the table's new rows go by Spark, which partitions them itself (``why_not`` says why). Each
partition's values reach Iceberg as the strings ``DataFiles.Builder.withPartitionValues``
parses for the partition's result type (ints as digits, dates as ISO dates, null as null).
Tests hold every transform against Iceberg's own, at the edges (before 1970, negatives,
nulls, non-ASCII text).
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from walberg.apply.session import java_items

# The source types each transform takes here, by Iceberg type id.
_TIME = {"DATE", "TIMESTAMP"}
_INTEGRAL = {"INTEGER", "LONG"}
_TAKES = {
    "identity": _INTEGRAL | {"STRING", "DATE", "BOOLEAN"},
    "year": _TIME, "month": _TIME, "day": _TIME, "hour": {"TIMESTAMP"},
    "bucket": _INTEGRAL | _TIME | {"STRING"},
    "truncate": _INTEGRAL | {"STRING"},
    "void": _INTEGRAL | _TIME | {"STRING", "BOOLEAN", "DECIMAL", "FLOAT", "DOUBLE", "UUID",
                                 "BINARY", "FIXED", "TIME", "TIMESTAMP_NANO"},
}
_EPOCH = datetime.date(1970, 1, 1)
_INT_MAX = 0x7FFFFFFF


HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # what withPartitionValues takes as null


class NotHere(Exception):
    """This batch's rows cannot be partitioned here (its values say why): Spark writes them."""


@dataclass(frozen=True)
class _Field:
    """One partition field: its source column (in the rows' schema), its transform and
    argument, its source's Iceberg type id, and whether its result is a date."""

    name: str
    column: str
    transform: str
    argument: int
    source_type: str
    dated: bool


class Partitioner:
    """Splits a table's new rows by the partition of its current spec."""

    def __init__(self, fields: Sequence[_Field]) -> None:
        self.fields = list(fields)

    @classmethod
    def of(cls, table: Any, schema: pa.Schema) -> Union["Partitioner", str]:
        """The partitioner of an Iceberg Java table's current spec for rows in ``schema``,
        or why its rows cannot be partitioned here."""
        iceberg_schema = table.schema()
        fields = []
        for field in java_items(table.spec().fields()):
            source = iceberg_schema.findField(field.sourceId())
            text = str(field.transform())
            name, _, rest = text.partition("[")
            argument = int(rest.rstrip("]")) if rest else 0
            type_id = str(source.type().typeId()) if source is not None else "?"
            if name not in _TAKES or type_id not in _TAKES[name]:
                return f"its partition field {field.name()} is {text} of a {type_id.lower()}"
            if source is None or str(source.name()) not in schema.names:
                return f"its partition field {field.name()} is not of a column it writes"
            dated = name == "day" or (name == "identity" and type_id == "DATE")
            fields.append(_Field(str(field.name()), str(source.name()), name, argument, type_id, dated))
        return cls(fields)

    def folder(self, values: Sequence[Optional[str]]) -> str:
        """A folder name for a partition's files, as Iceberg's writers name theirs
        (``field=value/...``), with any character beyond letters, digits, ``.``, ``-`` and
        ``_`` as ``_``: for people only (the table's metadata, not the path, says which
        partition a file is in; file names are unique whatever the folder)."""
        return "/".join(f"{_plain(f.name)}={_plain('null' if v is None else v)}"
                        for f, v in zip(self.fields, values, strict=True))

    def split(self, rows: pa.Table) -> Iterator[tuple[list[Optional[str]], pa.Table]]:
        """``rows`` a partition at a time: its values (as ``withPartitionValues`` takes
        them), and its rows in their order."""
        if not self.fields:
            yield [], rows
            return
        if rows.num_rows == 0:
            return
        results = [_transform(f, rows.column(f.column).combine_chunks()) for f in self.fields]
        names = [f"p{i}" for i in range(len(results))]
        keys = pa.table(results, names=names)
        # One stable sort by the partition values and one take, then each partition's rows
        # are a slice: a take per partition cost 1-3 ms each (0.5 s for a 365-partition batch).
        order = pc.sort_indices(keys, sort_keys=[(n, "ascending") for n in names])
        keys, ordered = keys.take(order), rows.take(order)
        starts = _run_starts(keys)
        values = [keys.column(n).take(pa.array(starts, pa.int64())).to_pylist() for n in names]
        texts = [[_as_text(v[g], f) for v, f in zip(values, self.fields, strict=True)]
                 for g in range(len(starts))]
        if any(t == HIVE_NULL for each in texts for t in each):
            # Iceberg reads this text as a null partition value: Spark writes this batch.
            raise NotHere(f"a partition value is the text {HIVE_NULL}")
        ends = [*starts[1:], rows.num_rows]
        for each, start, end in zip(texts, starts, ends, strict=True):
            yield each, ordered.slice(start, end - start)


def _run_starts(keys: pa.Table) -> list[int]:
    """Where each run of equal rows (nulls equal to nulls) of sorted ``keys`` starts."""
    n = keys.num_rows
    if n == 0:
        return []
    changed = np.zeros(n - 1, dtype=np.bool_)
    for column in keys.columns:
        cur, prev = column.slice(1), column.slice(0, n - 1)
        differs = pc.not_equal(cur, prev)
        one_null = pc.xor(pc.is_null(cur), pc.is_null(prev))
        changed |= pc.fill_null(differs, False).to_numpy(zero_copy_only=False)
        changed |= one_null.to_numpy(zero_copy_only=False)
    return [0, *(np.flatnonzero(changed) + 1).tolist()]


def _plain(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:64] or "_"


def _transform(field: _Field, column: pa.Array) -> pa.Array:
    """Iceberg's ``field.transform`` of every value of ``column`` (nulls stay null)."""
    kind = field.transform
    if kind == "identity":
        return column
    if kind == "void":
        return pa.nulls(len(column), pa.int32())
    valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=np.bool_)
    if kind == "bucket":
        hashes = _murmur3_text(column) if field.source_type == "STRING" else \
            _murmur3_longs(_numbers(column, field.source_type))
        return pa.array(((hashes & _INT_MAX) % field.argument).astype(np.int32), mask=~valid)
    if kind == "truncate" and field.source_type == "STRING":
        # Iceberg truncates text to a number of code points, as Arrow's slice counts them.
        return pc.utf8_slice_codeunits(column.cast(pa.string()), 0, field.argument)
    numbers = _numbers(column, field.source_type)
    if kind == "truncate":
        out: np.ndarray = numbers - np.mod(numbers, field.argument)
        return pa.array(out.astype(np.int32 if field.source_type == "INTEGER" else np.int64),
                        mask=~valid)
    unit = {"year": "Y", "month": "M", "day": "D", "hour": "h"}[kind]
    stamps = numbers.astype("datetime64[D]" if field.source_type == "DATE" else "datetime64[us]")
    # numpy floors to a coarser unit, as Iceberg does (1969-12-31 23:00 is day -1).
    return pa.array(stamps.astype(f"datetime64[{unit}]").astype(np.int64).astype(np.int32),
                    mask=~valid)


def _numbers(column: pa.Array, source_type: str) -> np.ndarray:
    """Ints, longs, dates (days) or timestamps (microseconds) as int64, nulls as 0."""
    if source_type == "DATE":
        column = column.cast(pa.int32())
    elif source_type == "TIMESTAMP":
        column = column.cast(pa.int64())
    return np.asarray(pc.fill_null(column, 0).to_numpy(zero_copy_only=False), dtype=np.int64)


# Murmur3 x86 32 (seed 0), as Iceberg's bucket transform hashes a value's bytes, in numpy
# columns of uint32 (whose arithmetic wraps as the algorithm's does).
_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _mix_block(h: np.ndarray, k: np.ndarray) -> np.ndarray:
    return _rotl(h ^ (_rotl(k * _C1, 15) * _C2), 13) * np.uint32(5) + np.uint32(0xE6546B64)


def _murmur3_longs(values: np.ndarray) -> np.ndarray:
    """The hash of each int64's 8 little-endian bytes (ints, longs, dates as days, timestamps
    as microseconds: Iceberg hashes them all as longs), as int64 (the signed 32-bit result):
    two 4-byte blocks, the length, the finalizer."""
    words = np.ascontiguousarray(values, "<i8").view("<u4").reshape(-1, 2)
    h = np.zeros(len(words), np.uint32)
    for i in (0, 1):
        h = _mix_block(h, words[:, i])
    h = h ^ np.uint32(8)
    h = (h ^ (h >> np.uint32(16))) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> np.uint32(13))) * np.uint32(0xC2B2AE35)
    h = h ^ (h >> np.uint32(16))
    return h.view(np.int32).astype(np.int64)


def _murmur3_text(column: pa.Array) -> np.ndarray:
    """The hash of each value's UTF-8 bytes (nulls as the empty text: the caller masks them),
    value by value: mmh3 takes 0.1 microseconds a value, faster than numpy's steps over 4-byte
    blocks (five times slower for uuids' text, measured)."""
    raw = pc.fill_null(column.cast(pa.string()), "").cast(pa.binary())
    hash32 = mmh3.hash
    return np.fromiter((hash32(v, 0, True) for v in raw.to_pylist()), np.int64, len(raw))


def _as_text(value: Any, field: _Field) -> Optional[str]:
    """A partition value as ``withPartitionValues`` parses it for its result type."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime.date):
        return value.isoformat()
    if field.dated:
        try:
            return (_EPOCH + datetime.timedelta(days=int(value))).isoformat()
        except OverflowError:
            raise NotHere(f"a date past what Python's dates hold in {field.name}") from None
    return str(value)
