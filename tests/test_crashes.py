"""kill -9 at 23 moments at 12 precise points (WALBERG_CRASH_AT, see walberg.faults) while a
writer keeps changing rows: inside the initial copy (its data files written on the driver, not
yet committed), during a restart's check of the lake while the stream already writes segments,
once the first batch has been staged during that check, while writing a segment, between seal
and apply, while decoding, inside the Spark commit, after the commit before the slot hears of
it, inside the apply by position (before its row delta, while its key index catches up with
it), when one table of a batch has committed while the batch's other tables commit beside it
(some committed, some under way, some not begun), and while the key index is being kept in the
warehouse (its files sent, the manifest that names them not yet); each followed by a restart.
Beside a table with one integer key, the apply by position runs on a uuid-keyed table
partitioned by day, a composite-keyed format-3 table (deletion vectors) and a text-keyed one,
so the crashes inside it land in each. The last run ends with the lake equal to Postgres: no
row lost, none duplicated."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import as_file, make_config, run_once, write_pipeline, writing
from lake import iceberg_rows, postgres_rows, snapshot_lsns
from walberg.config import parse_config
from walberg.model import Lsn

HITS = (1, 3)  # the n-th pass of each point: the first, and one with a history behind it
POINTS = {"copy-files": (1,), "lake-check": (1,), "early-staged": (1,),
          "segment-write": HITS, "seal": HITS,
          "decode": HITS, "commit": HITS, "committed": HITS,
          # A table's commit landed while the batch's other tables commit side by side.
          "table-committed": HITS,
          # Inside the apply by position (apply.position.keyed): before its row delta commits, and
          # while the key index is brought up to that commit; a batch applies its tables side by
          # side, so later passes land in the other shapes' paths, with other tables in flight.
          "row-delta": (1, 2, 3, 4), "indexed": (1, 2, 3),
          # Keeping an index in the warehouse (apply.position.keystore), in its own thread.
          "key-store": (1,)}
# The other shapes (see the module docstring): columns, key, and Iceberg layout.
SHAPES = {"uuid_days": ("id uuid PRIMARY KEY, at timestamptz, v int",
                        {"partition_by": ["days(at)"]}),
          "pair_v3": ("a int, b bigint, v int, PRIMARY KEY (a, b)", {"format_version": 3}),
          "text": ("id text PRIMARY KEY, v int", {})}


def test_kill_9_at_23_moments_loses_and_duplicates_nothing(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    others = {shape: f"public.{unique}_{shape}" for shape in SHAPES}
    # Each shape's row of number g, as a SELECT list over g.
    rows = {"uuid_days": "md5(({g})::text)::uuid, timestamptz '2024-01-01 00:00:00+00' + "
                         "(({g}) % 30) * interval '1 day', 0",
            "pair_v3": "({g}) % 7, {g}, 0", "text": "'key-' || ({g}), 0"}
    keys = {"uuid_days": "id = md5(({g})::text)::uuid", "pair_v3": "b = {g}",
            "text": "id = 'key-' || ({g})"}
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int, note text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 0, 'x' FROM generate_series(1, 5000) g")
        for shape, (columns, _) in SHAPES.items():
            cur.execute(f"CREATE TABLE {others[shape]} ({columns})")
            cur.execute(f"INSERT INTO {others[shape]} SELECT {rows[shape].format(g='g')} "
                        "FROM generate_series(1, 2000) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique,
                              [table, *others.values()], max_segment_bytes=65536))
    raw["sink"]["tables"] = {others[shape]: layout for shape, (_, layout) in SHAPES.items()}
    config = parse_config(raw, tmp_path)
    path = tmp_path / "pipeline.yaml"
    write_pipeline(raw, path)

    # A steady writer (about a hundred row changes a transaction, a few dozen transactions a
    # second): every crash meets changes in flight, and each run's backlog stays small.
    def step(cur: Any, i: int) -> None:
        cur.execute("BEGIN")
        cur.execute(f"UPDATE {table} SET v = v + 1 WHERE id <= 5000 AND id % 53 = {i % 53}")
        cur.execute(f"INSERT INTO {table} VALUES ({10000 + i}, 0, 'new')")
        # A row this writer inserted a few steps back, so the run never runs out of rows to
        # update or delete however long the 14 runs take (deleting copied rows did, after
        # 5,000 steps: the last points then met only inserts and were never reached).
        cur.execute(f"DELETE FROM {table} WHERE id = {10000 + i - 5}")
        for shape, other in others.items():
            cur.execute(f"UPDATE {other} SET v = v + 1 WHERE "
                        f"{keys[shape].format(g=1 + (i * 37) % 2000)}")
            cur.execute(f"INSERT INTO {other} SELECT {rows[shape].format(g=10000 + i)}")
            cur.execute(f"DELETE FROM {other} WHERE {keys[shape].format(g=10000 + i - 5)}")
        cur.execute("COMMIT")

    killed: dict[str, int] = {}
    with writing(postgres, step, pause=0.03):
        for point, hits in POINTS.items():
            for hit in hits:
                env = dict(os.environ, WALBERG_CRASH_AT=f"{point}:{hit}", PYTHONUNBUFFERED="1")
                proc = subprocess.run([sys.executable, "-m", "walberg.cli", "-q", "run", "-c",
                                       str(path)], env=env, capture_output=True, text=True,
                                      timeout=240)
                assert proc.returncode == -9, (point, hit, proc.returncode, proc.stdout[-2000:])
                killed[point] = killed.get(point, 0) + 1
    run_once(config, spark)  # the last run, in this process: no JVM to start

    target = config.target_for(table)
    lsns = [Lsn.parse(x) for x in snapshot_lsns(warehouse, target) if x]
    assert lsns == sorted(lsns), "a commit went backwards"
    lake = iceberg_rows(warehouse, target)
    source = postgres_rows(pg_conn, table)
    keys = [r["id"] for r in lake]
    duplicated = len(keys) - len(set(keys))
    lost = len({r["id"] for r in source} - set(keys))
    print(f"\ncrashes by point: {killed}; rows lost: {lost}; rows duplicated: {duplicated}")
    assert killed == {p: len(hits) for p, hits in POINTS.items()}
    assert (lost, duplicated) == (0, 0)
    assert lake == source
    for shape, other in others.items():
        key = {"pair_v3": "b"}.get(shape, "id")
        lake_rows = [tuple(str(v) for v in r.values())
                     for r in iceberg_rows(warehouse, config.target_for(other), key=key)]
        source_rows = [tuple(str(v) for v in r.values())
                       for r in postgres_rows(pg_conn, other, key=key)]
        assert sorted(lake_rows) == sorted(source_rows), shape


def test_a_restart_streams_while_the_lake_is_checked_and_confirms_nothing_early(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """A restart reads the backlog into segments while Spark starts (pipeline: streaming
    begins before the lake is checked, with a slot that exists). Killed then, it has written
    segments and told the slot nothing; the next run applies every change once."""
    from walberg.source import slots

    table, config, path = _copied(pg_conn, postgres, spark, warehouse, tmp_path, unique)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 1 WHERE id % 3 = 0")
        cur.execute(f"DELETE FROM {table} WHERE id % 7 = 0")
        cur.execute(f"INSERT INTO {table} SELECT g, 2, 'new' FROM generate_series(3001, 4000) g")
    slot_before = slots.slot_state(pg_conn, config.postgres.slot)
    assert slot_before is not None

    _killed_once_at(path, "lake-check:1")
    written = [p for p in (tmp_path / "segments").iterdir()
               if p.name.endswith((".sealed", ".active")) and p.stat().st_size > 0]
    assert written, "the stream wrote segments while the lake was being checked"
    slot_after = slots.slot_state(pg_conn, config.postgres.slot)
    assert slot_after is not None and slot_after.confirmed_flush == slot_before.confirmed_flush, \
        "nothing may be confirmed to the slot before the lake has been read"

    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)


def test_a_restart_stages_its_first_batch_while_the_lake_is_checked_and_keeps_it_only_if_it_holds(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A restart stages its first batch from what it streams while the lake is checked
    (PgStager.start_early), as if every table's mark lay before that batch. It is applied when
    the lake agrees. After a kill between an Iceberg commit and the slot's confirmation the
    slot sends again what the lake holds: that batch is thrown away and staged again the usual
    way. Either way every change is applied once."""
    table, config, path = _copied(pg_conn, postgres, spark, warehouse, tmp_path, unique)

    def change(round_: int) -> None:
        with pg_conn.cursor() as cur:
            cur.execute(f"UPDATE {table} SET v = v + 1 WHERE id % 5 = {round_}")
            cur.execute(f"DELETE FROM {table} WHERE id % 11 = {round_}")
            cur.execute(f"INSERT INTO {table} SELECT g, {round_}, 'new' FROM "
                        f"generate_series({3000 + 1000 * round_}, {3499 + 1000 * round_}) g")

    # 1. Killed after its Iceberg commit, before the slot heard of it.
    change(1)
    _killed_once_at(path, "committed:1")

    _lake_checked_once_staging(monkeypatch, config.segment_dir)

    # 2. The next run streams the killed run's transactions again with new ones: the batch it
    # staged early holds transactions the lake has, so it is staged again.
    change(2)
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark)
    assert "staging it again" in caplog.text
    assert "was staged while the lake was read" not in caplog.text
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)

    # 3. After a clean stop, the batch staged early is the one applied.
    caplog.clear()
    change(3)
    with caplog.at_level(logging.INFO, logger="walberg"):
        report = run_once(config, spark)
    assert "was staged while the lake was read" in caplog.text
    assert report.changes > 0
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)


