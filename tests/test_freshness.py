"""Freshness as users mean it: walberg_end_to_end_seconds observes, per table, the age of the
OLDEST transaction an Iceberg commit made visible (a batch's first transaction waits longest),
and walberg_replication_lag_seconds grows while changes wait, back to 0 once they are in."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from conftest import insert_lsn, make_config, run_once, running
from lake import hadoop_table
from walberg.cli.output import status_text
from walberg.lake.services import Lake
from walberg.ops.status import status
from walberg.pipeline import Pipeline


def _histogram(table: str) -> tuple[float, float]:
    labels = {"table": table}
    return (REGISTRY.get_sample_value("walberg_end_to_end_seconds_sum", labels) or 0.0,
            REGISTRY.get_sample_value("walberg_end_to_end_seconds_count", labels) or 0.0)


def _lag() -> float:
    return REGISTRY.get_sample_value("walberg_replication_lag_seconds",
                                     {"source": "postgres"}) or 0.0


def test_the_metric_reports_the_oldest_transaction_of_a_batch(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    # One batch per 5 s: three transactions a second apart land in one.
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table],
                         max_interval_seconds=5)
    run_once(config, spark)
    target = config.target_for(table)
    pipeline = Pipeline(config, session=spark)
    try:
        with running(pipeline) as failures:
            time.sleep(2)  # streaming, idle
            before_sum, before_count = _histogram(table)
            committed = []
            with pg_conn.cursor() as cur:
                for i in range(3):
                    cur.execute(f"INSERT INTO {table} VALUES ({i}, 'v')")
                    committed.append(time.time())
                    time.sleep(1)
            lsn = insert_lsn(pg_conn)
            assert _lag() > 1.5  # the first transaction waits, and the gauge says so
            # walberg status, from the segment files: the table's oldest waiting change.
            # (the running walberg's own figure; the table's, from the segment files, counts
            # only what is written to them)
            [waiting] = status(Lake(config))
            behind = waiting.pipeline.oldest_waiting_s
            assert behind is not None and behind > 1.0, waiting.pipeline
            assert f"committed {behind:.1f} s ago" in status_text([waiting])
            assert waiting.tables[table].waiting_s is not None
            pipeline.wait_for(lsn, timeout=60)
            deadline = time.monotonic() + 5
            while _lag() > 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _lag() == 0
            time.sleep(1.2)  # (said once a second)
            [current] = status(Lake(config))
            assert current.tables[table].waiting_s == 0
            assert current.pipeline.oldest_waiting_s == 0
            assert not failures, failures
    finally:
        pipeline.close()
    # Stopped, with a change the slot holds and no segment file does: not "nothing waits".
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (100, 'while stopped')")
    [stopped] = status(Lake(config))
    assert not stopped.pipeline.running and stopped.slot is not None
    assert (stopped.slot.lag_bytes or 0) > 0 and stopped.tables[table].waiting_s is None
    after_sum, after_count = _histogram(table)
    assert after_count == before_count + 1  # one commit made the three transactions visible
    observed = after_sum - before_sum
    visible = hadoop_table(warehouse, target).current_snapshot().timestamp_ms / 1000
    assert abs(observed - (visible - committed[0])) < 0.5, (observed, visible - committed[0])
    assert observed > visible - committed[-1] + 1.5  # not the last transaction's age
