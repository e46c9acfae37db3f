"""Postgres column types -> Iceberg (Spark SQL) types, and how Postgres's text representation of
a value becomes the typed value.

This is the one type path: the initial copy and the stream both hand over Postgres text (rendered
with the same session settings, see ``source.postgres.SESSION_OPTIONS``), and both go through here:

1. in Python, while staging (``TextPrep``): values that cannot be written exactly (NaN in a
   decimal column, a number too wide for its decimal, 'infinity' in a timestamp) are picked
   out for the dead-letter table instead of being rounded or nulled. Numbers, booleans, dates
   and timestamps are then parsed into their Arrow type (``SparkType.staged``) by Arrow's
   vectorised casts, a tenth of what Spark's per-row CAST of text costs, bytea's hex form into
   bytes (``_unhex``), and array literals into Arrow lists of their elements' type (the
   literals read a value at a time, the elements parsed in one cast); a value that does not
   parse goes to the dead-letter table too;
2. in Spark (``SparkType.convert``): what is still text is cast to the column's type (the same
   CAST over a column staged typed is a no-op).

The mapping (also in docs/types.md):

    smallint, integer         -> int          bigint, oid        -> long
    real                      -> float        double precision   -> double
    numeric(p,s), p <= 38     -> decimal(p,s)  other numeric     -> decimal(38,18) (configurable)
    boolean                   -> boolean      bytea              -> binary
    date                      -> date         timestamp          -> timestamp (without zone)
    timestamptz               -> timestamptz (UTC, microseconds)
    arrays (declared dims)    -> list (nested for int[][] ...)
    domains                   -> their base type;  enums -> string
    everything else built in  -> string holding Postgres's text form (lossless): text, varchar,
        char, name, citext, uuid, json, jsonb, time, timetz, interval (ISO 8601), money, bit,
        inet, cidr, macaddr, tsvector, xml, ranges, composites, geometric types.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from walberg.errors import ConfigError
from walberg.model import Column, PgType

# Postgres type OIDs (pg_type.oid, stable across versions).
BOOL, BYTEA, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 19, 20, 21, 23, 25, 26
JSON, FLOAT4, FLOAT8, BPCHAR, VARCHAR, DATE, TIME = 114, 700, 701, 1042, 1043, 1082, 1083
TIMESTAMP, TIMESTAMPTZ, NUMERIC, UUID, JSONB = 1114, 1184, 1700, 2950, 3802
BOX = 603  # the one built-in type whose arrays use ';' between elements
BIT = 1560
# Built-in array types (pg_type.typarray) -> their element type: known without the catalog,
# for a source that names types by OID alone (Debezium's arrays from Kafka).
BUILTIN_ARRAYS = {1000: BOOL, 1001: BYTEA, 1005: INT2, 1007: INT4, 1009: TEXT, 1015: VARCHAR,
                  1016: INT8, 1021: FLOAT4, 1022: FLOAT8, 1115: TIMESTAMP, 1182: DATE,
                  1183: TIME, 1185: TIMESTAMPTZ, 1231: NUMERIC, 1561: BIT, 2951: UUID,
                  199: JSON, 3807: JSONB}

# Unconstrained NUMERIC has no declared precision; this is where it lands by default.
DEFAULT_DECIMAL = (38, 18)

# Types from extensions that walberg knows to be text-like.
KNOWN_EXTENSION_TYPES = frozenset({"citext", "hstore", "ltree"})

# Dates and timestamps Spark can hold and walberg writes: years 0001-9999 AD. Postgres also
# has 'infinity', BC dates and years past 9999; those go to the dead-letter table.
_DATETIME_OK = r"^\d{4}-\d\d-\d\d[^B]*$"


@dataclass(frozen=True)
class SparkType:
    sql: str  # the Spark SQL type for CREATE TABLE
    convert: str  # expression template over the staged column, `{}` stands for the column
    valid: Optional[str] = None  # a regex every non-NULL text value must match to be written
    why_invalid: str = ""  # what an unmatched value is, for the dead-letter reason
    array_dims: int = 0  # >0: an array literal, made an Arrow list while staging
    element: Optional["SparkType"] = None
    # The Arrow type staging parses the text into; it reads back in Spark as exactly ``sql``.
    # None: staged as text, cast by ``convert`` in Spark.
    staged: Optional[pa.DataType] = None
    # Where ``convert`` of the staged column cannot take Postgres's text as well (bytea: its
    # hex form is decoded while staging), the expression that does: for text read without
    # staging (a copy read over JDBC, a column's default).
    text_convert: Optional[str] = None

    @property
    def from_text(self) -> str:
        """The expression template that makes Postgres's text of a value the column's type
        (not for arrays: see ``literal``)."""
        return self.text_convert or self.convert

    def literal(self, text: str) -> str:
        """A Spark SQL expression of the column's type for Postgres's text of one value (an
        array literal as nested ``array(...)`` of its elements). BadArray if an array's text
        is not one of the column's dimensions."""
        if not self.array_dims:
            return self.from_text.format(sql_string(text))
        assert self.element is not None
        element = self.element
        value = parse_array(text)
        if not _depth_ok(value, self.array_dims, None):
            raise BadArray(f"not a {self.array_dims}-dimensional array")

        def spell(v: Any) -> str:
            if isinstance(v, list):
                return f"array({', '.join(spell(x) for x in v)})"
            return "NULL" if v is None else element.from_text.format(sql_string(v))

        return f"CAST({spell(value)} AS {self.sql})"

    def describe(self) -> str:
        return self.sql.lower()

    @property
    def staged_sql(self) -> str:
        """The Spark SQL type of the staged column."""
        return self.sql if self.staged is not None else "STRING"


