"""Type fidelity: every Postgres type walberg maps, through the initial copy and through the
stream, compared value by value with Postgres; and what cannot be written exactly goes to the
dead-letter table, never rounded or nulled."""

from __future__ import annotations

import logging
import math
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_config
from lake import duckdb_rows, hadoop_table
from walberg import faults
from walberg.apply.position import datafiles
from walberg.apply.types import (
    BOOL,
    BYTEA,
    DATE,
    FLOAT4,
    FLOAT8,
    INT2,
    INT4,
    INT8,
    NUMERIC,
    TEXT,
    TIMESTAMP,
    TIMESTAMPTZ,
    BadArray,
    TypeMap,
    UnsupportedType,
    parse_array,
)
from walberg.errors import ApplyError, ConfigError
from walberg.lake.services import Lake
from walberg.model import Column, PgType
from walberg.ops import digest
from walberg.ops.verify import verify
from walberg.pipeline import Pipeline
from walberg.source.postgres import connect

# ---- unit: array literals, validation, type resolution ---------------------------------------


@pytest.mark.parametrize("text, value", [
    ("{}", []),
    ("{1,2,3}", ["1", "2", "3"]),
    ("{1,NULL,3}", ["1", None, "3"]),
    ('{"a,b","c\\"d",NULL,"","NULL"}', ["a,b", 'c"d', None, "", "NULL"]),
    ("{{1,2},{3,NULL}}", [["1", "2"], ["3", None]]),
    ("[0:1]={7,8}", ["7", "8"]),
    ('{"\\\\x0a"}', ["\\x0a"]),
    ("{😀,𝄞}", ["😀", "𝄞"]),
])
def test_parse_array(text: str, value: list[Any]) -> None:
    assert parse_array(text) == value


@pytest.mark.parametrize("text", ["", "{", "{1,2", "1,2}", "{1,2}x", '{"a}'])
def test_parse_array_refuses_broken_literals(text: str) -> None:
    with pytest.raises(BadArray):
        parse_array(text)


def numeric(p: int, s: int) -> Column:
    return Column("n", NUMERIC, ((p << 16) | s) + 4)


def test_decimal_validation_never_rounds() -> None:
    prep = TypeMap().prep([numeric(5, 2), Column("u", NUMERIC, -1)])
    n = ["123.45", "-0.01", "NaN", "1234.5", None, "0", "99999.9"]
    u = ["1.5", "NaN", "Infinity", "-Infinity", "1" * 21, "0." + "1" * 19, "1" * 20 + ".5"]
    arrays, reasons = prep.apply([pa.array(n), pa.array(u)])
    got = reasons.to_pylist() if reasons is not None else []
    bad = [i for i, r in enumerate(got) if r is not None]
    assert bad == [1, 2, 3, 4, 5, 6]
    assert "column n: 'NaN' does not fit decimal(5,2)" in got[2]
    assert "column u: 'Infinity'" in got[2]
    assert "column u: '" + "1" * 21 + "' does not fit decimal(38,18)" in got[4]
    # Rows that can be written are staged as decimals, exactly; the others are left out.
    assert arrays[0].type == pa.decimal128(5, 2)
    assert arrays[0].to_pylist() == [Decimal("123.45")] + [None] * 6
    assert arrays[1].to_pylist()[0] == Decimal("1.5")


