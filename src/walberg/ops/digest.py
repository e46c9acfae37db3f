"""`walberg verify`: prove that an Iceberg table equals its Postgres table.

Both sides compute, each in its own engine, a row count and an order-independent hash: every row
is rendered to one canonical text (the same text on both sides, column by column), hashed with
MD5, the first 60 bits taken as a number, and the numbers summed. Postgres computes its side in
SQL, Spark its side over the Iceberg table; no table passes through Python's memory.

When the sums differ, both sides compute the key and row hash of every row: Postgres streams its
side through a server-side cursor into a Parquet file, and Spark joins the two to name the first
differing keys (missing in the lake, extra in the lake, or different).

The canonical text per Iceberg type:

    int, long, boolean, date, string      the value's text
    decimal(p,s)                           the value with exactly s decimals
    float, double                          the IEEE 754 bits as an integer (so -0.0, NaN, and
                                           every last digit count)
    timestamp, timestamptz                 yyyy-MM-dd HH:mm:ss.ffffff (timestamptz in UTC)
    binary                                 lowercase hex
    list                                   its length, then a JSON array of its elements'
                                           canonical texts (all levels, in order)
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.iceberg import quote_target
from walberg.apply.types import SparkType, quote
from walberg.model import Column
from walberg.source.postgres import sql_identifier

# Between columns in the canonical row text. Each column's text starts with V (a value) or N
# (NULL), and a separator inside a text value is doubled: then no two rows read the same text
# ("a<SEP>Vb", "c" would otherwise read as "a", "b<SEP>Vc").
SEP = "\x1f"
# (Postgres hashes the text's UTF-8 bytes whatever the database's encoding, as Spark does)
_MD5_PG = "md5(convert_to({}, 'UTF8'))"
_HASH_PG = "('x' || substr(" + _MD5_PG + ", 1, 15))::bit(60)::bigint::numeric"
_HASH_SPARK = "CAST(conv(substr(md5({}), 1, 15), 16, 10) AS DECIMAL(20,0))"


def _element_sql(t: SparkType) -> str:
    """The Spark SQL type of an array's elements (of the innermost level)."""
    sql = t.sql
    for _ in range(t.array_dims):
        sql = sql[len("ARRAY<"):-1]
    return sql


def _pg_text(v: str, sql: str) -> str:
    """Postgres SQL rendering a non-NULL scalar ``v`` of Iceberg type ``sql`` canonically."""
    if sql in ("INT", "BIGINT", "BOOLEAN", "DATE"):
        return f"{v}::text"
    if sql == "FLOAT":
        return f"('x' || encode(float4send({v}), 'hex'))::bit(32)::int::text"
    if sql == "DOUBLE":
        return f"('x' || encode(float8send({v}), 'hex'))::bit(64)::bigint::text"
    if sql.startswith("DECIMAL"):
        # A value the Iceberg decimal cannot hold (too many integer digits, NaN, Infinity:
        # the lake's row went to the dead letters) is rendered as it is, so it differs.
        p, s = re.findall(r"\d+", sql)
        return (f"CASE WHEN abs(round({v}, {s})) < 1e{int(p) - int(s)} "
                f"THEN {v}::numeric({p},{s})::text ELSE {v}::text END")
    if sql == "TIMESTAMP_NTZ":
        return f"to_char({v}, 'YYYY-MM-DD HH24:MI:SS.US')"
    if sql == "TIMESTAMP":
        return f"to_char({v} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')"
    if sql == "BINARY":
        return f"encode({v}, 'hex')"
    # The type's output function (keeps char(n)'s padding); a separator in the text doubled,
    # so that no value can shift a column boundary (see SEP).
    return f"replace(concat({v}), chr(31), chr(31) || chr(31))"


def _spark_text(v: str, sql: str) -> str:
    """Spark SQL rendering a non-NULL scalar ``v`` of type ``sql`` as ``_pg_text`` does."""
    if sql == "FLOAT":
        return f"CAST(reflect('java.lang.Float', 'floatToIntBits', {v}) AS STRING)"
    if sql == "DOUBLE":
        return f"CAST(reflect('java.lang.Double', 'doubleToLongBits', {v}) AS STRING)"
    if sql.startswith("DECIMAL"):
        return f"CAST({v} AS STRING)"  # exactly s decimals, plain (never 1E-9)
    if sql in ("TIMESTAMP_NTZ", "TIMESTAMP"):
        return f"date_format({v}, 'yyyy-MM-dd HH:mm:ss.SSSSSS')"
    if sql == "BINARY":
        return f"lower(hex({v}))"
    if sql == "STRING":
        return f"replace({v}, char(31), concat(char(31), char(31)))"
    return f"CAST({v} AS STRING)"


