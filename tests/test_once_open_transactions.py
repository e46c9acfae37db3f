"""`run --once` ends once the lake holds everything committed before it started, also while a
transaction is still open (streamed to walberg in progress) or prepared and undecided: neither
is committed. The slot keeps it; once it commits, the next run applies it exactly once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import psycopg2
import pytest

from conftest import make_config
from lake import iceberg_rows, postgres_rows
from walberg.config import Config
from walberg.pipeline import Pipeline


@pytest.fixture
def small_work_mem(pg_conn: Any) -> Iterator[None]:
    """Transactions over 64 kB of decoded changes are streamed while in progress."""
    with pg_conn.cursor() as cur:
        cur.execute("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'")
        cur.execute("SELECT pg_reload_conf()")
    try:
        yield
    finally:
        with pg_conn.cursor() as cur:
            cur.execute("ALTER SYSTEM RESET logical_decoding_work_mem")
            cur.execute("SELECT pg_reload_conf()")


def _once_within(config: Config, spark: Any, seconds: float = 120) -> None:
    """`run --once`, which must end by itself within ``seconds`` (else it is stopped and the
    test fails)."""
    pipeline = Pipeline(config, session=spark)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            pipeline.run(once=True)
        except BaseException as exc:
            failures.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(seconds)
    try:
        if runner.is_alive():
            pipeline.stop()
            runner.join(60)
            pytest.fail(f"run --once did not end within {seconds:.0f} s")
        assert not failures, failures
    finally:
        pipeline.close()


def _setup(pg_conn: Any, postgres: Any, warehouse: Path, tmp_path: Path,
           unique: str) -> tuple[str, Config]:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'copied')")
    return table, make_config(postgres, warehouse, tmp_path / "segments", unique, [table])


@pytest.mark.parametrize("streamed", [False, True], ids=["decoded-at-commit", "streamed"])
def test_once_ends_while_a_transaction_is_prepared(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str, streamed: bool, request: pytest.FixtureRequest) -> None:
    if streamed:
        request.getfixturevalue("small_work_mem")
    table, config = _setup(pg_conn, postgres, warehouse, tmp_path, unique)
    _once_within(config, spark)
    gid = f"{unique}_p1"
    preparer = psycopg2.connect(postgres.dsn)
    preparer.autocommit = True
    try:
        with preparer.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(f"INSERT INTO {table} SELECT g, 'prepared' "
                        "FROM generate_series(2, 20001) g")
            cur.execute(f"PREPARE TRANSACTION '{gid}'")
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} VALUES (-1, 'after')")
        _once_within(config, spark)
        assert [r["id"] for r in iceberg_rows(warehouse, config.target_for(table))] == [-1, 1]
        with pg_conn.cursor() as cur:
            cur.execute(f"COMMIT PREPARED '{gid}'")
    except BaseException:
        with pg_conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s", (gid,))
            if cur.fetchone():
                cur.execute(f"ROLLBACK PREPARED '{gid}'")
        raise
    finally:
        preparer.close()
    _once_within(config, spark)
    lake = iceberg_rows(warehouse, config.target_for(table))
    assert len(lake) == 20002 and lake == postgres_rows(pg_conn, table)


def test_once_ends_while_a_large_transaction_is_open(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str, small_work_mem: None) -> None:
    table, config = _setup(pg_conn, postgres, warehouse, tmp_path, unique)
    _once_within(config, spark)
    writer = psycopg2.connect(postgres.dsn)
    try:
        with writer.cursor() as cur:  # open, its changes streamed to walberg as they come
            cur.execute(f"INSERT INTO {table} SELECT g, 'p' FROM generate_series(2, 5000) g")
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} VALUES (-1, 'after')")
        _once_within(config, spark)
        assert [r["id"] for r in iceberg_rows(warehouse, config.target_for(table))] == [-1, 1]
        writer.commit()
    finally:
        writer.close()
    _once_within(config, spark)
    lake = iceberg_rows(warehouse, config.target_for(table))
    assert len(lake) == 5001 and lake == postgres_rows(pg_conn, table)
    # And one rolled back instead leaves nothing.
    writer = psycopg2.connect(postgres.dsn)
    try:
        with writer.cursor() as cur:
            cur.execute(f"INSERT INTO {table} SELECT g, 'gone' "
                        "FROM generate_series(10001, 15000) g")
        _once_within(config, spark)
        writer.rollback()
    finally:
        writer.close()
    _once_within(config, spark)
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)