def test_scalars_are_staged_typed_exactly() -> None:
    cols = [Column("b", BOOL), Column("i", INT2), Column("l", INT8), Column("r", FLOAT4),
            Column("f", FLOAT8), Column("d", DATE), Column("ts", TIMESTAMP),
            Column("tz", TIMESTAMPTZ), Column("t", TEXT)]
    text = [
        ["t", "f", None],
        ["-32768", "32767", None],
        ["-9223372036854775808", "9223372036854775807", "0"],
        ["1.1", "-0", "NaN"],
        ["1e+300", "-Infinity", "2.2250738585072014e-308"],
        ["0001-01-01", "9999-12-31", None],
        ["2020-02-29 23:59:59.999999", "0001-01-01 00:00:00", None],
        ["2020-01-01 00:00:00.5+00", "9999-12-31 23:59:59.999999+00", None],
        ["t", "1", None],
    ]
    arrays, reasons = TypeMap().prep(cols).apply([pa.array(v, pa.string()) for v in text])
    assert reasons is None
    assert [a.type for a in arrays] == [
        pa.bool_(), pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.date32(),
        pa.timestamp("us"), pa.timestamp("us", "UTC"), pa.string()]
    assert arrays[0].to_pylist() == [True, False, None]
    assert arrays[2].to_pylist() == [-2**63, 2**63 - 1, 0]
    r = arrays[3].to_numpy(zero_copy_only=False)
    assert r[0] == np.float32(1.1) and math.copysign(1, r[1]) == -1 and math.isnan(r[2])
    assert arrays[4].to_pylist()[:2] == [1e300, -math.inf]
    assert arrays[5].to_pylist()[:2] == [date(1, 1, 1), date(9999, 12, 31)]
    assert arrays[6].to_pylist()[0] == datetime(2020, 2, 29, 23, 59, 59, 999999)
    assert arrays[7].cast(pa.int64()).to_pylist()[:2] == [1577836800500000, 253402300799999999]
    assert arrays[8].to_pylist() == ["t", "1", None]


def test_text_that_does_not_parse_goes_to_dead_letters() -> None:
    """Postgres never renders these, but a Debezium producer might: the row is set aside with
    the reason, and the rest of the chunk is staged."""
    arrays, reasons = TypeMap().prep([Column("b", BOOL), Column("i", INT4)]).apply(
        [pa.array(["t", "yes", "f"]), pa.array(["1", "2", "2147483648"])])
    assert reasons is not None
    got = reasons.to_pylist()
    assert got[0] is None
    assert got[1] == "column b: 'yes' cannot be read as boolean"
    assert got[2] == "column i: '2147483648' cannot be read as int"
    assert arrays[0].to_pylist() == [True, None, False]
    assert arrays[1].to_pylist() == [1, None, None]  # (row 1 is set aside already)


def test_bytea_is_decoded_while_staging() -> None:
    """bytea's hex form becomes bytes in Arrow (either case of digit); a value not in that form
    (a Debezium producer's, say) goes to the dead-letter table."""
    arrays, reasons = TypeMap().prep([Column("b", BYTEA)]).apply(
        [pa.array(["\\x00ff10", "\\x", None, "\\xABcd", "\\x0", "00ff", "\\xzz"])])
    assert arrays[0].type == pa.binary()
    assert arrays[0].to_pylist() == [b"\x00\xff\x10", b"", None, b"\xab\xcd", None, None, None]
    assert reasons is not None
    assert reasons.to_pylist()[:4] == [None] * 4
    assert all("is not bytea's hex form" in r for r in reasons.to_pylist()[4:])


def test_unconstrained_numeric_is_configurable() -> None:
    types = TypeMap(unconstrained_numeric=(30, 4))
    assert types.spark_type(Column("u", NUMERIC, -1)).sql == "DECIMAL(30,4)"
    assert types.spark_type(numeric(10, 2)).sql == "DECIMAL(10,2)"
    assert types.spark_type(numeric(60, 2)).sql == "DECIMAL(30,4)"  # wider than Iceberg allows