def quote(name: str) -> str:
    """Quote one Spark SQL identifier. Every name that reaches Spark SQL goes through here."""
    return "`" + name.replace("`", "``") + "`"


def sql_string(text: str) -> str:
    """A Spark SQL string literal for ``text`` (quotes and backslashes escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def numeric_precision(type_modifier: int) -> tuple[int, int] | None:
    if type_modifier < 4:
        return None
    mod = type_modifier - 4
    return (mod >> 16) & 0xFFFF, mod & 0xFFFF


def _decimal(p: int, s: int) -> SparkType:
    t = f"DECIMAL({p},{s})"
    whole = p - s
    integer = r"0" if whole == 0 else rf"\d{{1,{whole}}}"
    fraction = rf"(\.\d{{1,{s}}})?" if s else ""
    return SparkType(t, f"CAST({{}} AS {t})", rf"^-?{integer}{fraction}$",
                     f"does not fit {t.lower()} without rounding (NaN, Infinity, or too many "
                     "digits)", staged=pa.decimal128(p, s))


_STRING = SparkType("STRING", "{}")
_SCALARS: dict[int, SparkType] = {
    BOOL: SparkType("BOOLEAN", "CAST({} AS BOOLEAN)", staged=pa.bool_()),
    INT2: SparkType("INT", "CAST({} AS INT)", staged=pa.int32()),
    INT4: SparkType("INT", "CAST({} AS INT)", staged=pa.int32()),
    INT8: SparkType("BIGINT", "CAST({} AS BIGINT)", staged=pa.int64()),
    OID: SparkType("BIGINT", "CAST({} AS BIGINT)", staged=pa.int64()),
    FLOAT4: SparkType("FLOAT", "CAST({} AS FLOAT)", staged=pa.float32()),
    FLOAT8: SparkType("DOUBLE", "CAST({} AS DOUBLE)", staged=pa.float64()),
    DATE: SparkType("DATE", "CAST({} AS DATE)", _DATETIME_OK,
                    "is outside the dates 0001-01-01..9999-12-31 that Iceberg engines share",
                    staged=pa.date32()),
    # Parquet timestamps without isAdjustedToUTC read back in Spark as TIMESTAMP_NTZ.
    TIMESTAMP: SparkType("TIMESTAMP_NTZ", "CAST({} AS TIMESTAMP_NTZ)", _DATETIME_OK,
                         "is outside the years 0001..9999 that Iceberg engines share",
                         staged=pa.timestamp("us")),
    # Rendered in UTC (the source session's TimeZone), e.g. '2020-01-01 00:00:00.5+00'.
    TIMESTAMPTZ: SparkType("TIMESTAMP", "CAST({} AS TIMESTAMP)", _DATETIME_OK,
                           "is outside the years 0001..9999 that Iceberg engines share",
                           staged=pa.timestamp("us", "UTC")),
    # bytea_output=hex renders '\x0a0b...'; decoded while staging (``_unhex``)
    BYTEA: SparkType("BINARY", "{}", r"^\\x([0-9a-fA-F]{2})*$", "is not bytea's hex form",
                     staged=pa.binary(), text_convert="unhex(substring({}, 3))"),
}


class UnsupportedType(ConfigError):
    """A column of a type walberg has no mapping for; ``table``: the Iceberg table asked for."""

    def __init__(self, message: str, table: Optional[str] = None) -> None:
        super().__init__(message)
        self.table = table


@dataclass
class TypeMap:
    """Resolves a column's Postgres type (through domains and arrays) to its Iceberg type.

    Fed by the pipeline with what the source catalog says (``learn``); a column whose type it
    was never told about is mapped from its OID alone (built-in types)."""

    unconstrained_numeric: tuple[int, int] = DEFAULT_DECIMAL
    text_types: frozenset[str] = frozenset()
    types: dict[int, PgType] = field(default_factory=dict)
    dims: dict[tuple[str, str], int] = field(default_factory=dict)

    def learn(self, types: Mapping[int, PgType], table: Optional[str] = None,
              dims: Mapping[str, int] = {}) -> None:
        self.types.update(types)
        if table is not None:
            for name, n in dims.items():
                self.dims[(table, name)] = n

    def spark_type(self, col: Column, table: Optional[str] = None) -> SparkType:
        return self._resolve(col.type_oid, col.type_modifier,
                             self.dims.get((table, col.name), 1) if table else 1,
                             table, col.name)

    def _resolve(self, oid: int, modifier: int, dims: int, table: Optional[str],
                 column: str) -> SparkType:
        t = self.types.get(oid)
        if t is None and oid in BUILTIN_ARRAYS:
            t = PgType(oid, f"_{oid}", "b", element=BUILTIN_ARRAYS[oid])
        if t is not None and t.kind == "d":
            return self._resolve(t.base, t.base_modifier if modifier < 0 else modifier, dims,
                                 table, column)
        if t is not None and t.element:
            element = self._resolve(t.element, modifier, 1, table, column)
            if t.element == BOX or element.array_dims:
                return _STRING
            sql = element.sql
            for _ in range(dims):
                sql = f"ARRAY<{sql}>"
            return SparkType(sql, "{}", array_dims=max(dims, 1), element=element,
                             staged=_list_type(element, max(dims, 1)))
        if oid == NUMERIC:
            ps = numeric_precision(modifier)
            if ps is None or ps[0] > 38:
                ps = self.unconstrained_numeric
            return _decimal(*ps)
        scalar = _SCALARS.get(oid)
        if scalar is not None:
            return scalar
        if t is not None and not t.builtin and t.kind == "b" \
                and t.name not in KNOWN_EXTENSION_TYPES | self.text_types:
            where = f"{table}.{column}" if table else column
            raise UnsupportedType(
                f"column {where} has type {t.name}, which comes from an extension walberg has no "
                f"mapping for. To store its Postgres text form as a string, add it to "
                f"sink.text_types in the pipeline file (text_types: [{t.name}]).", table)
        # Everything else keeps its exact Postgres text representation: lossless, and readable
        # by every engine (see the module docstring for the list).
        return _STRING

    def prep(self, columns: Sequence[Column], table: Optional[str] = None) -> "TextPrep":
        return TextPrep(columns, [self.spark_type(c, table) for c in columns])


def _list_type(element: SparkType, dims: int) -> pa.DataType:
    """The Arrow type an array column is staged in: lists (nested for each further dimension)
    of the element's staged type (text for text-like elements)."""
    out = element.staged or pa.string()
    for _ in range(dims):
        out = pa.list_(pa.field("element", out))
    return out


