"""The lake holds what PostgreSQL's own subscriber holds. Scenarios of PostgreSQL's subscription
tests (src/test/subscription/t/) that apply to a lake run on the test server; a real
subscriber of the same publication, in a database of its own, applies them too; then each
table of the lake (read by PyIceberg) is compared row for row with the subscriber's, and
`verify` must call the lake equal, and unequal once a row of it is removed.

Ported: 001_rep_changes (inserts, updates, key changes, deletes, REPLICA IDENTITY FULL with and
without a key, duplicate rows), 002_types (arrays with NULLs and quoting, enums and their arrays,
composites and their arrays, ranges, domains), TOAST (unchanged values through key changes and
FULL identity), 010_truncate, 013_partition, inheritance, 015/016 streamed transactions with
subtransactions, 021_twophase, and DDL between transactions. Row filters, column lists and
generated columns are compared with a subscriber in test_publication.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from conftest import insert_lsn, make_config, run_once
from lake import iceberg_rows, postgres_rows
from walberg.apply.session import quote_target
from walberg.lake.services import Lake
from walberg.ops.check import check
from walberg.ops.verify import verify

BIG = "(SELECT string_agg(md5(g::text || {seed}), '') FROM generate_series(1, 400) g)"


class Scenario:
    """One scenario: tables made alike on the source and on the subscriber, a publication,
    walberg's pipeline and the subscriber on it. ``t(name)`` is a table's qualified name."""

    def __init__(self, ctx: dict[str, Any], ddl: str, tables: dict[str, str],
                 publish: str = "", sub_ddl: Optional[str] = None,
                 sub_options: str = "", two_phase: bool = False,
                 walberg_tables: Optional[list[str]] = None) -> None:
        """``ddl``: statements with ``{t_NAME}`` for each table; ``tables``: name -> key
        column to order by; ``publish``: the FOR clause (default: the tables);
        ``walberg_tables``: the names walberg mirrors (default: all)."""
        self.ctx = ctx
        self.unique = ctx["unique"]
        self.keys = tables
        self.names = {n: f"public.{self.unique}_{n}" for n in tables}
        fill = {f"t_{n}": q for n, q in self.names.items()}
        self.cur = ctx["pg_conn"].cursor()
        self.cur.execute(ddl.format(**fill))
        self.publication = f"pub_{self.unique}"
        clause = (publish.format(**fill) if publish
                  else "TABLE " + ", ".join(self.names.values()))
        self.cur.execute(f"CREATE PUBLICATION {self.publication} FOR {clause} "
                         "WITH (publish_via_partition_root = true)")
        self.sub = ctx["subscriber"](f"sub_{self.unique}", [self.publication],
                                     (sub_ddl or ddl).format(**fill), options=sub_options,
                                     two_phase=two_phase)
        mirrored = walberg_tables or list(tables)
        self.config = make_config(ctx["postgres"], ctx["warehouse"], ctx["tmp_path"] / "seg",
                                  self.unique, [self.names[n] for n in mirrored])
        self.mirrored = mirrored

    def t(self, name: str) -> str:
        return self.names[name]

    def source(self, *statements: str) -> None:
        for statement in statements:
            self.cur.execute(statement.format(**{f"t_{n}": q for n, q in self.names.items()}))

    def raw(self, *statements: str) -> None:
        """Statements as they are (no table names to fill in)."""
        for statement in statements:
            self.cur.execute(statement)

    def sync(self, select: Optional[dict[str, str]] = None) -> None:
        """walberg applies everything committed (one `run --once`), the subscriber catches up,
        and every mirrored table of the lake equals the subscriber's. ``select``: per table,
        the subscriber's select list where a column's lake form is its text."""
        run_once(self.config, self.ctx["spark"])
        self.sub.caught_up(insert_lsn(self.ctx["pg_conn"]))
        for name in self.mirrored:
            lake, subscribed = self.lake(name), self.subscribed(name, (select or {}).get(name))
            assert lake == subscribed, (name, _differences(lake, subscribed))

    def lake(self, name: str) -> list[dict[str, Any]]:
        return _ordered(iceberg_rows(self.ctx["warehouse"],
                                     self.config.target_for(self.names[name]),
                                     key=self.keys[name]))

    def subscribed(self, name: str, select: Optional[str] = None) -> list[dict[str, Any]]:
        table = self.names[name]
        return _ordered(postgres_rows(
            self.sub.conn, f"(SELECT {select or '*'} FROM {table}) AS s", self.keys[name]))

    def mirror(self, names: list[str], pipeline: str) -> None:
        """From now on walberg mirrors ``names``, by a pipeline (slot, publication, namespace)
        of its own named ``pipeline``."""
        self.config = make_config(self.ctx["postgres"], self.ctx["warehouse"],
                                  self.ctx["tmp_path"] / pipeline, pipeline,
                                  [self.names[n] for n in names])
        self.mirrored = names

    def verified(self, corrupt: str, where: str) -> None:
        """`verify` calls every table equal; then, with the rows ``where`` removed from the
        lake's ``corrupt`` table, unequal (and only that one)."""
        spark = self.ctx["spark"]
        with Lake(self.config, session=spark) as lake:
            verdicts = verify(lake)
        assert verdicts and all(v.equal for v in verdicts), verdicts
        target = self.config.target_for(self.names[corrupt])
        spark.sql(f"DELETE FROM {quote_target(target)} WHERE {where}")
        with Lake(self.config, session=spark) as lake:
            verdicts = verify(lake, attempts=1)
        assert [v.target for v in verdicts if not v.equal] == [target], verdicts


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in an order of their whole values (equal keys repeat in a table without one),
    bytea as bytes (psycopg2 reads it as a memoryview)."""
    rows = [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in r.items()}
            for r in rows]
    return sorted(rows, key=lambda r: [(v is None, str(v)) for v in r.values()])


def _differences(lake: list[dict[str, Any]], subscribed: list[dict[str, Any]]) -> list[Any]:
    """What differs, column by column, for a readable failure."""
    if len(lake) != len(subscribed):
        return [f"{len(lake)} rows in the lake, {len(subscribed)} in the subscriber"]
    return [(i, k, a.get(k), b.get(k)) for i, (a, b) in enumerate(zip(lake, subscribed, strict=True))
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)][:10]


@pytest.fixture
def ctx(pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str, subscriber: Any) -> Iterator[dict[str, Any]]:
    yield {"pg_conn": pg_conn, "postgres": postgres, "spark": spark, "warehouse": warehouse,
           "tmp_path": tmp_path, "unique": unique, "subscriber": subscriber}


def test_rep_changes(ctx: dict[str, Any]) -> None:
    """001_rep_changes: inserts, updates, key changes and deletes; REPLICA IDENTITY FULL with
    a key and without one (where equal rows repeat); a table emptied by DELETE."""
    s = Scenario(ctx, """
        CREATE TABLE {t_ins} (a int PRIMARY KEY);
        CREATE TABLE {t_rep} (a int PRIMARY KEY, b text);
        CREATE TABLE {t_full} (a int, b text); ALTER TABLE {t_full} REPLICA IDENTITY FULL;
        CREATE TABLE {t_fullpk} (a int PRIMARY KEY, b text);
        ALTER TABLE {t_fullpk} REPLICA IDENTITY FULL;
        CREATE TABLE {t_mixed} (a int PRIMARY KEY, b text, c numeric);
    """, {"ins": "a", "rep": "a", "full": "a", "fullpk": "a", "mixed": "a"})
    s.source("INSERT INTO {t_ins} SELECT generate_series(1, 1002)",
             "INSERT INTO {t_rep} SELECT g, 'r' || g FROM generate_series(1, 50) g",
             "INSERT INTO {t_full} SELECT g % 5, 'x' FROM generate_series(1, 20) g",
             "INSERT INTO {t_fullpk} VALUES (1, 'foo'), (2, 'baz')",
             "INSERT INTO {t_mixed} VALUES (1, 'foo', 1.1)")
    s.sync()
    s.source("INSERT INTO {t_ins} SELECT generate_series(1003, 1050)",
             "DELETE FROM {t_ins} WHERE a > 20",
             "UPDATE {t_ins} SET a = -a",
             "UPDATE {t_rep} SET a = -a WHERE a % 3 = 0",
             "UPDATE {t_rep} SET b = b || '!' WHERE a % 2 = 0",
             "DELETE FROM {t_rep} WHERE a BETWEEN 10 AND 20",
             # One of several equal rows of a table without a key, then all of one value.
             "DELETE FROM {t_full} WHERE ctid = (SELECT ctid FROM {t_full} WHERE a = 1 LIMIT 1)",
             "UPDATE {t_full} SET b = 'y' WHERE a = 2",
             "DELETE FROM {t_full} WHERE a = 3",
             "UPDATE {t_fullpk} SET b = 'zoo' WHERE a = 1",
             "UPDATE {t_fullpk} SET a = 20 WHERE a = 2",
             "UPDATE {t_mixed} SET b = 'bar', c = 2.2 WHERE a = 1")
    s.sync()
    s.source("DELETE FROM {t_ins}", "INSERT INTO {t_mixed} VALUES (2, NULL, NULL)")
    s.sync()
    s.verified("rep", "a = 1")


def test_types(ctx: dict[str, Any]) -> None:
    """002_types: arrays (NULL elements, quoted elements, two dimensions), an enum and an array
    of it, a composite and an array of it, ranges, a domain, and the scalar types of
    docs/types.md, through the copy and the stream. Where the lake holds a value's Postgres
    text, the subscriber's side is read as text."""
    u = ctx["unique"]
    types = f"""
        CREATE TYPE {u}_mood AS ENUM ('sad', 'ok', 'happy');
        CREATE TYPE {u}_pair AS (n int, label text);
        CREATE DOMAIN {u}_pos AS int CHECK (VALUE > 0);
    """
    ddl = types + f"""
        CREATE TABLE {{t_ty}} (id int PRIMARY KEY, ints int[], texts text[], grid int[][],
            mood {u}_mood, moods {u}_mood[], pair {u}_pair, pairs {u}_pair[],
            span int4range, days daterange, pos {u}_pos, n numeric(12,4), ts timestamptz,
            j jsonb, b bytea, id2 uuid, iv interval);
    """
    s = Scenario(ctx, ddl, {"ty": "id"})
    t = s.t("ty")

    def row(i: int) -> str:
        return (f"INSERT INTO {t} VALUES ({i}, '{{1,NULL,3}}', "
                + r"""'{a,NULL,"b c","q\"x","",NULL}', '{{1,2},{3,4}}', 'ok', '{sad,happy,NULL}', """
                + f"""ROW({i}, 'l"a,b'), ARRAY[ROW(1, 'x'), ROW(2, NULL), NULL]::{u}_pair[], """
                + f"'[1,{i + 1})', '[2024-01-01,2024-02-01)', {i}, {i}.5, "
                + r"""'2024-03-01 12:00:00.123456+02', '{"k": [1, 2, {"z": null}]}', '\x00ff', """
                + "gen_random_uuid(), '1 year 2 mons 3 days 04:05:06.7')")

    s.raw(*[row(i) for i in range(1, 4)], f"INSERT INTO {t} (id) VALUES (100)")
    text_form = ("id, ints, texts, grid, mood::text, moods::text[], pair::text, "
                 "pairs::text[], span::text, days::text, pos, n, ts, j::text, b, id2::text, "
                 "iv::text")
    select = {"ty": text_form}
    # The lake holds an interval in ISO 8601; the subscriber's side prints it so.
    s.sub.execute("SET intervalstyle = 'iso_8601'")
    s.sync(select)
    s.raw(*[row(i) for i in range(4, 6)],
          f"UPDATE {t} SET ints = '{{7,NULL}}', moods = '{{ok}}', pairs = NULL, "
          f"pair = ROW(NULL, 'q') WHERE id = 1",
          f"UPDATE {t} SET texts = '{{\"\"}}', grid = '{{}}' WHERE id = 2",
          f"DELETE FROM {t} WHERE id = 3",
          # A composite whose fields are all NULL is a value (which IS NULL calls NULL); a
          # control character in an array's element (JSON escapes it).
          f"UPDATE {t} SET pair = ROW(NULL, NULL), pairs = ARRAY[ROW(NULL, NULL)]::{u}_pair[], "
          "texts = ARRAY[E'a\\x0bb'] WHERE id = 100")
    s.sync(select)
    s.verified("ty", "id = 2")
    # One element of an array, one field of a composite in an array, one array of timestamps'
    # digit: each a difference verify names.
    target = quote_target(s.config.target_for(t))
    spark = ctx["spark"]
    spark.sql(f"UPDATE {target} SET texts = array('a', NULL, 'b c', 'changed', '', NULL) "
              "WHERE id = 4")
    spark.sql(f"UPDATE {target} SET pairs = array('(1,x)', '(3,)', NULL) WHERE id = 5")
    spark.sql(f"UPDATE {target} SET grid = array(array(1, 2), array(3, 5)) WHERE id = 1")
    # (timestamptz compared in UTC whatever the session's time zone)
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        with Lake(s.config, session=spark) as lake:
            [verdict] = verify(lake, attempts=1)
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    problems = {d["key"]["id"]: d["problem"] for d in verdict.differences}
    assert problems == {"1": "values differ", "2": "missing in the lake",
                        "4": "values differ", "5": "values differ"}, verdict.differences


