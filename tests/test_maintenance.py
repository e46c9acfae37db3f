"""Maintenance against the small-files problem: many small commits, then `maintain`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from conftest import as_file, insert_lsn, make_config, running
from lake import iceberg_rows
from walberg.apply.batch import BatchBuilder
from walberg.apply.iceberg import IcebergSink
from walberg.config import parse_config
from walberg.lake.history import history
from walberg.lake.maintain import maintain
from walberg.lake.services import Lake
from walberg.model import Column, Lsn, Op
from walberg.pipeline import Pipeline

COLUMNS = (Column("id", 23, -1, True), Column("v", 25))
# 100 commits: 80 data files and 19 delete files to compact, in as many snapshots to expire
# (WALBERG_TEST_COMMITS for more; each is a Spark statement of about 0.25 s, and 300 of them
# were the suite's fourth-longest test while proving nothing 100 do not).
COMMITS = int(os.environ.get("WALBERG_TEST_COMMITS", "100"))


def test_maintenance_after_many_small_commits(postgres: Any, spark: Any, warehouse: Path,
                                              tmp_path: Path, unique: str) -> None:
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [f"public.{unique}"])
    target = config.target_for(f"public.{unique}")
    sink = IcebergSink(spark)
    sink.record_server("7300000000000000001/1")
    sink.ensure_table(target, COLUMNS)
    # Many small commits, as a busy stream with a short interval makes them: inserts, and
    # every fifth commit an update of earlier rows (merge-on-read: position delete files).
    # Plain SQL commits (quicker than walberg's staging); the last one is walberg's own, so
    # the table records walberg.lsn.
    t = ".".join(f"`{p}`" for p in target.split("."))
    for i in range(1, COMMITS):
        if i % 5 == 0:
            spark.sql(f"UPDATE {t} SET v = 'u{i}', _walberg_lsn = {i} WHERE id = {i - 4}")
        else:
            spark.sql(f"INSERT INTO {t} VALUES ({i}, 'v{i}', {i})")
    b = BatchBuilder(tmp_path / "last")
    b.add("public.t", COLUMNS, Op.INSERT, 1, COMMITS,
          (str(COMMITS).encode(), f"v{COMMITS}".encode()))
    sink.apply(target, b.finish()["public.t"], Lsn(COMMITS), max_seq=1)
    before_rows = iceberg_rows(warehouse, target)
    before = sink.files(target)
    assert before["data_files"] >= COMMITS * 4 // 5 and before["delete_files"] >= (COMMITS - 1) // 5

    raw = as_file(config)
    raw["maintenance"] = {"snapshot_retention": "0s", "retain_last": 3}
    lake = Lake(parse_config(raw, tmp_path, "test"), session=spark)
    (report,) = maintain(lake)
    after = report.after
    assert after.data_files <= 3 and after.delete_files == 0
    assert after.snapshots <= 3
    assert report.before.data_files == before["data_files"]
    assert iceberg_rows(warehouse, target) == before_rows  # the data is unchanged
    # What the lake holds stays known: the compaction carried walberg.lsn along.
    assert sink.committed_lsn(target) == Lsn(COMMITS)
    assert history(lake, f"public.{unique}")[-1].lsn == str(Lsn(COMMITS))
    # And the server that LSN belongs to, which a failover is checked against.
    assert sink.committed_server(target) == "7300000000000000001/1"


def test_run_maintains_on_schedule_between_batches(pg_conn: Any, postgres: Any, spark: Any,
                                                   warehouse: Path, tmp_path: Path,
                                                   unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["maintenance"] = {"every": "2s", "snapshot_retention": "0s", "retain_last": 1}
    config = parse_config(raw, tmp_path, "test")
    pipeline = Pipeline(config, session=spark)
    lake = Lake(config, session=spark)
    with running(pipeline) as failures:
        for i in range(6):
            with pg_conn.cursor() as cur:
                cur.execute(f"INSERT INTO {table} VALUES (%s, 'x')", (i,))
                cur.execute(f"UPDATE {table} SET v = 'y' WHERE id = %s", (i,))
                pipeline.wait_for(insert_lsn(pg_conn), timeout=120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if "replace" in [h.operation for h in history(lake, table)]:
                break
            time.sleep(0.5)
    assert not failures, failures
    assert "replace" in [h.operation for h in history(lake, table)]
    rows = iceberg_rows(warehouse, pipeline.targets[table])
    assert [(r["id"], r["v"]) for r in rows] == [(i, "y") for i in range(6)]