def test_domains_enums_and_arrays_resolve_through_the_catalog() -> None:
    types = TypeMap()
    types.learn({
        90001: PgType(90001, "price", "d", base=NUMERIC, base_modifier=((12 << 16) | 2) + 4,
                      builtin=False),
        90002: PgType(90002, "mood", "e", builtin=False),
        90003: PgType(90003, "_int4", "b", element=INT4),
        90004: PgType(90004, "_price", "b", element=90001, builtin=False),
        90005: PgType(90005, "geometry", "b", builtin=False),
        90006: PgType(90006, "citext", "b", builtin=False),
    }, "lake.ns.t", {"grid": 2})
    assert types.spark_type(Column("p", 90001), "lake.ns.t").sql == "DECIMAL(12,2)"
    assert types.spark_type(Column("m", 90002), "lake.ns.t").sql == "STRING"
    assert types.spark_type(Column("a", 90003), "lake.ns.t").sql == "ARRAY<INT>"
    assert types.spark_type(Column("grid", 90003), "lake.ns.t").sql == "ARRAY<ARRAY<INT>>"
    assert types.spark_type(Column("ps", 90004), "lake.ns.t").sql == "ARRAY<DECIMAL(12,2)>"
    assert types.spark_type(Column("c", 90006), "lake.ns.t").sql == "STRING"
    assert types.spark_type(Column("t", TEXT), "lake.ns.t").sql == "STRING"
    with pytest.raises(UnsupportedType, match=r"lake.ns.t.g has type geometry.*sink.text_types"):
        types.spark_type(Column("g", 90005), "lake.ns.t")
    assert isinstance(UnsupportedType("x"), ConfigError)  # exit code 2, at start
    geo = TypeMap(text_types=frozenset({"geometry"}))
    geo.learn({90005: PgType(90005, "geometry", "b", builtin=False)})
    assert geo.spark_type(Column("g", 90005)).sql == "STRING"


def test_array_prep_checks_dimensions_and_elements() -> None:
    types = TypeMap()
    types.learn({90004: PgType(90004, "_numeric", "b", element=NUMERIC)}, "t", {"a": 1})
    prep = types.prep([Column("a", 90004, ((6 << 16) | 2) + 4)], "t")
    values = ["{1.5,NULL}", "{{1,2}}", "{NaN}", None, "{}"]
    arrays, reasons = prep.apply([pa.array(values)])
    assert arrays[0].type == pa.list_(pa.decimal128(6, 2))
    assert arrays[0].to_pylist() == [[Decimal("1.50"), None], None, None, None, []]
    assert reasons is not None
    assert [r is not None for r in reasons.to_pylist()] == [False, True, True, False, False]
    # Two dimensions, text elements with quotes and escapes; an element that does not parse
    # (no regex catches a bad int: Postgres never sends one) sets its row aside.
    types.learn({90005: PgType(90005, "_int4", "b", element=INT4),
                 90006: PgType(90006, "_text", "b", element=TEXT)}, "t", {"g": 2})
    prep = types.prep([Column("g", 90005), Column("s", 90006)], "t")
    arrays, reasons = prep.apply([
        pa.array(["{{1,2},{3,NULL}}", "{}", "{{x}}", None]),
        pa.array(['{"a,b","c\\"d",NULL,""}', "{}", "{z}", '{"😀"}'])])
    assert arrays[0].type == pa.list_(pa.list_(pa.int32()))
    assert arrays[0].to_pylist()[:2] == [[[1, 2], [3, None]], []]
    assert arrays[0].to_pylist()[3] is None
    assert arrays[1].to_pylist() == [["a,b", 'c"d', None, ""], [], ["z"], ["😀"]]
    assert reasons is not None
    assert [r is not None for r in reasons.to_pylist()] == [False, False, True, False]


def _pg_literal(values: list[str | None]) -> str:
    """A one-dimensional text[] as Postgres prints it: an element quoted (quotes and
    backslashes escaped) when empty, spelled NULL, or holding a delimiter, a brace, a quote,
    a backslash or white space."""
    def element(v: str | None) -> str:
        if v is None:
            return "NULL"
        if v == "" or v.upper() == "NULL" or any(c in v for c in '{},"\\') or \
                any(c.isspace() for c in v):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return v
    return "{" + ",".join(element(v) for v in values) + "}"


_ELEMENT = st.one_of(st.none(), st.text(max_size=6),
                    st.sampled_from(["NULL", "null", "", " ", "a,b", '"', "\\", "{x}", "\r\n"]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), st.lists(_ELEMENT, max_size=5)), max_size=30))
def test_array_literals_split_by_arrow_or_read_one_by_one_alike(rows: list[Any]) -> None:
    """Literals without quotes are split by Arrow, the others read as CSV or, with a quoted
    NULL text, by the literal parser: every way each row is the array Postgres printed."""
    types = TypeMap()
    types.learn({90010: PgType(90010, "_text", "b", element=TEXT)}, "t", {"a": 1})
    prep = types.prep([Column("a", 90010)], "t")
    literals = [None if r is None else _pg_literal(r) for r in rows]
    arrays, reasons = prep.apply([pa.array(literals, pa.string())])
    assert reasons is None or reasons.null_count == len(rows)
    assert arrays[0].to_pylist() == rows