def test_toast(ctx: dict[str, Any]) -> None:
    """Unchanged TOASTed values: key changes followed by updates in one batch, a key taken over
    after its row was deleted, and REPLICA IDENTITY FULL with a value stored out of line."""
    s = Scenario(ctx, """
        CREATE TABLE {t_big} (id bigint PRIMARY KEY, n int, body text);
        CREATE TABLE {t_full} (a int, b text, big text);
        ALTER TABLE {t_full} REPLICA IDENTITY FULL;
        ALTER TABLE {t_full} ALTER big SET STORAGE EXTERNAL;
    """, {"big": "id", "full": "a"})
    s.source(*[f"INSERT INTO {{t_big}} VALUES ({i}, 0, {BIG.format(seed=i)})"
               for i in (1, 2, 3, 4)],
             "INSERT INTO {t_full} SELECT g, 'x', repeat(md5(g::text), 300) "
             "FROM generate_series(1, 3) g")
    s.sync()
    s.source("UPDATE {t_big} SET id = 101 WHERE id = 1",
             "UPDATE {t_big} SET n = n + 1 WHERE id = 101",
             f"INSERT INTO {{t_big}} VALUES (5, 0, {BIG.format(seed=5)})",
             "UPDATE {t_big} SET id = 50 WHERE id = 5",
             "UPDATE {t_big} SET n = 7 WHERE id = 50",
             "DELETE FROM {t_big} WHERE id = 3",
             "UPDATE {t_big} SET id = 3 WHERE id = 4",
             "UPDATE {t_big} SET n = 9 WHERE id = 3",
             "UPDATE {t_full} SET b = 'y' WHERE a = 1",
             "UPDATE {t_full} SET a = 10 WHERE a = 2")
    s.sync()
    assert all(r["body"] for r in s.lake("big"))
    s.verified("big", "id = 101")