def test_a_restarts_backlog_over_many_segments_is_one_batch(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A --once restart's backlog that fits a batch is one commit, though its transactions
    run over many segments and the lake is read while the stream still writes them: the batch
    staged early grows until the reader has sealed all it reads, and the descriptions each
    segment repeats at its start (walberg's, so that a file decodes on its own) do not end it
    as pgoutput's own would (a column dropped and added again, see test_schema); nor does a
    description of pgoutput's own with the same columns, the numbers compared once the lake is
    read."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int, note text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 0, 'x' FROM generate_series(1, 2000) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table],
                         max_segment_bytes=64 * 1024)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        for round_ in range(4):  # (each transaction over several segments of 64 KiB)
            cur.execute(f"UPDATE {table} SET v = v + 1, note = repeat('y', 100) "
                        f"WHERE id % 4 = {round_}")
            cur.execute(f"INSERT INTO {table} SELECT g, {round_}, 'new' FROM generate_series("
                        f"{3000 + 1000 * round_}, {3799 + 1000 * round_}) g")
            if round_ == 1:
                # pgoutput describes the table again (the same columns) after DDL that leaves
                # them as they are, or a relcache invalidation such as autovacuum's: whether a
                # column was dropped and added again is asked once the lake is read.
                cur.execute(f"ALTER TABLE {table} SET (fillfactor = 90)")
    _lake_checked_once_staging(monkeypatch, config.segment_dir)
    with caplog.at_level(logging.INFO, logger="walberg"):
        report = run_once(config, spark)
    assert "was staged while the lake was read" in caplog.text
    assert report.batches == 1 and report.changes > 5000
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)


