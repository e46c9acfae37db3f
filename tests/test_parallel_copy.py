"""The parallel initial copy (source.postgres.initial_copy.method: jdbc): Spark reads the table
over JDBC in chunks inside the slot's exported snapshot; a copy cut short resumes with the chunks
it had not committed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import as_file, make_config, run_once, walberg_cli, write_pipeline, writing
from lake import hadoop_table, iceberg_rows, postgres_rows
from walberg.apply.session import java_table
from walberg.config import Config, parse_config
from walberg.lake.maintain import maintain
from walberg.lake.services import Lake
from walberg.source.chunks import (
    Span,
    covered,
    jdbc_target,
    plan_chunks,
    remaining,
    session_init,
)

COPY_MARK = "walberg.copy.span"
BIG = "(SELECT string_agg(md5(g::text || {seed}), '') FROM generate_series(1, 400) g)"
# (old key, new key), in order, of rows whose TOASTed note stays as it was while their key
# changes, in a copy cut short after keys 1..3000: from keys not yet copied and from copied
# ones, to keys beyond both, to keys not yet copied, to copied keys (freed before) and below
# every key.
TOAST_MOVES = ((5000, 8600), (500, 5000), (6100, 8700), (6000, 6100), (1500, 8800),
               (7000, 1500), (7100, -20), (600, -30))


def _covers(spans: list[Span], point: int) -> int:
    return sum(1 for s in spans if (s.lo is None or s.lo <= point) and (s.hi is None or point < s.hi))


@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(1, 30)), max_size=6),
       st.integers(-60, 0), st.integers(0, 60), st.integers(1, 500), st.integers(1, 4))
def test_chunks_cover_every_key_not_yet_copied_exactly_once(
        done_raw: list[tuple[int, int]], first: int, last: int, rows: int, parts: int) -> None:
    done = [Span("key", lo, lo + width) for lo, width in done_raw]
    plan = plan_chunks((first, last), rows, 100, parts, "key", remaining(done))
    pieces = [p for chunk in plan for p in chunk.parts]
    for point in range(-200, 200):
        copied = _covers(done, point) > 0
        assert _covers(covered(done), point) == copied, point  # merged, as a resume reads it
        # Every key is read by exactly one reader, unless an earlier chunk holds it already.
        assert _covers(pieces, point) == (0 if copied else 1), point
        assert _covers([c.span for c in plan], point) == (0 if copied else 1), point
    for chunk in plan:
        assert _covers(list(chunk.parts), chunk.span.lo if chunk.span.lo is not None else -999) \
            == _covers([chunk.span], chunk.span.lo if chunk.span.lo is not None else -999)


def test_jdbc_settings_come_from_the_dsn() -> None:
    url, props = jdbc_target("postgresql://app:s3cret@db.example:6543/sales?sslmode=verify-full")
    assert url == "jdbc:postgresql://db.example:6543/sales"
    assert props["user"] == "app" and props["password"] == "s3cret"
    assert props["sslmode"] == "verify-full"
    init = session_init("00000003-00000002-1")
    assert init.endswith("SET TRANSACTION SNAPSHOT '00000003-00000002-1'")
    assert "SET TimeZone = 'UTC'" in init


def _jdbc_config(postgres: Any, warehouse: Path, tmp_path: Path, name: str, table: str,
                 **copy: Any) -> Config:
    base = make_config(postgres, warehouse, tmp_path / "segments", name, [table])
    raw = as_file(base)
    raw["source"]["postgres"]["initial_copy"] = {"method": "jdbc", "chunk_rows": 1000,
                                                 "parallelism": 2, **copy}
    return parse_config(raw, tmp_path, "test config")


def _copy_marks(spark: Any, target: str) -> list[dict[str, str]]:
    rows = spark.sql(f"SELECT summary FROM {target}.snapshots ORDER BY committed_at").collect()
    return [dict(r["summary"]) for r in rows if COPY_MARK in r["summary"]]


def test_parallel_copy_stays_consistent_with_the_stream_under_writes(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, v int, amount numeric(8,2), "
                    "at timestamptz, note text, raw bytea)")
        cur.execute(f"INSERT INTO {table} SELECT g, 0, g / 100.0, "
                    "'2024-03-01 12:00:00+00'::timestamptz + g * interval '1 minute', "
                    f"'row ' || g, int4send(g) FROM generate_series(1, 6000) g")
        cur.execute(f"UPDATE {table} SET amount = 'NaN' WHERE id = 4321")  # no decimal holds it
        cur.execute(f"ANALYZE {table}")
    config = _jdbc_config(postgres, warehouse, tmp_path, unique, table)
    target = config.target_for(table)

    def step(cur: Any, i: int) -> None:
        cur.execute(f"INSERT INTO {table} VALUES ({10000 + i}, 1, 1.5, now(), 'new', '\\x00')")
        cur.execute(f"UPDATE {table} SET v = v + 1 WHERE id = {(i * 7) % 6000 + 1}")
        cur.execute(f"DELETE FROM {table} WHERE id = {(i * 13) % 6000 + 1}")

    with writing(postgres, step, pause=0.005):
        report = run_once(config, spark)  # copies while the writer writes, and streams
    run_once(config, spark)  # the rest of what the writer did
    assert report.copied[table] > 0

    marks = _copy_marks(spark, target)
    assert len(marks) == 6  # 6,000 rows in chunks of about 1,000: one commit each
    assert [m.get("walberg.copy.first") for m in marks] == ["true"] + [None] * 5
    assert [("walberg.lsn" in m) for m in marks] == [False] * 5 + [True]

    source = postgres_rows(pg_conn, table)
    lake = iceberg_rows(warehouse, target)
    nan_row = [r for r in source if r["id"] == 4321]
    if nan_row:  # the writer may have deleted it; else it is only in the dead-letter table
        source.remove(nan_row[0])
        dlq = spark.sql(f"SELECT amount, _dlq_reason FROM {target}__dlq").collect()
        assert [r["amount"] for r in dlq] == ["NaN"]
        assert "does not fit decimal(8,2)" in dlq[0]["_dlq_reason"]
    assert lake == source


def _eight_chunks(pg_conn: Any, postgres: Any, warehouse: Path, tmp_path: Path,
                  unique: str) -> tuple[str, Config, Path]:
    """A table of 8,000 rows copied by jdbc in chunks of 1,000: the table, its config and
    pipeline file."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int, note text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 0, 'x' FROM generate_series(1, 8000) g")
        cur.execute(f"ANALYZE {table}")
    config = _jdbc_config(postgres, warehouse, tmp_path, unique, table)
    return table, config, write_pipeline(config, tmp_path / "pipeline.yaml")