def test_truncate(ctx: dict[str, Any]) -> None:
    """010_truncate: TRUNCATE of one table, of two in one statement, with CASCADE to a table
    that references it, and rows inserted after a TRUNCATE in the same transaction."""
    s = Scenario(ctx, """
        CREATE TABLE {t_one} (a int PRIMARY KEY);
        CREATE TABLE {t_two} (a int PRIMARY KEY);
        CREATE TABLE {t_parent} (a int PRIMARY KEY);
        CREATE TABLE {t_child} (a int PRIMARY KEY, p int REFERENCES {t_parent});
    """, {"one": "a", "two": "a", "parent": "a", "child": "a"})
    s.source("INSERT INTO {t_one} SELECT generate_series(1, 10)",
             "INSERT INTO {t_two} SELECT generate_series(1, 10)",
             "INSERT INTO {t_parent} SELECT generate_series(1, 3)",
             "INSERT INTO {t_child} SELECT g, g % 3 + 1 FROM generate_series(1, 6) g")
    s.sync()
    s.source("TRUNCATE {t_one}", "INSERT INTO {t_one} VALUES (100)",
             "BEGIN", "TRUNCATE {t_two}", "INSERT INTO {t_two} VALUES (7), (8)", "COMMIT",
             "TRUNCATE {t_parent} CASCADE", "INSERT INTO {t_parent} VALUES (9)")
    s.sync()
    s.source("TRUNCATE {t_one}, {t_two}", "INSERT INTO {t_child} VALUES (1, 9)")
    s.sync()
    s.verified("child", "a = 1")


