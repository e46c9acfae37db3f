"""`walberg resync` repairs a table that a schema change stopped (an ALTER TABLE inside a
transaction that changed the table's rows before it, or a change Iceberg cannot follow): the
Iceberg table takes the source's columns (evolved as streaming evolution would, or replaced when
no schema update expresses the change), the copy goes in, and the stream goes on from there."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import as_file, make_config, run_once, walberg_cli, walberg_ok, write_pipeline
from lake import hadoop_table, iceberg_rows, postgres_rows
from walberg.config import Config, parse_config
from walberg.errors import Terminal
from walberg.lake.services import Lake
from walberg.ops.resync import plan, resync
from walberg.ops.verify import verify


def _schema(warehouse: Path, target: str) -> list[tuple[str, str]]:
    return [(f.name, str(f.field_type)) for f in hadoop_table(warehouse, target).schema().fields
            if not f.name.startswith("_walberg_")]


def _equal(pg_conn: Any, warehouse: Path, table: str, target: str) -> list[Any]:
    """The lake's rows (PyIceberg) equal the source's; their keys."""
    lake = iceberg_rows(warehouse, target, key="a")
    assert lake == postgres_rows(pg_conn, table, key="a")
    return [r["a"] for r in lake]


def _stop_mid_transaction(pg_conn: Any, table: str, alter: str, after: str) -> None:
    """Rows changed, then the ALTER, then rows with the new columns: one transaction."""
    with pg_conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(f"INSERT INTO {table} VALUES (2, 'y')")
        cur.execute(alter)
        cur.execute(after)
        cur.execute("COMMIT")


def test_resync_repairs_a_table_an_alter_amid_its_changes_stopped(
        pg_conn: Any, postgres: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """The command line, end to end: stopped, resync, streaming on, verify; run in a folder
    the pipeline file does not name, which they leave empty."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (a int PRIMARY KEY, b text)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'x')")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    # (a codec the driver does not write: new rows of a row delta go through Spark's writer)
    raw = as_file(config)
    raw["sink"]["properties"] = {"write.parquet.compression-codec": "lz4"}
    path = write_pipeline(raw, tmp_path / "pipeline.yaml")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    walberg_ok("-q", "run", "--once", "-c", str(path), cwd=cwd)

    _stop_mid_transaction(pg_conn, table, f"ALTER TABLE {table} ADD c int",
                          f"INSERT INTO {table} VALUES (3, 'z', 3)")
    stopped = walberg_cli("-q", "run", "--once", "-c", str(path), cwd=cwd)
    assert stopped.returncode != 0, stopped.stdout[-2000:]
    said = " ".join(stopped.stderr.split())  # (wrapped to the terminal's width)
    assert "inside a transaction that changed rows" in said, said[-3000:]
    assert f"walberg resync -c <pipeline file> {table}" in said, said[-3000:]

    # verify on the stopped table: unequal, the column named, the way out said; no traceback.
    verified = walberg_cli("-q", "verify", "-c", str(path), "--table", table, cwd=cwd)
    told = " ".join((verified.stdout + verified.stderr).split())
    assert verified.returncode == 1 and "Traceback" not in told, told[-3000:]
    assert "columns differ" in told and "in the source only: c" in told, told[-3000:]
    assert "walberg resync" in told, told[-3000:]

    # A resync killed between its two commits (the Iceberg table took the new columns, the
    # copy is not in): the next plain run finishes it.
    killed = walberg_cli("-q", "resync", "--yes", "-c", str(path), table, cwd=cwd,
                         env={**os.environ, "WALBERG_CRASH_AT": "reshaped:1"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert _schema(warehouse, target) == [("a", "int"), ("b", "string"), ("c", "int")]
    walberg_ok("-q", "run", "--once", "-c", str(path), cwd=cwd)
    assert _schema(warehouse, target) == [("a", "int"), ("b", "string"), ("c", "int")]
    assert _equal(pg_conn, warehouse, table, target) == [1, 2, 3]

    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (4, 'w', 4)")
        cur.execute(f"UPDATE {table} SET c = 30 WHERE a = 3")
    walberg_ok("-q", "run", "--once", "-c", str(path), cwd=cwd)
    assert _equal(pg_conn, warehouse, table, target) == [1, 2, 3, 4]
    walberg_ok("-q", "verify", "-c", str(path), "--table", table, cwd=cwd)
    # Nothing of walberg's (nor Spark's ./spark-warehouse) in the folder the commands ran in.
    assert list(cwd.iterdir()) == []


# The change made amid the transaction's rows, a row after it in the same transaction, a
# later change that streams in after the resync, and the lake's columns after the resync.
CHANGES = {
    "drop": ("ALTER TABLE {t} DROP b", "INSERT INTO {t} VALUES (3)",
             "INSERT INTO {t} VALUES (4)", [("a", "int")]),
    # the key itself, which the apply by position reads
    "widen": ("ALTER TABLE {t} ALTER a TYPE bigint", "INSERT INTO {t} VALUES (3, 'z')",
              "INSERT INTO {t} VALUES (5000000000, 'w')", [("a", "long"), ("b", "string")]),
    "rename": ("ALTER TABLE {t} RENAME b TO d", "INSERT INTO {t} VALUES (3, 'z')",
               "UPDATE {t} SET d = 'renamed' WHERE a = 1", [("a", "int"), ("d", "string")]),
    # No schema update expresses this one: the table is replaced by one with the new columns.
    "retype": ("ALTER TABLE {t} ALTER b TYPE int USING length(b)",
               "INSERT INTO {t} VALUES (3, 7)", "UPDATE {t} SET b = 8 WHERE a = 1",
               [("a", "int"), ("b", "int")]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_resync_brings_the_lake_to_the_source_columns(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        change: str) -> None:
    table = f"public.{unique}"
    alter, after, later = (s.format(t=table) for s in CHANGES[change][:3])
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (a int PRIMARY KEY, b text)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'x')")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    _stop_mid_transaction(pg_conn, table, alter, after)
    with pytest.raises(Terminal, match="inside a transaction that changed rows"):
        run_once(config, spark)
    history = len(hadoop_table(warehouse, target).snapshots())

    with Lake(config, session=spark) as lake:
        [report] = resync(lake, plan(lake, [table])).values()
    assert report.copied == {table: 3}
    assert _schema(warehouse, target) == CHANGES[change][3]
    assert _equal(pg_conn, warehouse, table, target) == [1, 2, 3]
    # Evolved or replaced, the table's earlier snapshots stay for time travel.
    assert len(hadoop_table(warehouse, target).snapshots()) > history

    with pg_conn.cursor() as cur:
        cur.execute(later)
    run_once(config, spark)
    _equal(pg_conn, warehouse, table, target)
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake)
    assert verdict.equal, verdict


def _both(config: Config, table: str) -> Config:
    """The pipeline with the table in mode both: a changelog beside the mirror."""
    raw = as_file(config)
    raw["sink"]["tables"] = {table: {"mode": "both"}}
    return parse_config(raw, config.base_dir, "test config")


def test_resync_evolves_a_changelog_and_never_replaces_it(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (a int PRIMARY KEY, b text)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'x')")
    config = _both(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]),
                   table)
    target, changelog = config.target_for(table), config.changelog_for(table)
    run_once(config, spark)

    # An added column: both tables take it, the changelog keeps its past rows.
    _stop_mid_transaction(pg_conn, table, f"ALTER TABLE {table} ADD c int",
                          f"INSERT INTO {table} VALUES (3, 'z', 3)")
    with pytest.raises(Terminal, match="inside a transaction that changed rows"):
        run_once(config, spark)
    with Lake(config, session=spark) as lake:
        resync(lake, plan(lake, [table]))
    assert _schema(warehouse, target) == _schema(warehouse, changelog) == \
        [("a", "int"), ("b", "string"), ("c", "int")]
    assert _equal(pg_conn, warehouse, table, target) == [1, 2, 3]
    assert len(iceberg_rows(warehouse, changelog, key="a")) >= 3

    # A change no schema update expresses: the changelog's history is not thrown away.
    with pg_conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(f"INSERT INTO {table} VALUES (4, 'w', 4)")
        cur.execute(f"ALTER TABLE {table} ALTER b TYPE int USING length(b)")
        cur.execute(f"INSERT INTO {table} VALUES (5, 5, 5)")
        cur.execute("COMMIT")
    with pytest.raises(Terminal, match="inside a transaction that changed rows"):
        run_once(config, spark)
    with Lake(config, session=spark) as lake, \
            pytest.raises(Terminal, match=rf"walberg does not replace its changelog.*"
                                          rf"DROP TABLE {changelog}"):
        resync(lake, plan(lake, [table]))
    assert ("b", "string") in _schema(warehouse, changelog)
    spark.sql(f"DROP TABLE {changelog}")  # the operator's choice
    with Lake(config, session=spark) as lake:
        resync(lake, plan(lake, [table]))
    assert _equal(pg_conn, warehouse, table, target) == [1, 2, 3, 4, 5]
    assert ("b", "int") in _schema(warehouse, changelog)