# ---- integration: the type matrix through copy and stream ------------------------------------

# (column, Postgres type, whether the lake holds Postgres's text form). xml is mapped like the other
# text forms but is left out: the embedded server is built without libxml.
MATRIX = [
    ("i2", "smallint", False), ("i4", "integer", False), ("i8", "bigint", False),
    ("f4", "real", False), ("f8", "double precision", False),
    ("n38", "numeric(38,10)", False), ("nu", "numeric", False), ("dom", "{price}", False),
    ("b", "boolean", False), ("tx", "text", True), ("vc", "varchar(10)", True),
    ("ch", "char(3)", False),  # (not ::text, which trims char's padding; the lake keeps it)
    ("nm", "name", True), ("u", "uuid", True), ("by", "bytea", False),
    ("d", "date", False), ("tm", "time", True), ("tmz", "timetz", True),
    ("ts", "timestamp", False), ("tstz", "timestamptz", False), ("iv", "interval", True),
    ("js", "json", True), ("jb", "jsonb", True), ("mo", "{mood}", True),
    ("ai", "integer[]", False), ("at", "text[]", False), ("an", "numeric(10,2)[]", False),
    ("a2", "integer[][]", False), ("ip", "inet", True), ("cid", "cidr", True),
    ("mac", "macaddr", True), ("mon", "money", True), ("bt", "bit(4)", True),
    ("vb", "varbit", True), ("tsv", "tsvector", True), ("pt", "point", True),
    ("bx", "box", True), ("rng", "int4range", True), ("comp", "{pair}", True),
]

LONG = "x" * 1_500_000 + "end"
ROWS = [
    # id 1: NULL everywhere
    {},
    # id 2: ordinary values
    {"i2": "1", "i4": "2", "i8": "3", "f4": "1.1", "f8": "2.2", "n38": "12.5", "nu": "1.5",
     "dom": "9.99", "b": "true", "tx": "hello", "vc": "v", "ch": "ab", "nm": "nm",
     "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "by": "\\x00ff10", "d": "2024-02-29",
     "tm": "12:34:56.789", "tmz": "12:00:00+02", "ts": "2024-01-01 10:00:00.123456",
     "tstz": "2024-01-01 10:00:00.5+05:30", "iv": "1 year 2 mons 3 days 04:05:06.7",
     "js": '{"b": 1, "a": [1, 2]}', "jb": '{"b": 1, "a": [1, 2]}', "mo": "happy",
     "ai": "{1,NULL,3}", "at": '{"a,b","c\\"d",NULL,""}', "an": "{1.50,NULL}",
     "a2": "{{1,2},{3,NULL}}", "ip": "192.168.0.1/24", "cid": "10.0.0.0/8",
     "mac": "08:00:2b:01:02:03", "mon": "12.34", "bt": "1010", "vb": "101",
     "tsv": "a fat cat", "pt": "(1,2)", "bx": "((1,2),(3,4))",
     "rng": "[1,10)", "comp": '(1,"x y")'},
    # id 3: edges
    {"i2": "-32768", "i4": "2147483647", "i8": "-9223372036854775808", "f4": "-0",
     "f8": "NaN", "n38": "1234567890123456789012345678.0123456789",
     "nu": "12345678901234567890.123456789012345678", "dom": "-9999999999.99", "b": "false",
     "tx": LONG, "vc": "", "ch": "", "u": "00000000-0000-0000-0000-000000000000",
     "by": "\\x", "d": "1969-12-31", "ts": "1900-01-01 00:00:00.000001",
     "tstz": "2100-12-31 23:59:59.999999+00", "iv": "-1 days -00:00:01",
     "js": '"😀 𝄞"', "jb": "[]", "ai": "{}", "at": '{"😀","𝄞"}', "a2": "{}",
     "tsv": "ünïcødé 𝄞"},
    # id 4: more edges
    {"f4": "-Infinity", "f8": "Infinity", "n38": "-0.0000000001", "nu": "0", "tx": "𝄞" * 1000,
     "d": "9999-12-31", "ts": "2038-01-19 03:14:08", "tstz": "1969-07-20 20:17:40+00"},
    # id 5: verify's column separator (0x1f) inside a text
    {"tx": "a\x1fVb", "vc": "c"},
    # id 6: a vertical tab, and its JSON escape as text (verify compares arrays as JSON)
    {"tx": "a\x0bb\\u000b", "vc": "\x0b", "at": '{"a\x0bb","\\\\u000b","\\\\u001F"}'},
]
# Rows that cannot be written exactly: they must land in the dead-letter table.
BAD = {
    10: {"nu": "NaN"},
    11: {"ts": "infinity"},
    12: {"d": "0044-03-15 BC"},
    13: {"nu": "1" * 25},
    14: {"n38": "NaN"},
}