def test_partitioned(ctx: dict[str, Any]) -> None:
    """013_partition: a partitioned table published through its root, rows moving between
    partitions."""
    s = Scenario(ctx, """
        CREATE TABLE {t_m} (a int PRIMARY KEY, b text) PARTITION BY RANGE (a);
        CREATE TABLE {t_m}_1 PARTITION OF {t_m} FOR VALUES FROM (0) TO (100);
        CREATE TABLE {t_m}_2 PARTITION OF {t_m} FOR VALUES FROM (100) TO (200);
        CREATE TABLE {t_m}_3 PARTITION OF {t_m} FOR VALUES FROM (200) TO (300);
    """, {"m": "a"})
    s.source("INSERT INTO {t_m} SELECT g, 'v' || g FROM generate_series(1, 250, 7) g")
    s.sync()
    s.source("UPDATE {t_m} SET a = a + 100 WHERE a < 50",  # into another partition
             "UPDATE {t_m} SET b = 'changed' WHERE a BETWEEN 150 AND 160",
             "DELETE FROM {t_m} WHERE a > 240",
             "INSERT INTO {t_m} VALUES (5, 'back'), (299, 'last')")
    s.sync()
    s.verified("m", "a = 5")


def test_inheritance(ctx: dict[str, Any]) -> None:
    """A table with an inheritance child, published FOR TABLE parent (which publishes the child
    as a table of its own): the parent's lake table holds the parent's own rows, as the
    subscriber's does; the child, when listed, its own; `check` says so when it is not."""
    s = Scenario(ctx, """
        CREATE TABLE {t_p} (a int PRIMARY KEY);
        CREATE TABLE {t_c} (b text) INHERITS ({t_p});
        ALTER TABLE {t_c} ADD PRIMARY KEY (a);
    """, {"p": "a", "c": "a"}, publish="TABLE {t_p}",
        sub_ddl="CREATE TABLE {t_p} (a int PRIMARY KEY); "
                "CREATE TABLE {t_c} (a int PRIMARY KEY, b text);",
        walberg_tables=["p"])
    s.source("INSERT INTO {t_p} VALUES (10), (20)",
             "INSERT INTO {t_c} VALUES (0, 'c'), (30, 'c'), (40, 'c')")
    with Lake(s.config, session=ctx["spark"]) as lake:
        [checks] = check(lake)
    tables = next(r for r in checks.results if r.name == "tables")
    assert tables.ok and f"inheritance children ({s.t('c')})" in tables.detail, tables.detail
    s.sync()
    assert [r["a"] for r in s.lake("p")] == [10, 20]
    s.source("INSERT INTO {t_p} VALUES (14)", "INSERT INTO {t_c} VALUES (13, 'c')",
             "UPDATE {t_p} SET a = 31 WHERE a = 30", "DELETE FROM {t_c} WHERE a = 40")
    s.sync()
    assert [r["a"] for r in s.lake("p")] == [10, 14, 20]
    # The child mirrored too: a table of its own, as the subscriber holds it.
    s.mirror(["p", "c"], f"{s.unique}_both")
    s.sync()
    assert [r["a"] for r in s.lake("c")] == [0, 13, 31]
    s.verified("c", "a = 0")