class BadArray(ValueError):
    pass


def parse_array(text: str, delimiter: str = ",") -> list[Any]:
    """Postgres array literal -> nested lists of element text (None for NULL)."""
    i = 0
    if text.startswith("["):  # explicit bounds, e.g. [0:2]={1,2,3}
        i = text.index("=") + 1
    n = len(text)

    def parse(i: int) -> tuple[list[Any], int]:
        if i >= n or text[i] != "{":
            raise BadArray("not an array literal")
        i += 1
        out: list[Any] = []
        if i < n and text[i] == "}":
            return out, i + 1
        while i < n:
            c = text[i]
            if c == "{":
                value, i = parse(i)
                out.append(value)
            elif c == '"':
                j, buf = i + 1, []
                while text[j] != '"':
                    if text[j] == "\\":
                        j += 1
                    buf.append(text[j])
                    j += 1
                out.append("".join(buf))
                i = j + 1
            else:
                j = i
                while text[j] != delimiter and text[j] != "}":
                    j += 1
                raw = text[i:j]
                out.append(None if raw == "NULL" else raw)
                i = j
            if text[i] == delimiter:
                i += 1
            elif text[i] == "}":
                return out, i + 1
            else:
                raise BadArray("unexpected character")
        raise BadArray("unterminated array literal")

    try:
        value, end = parse(i)
    except IndexError:
        raise BadArray("unterminated array literal") from None
    if end != n:
        raise BadArray("trailing characters")
    return value


