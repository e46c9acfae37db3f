"""kill -9 at 15 moments at 8 precise points (WALBERG_CRASH_AT, see walberg.faults) while a
writer keeps changing rows: inside the initial copy (its data files written on the driver, not
yet committed), while writing a segment, between seal and apply, while decoding,
inside the Spark commit, after the commit before the slot hears of it, and inside the apply by
position (before its row delta, while its key index catches up with it); each followed by a
restart. The last run ends with the lake equal to Postgres: no row lost, none duplicated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from conftest import make_config, run_once, writing
from lake import iceberg_rows, postgres_rows, snapshot_lsns
from walberg.model import Lsn

HITS = (1, 3)  # the n-th pass of each point: the first, and one with a history behind it
POINTS = {"copy-files": (1,), "segment-write": HITS, "seal": HITS, "decode": HITS, "commit": HITS,
          "committed": HITS,
          # Inside the apply by position (apply.keyed): before its row delta commits, and
          # while the key index is brought up to that commit.
          "row-delta": HITS, "indexed": (1, 2)}


def test_kill_9_at_15_moments_loses_and_duplicates_nothing(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int, note text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 0, 'x' FROM generate_series(1, 5000) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table],
                         max_segment_bytes=65536)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude={"base_dir"})))

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