def test_streamed_transactions_with_subtransactions(ctx: dict[str, Any]) -> None:
    """015_stream and 016_stream_subxact: transactions larger than logical_decoding_work_mem,
    streamed while in progress, with savepoints, a rollback to a savepoint, and one aborted."""
    pg = ctx["pg_conn"]
    with pg.cursor() as cur:
        cur.execute("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
        cur.execute("SELECT pg_reload_conf()")
    try:
        s = Scenario(ctx, "CREATE TABLE {t_s} (a int PRIMARY KEY, b text);", {"s": "a"},
                     sub_options="streaming = on")
        s.source("INSERT INTO {t_s} VALUES (1, 'one'), (2, 'two')")
        s.sync()
        s.source("BEGIN",
                 "INSERT INTO {t_s} SELECT g, md5(g::text) FROM generate_series(3, 2000) g",
                 "SAVEPOINT s1",
                 "UPDATE {t_s} SET b = 'upd ' || a WHERE a % 2 = 0",
                 "SAVEPOINT s2",
                 "DELETE FROM {t_s} WHERE a % 3 = 0",
                 "ROLLBACK TO SAVEPOINT s2",
                 "DELETE FROM {t_s} WHERE a % 5 = 0",
                 "RELEASE SAVEPOINT s1",
                 "COMMIT",
                 "BEGIN",
                 "INSERT INTO {t_s} SELECT g, 'gone' FROM generate_series(5000, 8000) g",
                 "ROLLBACK")
        s.sync()
        assert len(s.lake("s")) == 2000 - 400
        s.verified("s", "a = 2")
    finally:
        with pg.cursor() as cur:
            cur.execute("ALTER SYSTEM RESET logical_decoding_work_mem")
            cur.execute("SELECT pg_reload_conf()")


def test_prepared_transactions(ctx: dict[str, Any]) -> None:
    """021_twophase: a prepared transaction committed, one rolled back, and one whose COMMIT
    PREPARED comes in a later batch than its PREPARE; the subscriber decodes at PREPARE."""
    s = Scenario(ctx, "CREATE TABLE {t_x} (a int PRIMARY KEY, b text);", {"x": "a"},
                 sub_options="two_phase = true", two_phase=True)
    s.source("INSERT INTO {t_x} VALUES (1, 'a'), (2, 'b')")
    s.sync()
    g1, g2 = f"{s.unique}_g1", f"{s.unique}_g2"
    s.source("BEGIN", "INSERT INTO {t_x} VALUES (3, 'c'), (4, 'd')",
             "UPDATE {t_x} SET b = 'B' WHERE a = 2", f"PREPARE TRANSACTION '{g1}'",
             f"COMMIT PREPARED '{g1}'",
             "BEGIN", "DELETE FROM {t_x} WHERE a = 1", "INSERT INTO {t_x} VALUES (5, 'e')",
             f"PREPARE TRANSACTION '{g2}'", f"ROLLBACK PREPARED '{g2}'")
    s.sync()
    assert [r["a"] for r in s.lake("x")] == [1, 2, 3, 4]
    s.verified("x", "a = 4")


def test_ddl_between_transactions(ctx: dict[str, Any]) -> None:
    """Schema changes between transactions (PostgreSQL leaves the subscriber's DDL to the user;
    the lake follows by itself): a column added with a default, one dropped, one renamed, a
    type widened, one added without a default that gets one later (the rows there before
    keep NULL), each with changes around it."""
    s = Scenario(ctx, "CREATE TABLE {t_d} (a int PRIMARY KEY, b text, c int, old int);",
                 {"d": "a"})
    s.source("INSERT INTO {t_d} SELECT g, 'b' || g, g, g FROM generate_series(1, 20) g")
    s.sync()
    t = s.t("d")
    for statement in (f"ALTER TABLE {t} ADD COLUMN e text DEFAULT 'x'",
                      f"ALTER TABLE {t} DROP COLUMN old",
                      f"ALTER TABLE {t} RENAME COLUMN b TO bee",
                      f"ALTER TABLE {t} ALTER COLUMN c TYPE bigint",
                      f"ALTER TABLE {t} ADD COLUMN f text",
                      f"ALTER TABLE {t} ALTER COLUMN f SET DEFAULT 'v'"):
        # The subscriber's table changes once it has applied what came before (changes sent
        # with the old columns would not fit the new ones).
        s.sub.caught_up(insert_lsn(ctx["pg_conn"]))
        s.source(statement)
        s.sub.execute(statement)
        s.source(f"INSERT INTO {t} (a, c) VALUES ((SELECT max(a) + 1 FROM {t}), 1)",
                 f"UPDATE {t} SET c = c + 1 WHERE a % 4 = 0",
                 f"DELETE FROM {t} WHERE a = (SELECT min(a) FROM {t})")
    s.sync()
    assert set(s.lake("d")[0]) == {"a", "bee", "c", "e", "f"}
    s.verified("d", "a = 10")


def test_defaults_read_from_the_rows_after_a_rewrite(ctx: dict[str, Any]) -> None:
    """A default set after a plain ADD COLUMN, and a column added with a default that is then
    changed, both before a rewrite (ALTER ... TYPE of another column) and all before walberg
    applies the ADDs: the catalog records no value for the existing rows, and the rewrite made
    every row as new as itself. The rows keep NULL in the first (it was the default only from
    then on) and the first default in the second; the lake had the current defaults. A third
    column added with a default that was dropped again (as Django adds a NOT NULL column)
    holds it in every row, where the lake had NULL. The rows as old as the table's oldest say
    it; where they disagree about a default, the table stops instead of guessing (see
    test_mixed_oldest_rows_are_not_guessed)."""
    s = Scenario(ctx, "CREATE TABLE {t_w} (a int PRIMARY KEY, c int);", {"w": "a"})
    s.source("INSERT INTO {t_w} SELECT g, g FROM generate_series(1, 20) g")
    s.sync()
    t = s.t("w")
    s.sub.caught_up(insert_lsn(ctx["pg_conn"]))
    for statement in (f"ALTER TABLE {t} ADD COLUMN f text",
                      f"ALTER TABLE {t} ALTER COLUMN f SET DEFAULT 'v'",
                      f"ALTER TABLE {t} ADD COLUMN g text DEFAULT 'x'",
                      f"ALTER TABLE {t} ADD COLUMN h int NOT NULL DEFAULT 0",
                      f"ALTER TABLE {t} ALTER COLUMN h DROP DEFAULT",
                      f"ALTER TABLE {t} ALTER COLUMN c TYPE bigint",
                      f"ALTER TABLE {t} ALTER COLUMN g SET DEFAULT 'y'"):
        s.source(statement)
        s.sub.execute(statement)
    s.source(f"INSERT INTO {t} (a, c, h) VALUES (21, 1, 5)",
             f"UPDATE {t} SET c = c + 1 WHERE a % 4 = 0")
    s.sync()
    rows = s.lake("w")
    assert {(r["f"], r["g"], r["h"]) for r in rows if r["a"] <= 20} == {(None, "x", 0)}
    assert [(r["f"], r["g"], r["h"]) for r in rows if r["a"] == 21] == [("v", "y", 5)]


def test_mixed_oldest_rows_are_not_guessed(pg_conn: Any, unique: str) -> None:
    """The same after rows were written between the SET DEFAULT and the rewrite: the rewrite's
    rows hold NULL (those before) and the default (those after), which no longer says which
    rows the lake holds. walberg stops the table (resync is the way out), not guesses."""
    from walberg.source import postgres as pg

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (a int PRIMARY KEY, c int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 5) g")
        cur.execute(f"ALTER TABLE {table} ADD COLUMN f text")
        cur.execute(f"ALTER TABLE {table} ALTER COLUMN f SET DEFAULT 'v'")
        cur.execute(f"INSERT INTO {table} (a, c) VALUES (6, 6)")
        assert pg.column_default(pg_conn, table, "f") == (False, None)  # (by the rows' age)
        cur.execute(f"ALTER TABLE {table} ALTER COLUMN c TYPE bigint")
    with pytest.raises(pg.ExistingValuesUnknown, match=f"column f of {table} .* rewritten"):
        pg.column_default(pg_conn, table, "f")


@pytest.mark.parametrize("seed", [7, 28])
def test_randomized_key_changes_and_toast(ctx: dict[str, Any], seed: int) -> None:
    """A randomized soak in small: inserts, updates that leave a TOASTed value unsent, key
    changes, value changes and deletes in random order over a few batches, in transactions of
    a few statements (seeded, so a failure repeats)."""
    rng = random.Random(seed)
    s = Scenario(ctx, "CREATE TABLE {t_r} (id bigint PRIMARY KEY, n int, body text);",
                 {"r": "id"})
    t = s.t("r")
    live = list(range(1, 21))
    s.raw(*[f"INSERT INTO {t} VALUES ({i}, 0, {BIG.format(seed=i)})" for i in live])
    s.sync()
    fresh = 1000
    for _ in range(3):
        statements = []
        for _ in range(60):
            roll = rng.random()
            if roll < 0.1 or not live:
                fresh += 1
                big = BIG.format(seed=fresh) if rng.random() < 0.7 else "'small'"
                statements.append(f"INSERT INTO {t} VALUES ({fresh}, 0, {big})")
                live.append(fresh)
                continue
            row = rng.choice(live)
            if roll < 0.45:
                statements.append(f"UPDATE {t} SET n = n + 1 WHERE id = {row}")
            elif roll < 0.75:
                fresh += 1
                statements.append(f"UPDATE {t} SET id = {fresh} WHERE id = {row}")
                live[live.index(row)] = fresh
            elif roll < 0.85:
                value = BIG.format(seed=rng.randrange(10**6)) if rng.random() < 0.5 else "'set'"
                statements.append(f"UPDATE {t} SET body = {value} WHERE id = {row}")
            else:
                statements.append(f"DELETE FROM {t} WHERE id = {row}")
                live.remove(row)
        while statements:
            size = rng.randint(1, 5)
            s.raw("BEGIN", *statements[:size], "COMMIT")
            statements = statements[size:]
        s.sync()
    s.verified("r", f"id = {live[0]}")


@pytest.mark.parametrize("truncate,partitioned", [(False, False), (True, False), (True, True)])
def test_column_dropped_and_added_again_in_streamed_transactions(
        ctx: dict[str, Any], truncate: bool, partitioned: bool) -> None:
    """A column dropped and added again under its name beside a new one, in an ALTER TABLE of
    its own between two runs, then changes, with every transaction streamed while it runs
    (``debug_logical_replication_streaming = immediate``: the path of a transaction over
    logical_decoding_work_mem); with or without a TRUNCATE of its own before; on a plain table
    and on a partitioned root published through the root. (pgoutput describes the table again
    in every streamed transaction: that alone must not stop it.)"""
    pg = ctx["pg_conn"]
    with pg.cursor() as cur:
        cur.execute("ALTER SYSTEM SET debug_logical_replication_streaming = 'immediate'")
        cur.execute("SELECT pg_reload_conf()")
    try:
        ddl = ("CREATE TABLE {t_p} (a int PRIMARY KEY, b text) PARTITION BY RANGE (a); "
               "CREATE TABLE {t_p}_1 PARTITION OF {t_p} FOR VALUES FROM (0) TO (100);"
               if partitioned else "CREATE TABLE {t_p} (a int PRIMARY KEY, b text);")
        s = Scenario(ctx, ddl, {"p": "a"}, sub_options="streaming = on")
        s.source("INSERT INTO {t_p} VALUES (1, 'one'), (2, 'two')")
        s.sync()
        if truncate:
            s.source("TRUNCATE {t_p}")
        s.sub.caught_up(insert_lsn(pg))
        alter = "ALTER TABLE {t_p} DROP b, ADD COLUMN c text DEFAULT 'dflt', ADD b text"
        s.source(alter)
        s.sub.execute(alter.format(t_p=s.t("p")))
        s.source("INSERT INTO {t_p} VALUES (3, 'three', 'b3'), (4, DEFAULT, 'b4')",
                 "UPDATE {t_p} SET b = 'upd' WHERE a = 3")
        s.sync()
        assert [list(r) for r in s.lake("p")][:1] == [["a", "c", "b"]]
        s.verified("p", "a = 3")
    finally:
        with pg.cursor() as cur:
            cur.execute("ALTER SYSTEM RESET debug_logical_replication_streaming")
            cur.execute("SELECT pg_reload_conf()")