# Postgres escapes a control character in JSON with lowercase hex digits, Spark (Jackson) with
# uppercase: Postgres's side spelled as Spark's. A text that holds a backslash and "u000b" reads
# "\\u000b" in JSON and is not an escape: escaped backslashes stand aside meanwhile as chr(1),
# which JSON never holds raw (every control character in it is escaped).
_JACKSON_ESCAPES = "replace({}, '\\\\', chr(1))"
for _code in (0x0B, 0x0E, 0x0F, 0x1A, 0x1B, 0x1C, 0x1D, 0x1E, 0x1F):
    _JACKSON_ESCAPES = (f"replace({_JACKSON_ESCAPES}, '\\u{_code:04x}', "
                        f"'\\u{_code:04X}')")
_JACKSON_ESCAPES = f"replace({_JACKSON_ESCAPES}, chr(1), '\\\\')"


def pg_render(col: Column, t: SparkType) -> str:
    """Postgres SQL rendering a column's value as the canonical text (never NULL itself). An
    array: its first dimension's length, then its elements in order (all dimensions, as
    ``unnest`` yields them in a select list, whole even when they are composites), each
    rendered as a scalar of its type, as a JSON array of strings (null for NULL): one form for
    every element type, whatever JSON the type would make."""
    c = sql_identifier(col.name)
    if t.array_dims:
        element = _pg_text("e", _element_sql(t))
        text = (f"coalesce(array_length({c}, 1), 0)::text || ':' || " + _JACKSON_ESCAPES.format(
                f"array_to_json(ARRAY("
                f"SELECT CASE WHEN {_pg_null('e')} THEN NULL ELSE {element} END "
                f"FROM (SELECT unnest({c}) AS e) AS u))::text"))
    else:
        text = _pg_text(c, t.sql)
    return f"CASE WHEN {_pg_null(c)} THEN 'N' ELSE 'V' || {text} END"


def _pg_null(v: str) -> str:
    """Whether ``v`` is NULL itself: a composite value whose fields are all NULL (``ROW(NULL,
    NULL)``) is not, though ``IS NULL`` says it is (the lake holds its text, "(,)")."""
    return f"num_nulls({v}) = 1"


def spark_render(col: Column, t: SparkType) -> str:
    c = quote(col.name)
    if t.array_dims:
        flat = c
        for _ in range(t.array_dims - 1):
            flat = f"flatten({flat})"
        element = _spark_text("x", _element_sql(t))
        text = (f"concat(CAST(size({c}) AS STRING), ':', to_json(transform({flat}, "
                f"x -> CASE WHEN x IS NULL THEN NULL ELSE {element} END)))")
    else:
        text = _spark_text(c, t.sql)
    return f"CASE WHEN {c} IS NULL THEN 'N' ELSE concat('V', {text}) END"


@contextlib.contextmanager
def utc_session(spark: Any) -> Iterator[None]:
    """Spark renders a timestamptz in its session's time zone, Postgres (``_pg_text``) in UTC:
    the session's is UTC meanwhile, whatever spark.conf set it to."""
    conf = spark.conf
    before = conf.get("spark.sql.session.timeZone", None)
    conf.set("spark.sql.session.timeZone", "UTC")
    try:
        yield
    finally:
        if before is None:
            conf.unset("spark.sql.session.timeZone")
        else:
            conf.set("spark.sql.session.timeZone", before)


@dataclass
class TableVerdict:
    source: str
    target: str
    equal: bool
    source_rows: int
    lake_rows: int
    source_lsn: str
    lake_lsn: Optional[str]
    differences: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""


def source_digest(conn: Any, table: str, columns: Sequence[Column],
                  types: Sequence[SparkType]) -> tuple[int, int]:
    row = "concat_ws(chr(31), " + ", ".join(pg_render(c, t) for c, t in
                                             zip(columns, types, strict=True)) + ")"
    with conn.cursor() as cur:
        cur.execute(f"SELECT count(*), coalesce(sum({_HASH_PG.format(row)}), 0)::text "
                    f"FROM {table}")
        n, total = cur.fetchone()
    return int(n), int(total)