def _depth_ok(value: list[Any], dims: int, check: Optional[re.Pattern[str]]) -> bool:
    for v in value:
        if isinstance(v, list):
            if dims <= 1 or not _depth_ok(v, dims - 1, check):
                return False
        elif dims != 1:
            return False
        elif v is not None and check is not None and not check.match(v):
            return False
    return True


class TextPrep:
    """Per table: staged text -> the columns to stage (typed where ``SparkType.staged`` says so,
    else text Spark can cast), and which rows cannot be written exactly.

    ``apply`` takes one chunk of string columns and gives back the columns to stage, plus a
    reason (or null) per row: rows with a reason go to the dead-letter table. Values that
    ``spare`` names are not worth a row's dead letter: they are staged as NULL instead (a
    delete's values outside its key, which it needs only to find the row)."""

    def __init__(self, columns: Sequence[Column], types: Sequence[SparkType]) -> None:
        self.names = [c.name for c in columns]
        self.types = list(types)
        self.active = any(t.valid or t.array_dims or t.staged is not None for t in self.types)

    def staged_types(self, ncols: int) -> list[pa.DataType]:
        """The Arrow type of each staged column (text where no type was given)."""
        if not self.types:
            return [pa.string()] * ncols
        return [t.staged or pa.string() for t in self.types]

    def apply(self, arrays: Sequence[pa.Array],
              spare: Optional[tuple[pa.Array, Sequence[int]]] = None
              ) -> tuple[list[pa.Array], Optional[pa.Array]]:
        """The columns to stage and each row's reason for the dead-letter table (or null).
        ``spare``: (a mask of rows, column positions): there a value that cannot be written is
        staged as NULL, and the row keeps going."""
        if not self.active:
            return list(arrays), None
        rows, spared = spare if spare is not None and pc.any(spare[0]).as_py() else (None, ())
        inputs = list(arrays)
        out = list(arrays)
        reasons: Optional[pa.Array] = None
        for i, (arr, t) in enumerate(zip(arrays, self.types, strict=True)):
            if t.array_dims:
                out[i], bad = self._arrays(arr, t)
                why = (f"is not a {t.array_dims}-dimensional array of {t.element.describe()}"
                       if t.element else "is not an array")
            elif t.valid:
                bad = pc.and_kleene(pc.is_valid(arr),
                                    pc.invert(pc.match_substring_regex(arr, t.valid)))
                why = t.why_invalid
            else:
                continue
            if rows is not None and i in spared:
                inputs[i] = pc.if_else(pc.and_kleene(bad, rows), pa.nulls(len(arr), arr.type),
                                       arr)
                if not t.array_dims:  # (an array column's list is NULL there already)
                    out[i] = inputs[i]
                bad = pc.and_kleene(bad, pc.invert(rows))
            reasons = self._blame(reasons, bad, arr, self.names[i], why)
        for i, (arr, t) in enumerate(zip(inputs, self.types, strict=True)):
            if t.staged is None or t.array_dims:  # (arrays: made lists above)
                continue
            if reasons is not None and reasons.null_count < len(reasons):
                # Rows already bound for the dead-letter table are not parsed (nor staged).
                arr = pc.if_else(pc.is_valid(reasons), pa.nulls(len(arr), pa.string()), arr)
            try:
                out[i] = _parse(arr, t.staged)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                out[i], bad = _parse_each(arr, t.staged)
                if rows is not None and i in spared:
                    bad = pc.and_kleene(bad, pc.invert(rows))  # (NULL in out[i] already)
                reasons = self._blame(reasons, bad, arr, self.names[i],
                                      f"cannot be read as {t.describe()}")
        return out, reasons

    @staticmethod
    def _blame(reasons: Optional[pa.Array], bad: pa.Array, arr: pa.Array, name: str,
               why: str) -> Optional[pa.Array]:
        """``reasons`` with ``why`` (and the value) added to the rows ``bad`` flags."""
        if not pc.any(bad).as_py():
            return reasons
        text = pc.binary_join_element_wise(
            f"column {name}: '", pc.utf8_slice_codeunits(arr, 0, 60), f"' {why}", "")
        mine = pc.if_else(bad, text, pa.nulls(len(arr), pa.string()))
        if reasons is None:
            return mine
        both = pc.binary_join_element_wise(reasons, mine, "; ")
        return pc.coalesce(both, reasons, mine)

    @staticmethod
    def _arrays(arr: pa.Array, t: SparkType) -> tuple[pa.Array, pa.Array]:
        """An array column's literals as Arrow lists of the element's type, and which values
        cannot be written (not an array of the column's dimensions, an element that does not
        fit its type)."""
        assert t.element is not None
        lists, bad = _literal_lists(arr.cast(pa.string()), t.array_dims)
        # Down the levels, outermost first: each level's offsets and NULLs, and the row each
        # element comes from; then the elements, checked and parsed at once.
        levels: list[tuple[np.ndarray, pa.Array]] = []
        rows = np.arange(len(lists))
        level: pa.Array = lists
        for _ in range(t.array_dims):
            offsets = level.offsets.to_numpy(zero_copy_only=False)
            levels.append((offsets - offsets[0], level.is_null()))
            rows = np.repeat(rows, np.diff(offsets))
            level = level.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        elements, wrong = level, np.zeros(len(level), np.bool_)
        if t.element.valid:
            wrong |= pc.fill_null(pc.invert(pc.match_substring_regex(elements, t.element.valid)),
                                  False).to_numpy(zero_copy_only=False)
        if t.element.staged is not None:
            fit = pc.if_else(pa.array(wrong), pa.nulls(len(elements), pa.string()), elements)
            try:
                elements = _parse(fit, t.element.staged)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                elements, unparsed = _parse_each(fit, t.element.staged)
                wrong |= unparsed.to_numpy(zero_copy_only=False)
        bad[rows[wrong]] = True
        out: pa.Array = elements
        for offsets, null in reversed(levels):
            out = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), out,
                                           pa.list_(pa.field("element", out.type)), mask=null)
        if bad.any():  # (rows bound for the dead-letter table stage nothing)
            out = pc.if_else(pa.array(bad), pa.nulls(len(out), out.type), out)
        return out, pa.array(bad, pa.bool_())


