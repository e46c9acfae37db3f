"""Schema evolution: ALTER TABLE in Postgres while walberg streams becomes an Iceberg schema
change (no data rewritten, no stop); what Iceberg cannot express stops with the way out."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import insert_lsn, make_config, run_once, running
from lake import duckdb_rows, hadoop_table, iceberg_rows, postgres_rows
from walberg.apply.evolution import NotEvolvable, Step, plan, widens
from walberg.errors import Terminal
from walberg.lake.services import Lake
from walberg.model import Insert, Lsn, Relation
from walberg.ops.resync import plan as resync_plan
from walberg.ops.resync import resync
from walberg.ops.verify import verify
from walberg.pipeline import Pipeline
from walberg.runtime.pg_reader import PgReader
from walberg.source.pgoutput import Decoder


def resent_rows(conn: Any, slot: str, publication: str, table: str) -> list[tuple[int, int]]:
    """(id, v) of the inserts into ``table`` that ``slot`` would send again (peeked through
    pgoutput, not consumed)."""
    decoder = Decoder()
    oids: set[int] = set()
    rows = []
    with conn.cursor() as cur:
        cur.execute("SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, "
                    "NULL, 'proto_version', '1', 'publication_names', %s)", (slot, publication))
        for lsn, data in cur.fetchall():
            msg = decoder.decode(bytes(data), int(Lsn.parse(lsn)))
            if isinstance(msg, Relation) and msg.qualified_name == table:
                oids.add(msg.oid)
            elif isinstance(msg, Insert) and msg.relation_oid in oids:
                rows.append((int(msg.new[0]), int(msg.new[1])))
    return rows


# ---- unit: planning -----------------------------------------------------------------------------


def test_plan_reads_adds_drops_renames_and_widening() -> None:
    current = [("id", "int"), ("a", "int"), ("b", "string"), ("c", "float"), ("d", "decimal(5,2)")]
    wanted = [("id", "int"), ("a", "bigint"), ("c2", "double"), ("d", "decimal(9,2)"),
              ("e", "int")]
    assert plan(current, wanted) == [
        Step("widen", "a", "bigint"), Step("drop", "b"), Step("rename", "c", new_name="c2"),
        Step("widen", "c2", "double"), Step("widen", "d", "decimal(9,2)"), Step("add", "e", "int"),
    ]
    assert plan(current, current) == []
    assert plan([("id", "int")], [("id", "int"), ("x", "string"), ("y", "date")]) == [
        Step("add", "x", "string"), Step("add", "y", "date")]
    # A dropped column whose place is taken by a new name of another family: drop plus add.
    assert plan([("id", "int"), ("b", "string")], [("id", "int"), ("n", "int")]) == [
        Step("drop", "b"), Step("add", "n", "int")]
    # RENAME price TO price_old, then ADD COLUMN price: by name, "add price_old" before the old
    # price, which Postgres never does: refused, not read as that.
    with pytest.raises(NotEvolvable, match="comes after the new column price_old"):
        plan([("id", "int"), ("price", "decimal(5,2)")],
             [("id", "int"), ("price_old", "decimal(5,2)"), ("price", "decimal(5,2)")])


@pytest.mark.parametrize("old, new", [("bigint", "int"), ("double", "float"), ("int", "string"),
                                      ("decimal(9,2)", "decimal(5,2)"),
                                      ("decimal(9,2)", "decimal(12,4)"), ("string", "int")])
def test_plan_refuses_what_iceberg_cannot_do(old: str, new: str) -> None:
    assert not widens(old, new)
    with pytest.raises(NotEvolvable, match="cannot do in place"):
        plan([("id", "int"), ("v", old)], [("id", "int"), ("v", new)])


# ---- integration ------------------------------------------------------------------------------


def test_alter_table_between_changes_evolves_the_iceberg_table(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, a int, b text, c real, "
                    "d numeric(5,2), v varchar(5))")
        cur.execute(f"INSERT INTO {table} SELECT g, g, 'b' || g, g / 2.0, g / 4.0, 'v' "
                    "FROM generate_series(1, 50) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)

    # Every kind of ALTER, each between changes, all streamed in one run (one batch is cut
    # at each change of columns).
    steps = [
        f"INSERT INTO {table} VALUES (51, 51, 'x', 1.5, 1.25, 'w')",
        f"ALTER TABLE {table} ADD COLUMN e int DEFAULT 7",  # existing rows read 7
        f"INSERT INTO {table} VALUES (52, 52, 'y', 2.5, 2.5, 'z', 8)",
        f"ALTER TABLE {table} ADD COLUMN f text",
        f"UPDATE {table} SET f = 'f' || id WHERE id <= 10",
        f"ALTER TABLE {table} DROP COLUMN b",
        f"DELETE FROM {table} WHERE id BETWEEN 11 AND 15",
        f"ALTER TABLE {table} RENAME COLUMN c TO c2",
        f"UPDATE {table} SET c2 = 0.5 WHERE id = 20",
        f"ALTER TABLE {table} ALTER COLUMN a TYPE bigint",
        f"ALTER TABLE {table} ALTER COLUMN c2 TYPE double precision",
        f"ALTER TABLE {table} ALTER COLUMN d TYPE numeric(9,2)",
        f"ALTER TABLE {table} ALTER COLUMN v TYPE varchar(50)",
        f"INSERT INTO {table} VALUES (53, 9000000000, 0.1, 1234567.89, 'a longer text', 9, 'g')",
        f"ALTER TABLE {table} ADD COLUMN g timestamptz DEFAULT '2024-01-01 00:00:00+00'",
        f"UPDATE {table} SET e = e + 1 WHERE id > 40",
        # the default's text is decoded in Spark (its values, while staging)
        f"ALTER TABLE {table} ADD COLUMN h bytea DEFAULT '\\x00ff'",
        f"UPDATE {table} SET h = '\\x0a' WHERE id = 53",
        # an array's default is the array, element by element
        f"ALTER TABLE {table} ADD COLUMN k int[] DEFAULT '{{1,NULL,3}}', "
        "ADD COLUMN m text[] DEFAULT '{}'",
        f"UPDATE {table} SET k = '{{7}}', m = '{{\"a b\"}}' WHERE id = 52",
        # Existing rows keep the default they were added with after it is dropped (as Django
        # adds a column).
        f"ALTER TABLE {table} ADD COLUMN n int NOT NULL DEFAULT 0",
        f"ALTER TABLE {table} ALTER COLUMN n DROP DEFAULT",
        f"INSERT INTO {table} (id, a, n) VALUES (54, 54, 3)",
    ]
    with pg_conn.cursor() as cur:
        for statement in steps:
            cur.execute(statement)
    report = run_once(config, spark)
    assert report.batches >= 5  # cut before each change of columns that rows follow

    schema = {f.name: str(f.field_type) for f in hadoop_table(warehouse, target).schema().fields}
    assert schema == {"id": "int", "a": "long", "c2": "double", "d": "decimal(9, 2)",
                      "v": "string", "e": "int", "f": "string", "g": "timestamptz",
                      "h": "binary", "k": "list<int>", "m": "list<string>", "n": "int",
                      "_walberg_lsn": "long"}
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    # DuckDB reads the evolved table too (columns by field id: renamed, dropped, promoted).
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake)
    assert verdict.equal, verdict


def test_a_column_dropped_and_added_again_under_its_name_loses_its_values(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """DROP COLUMN then ADD COLUMN of the same name and type, with no change between: pgoutput
    describes the table as before, but Postgres's rows lost their values (NULL, or the new
    default). The lake's column goes and comes back too, by the column's number in the
    catalog: the last column between runs (the batch cut where the table is described again
    amid its changes), then a middle one (which comes back at the end) with a default, then
    the last one dropped and another of its type added (which the names read as a rename);
    and where the order cannot be told, a stop with the way out."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, a int, c int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g, g * 10 FROM generate_series(1, 6) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET c = 11 WHERE id = 1")  # (lost with the column)
        cur.execute(f"ALTER TABLE {table} DROP COLUMN c")
        cur.execute(f"ALTER TABLE {table} ADD COLUMN c int")
        cur.execute(f"UPDATE {table} SET c = 99 WHERE id = 2")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert [r["c"] for r in iceberg_rows(warehouse, target)] == [None, 99, None, None, None,
                                                                 None]
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} DROP COLUMN a")
        cur.execute(f"ALTER TABLE {table} ADD COLUMN a int DEFAULT 5")
        cur.execute(f"UPDATE {table} SET a = 7 WHERE id = 3")
    run_once(config, spark)
    assert [f.name for f in hadoop_table(warehouse, target).schema().fields
            if not f.name.startswith("_")] == ["id", "c", "a"]
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert [r["a"] for r in iceberg_rows(warehouse, target)] == [5, 5, 7, 5, 5, 5]
    # Another column of the same type in the last one's place: by the names a rename, by the
    # numbers another column.
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} DROP COLUMN a")
        cur.execute(f"ALTER TABLE {table} ADD COLUMN d int")
        cur.execute(f"UPDATE {table} SET d = 1 WHERE id = 4")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert [r["d"] for r in iceberg_rows(warehouse, target)] == [None, None, None, 1, None,
                                                                 None]
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake)
    assert verdict.equal, verdict
    # The last column dropped and added again after the table's last change: the stream's one
    # description comes before that change and shows the same columns, and whether the
    # column went before or after it cannot be told: the table stops, with the way out.
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET d = 2 WHERE id = 5")
        cur.execute(f"ALTER TABLE {table} DROP COLUMN d")
        cur.execute(f"ALTER TABLE {table} ADD COLUMN d int")
    with pytest.raises(Terminal, match=r"column\(s\) d were dropped and added again .*walberg "
                                       r"resync"):
        run_once(config, spark)
    with Lake(config, session=spark) as lake:
        resync(lake, resync_plan(lake, [table]))
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET d = 3 WHERE id = 6")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_a_table_that_loses_its_key_stops_with_the_way_out(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """The primary key dropped while walberg streams: Postgres refuses the table's updates and
    deletes from then on, but inserts and TRUNCATE go on. The table stops with the way out
    (a batch without a key to net by kept one row of a TRUNCATE and three inserts); the way
    out works. (A start finds the table without a key before anything runs.)"""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 1), (2, 2)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    pipeline = Pipeline(config, session=spark)
    with running(pipeline) as failures:
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} VALUES (6, 6)")
            pipeline.wait_for(insert_lsn(pg_conn), timeout=120)
            cur.execute(f"ALTER TABLE {table} DROP CONSTRAINT {unique}_pkey")
            cur.execute(f"TRUNCATE {table}")
            cur.execute(f"INSERT INTO {table} VALUES (3, 3), (4, 4), (5, 5)")
        deadline = time.monotonic() + 120
        while not failures and table not in pipeline._state.halted() and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        why = pipeline._state.halted().get(table) or str(failures)
    assert re.search(rf"{table} lost its key in Postgres .*REPLICA IDENTITY FULL.*walberg "
                     "resync", why), why
    assert iceberg_rows(warehouse, target) == [{"id": 1, "v": 1}, {"id": 2, "v": 2},
                                               {"id": 6, "v": 6}]
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
    with Lake(config, session=spark) as lake:
        resync(lake, resync_plan(lake, [table]))
    with pg_conn.cursor() as cur:
        cur.execute(f"DELETE FROM {table} WHERE id = 4")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_the_dead_letter_table_follows_added_columns(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Dead letters after an ADD COLUMN and a DROP COLUMN: the dead-letter table gains the
    new column (as text) and keeps the dropped one (NULL in the new rows), instead of the
    append failing and stopping the table."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, n numeric, b text)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'NaN', 'x'), (2, 2, 'y')")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)  # row 1: a dead letter of the copy
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} ADD COLUMN c int")
        cur.execute(f"ALTER TABLE {table} DROP COLUMN b")
        cur.execute(f"INSERT INTO {table} VALUES (3, 'NaN', 30), (4, 4, 40)")
    run_once(config, spark)
    dead = sorted(hadoop_table(warehouse, f"{target}__dlq").scan().to_arrow().to_pylist(),
                  key=lambda r: r["id"])
    assert [(r["id"], r["n"], r["b"], r.get("c")) for r in dead] == \
        [("1", "NaN", "x", None), ("3", "NaN", None, "30")]
    assert [(r["id"], r["c"]) for r in iceberg_rows(warehouse, target)] == [(2, None), (4, 40)]


def test_a_type_change_the_lake_cannot_see_is_said(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """ALTER ... TYPE to a type the lake holds the same way: Postgres rewrites the values
    (timestamptz(0) rounds them), which is never streamed. Said, with the way out; a longer
    varchar or a wider integer keeps every value and is not. (An identity column added: its
    numbers come from a rewrite too, and are said.)"""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, ts timestamptz, v varchar(5), "
                    "s smallint)")
        cur.execute(f"INSERT INTO {table} VALUES (1, '2024-01-01 00:00:00.7+00', 'a')")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (2, '2024-01-02 00:00:00+00', 'b')")
        cur.execute(f"ALTER TABLE {table} ALTER COLUMN ts TYPE timestamptz(0), "
                    "ALTER COLUMN v TYPE varchar(9), ALTER COLUMN s TYPE int")
        cur.execute(f"INSERT INTO {table} VALUES (3, '2024-01-03 00:00:00+00', 'c')")
        cur.execute(f"ALTER TABLE {table} ADD COLUMN n bigint GENERATED ALWAYS AS IDENTITY")
        cur.execute(f"INSERT INTO {table} (id) VALUES (4)")
    with caplog.at_level(logging.WARNING, logger="walberg"):
        run_once(config, spark)
    said = [r.getMessage() for r in caplog.records if "changed type in Postgres" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"column ts of {table}"), said
    assert "walberg resync" in said[0]
    assert any(r.getMessage().startswith(f"column n of {table} was added with a volatile "
                                         "default (or an identity)") for r in caplog.records)


def test_arrays_of_two_dimensions_added_and_renamed_while_streaming(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """An int[][] column added, then renamed, while walberg streams: its dimensions are the
    catalog's (asked again for a name the type map does not know), so it is a list of lists
    under both names, its values kept through the rename, none in the dead letters. (And
    `walberg verify` beside the running walberg: a table with no changes meanwhile is known
    to hold everything once the slot is confirmed past the source's read position.)"""
    table, quiet = f"public.{unique}", f"public.{unique}_quiet"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, a int[])")  # (int[] is known)
        cur.execute(f"INSERT INTO {table} VALUES (1, '{{1}}'), (2, '{{2}}')")
        cur.execute(f"CREATE TABLE {quiet} (id int PRIMARY KEY)")
        cur.execute(f"INSERT INTO {quiet} VALUES (1)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table, quiet])
    target = config.target_for(table)
    run_once(config, spark)
    pipeline = Pipeline(config, session=spark)
    try:
        with running(pipeline) as failures:
            with pg_conn.cursor() as cur:
                cur.execute(f"ALTER TABLE {table} ADD COLUMN q int[][]")
                cur.execute(f"UPDATE {table} SET q = '{{{{1,2}},{{3,4}}}}' WHERE id = 1")
            pipeline.wait_for(insert_lsn(pg_conn), timeout=60)
            with pg_conn.cursor() as cur:
                cur.execute(f"ALTER TABLE {table} RENAME COLUMN q TO q2")
                cur.execute(f"UPDATE {table} SET q2 = '{{{{5,6}},{{7,8}}}}' WHERE id = 2")
            pipeline.wait_for(insert_lsn(pg_conn), timeout=60)
            with Lake(config, session=spark) as lake:
                verdicts = verify(lake, wait_seconds=20)
            assert [(v.equal, v.note) for v in verdicts] == [(True, ""), (True, "")], verdicts
            assert not failures, failures
    finally:
        pipeline.close()
    schema = {f.name: str(f.field_type) for f in hadoop_table(warehouse, target).schema().fields}
    assert schema["q2"] == "list<list<int>>", schema
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_alter_table_before_the_slot_exists_is_in_the_copy(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """walberg describes its tables before it creates the slot; an ALTER TABLE (and changes)
    committed in between are in the slot's snapshot, and the stream, which starts after it,
    never mentions them: the copy takes the snapshot's columns, or the added column and its
    values would be missing from the lake."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, a int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 20) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    before_slot = PgReader._failover_wanted

    def alter_first(self: PgReader, conn: Any) -> bool:
        with pg_conn.cursor() as cur:
            cur.execute(f"ALTER TABLE {table} ADD COLUMN e int DEFAULT 7")
            cur.execute(f"ALTER TABLE {table} ADD COLUMN f text")
            cur.execute(f"UPDATE {table} SET f = 'f' || id WHERE id <= 5")
        return before_slot(self, conn)

    monkeypatch.setattr(PgReader, "_failover_wanted", alter_first)
    run_once(config, spark)
    monkeypatch.undo()
    target = config.target_for(table)
    schema = [f.name for f in hadoop_table(warehouse, target).schema().fields]
    assert schema == ["id", "a", "e", "f", "_walberg_lsn"]
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake)
    assert verdict.equal, verdict


def test_what_iceberg_cannot_follow_stops_with_the_way_out(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v bigint)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 1)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)

    # strict: any change stops.
    strict = config.model_copy(
        update={"sink": config.sink.model_copy(update={"schema_evolution": "strict"})})
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} ADD COLUMN w text")
        cur.execute(f"INSERT INTO {table} VALUES (2, 2, 'w')")
    with pytest.raises(Terminal, match=r"add column w string is not allowed by "
                                       r"sink.schema_evolution: strict"):
        run_once(strict, spark)
    run_once(config, spark)  # full (the default) follows
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)

    # A narrowing Iceberg cannot express: that table stops, named with the column and the way
    # out, while another table of the pipeline goes on; the slot waits for the stopped one.
    other = f"{table}_other"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {other} (id int PRIMARY KEY)")
    two = make_config(postgres, warehouse, tmp_path / "segments2", unique + "x", [table, other])
    run_once(two, spark)
    two_target = two.target_for(table)
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} ALTER COLUMN v TYPE int")
        cur.execute(f"INSERT INTO {table} VALUES (3, 3, 'x')")
        cur.execute(f"INSERT INTO {other} VALUES (1)")
    with pytest.raises(Terminal, match=rf"every other table applied.*column v changed from "
                                       rf"bigint to int.*DROP TABLE {two_target}"):
        run_once(two, spark)
    assert iceberg_rows(warehouse, two.target_for(other)) == [{"id": 1}]
    # The slot holds back the stopped table's change: it will be sent again. (Positions the
    # server reports having looked past while nothing was pending may be confirmed, so the
    # slot may well be past the ALTER itself; what matters is the change after it.)
    assert (3, 3) in resent_rows(pg_conn, two.source.postgres.slot,
                                 two.source.postgres.publication, table)
    spark.sql(f"DROP TABLE {two_target}")
    run_once(two, spark)
    assert iceberg_rows(warehouse, two_target) == postgres_rows(pg_conn, table)
    assert iceberg_rows(warehouse, two.target_for(other)) == postgres_rows(pg_conn, other)
    with pytest.raises(Terminal, match="column v changed from bigint to int"):
        run_once(config, spark)  # the first pipeline's copy of the table stops too
    spark.sql(f"DROP TABLE {target}")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)

    # ALTER amid a transaction's own changes: no commit separates old and new columns.
    with pg_conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(f"INSERT INTO {table} VALUES (4, 4, 'y')")
        cur.execute(f"ALTER TABLE {table} ADD COLUMN z int")
        cur.execute(f"INSERT INTO {table} VALUES (5, 5, 'z', 5)")
        cur.execute("COMMIT")
    with pytest.raises(Terminal, match="inside a transaction that changed rows"):
        run_once(config, spark)


def test_the_source_catalog_connection_is_kept_and_replaced_once_the_server_drops_it(
        pg_conn: Any, postgres: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """pgoutput describes busy tables again often; each description is checked against the
    source's catalog. The connection for it is kept between reads, in autocommit (no
    snapshot held), replaced when the server has dropped it (a restart, a failover: the read
    is made again on a new one), and closed with the tables."""
    from walberg.apply.types import TypeMap
    from walberg.runtime.tables import PgTables
    from walberg.source import postgres as pg

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    tables = PgTables(config, lambda: None, TypeMap())  # type: ignore[arg-type,return-value]

    def backend() -> int:
        return int(tables._catalog("a test", lambda conn: conn.get_backend_pid()))

    def sessions(pid: int) -> list[tuple[str, str]]:
        with pg_conn.cursor() as cur:
            cur.execute("SELECT state, coalesce(backend_xmin::text, '') FROM pg_stat_activity "
                        "WHERE pid = %s", (pid,))
            return cur.fetchall()

    first = backend()
    assert backend() == first, "kept between reads"
    assert sessions(first) == [("idle", "")], "idle, holding no snapshot"
    with pg_conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(%s)", (first,))
    deadline = time.monotonic() + 10
    while sessions(first) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The read on the dropped connection fails; it is made again on a new one.
    assert tables._catalog("a test", lambda conn: pg.column_numbers(conn, table)) == \
        {"id": 1, "v": 2}
    second = backend()
    assert second != first
    tables.close()
    deadline = time.monotonic() + 10
    while sessions(second) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sessions(second) == [], "closed with the tables"
