"""The replication slot gone wrong: invalidated by the server (max_slot_wal_keep_size) or dropped
while walberg streams; `walberg resync` copies the tables again; `walberg slot` creates and
drops it."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from conftest import make_config, run_once, running, walberg_cli, write_pipeline
from lake import iceberg_rows, postgres_rows
from walberg.buffer.store import SegmentStore
from walberg.errors import SourceError, WalbergError
from walberg.lake.services import Lake
from walberg.ops import slot as slot_commands
from walberg.ops.resync import describe, plan, resync
from walberg.ops.status import status
from walberg.pipeline import Pipeline


def _wal_status(pg_conn: Any, slot: str) -> Any:
    with pg_conn.cursor() as cur:
        cur.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        row = cur.fetchone()
        return row[0] if row else None


def test_an_invalidated_slot_is_said_plainly_and_resync_recovers(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' FROM generate_series(1, 100) g")
        cur.execute(f"CREATE TABLE {unique}_noise (x text)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    slot = config.source.postgres.slot
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} SELECT g, 'lost?' FROM generate_series(101, 150) g")
        cur.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        cur.execute("SELECT pg_reload_conf()")
        try:
            # Past the limit, not yet removed: status warns before the slot is lost.
            cur.execute(f"INSERT INTO {unique}_noise SELECT repeat('n', 1000) "
                        "FROM generate_series(1, 2000)")
            cur.execute("SELECT pg_switch_wal()")
            with Lake(config, session=spark) as lake:
                [before] = status(lake)
            assert before.slot is not None and before.slot.warning, before.slot
            assert "about to be invalidated" in before.slot.warning
            for _ in range(20):  # WAL past the limit, then a checkpoint removes it
                cur.execute(f"INSERT INTO {unique}_noise SELECT repeat('n', 1000) "
                            "FROM generate_series(1, 2000)")
                cur.execute("SELECT pg_switch_wal()")
                cur.execute("CHECKPOINT")
                if _wal_status(pg_conn, slot) == "lost":
                    break
        finally:
            cur.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            cur.execute("SELECT pg_reload_conf()")
    assert _wal_status(pg_conn, slot) == "lost"

    with pytest.raises(WalbergError, match=r"invalidated by the server.*walberg resync"):
        run_once(config, spark)
    # What the old slot left in segment files goes with it (a file no run could read here).
    leftover = tmp_path / "segments" / f"{99:016d}.sealed"
    leftover.write_bytes(b"of the old slot")
    with Lake(config, session=spark) as lake:
        # The table named, the slot lost: every table is copied, and the question says so.
        chosen = plan(lake, [table])
        assert [tables for _, tables in chosen] == [None]
        assert "every table, after dropping replication slot" in describe(chosen)
        [report] = resync(lake, chosen).values()
    assert report.copied == {table: 150}
    assert not leftover.exists()
    assert _wal_status(pg_conn, slot) not in (None, "lost")
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)
    with pg_conn.cursor() as cur:  # and it streams on from the new slot
        cur.execute(f"UPDATE {table} SET v = 'after' WHERE id <= 10")
    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)


def test_resync_of_one_table_repairs_it(pg_conn: Any, postgres: Any, spark: Any,
                                        warehouse: Path, tmp_path: Path, unique: str) -> None:
    a, b = f"public.{unique}_a", f"public.{unique}_b"
    with pg_conn.cursor() as cur:
        for t in (a, b):
            cur.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
            cur.execute(f"INSERT INTO {t} SELECT g, 'v' FROM generate_series(1, 30) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [a, b])
    run_once(config, spark)
    spark.sql(f"DELETE FROM {config.target_for(a)} WHERE id <= 5")  # damage behind its back
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {a} VALUES (31, 'new')")
        cur.execute(f"INSERT INTO {b} VALUES (31, 'new')")
    with Lake(config, session=spark) as lake:
        [report] = resync(lake, plan(lake, [a])).values()
    assert report.copied == {a: 31}
    for t in (a, b):
        assert iceberg_rows(warehouse, config.target_for(t)) == postgres_rows(pg_conn, t)

    # Refused while a walberg holds the pipeline's segment directory, before the slot is
    # touched (dropping it would stop that walberg).
    slot = config.source.postgres.slot
    with SegmentStore(config.segment_dir, 1 << 20), Lake(config, session=spark) as lake:
        with pytest.raises(WalbergError, match=r"is in use by another walberg process"):
            resync(lake, plan(lake))
    assert _wal_status(pg_conn, slot) is not None
    # A slot of that name that is not walberg's (another plugin) is an error, never dropped.
    with pg_conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        cur.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (slot,))
    try:
        with Lake(config, session=spark) as lake:
            with pytest.raises(WalbergError, match=r"exists but is not a pgoutput slot"):
                resync(lake, plan(lake))
        with pg_conn.cursor() as cur:
            cur.execute("SELECT plugin FROM pg_replication_slots WHERE slot_name = %s", (slot,))
            assert cur.fetchone() == ("test_decoding",)
    finally:
        with pg_conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def test_a_slot_dropped_while_streaming_stops_walberg_with_the_way_out(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    slot = config.source.postgres.slot
    pipeline = Pipeline(config, session=spark)
    with running(pipeline) as failures:
        deadline = time.monotonic() + 60
        dropped = False
        with pg_conn.cursor() as cur:
            while not dropped and time.monotonic() < deadline:
                cur.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                            (slot,))
                row = cur.fetchone()
                if row and row[0]:
                    cur.execute("SELECT pg_terminate_backend(%s)", (row[0],))
                elif row:
                    try:
                        cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                        dropped = True
                    except Exception:  # taken again by the reconnect: try once more
                        pass
                time.sleep(0.05)
        assert dropped
        while not failures and time.monotonic() < deadline:
            time.sleep(0.1)
    assert failures and "dropped while walberg streamed" in str(failures[0])
    assert "walberg resync" in str(failures[0])


def test_slot_commands(pg_conn: Any, postgres: Any, spark: Any, warehouse: Path,
                       tmp_path: Path, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    path = tmp_path / "pipeline.yaml"
    write_pipeline(config, path)
    slot = config.source.postgres.slot

    done = walberg_cli("slot", "create", "-c", str(path))
    assert done.returncode == 0 and "created replication slot" in done.stdout, done.stderr
    assert _wal_status(pg_conn, slot) is not None
    done = walberg_cli("slot", "drop", "-c", str(path))  # not on a terminal, no --yes: refused
    assert done.returncode == 1 and "pass --yes" in done.stderr
    assert _wal_status(pg_conn, slot) is not None
    done = walberg_cli("slot", "drop", "-c", str(path), "--yes")
    assert done.returncode == 0 and f"dropped replication slot {slot}" in done.stdout
    assert _wal_status(pg_conn, slot) is None

    # Once the lake holds the table, a slot made by hand would miss what changed since the
    # lake's last commit: refused, pointing to resync.
    run_once(config, spark)
    done = walberg_cli("slot", "drop", "-c", str(path), "--yes")
    assert done.returncode == 0
    done = walberg_cli("slot", "create", "-c", str(path))
    assert done.returncode == 2 and "walberg resync" in done.stderr, done.stderr
    assert f"the lake holds 1 of this source's tables already ({table} up to LSN" in done.stderr
    assert _wal_status(pg_conn, slot) is None
    # A catalog read only through Spark (hive, glue, nessie) is read through Spark, as a run
    # reads it, and refused the same way (shown on this hadoop catalog, through its Spark path).
    monkeypatch.setattr(slot_commands, "READ_THROUGH_SPARK", ("hadoop",))
    with pytest.raises(SourceError, match="the lake holds 1 of this source's tables"):
        slot_commands.create_slot(config, session=spark)
    assert _wal_status(pg_conn, slot) is None


def test_a_slot_creation_held_up_by_a_transaction_says_which(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: Any) -> None:
    """The server creates a logical slot only once every transaction that wrote and was
    running when it began has ended: a session left idle in a transaction holds a first run
    up for as long as it stays. The run says which session, and how to end it, instead of
    seeming to hang."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"CREATE TABLE {table}_other (id int)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'a')")
    idle = psycopg2.connect(postgres.dsn, application_name="left-open")
    with idle.cursor() as cur:
        cur.execute(f"INSERT INTO {table}_other VALUES (1)")  # a transaction with a write, open
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    caplog.set_level(logging.WARNING, logger="walberg")
    outcome: list[Any] = []
    runner = threading.Thread(target=lambda: outcome.append(run_once(config, spark)), daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while not any("creating replication slot" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline and runner.is_alive(), "no word of the wait"
        time.sleep(0.2)
    said = next(r.getMessage() for r in caplog.records
                if "creating replication slot" in r.getMessage())
    assert f"slot_{unique}" in said and f"server process {idle.get_backend_pid()}" in said, said
    assert "application left-open" in said and "idle in transaction" in said, said
    assert "pg_terminate_backend" in said, said
    assert runner.is_alive()  # still held up
    idle.rollback()
    idle.close()
    runner.join(timeout=120)
    assert outcome and outcome[0].copied == {table: 1}, outcome
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)


def test_copies_owed_to_a_new_slot_are_made_after_a_kill_between_them(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """A slot dropped while walberg was down: the next run makes it anew and copies again
    every table the lake holds from before it (the new slot streams only what commits after
    it). Killed between two of those copies, the run leaves the second table with its old
    mark; the run after it finds the slot there, and without a word in the lake would take
    that table for one the slot serves, losing what changed in it while the slot was gone."""
    tables = [f"public.{unique}_a", f"public.{unique}_b"]
    with pg_conn.cursor() as cur:
        for t in tables:
            cur.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
            cur.execute(f"INSERT INTO {t} SELECT g, 'v' FROM generate_series(1, 100) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, tables)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"SELECT pg_drop_replication_slot('{config.source.postgres.slot}')")
        for t in tables:  # what no slot streams: only a copy brings it
            cur.execute(f"UPDATE {t} SET v = 'while the slot was gone' WHERE id <= 10")
    path = write_pipeline(config, tmp_path / "pipeline.yaml")
    killed = walberg_cli("-q", "run", "-c", str(path), "--once",
                         env=dict(os.environ, WALBERG_CRASH_AT="copy-files:2"))
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    run_once(config, spark)
    for t in tables:
        assert iceberg_rows(warehouse, config.target_for(t)) == postgres_rows(pg_conn, t), t