def _literal_lists(text: pa.Array, dims: int) -> tuple[pa.Array, np.ndarray]:
    """Each array literal as ``dims``-deep lists of its elements' text, and which literals are
    not arrays of that many dimensions (NULL there). One-dimensional literals without a quote,
    a backslash or an inner brace, as Postgres writes most (it quotes any element holding a
    delimiter, a brace, a quote, a backslash or white space, or spelled NULL), are split by
    Arrow; the others are read a value at a time."""
    n = len(text)
    strings = _list_type(_STRING, dims)
    plain = np.zeros(n, np.bool_)
    if dims == 1 and n:
        simple = pc.and_(pc.starts_with(text, "{"), pc.ends_with(text, "}"))
        for mark in ('"', "\\"):
            simple = pc.and_(simple, pc.invert(pc.match_substring(text, mark)))
        for brace in ("{", "}"):
            simple = pc.and_(simple, pc.equal(pc.count_substring(text, brace), 1))
        plain = pc.fill_null(simple, False).to_numpy(zero_copy_only=False)
    others = np.flatnonzero(~plain)
    literals = text.take(pa.array(others)).to_pylist()
    values = _read_literals(literals, dims)
    bad = np.zeros(n, np.bool_)
    bad[others] = [literal is not None and value is None
                   for literal, value in zip(literals, values, strict=True)]
    parts = [pa.array(values, strings)]
    placed = [others]
    if plain.any():
        inner = pc.utf8_slice_codeunits(text.filter(plain), 1, -1)
        split = pc.split_pattern(inner, ",")
        # '{}' splits into one empty text: no elements there
        empty = np.flatnonzero(pc.equal(inner, "").to_numpy(zero_copy_only=False))
        offsets = split.offsets.to_numpy(zero_copy_only=False)
        keep = np.ones(int(offsets[-1]), np.bool_)
        keep[offsets[empty]] = False
        lengths = np.diff(offsets)
        lengths[empty] = 0
        flat = split.values.filter(pa.array(keep))
        flat = pc.if_else(pc.equal(flat, "NULL"), pa.nulls(len(flat), pa.string()), flat)
        starts = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=starts[1:])
        parts.append(pa.ListArray.from_arrays(pa.array(starts), flat, strings))
        placed.append(np.flatnonzero(plain))
    # back in the rows' order
    where = np.empty(n, np.int64)
    where[np.concatenate(placed)] = np.arange(n)
    return pa.concat_arrays(parts).take(pa.array(where)), bad


