"""Large transactions streamed while in progress (pgoutput protocol 2): spilled to disk until
their commit, interleaved with small ones, a rolled-back subtransaction leaving no trace, and an
aborted streamed transaction leaving none either."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg2
import pytest

from conftest import as_file, insert_lsn, make_config, run_once, run_once_within, running
from lake import iceberg_rows, postgres_rows
from tcp_proxy import Proxy
from walberg.config import parse_config
from walberg.errors import ApplyError
from walberg.pipeline import Pipeline


def test_streamed_in_progress_transactions(pg_conn: Any, postgres: Any, spark: Any,
                                           warehouse: Path, tmp_path: Path,
                                           unique: str) -> None:
    table, small = f"public.{unique}", f"public.{unique}_small"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"CREATE TABLE {small} (id int PRIMARY KEY)")
        # Stream anything over 64 kB of decoded changes (the server's smallest setting).
        cur.execute("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
        cur.execute("SELECT pg_reload_conf()")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table, small])
    try:
        pipeline = Pipeline(config, session=spark)
        with running(pipeline) as failures:
            with pg_conn.cursor() as cur:
                cur.execute(f"INSERT INTO {small} VALUES (0)")
                pipeline.wait_for(insert_lsn(pg_conn), timeout=120)
            other = psycopg2.connect(postgres.dsn)
            other.autocommit = True
            with pg_conn.cursor() as cur, other.cursor() as side:
                cur.execute("BEGIN")
                cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g "
                            "FROM generate_series(1, 20000) g")
                side.execute(f"INSERT INTO {small} VALUES (1)")  # commits in between
                cur.execute(f"UPDATE {table} SET v = 'u' WHERE id % 4 = 0")
                cur.execute("SAVEPOINT s")
                cur.execute(f"INSERT INTO {table} SELECT g, 'gone' "
                            "FROM generate_series(100001, 105000) g")
                cur.execute("ROLLBACK TO SAVEPOINT s")
                side.execute(f"INSERT INTO {small} VALUES (2)")
                cur.execute(f"DELETE FROM {table} WHERE id <= 100")
                cur.execute("COMMIT")
                cur.execute("BEGIN")
                cur.execute(f"INSERT INTO {table} SELECT g, 'aborted' "
                            "FROM generate_series(200001, 220000) g")
                cur.execute("ROLLBACK")
                cur.execute(f"INSERT INTO {small} VALUES (3)")
                pipeline.wait_for(insert_lsn(pg_conn), timeout=180)
            other.close()
            assert not failures, failures
        with pg_conn.cursor() as cur:
            cur.execute("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s",
                        (config.source.postgres.slot,))
            assert cur.fetchone()[0] >= 1, "the server did not stream a transaction"
    finally:
        with pg_conn.cursor() as cur:
            cur.execute("ALTER SYSTEM RESET logical_decoding_work_mem")
            cur.execute("SELECT pg_reload_conf()")
    for t in (table, small):
        assert iceberg_rows(warehouse, config.target_for(t)) == postgres_rows(pg_conn, t)
    assert len(postgres_rows(pg_conn, table)) == 19900
    assert not list((config.segment_dir / "spill").glob("*.spill"))


def test_a_streamed_transaction_sent_again_after_a_failed_run_describes_its_table(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        immutable: Any) -> None:
    """A streamed transaction is in the segments, not applied (its commit failed); the next run
    is sent it again and drops it, but pgoutput counts the table as described by it, so the
    next change comes with no Relation message of its own: the table is still known when a
    later batch's segment holds that change (the run stopped, every time: "relation oid ...
    has not been described")."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} VALUES (0, 'before')")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["buffer"].update(max_segment_bytes=64 * 1024, max_batch_bytes=64 * 1024)
    config = parse_config(raw, tmp_path)
    target = config.target_for(table)
    run_once(config, spark)
    raw["sink"]["commit_max_attempts"] = 1
    failing = parse_config(raw, tmp_path)
    try:
        with pg_conn.cursor() as cur:
            cur.execute("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
            cur.execute("SELECT pg_reload_conf()")
            cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 5000) g")
        _, namespace, name = target.split(".")
        immutable(warehouse / namespace / name / "metadata")
        with pytest.raises(ApplyError, match="could not commit"):
            run_once(failing, spark)
        immutable.release()
        with pg_conn.cursor() as cur:
            cur.execute(f"UPDATE {table} SET v = 'after' WHERE id = 42")
        run_once(config, spark)
    finally:
        with pg_conn.cursor() as cur:
            cur.execute("ALTER SYSTEM RESET logical_decoding_work_mem")
            cur.execute("SELECT pg_reload_conf()")
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert len(postgres_rows(pg_conn, table)) == 5001


def test_a_transaction_larger_than_the_reader_holds_back_for_is_applied_whole(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Not streamed in progress (protocol 1, as before PostgreSQL 14): the server sends a
    transaction whole after its commit. One larger than the reader's hold-back (four batches'
    worth of segments pending) must still reach the lake, streaming and --once: a batch can
    only end at a commit, so a reader that stopped reading inside the transaction, or right
    after it with its commit in the active segment, would wait for a batch that cannot come.
    Over a slow link (as to a server on another machine) the reader finds the socket empty
    inside the transaction, and looks at its hold-back there."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} VALUES (0, 'first')")
    link = Proxy(postgres.port, pace=0.002)
    small = 64 * 1024  # the smallest segment and batch: the hold-back is 256 kB
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table],
                         max_segment_bytes=small, max_batch_bytes=small)
    config = config.model_copy(update={"source": config.source.model_copy(update={
        "postgres": config.postgres.model_copy(update={
            "stream_in_progress": False,
            "dsn": postgres.dsn.replace(f":{postgres.port}/", f":{link.port}/")})})})

    def large(first: int) -> None:  # about 2.5 MB of changes in one transaction
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} SELECT g, repeat('v', 80) || g "
                        f"FROM generate_series({first}, {first + 19999}) g")

    try:
        run_once(config, spark)
        pipeline = Pipeline(config, session=spark)
        with running(pipeline) as failures:
            large(1)  # (the last change: nothing after it seals its commit's segment)
            pipeline.wait_for(insert_lsn(pg_conn), timeout=120)
            assert not failures, failures
        large(20001)
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} VALUES (40001, 'after')")
        run_once_within(240, config, spark)
    finally:
        link.cut()
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)
