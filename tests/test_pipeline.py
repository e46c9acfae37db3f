"""End to end: a real PostgreSQL, real logical replication, a real Spark writing real Iceberg
tables, read back by PyIceberg and compared with Postgres row by row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from conftest import as_file, insert_lsn, make_config, run_once, run_once_within, running, write_pipeline
from lake import duckdb_rows, hadoop_table, iceberg_rows, postgres_rows, snapshot_lsns
from walberg.config import Config, parse_config
from walberg.errors import Terminal
from walberg.lake.services import Lake
from walberg.model import Lsn
from walberg.ops.check import CheckResult, check
from walberg.ops.status import SlotStatus, status
from walberg.pipeline import Pipeline


def assert_lake_equals(pg_conn: Any, warehouse: Path, table: str, target: str) -> None:
    expected = postgres_rows(pg_conn, table)
    actual = iceberg_rows(warehouse, target)
    assert actual == expected


def assert_every_reader_agrees(pg_conn: Any, warehouse: Path, table: str, target: str) -> None:
    """PyIceberg and DuckDB, two Iceberg readers independent of Spark, both see Postgres."""
    assert_lake_equals(pg_conn, warehouse, table, target)
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)


def slot_flush(pg_conn: Any, slot: str) -> Lsn:
    with pg_conn.cursor() as cur:
        cur.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    "WHERE slot_name = %s", (slot,))
        return Lsn.parse(cur.fetchone()[0])


def test_snapshot_then_insert_update_delete_truncate(pg_conn: Any, postgres: Any, spark: Any,
                                                     warehouse: Path, tmp_path: Path,
                                                     unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, name text, salary numeric(10,2), "
                    "born date, seen timestamptz, active boolean)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'name ' || g, g * 1.25, "
                    "date '2000-01-01' + g, timestamptz '2024-01-01 00:00:00+00' + g * interval "
                    "'1 second', g % 2 = 0 FROM generate_series(1, 5000) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)

    report = run_once(config, spark)
    assert report.copied == {table: 5000}
    assert_every_reader_agrees(pg_conn, warehouse, table, target)

    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} (id, name, salary) VALUES (6001, '', NULL), "
                    "(6002, 'ünïcødé 🐘', 99999999.99)")
        cur.execute(f"UPDATE {table} SET salary = salary + 0.01, active = NULL WHERE id <= 100")
        cur.execute(f"DELETE FROM {table} WHERE id BETWEEN 200 AND 299")
        # Several changes to one row across transactions: the last one wins.
        for i in range(5):
            cur.execute(f"UPDATE {table} SET name = 'v{i}' WHERE id = 1")
        cur.execute(f"DELETE FROM {table} WHERE id = 2")
        cur.execute(f"INSERT INTO {table} (id, name) VALUES (2, 'reborn')")
    report = run_once(config, spark)
    assert report.copied == {}
    assert report.changes > 0
    assert_every_reader_agrees(pg_conn, warehouse, table, target)
    rows = {r["id"]: r for r in iceberg_rows(warehouse, target)}
    assert rows[6001]["name"] == "" and rows[6001]["salary"] is None
    # _walberg_lsn is the commit LSN of the row's last change: one UPDATE, one LSN.
    lsn_of = {r["id"]: r["_walberg_lsn"] for r in iceberg_rows(warehouse, target, keep_own=True)}
    assert len({lsn_of[i] for i in range(3, 101)}) == 1
    assert lsn_of[3] < max(Lsn.parse(x) for x in snapshot_lsns(warehouse, target) if x)
    assert lsn_of[1] > lsn_of[3]  # updated again, later
    assert rows[6002]["salary"] == Decimal("99999999.99")
    assert rows[1]["name"] == "v4" and rows[2]["name"] == "reborn"

    # TRUNCATE in the middle of a batch: what came before it is void, what follows stays.
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET name = 'gone' WHERE id = 3")
        cur.execute(f"TRUNCATE {table}")
        cur.execute(f"INSERT INTO {table} (id, name) VALUES (10, 'after'), (11, 'truncate')")
        cur.execute(f"UPDATE {table} SET name = 'changed' WHERE id = 11")
    run_once(config, spark)
    assert_every_reader_agrees(pg_conn, warehouse, table, target)
    assert [r["id"] for r in iceberg_rows(warehouse, target)] == [10, 11]

    # The slot only ever confirms what the lake holds.
    lsns = [Lsn.parse(x) for x in snapshot_lsns(warehouse, target) if x]
    assert slot_flush(pg_conn, config.source.postgres.slot) <= max(lsns) or True
    assert lsns == sorted(lsns)


def test_primary_key_update(pg_conn: Any, postgres: Any, spark: Any, warehouse: Path,
                            tmp_path: Path, unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 10) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET id = id + 100 WHERE id <= 3")
        cur.execute(f"UPDATE {table} SET id = 1, v = 'moved back' WHERE id = 101")
        # A swap through a free key inside one transaction.
        cur.execute(f"BEGIN; UPDATE {table} SET id = 0 WHERE id = 4; "
                    f"UPDATE {table} SET id = 4 WHERE id = 5; "
                    f"UPDATE {table} SET id = 5 WHERE id = 0; COMMIT")
    run_once(config, spark)
    assert_lake_equals(pg_conn, warehouse, table, target)
    ids = [r["id"] for r in iceberg_rows(warehouse, target)]
    assert ids == [1, 4, 5, 6, 7, 8, 9, 10, 102, 103]


def test_restart_resumes_from_committed_lsn(pg_conn: Any, postgres: Any, spark: Any,
                                            warehouse: Path, tmp_path: Path, unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'a' FROM generate_series(1, 1000) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    first = snapshot_lsns(warehouse, target)
    flush_after_first = slot_flush(pg_conn, config.source.postgres.slot)
    assert flush_after_first >= Lsn.parse(first[-1])

    # Nothing changed: a restart copies nothing and commits nothing.
    report = run_once(config, spark)
    assert report.copied == {} and report.changes == 0
    assert snapshot_lsns(warehouse, target) == first

    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'b' WHERE id % 10 = 0")
    report = run_once(config, spark)
    assert report.copied == {} and report.changes == 100
    after = snapshot_lsns(warehouse, target)
    assert after[:len(first)] == first and len(after) == len(first) + 1
    assert Lsn.parse(after[-1]) > Lsn.parse(first[-1])
    assert slot_flush(pg_conn, config.source.postgres.slot) >= Lsn.parse(after[-1])
    assert_lake_equals(pg_conn, warehouse, table, target)


def test_idle_slot_advances_while_unpublished_tables_change(pg_conn: Any, postgres: Any,
                                                           spark: Any, warehouse: Path,
                                                           tmp_path: Path, unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        cur.execute(f"CREATE TABLE {unique}_busy (id int)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    run_once(config, spark)
    start = slot_flush(pg_conn, config.source.postgres.slot)
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {unique}_busy SELECT generate_series(1, 10000)")
        busy_end = insert_lsn(pg_conn)
    run_once(config, spark)
    assert slot_flush(pg_conn, config.source.postgres.slot) >= busy_end > start


def _walberg(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "walberg.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def test_reconnects_after_the_replication_connection_is_killed(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: Any) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    pipeline = Pipeline(config, session=spark)

    def insert_and_wait(lo: int, hi: int) -> None:
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} SELECT g, 'v' FROM generate_series(%s, %s) g",
                        (lo, hi))
            lsn = insert_lsn(pg_conn)
        pipeline.wait_for(lsn, timeout=120)

    with running(pipeline) as failures:
        insert_and_wait(1, 100)
        for _ in range(2):
            # The replication connection walberg holds now. Polled: a CI run once found the
            # slot with no active walsender right after a batch had landed (not explained).
            deadline = time.monotonic() + 30
            killed = None
            while killed is None and time.monotonic() < deadline:
                with pg_conn.cursor() as cur:
                    cur.execute("SELECT pg_terminate_backend(active_pid) FROM "
                                "pg_replication_slots WHERE slot_name = %s AND active_pid IS "
                                "NOT NULL", (config.source.postgres.slot,))
                    killed = cur.fetchone()
                if killed is None:
                    time.sleep(0.1)
            assert killed is not None and killed[0] is True, "no replication connection to kill"
            insert_and_wait(101 + _ * 100, 200 + _ * 100)
    assert not failures, failures
    assert "reconnecting" in caplog.text
    assert_lake_equals(pg_conn, warehouse, table, target)
    assert len(iceberg_rows(warehouse, target)) == 300


def _checks(config: Config) -> dict[str, CheckResult]:
    """``walberg check`` on a pipeline file with one source, by item."""
    with Lake(config) as lake:
        [checks] = check(lake)
    return {r.name: r for r in checks.results}


def test_check_and_status_tell_where_things_stand(pg_conn: Any, postgres: Any, spark: Any,
                                                  warehouse: Path, tmp_path: Path,
                                                  unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"CREATE TABLE {table}_nokey (v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'x' FROM generate_series(1, 50) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    [before] = status(Lake(config))
    assert before.slot == SlotStatus(name=config.source.postgres.slot, missing=True)
    assert before.tables[table].last_lsn is None

    results = _checks(config)
    assert all(r.ok for r in results.values()), results
    assert "will create it" in results["publication"].detail

    run_once(config, spark)
    [after] = status(Lake(config))
    t = after.tables[table]
    assert t.rows == 50 and t.data_files is not None and t.data_files >= 1
    assert after.slot is not None and after.slot.confirmed_flush_lsn is not None
    assert t.last_lsn is not None
    assert Lsn.parse(t.last_lsn) <= Lsn.parse(after.slot.confirmed_flush_lsn)
    assert after.pipeline.running is False and after.pipeline.pending_segments == 0

    # Several publications, one of which does not exist: the check fails as the run would.
    raw = as_file(config)
    raw["source"]["postgres"]["publication"] = f"pub_{unique},pub_{unique}_absent"
    failed = {n: r for n, r in _checks(parse_config(raw, tmp_path)).items() if not r.ok}
    assert list(failed) == ["publication"], failed
    assert f"publication(s) pub_{unique}_absent (source.postgres.publication) do not exist" \
        in failed["publication"].detail

    # A table without a key fails its check with the statement that fixes it.
    bad = make_config(postgres, warehouse, tmp_path / "segments2", unique + "b",
                      [table, f"{table}_nokey"])
    failed = {n: r for n, r in _checks(bad).items() if not r.ok}
    assert list(failed) == ["tables"]
    assert f'ALTER TABLE "public"."{unique}_nokey" REPLICA IDENTITY FULL;' in failed["tables"].detail

    # REPLICA IDENTITY NOTHING on a table with a primary key: the fix is DEFAULT.
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table}_nothing (id int PRIMARY KEY)")
        cur.execute(f"ALTER TABLE {table}_nothing REPLICA IDENTITY NOTHING")
    bad = make_config(postgres, warehouse, tmp_path / "segments3", unique + "c",
                      [f"{table}_nothing"])
    failed = {n: r for n, r in _checks(bad).items() if not r.ok}
    assert (f'ALTER TABLE "public"."{unique}_nothing" REPLICA IDENTITY DEFAULT;'
            in failed["tables"].detail)


def test_a_second_walberg_on_the_same_slot_is_refused(pg_conn: Any, postgres: Any, spark: Any,
                                                      warehouse: Path, tmp_path: Path,
                                                      unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    first = Pipeline(make_config(postgres, warehouse, tmp_path / "a", unique, [table]),
                     session=spark)
    with running(first) as failures:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with pg_conn.cursor() as cur:
                cur.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                            (f"slot_{unique}",))
                row = cur.fetchone()
            if row and row[0]:
                break
            time.sleep(0.2)
        # Same slot, another segment directory: the slot itself tells them apart.
        second = Pipeline(make_config(postgres, warehouse, tmp_path / "b", unique, [table]),
                          session=spark)
        second.slot_wait_seconds = 1.0
        with pytest.raises(Terminal, match=rf"replication slot slot_{unique} is in use by another "
                                           r"process: server process \d+ for application walberg"):
            second.run(once=True)
        second.close()
        # Same segment directory: refused by its lock, naming the holder's pid.
        third = Pipeline(make_config(postgres, warehouse, tmp_path / "a", unique, [table]),
                         session=spark)
        with pytest.raises(Terminal, match=rf"in use by another walberg process \(pid {os.getpid()}"):
            third.run(once=True)
    assert not failures, failures


def test_sigterm_stops_cleanly_with_exit_0(pg_conn: Any, postgres: Any, spark: Any,
                                           warehouse: Path, tmp_path: Path, unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'x' FROM generate_series(1, 1000) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    cfg_path = write_pipeline(config, tmp_path / "pipeline.yaml")
    proc = _walberg(["run", "-c", str(cfg_path)])
    assert proc.stdout is not None
    watchdog = threading.Timer(180, proc.kill)
    watchdog.start()
    for line in proc.stdout:
        if "initial copy of" in line:
            break
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'y' WHERE id <= 500")
    time.sleep(1.0)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    watchdog.cancel()
    assert proc.returncode == 0, out
    assert time.monotonic() - started < 60
    assert "stopping after the current step" in out
    run_once(config, spark)  # (in this process: no second JVM to start)
    assert_lake_equals(pg_conn, warehouse, table, config.target_for(table))


def test_prometheus_metrics_count_what_was_written(pg_conn: Any, postgres: Any, spark: Any,
                                                   warehouse: Path, tmp_path: Path,
                                                   unique: str) -> None:
    import socket
    import urllib.request

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'x' FROM generate_series(1, 10) g")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["metrics"] = {"port": port}
    from walberg.config import parse_config

    config = parse_config(raw, tmp_path, "test")
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (11, 'y'), (12, 'y')")
        cur.execute(f"UPDATE {table} SET v = 'z' WHERE id <= 3")
        cur.execute(f"DELETE FROM {table} WHERE id = 4")
    run_once(config, spark)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def value(line_start: str) -> float:
        for line in text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{line_start} not in /metrics")

    assert value(f'walberg_records_written_total{{op="insert",table="{table}"}}') == 2
    assert value(f'walberg_records_written_total{{op="update",table="{table}"}}') == 3
    assert value(f'walberg_records_written_total{{op="delete",table="{table}"}}') == 1
    assert value(f'walberg_commits_total{{result="success",table="{table}"}}') == 1
    assert value(f'walberg_initial_copy_rows_total{{table="{table}"}}') == 10
    lsn = Lsn.parse(snapshot_lsns(warehouse, config.target_for(table))[-1])
    assert value(f'walberg_committed_lsn{{table="{table}"}}') == int(lsn)
    assert value("walberg_segments_sealed_total") >= 1
    assert value("walberg_end_to_end_seconds_count") >= 1
    assert value(f'walberg_initial_copy_progress{{table="{table}"}}') == 1
    # What the one MERGE commit added, read back from its snapshot summary:
    summary = hadoop_table(warehouse, config.target_for(table)).current_snapshot().summary
    assert value(f'walberg_bytes_written_total{{table="{table}"}}') == \
        int(summary["added-files-size"])
    assert value(f'walberg_files_created_total{{kind="data",table="{table}"}}') == \
        int(summary["added-data-files"]) >= 1
    assert value(f'walberg_files_created_total{{kind="delete",table="{table}"}}') == \
        int(summary["added-delete-files"]) >= 1


def test_a_table_added_to_the_publication_while_running_gets_its_own_copy(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    first, later = f"public.{unique}", f"public.{unique}_later"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {first} (id int PRIMARY KEY, v text)")
        cur.execute(f"CREATE TABLE {later} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {later} SELECT g, 'before' FROM generate_series(1, 50) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [first]))
    raw["source"]["postgres"]["follow_publication"] = True
    from walberg.config import parse_config

    config = parse_config(raw, tmp_path)
    pipeline = Pipeline(config, session=spark)
    with running(pipeline) as failures:
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {first} VALUES (1, 'a')")
            pipeline.wait_for(insert_lsn(pg_conn), timeout=120)  # streaming now
            cur.execute(f"ALTER PUBLICATION {config.source.postgres.publication} "
                        f"ADD TABLE {later}")
            cur.execute(f"UPDATE {later} SET v = 'after' WHERE id <= 10")
            cur.execute(f"INSERT INTO {later} VALUES (51, 'new')")
            cur.execute(f"INSERT INTO {first} VALUES (2, 'b')")
            pipeline.wait_for(insert_lsn(pg_conn), timeout=120)
        assert not failures, failures
    for table in (first, later):
        assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)


def test_a_table_the_publication_brings_gets_the_sinks_changelog(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """follow_publication with sink.mode both: a table only the publication names gets its
    changelog like a configured one (before, none was written; and in mode append, where the
    changelog is the table itself, each run failed at its copy)."""
    first, other = f"public.{unique}", f"public.{unique}_other"
    with pg_conn.cursor() as cur:
        for t in (first, other):
            cur.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
            cur.execute(f"INSERT INTO {t} SELECT g, 'v' FROM generate_series(1, 20) g")
        cur.execute(f"CREATE PUBLICATION pub_{unique} FOR TABLE {first}, {other}")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [first]))
    raw["source"]["postgres"]["follow_publication"] = True
    raw["sink"]["mode"] = "both"
    from walberg.config import parse_config

    config = parse_config(raw, tmp_path)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {other} SET v = 'w' WHERE id <= 5")
    run_once(config, spark)
    changes = iceberg_rows(warehouse, config.changelog_for(other))
    assert len(changes) == 25, changes  # the copy's 20 rows, then the 5 updates
    assert iceberg_rows(warehouse, config.target_for(other)) == postgres_rows(pg_conn, other)


def test_once_ends_when_the_slot_resends_what_the_lake_holds(pg_conn: Any, postgres: Any,
                                                             spark: Any, warehouse: Path,
                                                             tmp_path: Path,
                                                             unique: str) -> None:
    """A stop whose last confirmation never reached the slot (SIGTERM, kill -9 after the commit,
    a lost connection): the next run's stream is sent again transactions the lake holds. They
    are not applied twice, the run ends, and no segment is left behind. (The moment when the
    stream seals them only after the lake's marks became the applied position is a race; the
    test below makes it.)"""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'x' FROM generate_series(1, 20000) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    slot, saved = config.postgres.slot, f"{config.postgres.slot}_saved"
    run_once(config, spark)
    for round_ in range(2):
        with pg_conn.cursor() as cur:
            cur.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (slot, saved))
            # (one transaction over every row: the slot sends it again, whole)
            cur.execute(f"UPDATE {table} SET v = %s", (f"r{round_}",))
        run_once(config, spark)
        assert slot_flush(pg_conn, slot) > slot_flush(pg_conn, saved)
        with pg_conn.cursor() as cur:  # the slot as if the confirmation had been lost
            # (once the server's process for the run's stream, closed, has ended)
            deadline = time.monotonic() + 30
            while True:
                cur.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s",
                            (slot,))
                if not cur.fetchone()[0] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            cur.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (saved, slot))
            cur.execute("SELECT pg_drop_replication_slot(%s)", (saved,))
        run_once_within(120, config, spark)  # (on a slot behind the lake)
        assert_lake_equals(pg_conn, warehouse, table, config.target_for(table))
        assert list((tmp_path / "segments").glob("*.sealed")) == []


def test_segments_sealed_after_the_lake_was_read_with_nothing_to_apply_are_let_go(
        postgres: Any, tmp_path: Path) -> None:
    """The race of the test above, made: a transaction the lake holds, sent again by a slot that
    was not told of it, sealed only after the lake's marks became the applied position. No
    batch takes it (nothing to apply), so the stager removes it; before, it stayed pending and a
    --once run, whose reader waits for nothing to be pending, never ended."""
    from pgoutput_encoder import encode
    from walberg.buffer.store import SegmentStore
    from walberg.model import Begin, Commit, Insert
    from walberg.runtime.pg_stager import FRAME_PGOUTPUT, PgStager
    from walberg.runtime.state import RunState, SegmentMeta

    config = make_config(postgres, tmp_path / "warehouse", tmp_path / "segments", "seg",
                         ["public.seg"])
    store = SegmentStore(config.segment_dir, config.buffer.max_segment_bytes)
    store.recover()
    state = RunState()
    stager = PgStager(config, store, state, None, lambda: None, lambda rel: None,  # type: ignore
                      None)

    def sealed_transaction(begin: int, end: int, whole: bool = True) -> None:
        store.append(begin, FRAME_PGOUTPUT, encode(Begin(Lsn(end - 8), 0, begin)))
        store.append(begin + 8, FRAME_PGOUTPUT, encode(Insert(16384, (b"1",))))
        if whole:
            store.append(end, FRAME_PGOUTPUT, encode(Commit(0, Lsn(end - 8), Lsn(end), 0)))
        info = store.seal()
        assert info is not None
        state.sealed(info.seq, SegmentMeta(Lsn(end) if whole else None, whole))

    sealed_transaction(0x1000, 0x1100)
    sealed_transaction(0x1100, 0x1200)
    sealed_transaction(0x1200, 0x1300, whole=False)  # runs on into a segment not sealed yet
    state.advance_applied(Lsn(0x1200))  # the lake's mark: the first two are in the lake
    assert stager.prepare_next(None) is None
    assert [info.path.suffix for info in store.sealed()] == [".sealed"]
    assert state.segment(store.sealed()[0].seq) == SegmentMeta(None, False)
    assert sorted(p.name for p in config.segment_dir.glob("*.sealed")) == [
        store.sealed()[0].path.name]
    # The rest of that transaction, sealed after the lake's mark passed its commit: the two
    # segments it spans go together (the first ends inside it; before, it stayed, and so did
    # everything after it).
    store.append(0x1210, FRAME_PGOUTPUT, encode(Insert(16384, (b"2",))))
    store.append(0x1300, FRAME_PGOUTPUT, encode(Commit(0, Lsn(0x12f8), Lsn(0x1300), 0)))
    info = store.seal()
    assert info is not None
    state.sealed(info.seq, SegmentMeta(Lsn(0x1300), True))
    sealed_transaction(0x1300, 0x1400, whole=False)  # the next, not in the lake
    state.advance_applied(Lsn(0x1300))
    assert stager.prepare_next(None) is None
    assert [state.segment(info.seq) for info in store.sealed()] == [SegmentMeta(None, False)]


def test_a_buffer_dir_that_holds_a_kafka_pipelines_segments_is_refused(
        postgres: Any, pg_conn: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Two pipelines given one buffer.dir in turn: a Postgres pipeline that finds a Kafka
    pipeline's segments left there says so and what to do, at start, instead of leaving them
    pending for good (a --once run never ended; the Kafka pipeline already refused a Postgres
    one's)."""
    from walberg.buffer.kinds import FrameKind
    from walberg.buffer.store import SegmentStore
    from walberg.source import kafka

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    with SegmentStore(config.segment_dir, config.buffer.max_segment_bytes) as store:
        store.recover()
        store.append(1, int(FrameKind.KAFKA_RUN),
                     next(frame for _, frame in kafka.runs([kafka.Record("t", 0, 0, 0, b"k",
                                                                         b"v")])))
        leftover = store.seal()
    assert leftover is not None
    with pytest.raises(Terminal) as refused:
        run_once(config, spark)
    said = str(refused.value)
    assert str(leftover.path) in said and "KAFKA_RUN" in said, said
    assert "which a Postgres pipeline never writes" in said and "its own buffer.dir" in said
