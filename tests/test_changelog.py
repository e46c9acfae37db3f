"""Append mode: a changelog table with one row per change, exactly once, alone or next to the
mirror (mode both)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg2
import pytest

from conftest import as_file, make_config, run_once
from lake import hadoop_table, iceberg_rows, postgres_rows
from walberg import faults
from walberg.config import parse_config
from walberg.errors import ApplyError
from walberg.lake.maintain import maintain
from walberg.lake.services import Lake
from walberg.model import Lsn
from walberg.pipeline import Pipeline


def _rows(warehouse: Path, target: str) -> list[dict[str, Any]]:
    rows = hadoop_table(warehouse, target).scan().to_arrow().to_pylist()
    return sorted(rows, key=lambda r: (r["_walberg_lsn"], r["_walberg_seq"] or 0, r["id"] or 0))


def test_changelog_next_to_the_mirror_and_alone(pg_conn: Any, postgres: Any, spark: Any,
                                                warehouse: Path, tmp_path: Path, unique: str,
                                                immutable: Any) -> None:
    both, alone = f"public.{unique}", f"public.{unique}_log"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {both} (id int PRIMARY KEY, v text, big text)")
        cur.execute(f"INSERT INTO {both} VALUES (1, 'a', (SELECT string_agg(md5(g::text), '') "
                    "FROM generate_series(1, 500) g)), (2, 'b', 'small')")  # 16 kB: TOASTed
        cur.execute(f"CREATE TABLE {alone} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {alone} VALUES (1, 'a')")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique,
                              [both, alone]))
    raw["sink"]["tables"] = {both: {"mode": "both"}, alone: {"mode": "append"}}
    config = parse_config(raw, tmp_path)
    mirror, changelog, log_only = (config.target_for(both), config.changelog_for(both),
                                   config.target_for(alone))
    assert changelog == mirror + "_changelog" and config.changelog_for(alone) == log_only

    run_once(config, spark)
    assert [(r["_walberg_op"], r["id"]) for r in _rows(warehouse, changelog)] == \
        [("snapshot", 1), ("snapshot", 2)]
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {both} VALUES (3, 'c', 'x')")
        cur.execute(f"UPDATE {both} SET v = 'a2' WHERE id = 1")  # big stays TOASTed, unsent
        cur.execute("BEGIN")
        cur.execute(f"UPDATE {both} SET id = 20 WHERE id = 2")  # key change
        cur.execute(f"DELETE FROM {both} WHERE id = 3")
        cur.execute(f"INSERT INTO {alone} VALUES (2, 'b')")
        cur.execute("COMMIT")
        cur.execute(f"TRUNCATE {alone}")
        cur.execute(f"INSERT INTO {alone} VALUES (3, 'c')")
    run_once(config, spark)

    rows = _rows(warehouse, changelog)
    assert [(r["_walberg_op"], r["id"], r["v"]) for r in rows] == [
        ("snapshot", 1, "a"), ("snapshot", 2, "b"),
        ("insert", 3, "c"), ("update", 1, "a2"),
        ("delete", 2, None), ("insert", 20, "b"), ("delete", 3, None),
    ]
    update = rows[3]
    assert update["big"] is None and update["_walberg_unchanged"] == "big"
    assert all(r["_walberg_xid"] and r["_walberg_commit_ts"] for r in rows[2:])
    key_change = [r for r in rows if r["id"] in (2, 20) and r["_walberg_op"] != "snapshot"]
    assert len({r["_walberg_xid"] for r in key_change + [rows[6]]}) == 1  # one transaction
    assert iceberg_rows(warehouse, mirror) == postgres_rows(pg_conn, both)
    assert [(r["_walberg_op"], r["id"]) for r in _rows(warehouse, log_only)] == [
        ("snapshot", 1), ("insert", 2), ("truncate", None), ("insert", 3)]
    # Each streamed commit names the first transaction it holds changes of (its commit LSN, as
    # the rows carry it), which `query --consistent` reads: the mirror's and both changelogs'.
    for target, rows_of in ((log_only, log_only), (changelog, changelog), (mirror, changelog)):
        first = Lsn(min(r["_walberg_lsn"] for r in _rows(warehouse, rows_of)
                        if r["_walberg_op"] != "snapshot"))
        said = [Lsn.parse(s) for s in (
            snap.summary.additional_properties.get("walberg.from-lsn")
            for snap in hadoop_table(warehouse, target).snapshots()) if s is not None]
        assert said and said[0] == first, (target, said, first)

    # The mirror's commit fails after the changelog's (its metadata directory made immutable):
    # the next run applies the batch again, and the changelog must not get its rows twice.
    raw["sink"]["commit_max_attempts"] = 1
    failing = parse_config(raw, tmp_path)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {both} SET v = 'again' WHERE id = 1")
        cur.execute(f"INSERT INTO {both} VALUES (4, 'd', 'd')")
    _, namespace, name = mirror.split(".")
    immutable(warehouse / namespace / name / "metadata")
    p = Pipeline(failing, session=spark)
    try:
        with pytest.raises(ApplyError, match="could not commit"):
            p.run(once=True)
    finally:
        p.close()
    assert len(_rows(warehouse, changelog)) == len(rows) + 2  # the changelog got its commit
    immutable.release()
    run_once(config, spark)
    assert [(r["_walberg_op"], r["id"], r["v"]) for r in _rows(warehouse, changelog)[len(rows):]] \
        == [("update", 1, "again"), ("insert", 4, "d")]
    assert iceberg_rows(warehouse, mirror) == postgres_rows(pg_conn, both)


def test_a_transaction_whose_commit_follows_the_batchs_last_is_in_the_changelog(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """A transaction open while a batch ends at another's commit, and committed right after it:
    its commit record begins where the batch's last ends (the position the changelog holds),
    and it is the next batch's, in the changelog too."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["sink"]["tables"] = {table: {"mode": "both"}}
    config = parse_config(raw, tmp_path)
    run_once(config, spark)
    other = psycopg2.connect(postgres.dsn)
    try:
        with other.cursor() as open_txn, pg_conn.cursor() as cur:
            open_txn.execute(f"INSERT INTO {table} VALUES (1)")  # (open: not in the next batch)
            cur.execute(f"INSERT INTO {table} VALUES (2)")
            run_once(config, spark)
            other.commit()
    finally:
        other.close()
    run_once(config, spark)
    assert [r["id"] for r in iceberg_rows(warehouse, config.target_for(table))] == [1, 2]
    assert [(r["_walberg_op"], r["id"]) for r in _rows(warehouse, config.changelog_for(table))] \
        == [("insert", 2), ("insert", 1)]