def lake_digest(spark: Any, target: str, columns: Sequence[Column],
                types: Sequence[SparkType], where: str = "true") -> tuple[int, int]:
    row = f"concat_ws('{SEP}', " + ", ".join(spark_render(c, t) for c, t in
                                              zip(columns, types, strict=True)) + ")"
    df = spark.table(quote_target(target)).where(where) \
        .selectExpr(f"{_HASH_SPARK.format(row)} AS h")
    result = df.selectExpr("count(*) AS n", "CAST(coalesce(sum(h), 0) AS STRING) AS total") \
        .collect()[0]
    return int(result["n"]), int(result["total"])


def source_row_hashes(conn: Any, table: str, columns: Sequence[Column],
                      types: Sequence[SparkType], out: Path, chunk: int = 50_000) -> None:
    """Key text and row hash of every source row, streamed into ``out`` (Parquet)."""
    keys = [(c, t) for c, t in zip(columns, types, strict=True) if c.is_key]
    row = "concat_ws(chr(31), " + ", ".join(pg_render(c, t) for c, t in
                                             zip(columns, types, strict=True)) + ")"
    exprs = [pg_render(c, t) for c, t in keys] + [_MD5_PG.format(row)]
    names = [f"k{i}" for i in range(len(keys))] + ["h"]
    schema = pa.schema([pa.field(n, pa.string()) for n in names])
    with conn.cursor(name="walberg_verify") as cur, \
            pq.ParquetWriter(out, schema, compression="snappy") as writer:
        cur.itersize = chunk
        cur.execute(f"SELECT {', '.join(exprs)} FROM {table}")
        while True:
            rows = cur.fetchmany(chunk)
            if not rows:
                break
            writer.write_table(pa.Table.from_arrays(
                [pa.array([r[i] for r in rows], pa.string()) for i in range(len(names))],
                schema=schema))


def differing_keys(spark: Any, target: str, columns: Sequence[Column],
                   types: Sequence[SparkType], source: Any,
                   limit: int, where: str = "true") -> list[dict[str, Any]]:
    """The first ``limit`` keys whose rows differ between the source hashes (``source``: a
    DataFrame of what ``source_row_hashes`` wrote) and the lake."""
    keys = [(c, t) for c, t in zip(columns, types, strict=True) if c.is_key]
    row = f"concat_ws('{SEP}', " + ", ".join(spark_render(c, t) for c, t in
                                              zip(columns, types, strict=True)) + ")"
    lake = spark.table(quote_target(target)).where(where).selectExpr(
        *[f"{spark_render(c, t)} AS k{i}" for i, (c, t) in enumerate(keys)], f"md5({row}) AS h")
    # Rows are counted per key and hash, so duplicates (tables without a key) show up too.
    s = source.groupBy(*source.columns).count().withColumnRenamed("count", "s_n")
    lk = lake.groupBy(*lake.columns).count().withColumnRenamed("count", "l_n")
    on = [f"k{i}" for i in range(len(keys))]
    joined = s.join(lk, on=[*on, "h"], how="full_outer") \
        .where("s_n IS NULL OR l_n IS NULL OR s_n <> l_n")
    found = joined.limit(limit * 4).collect()
    by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in found:
        key = tuple(r[k] for k in on)
        entry = by_key.setdefault(key, {"key": {c.name: _unrender(r[f"k{i}"])
                                                 for i, (c, _) in enumerate(keys)},
                                        "source": 0, "lake": 0})
        entry["source"] += r["s_n"] or 0
        entry["lake"] += r["l_n"] or 0
    out = []
    for entry in list(by_key.values())[:limit]:
        if entry["lake"] == 0:
            entry["problem"] = "missing in the lake"
        elif entry["source"] == 0:
            entry["problem"] = "in the lake, not in the source"
        elif entry["source"] == entry["lake"]:
            entry["problem"] = "values differ"
        else:
            entry["problem"] = f"{entry['source']} row(s) in the source, {entry['lake']} in the lake"
        out.append(entry)
    return out


def _unrender(text: Optional[str]) -> Optional[str]:
    return None if text is None or text == "N" else text[1:]