def _insert(cur: Any, table: str, ident: int, values: dict[str, str]) -> None:
    cols = ["id", *values]
    cur.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})",
                [ident] + [values[c] for c in cols[1:]])


def _same(a: Any, b: Any, column: str) -> bool:
    if isinstance(a, memoryview):
        a = bytes(a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, column) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        if column == "f4":
            return bool(np.float32(a) == np.float32(b)) and \
                math.copysign(1, a) == math.copysign(1, b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return bool(a == b)


# Every column is staged in its type, so the copy and the batches' new rows are written on the
# driver (apply.initial.files). A table with a sort order (or a compression the driver does not
# write) has them written by Spark; the test asks for that path directly. The matrix goes both
# ways. COPY's rows come through psql where psycopg2's connection is in the clear (this suite's
# server), through psycopg2 otherwise: the Spark way reads them through psycopg2.


@pytest.mark.parametrize("copy_by", ["spark", "driver"])
def test_type_matrix_through_copy_and_stream(postgres: Any, pg_conn: Any, spark: Any,
                                              warehouse: Path, tmp_path: Path, unique: str,
                                              copy_by: str,
                                              caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if copy_by == "spark":
        monkeypatch.setattr(datafiles, "why_not", lambda *args: "the test asks for Spark")
        monkeypatch.setenv("WALBERG_COPY_CLIENT", "psycopg2")
    table = f"public.{unique}"
    types = {"price": f"price_{unique}", "mood": f"mood_{unique}", "pair": f"pair_{unique}"}
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE DOMAIN {types['price']} AS numeric(12,2)")
        cur.execute(f"CREATE TYPE {types['mood']} AS ENUM ('sad', 'ok', 'happy')")
        cur.execute(f"CREATE TYPE {types['pair']} AS (a int, b text)")
        cols = ", ".join(f"{c} {t.format(**types)}" for c, t, _ in MATRIX)
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, {cols})")
        names = {c for c, _, _ in MATRIX}
        for i, values in enumerate(ROWS, start=1):
            _insert(cur, table, i, {c: v for c, v in values.items() if c in names})
        for i, values in BAD.items():
            _insert(cur, table, i, values)
    config = make_config(postgres, warehouse, tmp_path / "seg", unique, [table])
    target = config.target_for(table)

    def run() -> None:
        pipeline = Pipeline(config, session=spark)
        try:
            pipeline.run(once=True)
        finally:
            pipeline.close()

    with caplog.at_level(logging.INFO, logger="walberg"):
        run()  # initial copy
    assert ("written on the driver" in caplog.text) == (copy_by == "driver"), caplog.text[-3000:]
    with pg_conn.cursor() as cur:  # the same values again, through the stream
        cur.execute(f"INSERT INTO {table} SELECT id + 100, {', '.join(c for c, _, _ in MATRIX)} "
                    f"FROM {table}")
        # An update that leaves the 1.5 MB TOASTed text untouched must keep it.
        cur.execute(f"UPDATE {table} SET i4 = 7 WHERE id IN (3, 103)")
    run()
    with pg_conn.cursor() as cur:  # whole rows sent again: a batch applied by position
        cur.execute(f"UPDATE {table} SET i4 = coalesce(i4, 0) + 1 WHERE id = ANY(%s)",
                    ([i + 100 for i in range(1, len(ROWS) + 1) if i != 3],))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="walberg"):
        run()
    # New rows as data files on the driver when no column needs Spark's convert.
    assert ("added (written on the driver)" in caplog.text) == (copy_by == "driver"), \
        caplog.text[-3000:]

    good = sorted({i for i in range(1, len(ROWS) + 1)} | {i + 100 for i in range(1, len(ROWS) + 1)})
    conn = connect(postgres.dsn)  # walberg's session settings: UTC, ISO intervals
    try:
        with conn.cursor() as cur:
            select = ", ".join(f"{c}::text" if text else c for c, _, text in MATRIX)
            cur.execute(f"SELECT id, {select} FROM {table} WHERE id = ANY(%s) ORDER BY id",
                        (good,))
            expected = {r[0]: dict(zip([c for c, _, _ in MATRIX], r[1:], strict=True))
                        for r in cur.fetchall()}
    finally:
        conn.close()

    lake = hadoop_table(warehouse, target)
    schema = {f.name: str(f.field_type) for f in lake.schema().fields}
    assert schema["n38"] == "decimal(38, 10)" and schema["nu"] == "decimal(38, 18)"
    assert schema["dom"] == "decimal(12, 2)" and schema["tstz"] == "timestamptz"
    assert schema["ts"] == "timestamp"
    assert schema["by"] == "binary" and schema["a2"].startswith("list<list<int")
    got = {r["id"]: r for r in lake.scan().to_arrow().to_pylist()}
    assert sorted(got) == good, "rows that cannot be written exactly must not be in the table"
    mismatches = [(i, c, expected[i][c], got[i][c]) for i in good for c, _, _ in MATRIX
                  if not _same(expected[i][c], got[i][c], c)]
    assert not [(i, c, str(e)[:80], str(g)[:80]) for i, c, e, g in mismatches]
    assert got[103]["tx"] == LONG and got[103]["i4"] == 7

    dead = hadoop_table(warehouse, f"{target}__dlq")
    letters = {(int(r["id"]), r["_walberg_op"]): r for r in dead.scan().to_arrow().to_pylist()}
    assert sorted(letters) == sorted([(i, "snapshot") for i in BAD]
                                     + [(i + 100, "insert") for i in BAD])
    assert "column nu: 'NaN' does not fit decimal(38,18)" in letters[(10, "snapshot")]["_dlq_reason"]
    assert letters[(111, "insert")]["ts"] == "infinity"
    assert "column d: '0044-03-15 BC'" in letters[(12, "snapshot")]["_dlq_reason"]
    assert letters[(113, "insert")]["nu"] == "1" * 25
    assert "n38" in letters[(14, "snapshot")]["_dlq_reason"]
    if copy_by == "driver":
        # The files written on the driver read the same in DuckDB and Spark (decimals as
        # integers, timestamps in microseconds, the field ids Iceberg gave the columns).
        exact = ["i2", "i4", "i8", "f4", "f8", "n38", "nu", "dom", "b", "tx", "u", "d", "ts",
                 "tstz"]
        duck = {r["id"]: r for r in duckdb_rows(warehouse, target)}
        assert sorted(duck) == good
        assert not [(i, c) for i in good for c in exact if not _same(duck[i][c], got[i][c], c)]
        seen = spark.sql(f"SELECT count(*), min(i8), max(i8), min(n38), max(nu), max(dom), "
                         f"max(d), min(ts) FROM {target}").collect()[0]
        values = list(got.values())

        def present(c: str) -> list[Any]:
            return [r[c] for r in values if r[c] is not None]

        assert tuple(seen) == (len(good), min(present("i8")), max(present("i8")),
                               min(present("n38")), max(present("nu")), max(present("dom")),
                               max(present("d")), min(present("ts")))
        return  # the rest (verify) does not depend on how the copy was written

    # walberg verify: the rows that could not be written (in the dead letters) are missing in
    # the lake, values a decimal cannot hold (NaN, 25 digits) included...
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake, attempts=1)
    bad = sorted(str(i) for i in [*BAD, *(i + 100 for i in BAD)])
    assert sorted(d["key"]["id"] for d in verdict.differences) == bad, verdict.differences
    assert {d["problem"] for d in verdict.differences} == {"missing in the lake"}
    # ... and equal once they are gone from the source...
    with pg_conn.cursor() as cur:
        cur.execute(f"DELETE FROM {table} WHERE id = ANY(%s)",
                    ([*BAD, *(i + 100 for i in BAD)],))
    run()
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake)
        assert verdict.equal, verdict
        assert verdict.source_rows == verdict.lake_rows == len(good)
        # ... and a lake changed behind walberg's back is caught, with the keys.
        spark.sql(f"DELETE FROM {target} WHERE id = 2")
        spark.sql(f"UPDATE {target} SET f8 = -0.0 WHERE id = 104")  # only the sign of zero
        # the separator moved from one text column into the next: the same text unescaped
        spark.sql(f"UPDATE {target} SET tx = 'a', vc = concat('b', char(31), 'Vc') WHERE id = 5")
        spark.table(target).where("id = 3").selectExpr(
            *["999 AS id" if f == "id" else f"`{f}`" for f in spark.table(target).columns]
        ).writeTo(target).append()
        # The source's row hashes are written in buffer.dir (what a cluster's executors read
        # when buffer.stage_uri is `local`), and removed after.
        hashed = []
        row_hashes = digest.source_row_hashes
        monkeypatch.setattr(digest, "source_row_hashes",
                            lambda *args: hashed.append(args[-1]) or row_hashes(*args))
        [verdict] = verify(lake, attempts=1)
        assert not verdict.equal
        problems = {d["key"]["id"]: d["problem"] for d in verdict.differences}
        assert problems == {"2": "missing in the lake", "104": "values differ",
                            "5": "values differ", "999": "in the lake, not in the source"}
        assert [p.parent.parent for p in hashed] == [config.segment_dir]
        assert not hashed[0].parent.exists()