@pytest.mark.parametrize("expired", ["", "first-chunk", "resumed"],
                         ids=["resumed", "first-chunk-expired", "expired-after-resume"])
def test_an_interrupted_parallel_copy_resumes_with_the_chunks_it_had_not_committed(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str, expired: str) -> None:
    """``expired``: a maintenance expired the first chunk's snapshot before the next run. Its
    spans are then unknown: the copy starts anew (resumed with the chunks still in the
    history, it appended the expired chunks' rows a second time). Or (``resumed``) it
    expired every snapshot of the copy after the resume, before the stream applied a change
    (the catch-up mark an older walberg kept in them was lost, and the stream appended the
    inserts of the interruption a second time)."""
    table, config, path = _eight_chunks(pg_conn, postgres, warehouse, tmp_path, unique)
    target = config.target_for(table)
    with pg_conn.cursor() as cur:
        for old, _ in TOAST_MOVES:
            cur.execute(f"UPDATE {table} SET note = {BIG.format(seed=old)} WHERE id = {old}")

    # kill -9 right after the third chunk's commit.
    env = dict(os.environ, WALBERG_CRASH_AT="chunk:3", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "walberg.cli", "-q", "run", "-c", str(path),
                           "--once"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(_copy_marks(spark, target)) == 3
    if expired == "resumed":
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} SELECT g, 2, 'late' "
                        "FROM generate_series(8001, 8500) g")
            cur.execute(f"INSERT INTO {table} VALUES (-5, 3, 'below')")
        killed = walberg_cli("-q", "run", "-c", str(path), "--once",
                             env=dict(os.environ, WALBERG_CRASH_AT="copied",
                                      PYTHONUNBUFFERED="1"))
        assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
        raw = as_file(config)
        raw["maintenance"] = {"snapshot_retention": "0s", "retain_last": 1}
        with Lake(parse_config(raw, tmp_path, "test config"), session=spark) as lake:
            maintain(lake)
        assert not any(COPY_MARK in s.summary.additional_properties
                       for s in hadoop_table(warehouse, target).snapshots())
        run_once(config, spark)
        assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
        return
    if expired:
        first = spark.sql(f"SELECT snapshot_id FROM {target}.snapshots "
                          "ORDER BY committed_at LIMIT 1").collect()[0][0]
        java_table(spark, target).expireSnapshots().expireSnapshotId(first) \
            .cleanExpiredFiles(False).commit()
        assert len(_copy_marks(spark, target)) == 2
        run_once(config, spark)
        marks = _copy_marks(spark, target)
        assert [m.get("walberg.copy.first") for m in marks].count("true") == 1
        assert "walberg.copy.catchup" not in marks[-1]  # a copy of its own, not a resume
        assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
        return

    # Meanwhile the source changes, in copied and in not yet copied ranges, and beyond both.
    with pg_conn.cursor() as cur:
        # Keys of rows with a TOASTed value move, the value left unsent: from a copied range
        # to a range not yet copied, within the ranges not yet copied, from there into a
        # copied range, and beyond both.
        for old, new in TOAST_MOVES:
            cur.execute(f"UPDATE {table} SET id = {new} WHERE id = {old}")
        cur.execute(f"UPDATE {table} SET v = 1 WHERE id % 10 = 0")  # both sides
        cur.execute(f"INSERT INTO {table} SELECT g, 2, 'late' FROM generate_series(8001, 8500) g")
        cur.execute(f"DELETE FROM {table} WHERE id % 7 = 0")
        cur.execute(f"INSERT INTO {table} VALUES (-5, 3, 'below')")

    run_once(config, spark)
    marks = _copy_marks(spark, target)
    assert [m.get("walberg.copy.first") for m in marks].count("true") == 1
    assert len(marks) > 3
    spans = [Span.decode(m[COPY_MARK]) for m in marks]
    for point in (-5, 1, 2500, 7999, 8400, 99999):
        assert _covers(spans, point) == 1  # each key range was copied once, none twice
    # The spans committed before were brought to the resume's snapshot: no catch-up to pass.
    assert "walberg.copy.catchup" not in marks[-1]
    assert len({m["walberg.copy.point"] for m in marks}) == 1
    lake = iceberg_rows(warehouse, target)
    moved = {new for _, new in TOAST_MOVES}
    assert [(r["id"], len(r["note"] or "")) for r in lake if r["id"] in moved] == \
        [(new, 12800) for new in sorted(moved)]
    assert lake == postgres_rows(pg_conn, table)

    # The stream replays from the copy's start: more changes after the resume land too.
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (9001, 4, 'after')")
        cur.execute(f"UPDATE {table} SET note = 'changed' WHERE id = 8001")
    run_once(config, spark)
    lake = iceberg_rows(warehouse, target)
    assert lake == postgres_rows(pg_conn, table)


@pytest.mark.parametrize("dsn", ["host=/var/run/postgresql dbname=app"])
def test_a_socket_dsn_is_refused_for_jdbc_with_the_fix(dsn: str) -> None:
    from walberg.errors import ConfigError

    with pytest.raises(ConfigError, match="give the server's host name"):
        jdbc_target(dsn)


def test_a_resync_of_a_table_cut_short_is_made_again_by_the_next_run(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """`walberg resync <table>` killed after the first chunk of its copy: that chunk replaced
    the table's rows, and the table's last LSN mark is still the one before the resync. The
    next run must copy it again, not take it for a table that holds everything up to that
    mark (it held one chunk of 8)."""
    table, config, path = _eight_chunks(pg_conn, postgres, warehouse, tmp_path, unique)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 1 WHERE id % 10 = 0")
    killed = walberg_cli("-q", "resync", "-c", str(path), table, "--yes",
                         env=dict(os.environ, WALBERG_CRASH_AT="chunk:1", PYTHONUNBUFFERED="1"))
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)