_QUOTED_NULL = re.compile('"null"', re.IGNORECASE)


def _read_literals(literals: Sequence[Optional[str]], dims: int) -> list[Optional[list[Any]]]:
    """Array literals read a value at a time: each one's elements (nested for each further
    dimension), or None (a NULL, or not an array of ``dims`` dimensions). A one-dimensional
    literal is a line of CSV between its braces (quotes, backslash escapes, an unquoted NULL
    for a NULL element), read by Python's C reader, half what ``parse_array`` costs; unless an
    element is the quoted text NULL, which CSV would not tell from a NULL."""
    values: list[Optional[list[Any]]] = [None] * len(literals)
    lines = [i for i, literal in enumerate(literals)
             if dims == 1 and literal is not None and literal.startswith("{")
             and not literal.startswith("{{") and literal.endswith("}")
             and not _QUOTED_NULL.search(literal)]
    try:
        rows = list(csv.reader([literals[i][1:-1] for i in lines],  # type: ignore[index]
                               escapechar="\\", doublequote=False, strict=True))
    except csv.Error:
        rows = []
    if len(rows) != len(lines):  # (a line cut short would have run into the next)
        lines, rows = [], []
    for i, row in zip(lines, rows, strict=True):
        values[i] = [None if field == "NULL" else field for field in row]
    read = set(lines)
    for i, literal in enumerate(literals):
        if literal is None or i in read:
            continue
        try:
            value = parse_array(literal)
        except BadArray:
            continue
        if _depth_ok(value, dims, None):
            values[i] = value
    return values


def _parse(arr: pa.Array, to: pa.DataType) -> pa.Array:
    """Postgres text -> ``to``; ArrowInvalid if any value does not parse."""
    if pa.types.is_binary(to):
        return _unhex(arr)
    if pa.types.is_boolean(to):
        true, false = pc.equal(arr, "t"), pc.equal(arr, "f")
        if pc.any(pc.invert(pc.or_(true, false))).as_py():
            raise pa.ArrowInvalid("a boolean that is neither 't' nor 'f'")
        return true
    return pc.cast(arr, to)