def test_dead_letters_are_said_again_when_their_batch_is_replayed(
        postgres: Any, pg_conn: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dead letters of a batch are written before its table's commit. When the run stops
    right after writing them (before saying so), the next run applies the batch again and
    finds them already written: it says all the same that the batch's rows went there, once
    (also when its own first attempt fails there and is tried again)."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, n numeric(6,2))")
    config = make_config(postgres, warehouse, tmp_path / "seg", unique, [table])
    target = config.target_for(table)

    def run(attempts: int = 3) -> None:
        sink = config.sink.model_copy(update={"commit_max_attempts": attempts})
        pipeline = Pipeline(config.model_copy(update={"sink": sink}), session=spark)
        try:
            pipeline.run(once=True)
        finally:
            pipeline.close()

    run()
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (1, 1.5), (2, 'NaN'), (3, 'NaN')")
    said = f"2 row(s) of {table} could not be written exactly"
    monkeypatch.setattr(faults, "_FAIL", ("dead-letters", 1))
    monkeypatch.setattr(faults, "_fails", {})
    with caplog.at_level(logging.INFO, logger="walberg"), pytest.raises(ApplyError):
        run(attempts=1)  # the failure ends the run
    assert said not in caplog.text
    assert hadoop_table(warehouse, target).scan().to_arrow().num_rows == 0
    # The batch again, as after a restart; its first attempt fails the same way.
    monkeypatch.setattr(faults, "_FAIL", ("dead-letters", 1))
    monkeypatch.setattr(faults, "_fails", {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="walberg"):
        run()
    assert faults._FAIL is None  # (the failure point was passed)
    assert caplog.text.count(said) == 1 and f"{target}__dlq" in caplog.text, caplog.text[-3000:]
    assert [r["id"] for r in hadoop_table(warehouse, target).scan().to_arrow().to_pylist()] \
        == [1]
    dead = hadoop_table(warehouse, f"{target}__dlq").scan().to_arrow().to_pylist()
    assert sorted(int(r["id"]) for r in dead) == [2, 3]