def test_changelog_append_whose_outcome_is_unknown_is_not_made_twice(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Mode both: the changelog's append lands but its commit answers with an error (Iceberg's
    CommitStateUnknownException, e.g. a catalog that timed out after taking it). The retry must
    read what the changelog holds again, not append the batch's rows a second time."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'a')")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["sink"]["tables"] = {table: {"mode": "both"}}
    config = parse_config(raw, tmp_path)
    mirror, changelog = config.target_for(table), config.changelog_for(table)

    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (2, 'b')")
        cur.execute(f"UPDATE {table} SET v = 'a2' WHERE id = 1")
    monkeypatch.setattr(faults, "_FAIL", ("changelog", 1))
    monkeypatch.setattr(faults, "_fails", {})
    run_once(config, spark)
    assert faults._FAIL is None  # the failure point was passed
    logged = [(r["_walberg_op"], r["id"], r["v"]) for r in _rows(warehouse, changelog)]
    assert logged == [("snapshot", 1, "a"), ("insert", 2, "b"), ("update", 1, "a2")]
    assert iceberg_rows(warehouse, mirror) == postgres_rows(pg_conn, table)

    # `walberg maintain` keeps the changelog beside the table too (a commit a batch).
    reports = maintain(Lake(config, session=spark))
    assert sorted(r.table for r in reports) == sorted([mirror, changelog])
    assert [(r["_walberg_op"], r["id"], r["v"]) for r in _rows(warehouse, changelog)] == logged
