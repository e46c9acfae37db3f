"""Faults of the lake side: a warehouse that cannot be written for a while (the commit is
retried with backoff), and for too long (walberg stops with a clear error, and a later run
resumes). The fault is real: the table's metadata directory is made immutable (chattr +i),
which stops even root from writing there."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from conftest import insert_lsn, make_config, running
from lake import iceberg_rows, postgres_rows
from walberg.errors import ApplyError
from walberg.pipeline import Pipeline


def _retries(source: str) -> float:
    return REGISTRY.get_sample_value("walberg_commit_retries_total", {"table": source}) or 0.0


def _setup(pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
           unique: str, **sink: Any) -> tuple[str, str, Any]:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 100) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    if sink:
        config = config.model_copy(update={"sink": config.sink.model_copy(update=sink)})
    pipeline = Pipeline(config, session=spark)
    try:
        pipeline.run(once=True)
    finally:
        pipeline.close()
    return table, config.target_for(table), config


def _metadata_dir(warehouse: Path, target: str) -> Path:
    _, namespace, name = target.split(".")
    return warehouse / namespace / name / "metadata"


def test_a_commit_is_retried_until_the_warehouse_is_writable_again(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        immutable: Any) -> None:
    table, target, config = _setup(pg_conn, postgres, spark, warehouse, tmp_path, unique)
    before = _retries(table)
    immutable(_metadata_dir(warehouse, target))
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'new' WHERE id <= 10")
        cur.execute(f"DELETE FROM {table} WHERE id > 90")
        lsn = insert_lsn(pg_conn)
    pipeline = Pipeline(config, session=spark)
    try:
        with running(pipeline) as failures:
            deadline = time.monotonic() + 60
            while _retries(table) < before + 2 and time.monotonic() < deadline and not failures:
                time.sleep(0.1)
            assert _retries(table) >= before + 2, failures
            assert pipeline.applied_lsn < lsn  # nothing is marked applied meanwhile
            immutable.release()
            pipeline.wait_for(lsn, timeout=90)
        assert not failures, failures
    finally:
        pipeline.close()
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_a_commit_that_keeps_failing_stops_with_a_clear_error_and_nothing_is_lost(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        immutable: Any) -> None:
    table, target, config = _setup(pg_conn, postgres, spark, warehouse, tmp_path, unique,
                                   commit_max_attempts=3)
    immutable(_metadata_dir(warehouse, target))
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (101, 'x')")
        cur.execute(f"UPDATE {table} SET v = 'y' WHERE id = 1")
    pipeline = Pipeline(config, session=spark)
    try:
        with pytest.raises(ApplyError, match=rf"could not commit {table}'s changes up to LSN "
                                             rf".* after 3 attempt\(s\).*resumes there"):
            pipeline.run(once=True)
    finally:
        pipeline.close()
    immutable.release()
    pipeline = Pipeline(config, session=spark)
    try:
        pipeline.run(once=True)
    finally:
        pipeline.close()
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_an_unwritable_segment_directory_stops_walberg_cleanly_and_it_resumes(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        immutable: Any) -> None:
    table, target, config = _setup(pg_conn, postgres, spark, warehouse, tmp_path, unique)
    pipeline = Pipeline(config, session=spark)
    try:
        with running(pipeline) as failures:
            with pg_conn.cursor() as cur:
                cur.execute(f"INSERT INTO {table} VALUES (101, 'a')")
                pipeline.wait_for(insert_lsn(pg_conn), timeout=60)
            immutable(config.segment_dir)  # no file can be created, renamed or removed there
            with pg_conn.cursor() as cur:
                cur.execute(f"INSERT INTO {table} SELECT g, 'b' FROM generate_series(102, 200) g")
            deadline = time.monotonic() + 60
            while not failures and time.monotonic() < deadline:
                time.sleep(0.1)
        assert failures, "walberg kept running on a segment directory it cannot write"
        message = str(failures[0])
        assert f"segment directory {config.segment_dir}" in message
        assert "Operation not permitted" in message and "restart walberg" in message
    finally:
        pipeline.close()
    immutable.release()
    pipeline = Pipeline(config, session=spark)
    try:
        pipeline.run(once=True)
    finally:
        pipeline.close()
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_postgres_restarts_and_crashes_while_streaming(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    import psycopg2

    table, target, config = _setup(pg_conn, postgres, spark, warehouse, tmp_path, unique)
    pipeline = Pipeline(config, session=spark)
    try:
        with running(pipeline) as failures:
            # Streaming first: a source never reached at start is refused at once, by design.
            with pg_conn.cursor() as cur:
                cur.execute(f"INSERT INTO {table} VALUES (999, 'first')")
                pipeline.wait_for(insert_lsn(pg_conn), timeout=120)
            for round_, mode in enumerate(("fast", "immediate")):
                conn = psycopg2.connect(postgres.dsn)
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute(f"INSERT INTO {table} SELECT g, '{mode}' FROM generate_series("
                                f"{1000 * (round_ + 1)}, {1000 * (round_ + 1) + 99}) g")
                conn.close()
                postgres.restart(mode)  # immediate: a crash, with recovery on start
                conn = psycopg2.connect(postgres.dsn)
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute(f"UPDATE {table} SET v = 'after {mode}' WHERE id % 3 = 0")
                    lsn = insert_lsn(conn)
                conn.close()
                pipeline.wait_for(lsn, timeout=120)
            assert not failures, failures
    finally:
        pipeline.close()
    assert "reconnecting" in caplog.text
    conn = psycopg2.connect(postgres.dsn)
    try:
        assert iceberg_rows(warehouse, target) == postgres_rows(conn, table)
    finally:
        conn.close()


def test_which_java_failures_are_worth_a_retry(spark: Any) -> None:
    """The classification behind the commit retry, on real Java exceptions: storage and
    catalog trouble and lost races are retried; errors in the data or the statement are not."""
    from walberg.apply.jvm.calls import _transient

    jvm = spark._jvm
    gateway = spark.sparkContext._gateway
    no_args = gateway.new_array(jvm.java.lang.Object, 0)

    def wrapped(java_exc: Any) -> Exception:
        exc = Exception("from Spark")
        exc.java_exception = java_exc  # type: ignore[attr-defined]
        return exc

    iceberg = jvm.org.apache.iceberg.exceptions
    retry = [
        iceberg.CommitFailedException("Version 7 already exists", no_args),
        iceberg.ValidationException("Found conflicting files that can contain records "
                                    "matching true", no_args),
        iceberg.ValidationException("Cannot commit, missing data files", no_args),
        jvm.java.lang.RuntimeException("wrapped", jvm.java.io.IOException("disk went away")),
        jvm.java.nio.file.AccessDeniedException("/warehouse/t/metadata/v9.metadata.json"),
    ]
    keep = [
        iceberg.ValidationException("Cannot change column type: id: int -> string", no_args),
        jvm.java.lang.IllegalArgumentException("bad value"),
        jvm.java.lang.ArithmeticException("overflow"),
    ]
    assert [_transient(wrapped(e)) for e in retry] == [True] * len(retry)
    assert [_transient(wrapped(e)) for e in keep] == [False] * len(keep)


def test_a_schema_change_applied_while_postgres_restarts(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """An ADD COLUMN with a default, an insert, and the server stopped right after: applying the
    schema change opens a connection of its own (for the default the old rows get), which waits
    for the server like the stream does, instead of failing the run."""
    import psycopg2

    table, target, config = _setup(pg_conn, postgres, spark, warehouse, tmp_path, unique)
    pipeline = Pipeline(config, session=spark)
    try:
        with running(pipeline) as failures:
            with pg_conn.cursor() as cur:
                cur.execute(f"INSERT INTO {table} VALUES (999, 'first')")
                pipeline.wait_for(insert_lsn(pg_conn), timeout=120)
                cur.execute(f"ALTER TABLE {table} ADD COLUMN c text DEFAULT 'x'")
                cur.execute(f"INSERT INTO {table} VALUES (1000, 'after', 'y')")
            postgres._run(str(postgres.bin_dir / "pg_ctl"), "-D", str(postgres.data_dir), "-m",
                          "fast", "-w", "stop")
            time.sleep(8)
            assert not failures, failures
            postgres.start()
            conn = psycopg2.connect(postgres.dsn)
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"UPDATE {table} SET c = 'z' WHERE id <= 5")
            lsn = insert_lsn(conn)
            conn.close()
            pipeline.wait_for(lsn, timeout=120)
            assert not failures, failures
    finally:
        pipeline.close()
    conn = psycopg2.connect(postgres.dsn)
    try:
        assert iceberg_rows(warehouse, target) == postgres_rows(conn, table)
    finally:
        conn.close()