def _lake_checked_once_staging(monkeypatch: pytest.MonkeyPatch, staging_dir: Path) -> None:
    """A lake check that lasts until the first batch is being staged, as a cold start's does
    (a Spark session starting); in this process the session is warm."""
    from walberg.runtime.tables import PgTables

    ensure = PgTables.ensure

    def slow_ensure(self: Any, source: str, info: Any) -> None:
        deadline = time.monotonic() + 60
        while (not any(p.name.startswith("batch-") for p in staging_dir.iterdir())
               and time.monotonic() < deadline):
            time.sleep(0.01)
        ensure(self, source, info)

    monkeypatch.setattr(PgTables, "ensure", slow_ensure)


def _copied(pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
            unique: str) -> tuple[str, Any, Path]:
    """A table of 2,000 rows copied into the lake by a run in this process (the slot exists
    from here on): the table, its pipeline's config and that config as a file."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int, note text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 0, 'x' FROM generate_series(1, 2000) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    path = tmp_path / "pipeline.yaml"
    write_pipeline(config, path)
    run_once(config, spark)
    return table, config, path


def _killed_once_at(path: Path, crash_at: str) -> None:
    """`walberg run --once` as a command, killed (-9) at ``crash_at`` (WALBERG_CRASH_AT)."""
    env = dict(os.environ, WALBERG_CRASH_AT=crash_at, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "walberg.cli", "-q", "run", "-c", str(path),
                           "--once"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -9, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