def hex_byte_table(digits: str) -> np.ndarray:
    """The byte each two of ``digits`` (hex digits) spell, by the two characters read as one
    little-endian uint16 (65536 entries: a column's digit pairs are looked up at once);
    0xFFFF for any other two characters."""
    digit = {c: int(c, 16) for c in digits}
    table = np.full(1 << 16, 0xFFFF, np.uint16)
    for hi, high in digit.items():
        for lo, low in digit.items():
            table[ord(hi) | ord(lo) << 8] = high * 16 + low
    return table


_HEX_BYTE = hex_byte_table("0123456789abcdefABCDEF")  # bytea's hex form, either case


def _unhex(arr: pa.Array) -> pa.Array:
    """bytea's hex form (``\\x`` and two hex digits a byte) as binary, in columns: every
    value's digits are pairs, so the column's digits are one array of pairs, each looked up
    at once. ArrowInvalid if a value is not in that form."""
    text = arr.cast(pa.string())
    if not pc.all(pc.starts_with(text, "\\x")).as_py():
        raise pa.ArrowInvalid("a bytea value that does not start with \\x")
    body = pc.utf8_slice_codeunits(text, 2).cast(pa.binary())
    n = len(body)
    offsets = np.frombuffer(body.buffers()[1], np.int32, n + 1, body.offset * 4)
    if (np.diff(offsets) % 2).any():
        raise pa.ArrowInvalid("a bytea value with an odd number of hex digits")
    start, end = int(offsets[0]), int(offsets[-1])
    digits = np.frombuffer(body.buffers()[2], np.uint8, end - start, start) if end > start \
        else np.empty(0, np.uint8)
    values = _HEX_BYTE[digits.view("<u2")]
    if values.size and int(values.max()) == 0xFFFF:
        raise pa.ArrowInvalid("a bytea value with a character that is not a hex digit")
    validity = None if body.null_count == 0 else pc.is_valid(body).buffers()[1]
    return pa.Array.from_buffers(
        pa.binary(), n, [validity, pa.py_buffer(((offsets - start) // 2).astype(np.int32)),
                         pa.py_buffer(values.astype(np.uint8))], body.null_count)


def _parse_each(arr: pa.Array, to: pa.DataType) -> tuple[pa.Array, pa.Array]:
    """``_parse`` value by value: the parsed column (null where a value did not parse) and
    which values did not."""
    values: list[Any] = []
    bad: list[bool] = []
    for text in arr.to_pylist():
        value = None
        if text is not None:
            try:
                value = _parse(pa.array([text], pa.string()), to)[0].as_py()
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                bad.append(True)
                values.append(None)
                continue
        bad.append(False)
        values.append(value)
    return pa.array(values, to), pa.array(bad, pa.bool_())

_FROM_SPARK = {"smallint": (21, -1), "int": (23, -1), "bigint": (20, -1), "float": (700, -1),
               "double": (701, -1), "boolean": (BOOL, -1), "string": (TEXT, -1),
               "date": (DATE, -1), "timestamp": (TIMESTAMPTZ, -1),
               "timestamp_ntz": (TIMESTAMP, -1), "binary": (BYTEA, -1)}


def pg_type_for(spark_type: str, where: str) -> tuple[int, int]:
    """The Postgres type (OID, modifier) that lands as this Spark type, for a table that exists
    before its source has said what its columns are. ``where`` names the column in errors."""
    m = re.fullmatch(r"decimal\((\d+),(\d+)\)", spark_type)
    if m:
        return NUMERIC, ((int(m.group(1)) << 16) | int(m.group(2))) + 4
    m = re.fullmatch(r"array<(.+)>", spark_type)
    if m:  # a list of one of the types below (its element's modifier is the array's)
        element, modifier = pg_type_for(m.group(1), where)
        arrays = {e: a for a, e in BUILTIN_ARRAYS.items()}
        if element in arrays:
            return arrays[element], modifier
    found = _FROM_SPARK.get(spark_type)
    if found is None:
        raise ConfigError(f"column {where} is {spark_type} in Iceberg, which records without a "
                          "schema cannot fill; give the table's columns in the pipeline file "
                          "(source.kafka.tables.<topic>.columns)")
    return found
