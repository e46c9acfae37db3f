"""`walberg query --consistent` on a catalog that commits one table at a time (hadoop): the
tables read at the newest source position every one of them holds whole, so a reader never
sees part of a source transaction although the tables' commits land one after another."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from conftest import as_file, make_config, run_once, running, walberg_cli, walberg_ok, write_pipeline
from lake import hadoop_table
from shop import half_transactions, make_shop, write_shop
from walberg.lake.query import consistent_cut
from walberg.lake.services import Lake
from walberg.pipeline import Pipeline


def test_a_consistent_cut_never_holds_part_of_a_source_transaction(
        postgres: Any, pg_conn: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    orders, lines = make_shop(pg_conn, unique)
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [orders, lines])
    run_once(config, spark)
    targets = config.target_for(orders), config.target_for(lines)

    stop = threading.Event()
    counts = {"transactions": 0}
    writer = threading.Thread(target=write_shop, args=(postgres.dsn, orders, lines, stop, counts))
    cuts: list[int] = []
    current_half = 0
    with Lake(config, session=spark) as lake, running(Pipeline(config, session=spark)) as failed:
        writer.start()
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not failed:
                cut = consistent_cut(lake)
                # Read back by PyIceberg at the snapshots the cut names (the recipe for
                # engines other than walberg's own query).
                first, second = (hadoop_table(warehouse, t) for t in targets)
                problems = half_transactions(
                    first.scan(snapshot_id=cut.snapshots[targets[0]]).to_arrow(),
                    second.scan(snapshot_id=cut.snapshots[targets[1]]).to_arrow())
                assert not problems, (cut, problems[:5])
                cuts.append(int(cut.lsn))
                # The tables as they are now, each at its newest commit: these may hold part
                # of a transaction (counted, not asserted: it depends on timing).
                now = (hadoop_table(warehouse, t) for t in targets)
                current_half += bool(half_transactions(*(t.scan().to_arrow() for t in now)))
        finally:
            stop.set()
            writer.join(timeout=30)
    assert not failed, failed
    assert cuts == sorted(cuts), "a later cut went back"
    assert counts["transactions"] > 100 and len(set(cuts)) > 3, (counts, len(set(cuts)))
    print(f"\n{len(cuts)} consistent cuts at {len(set(cuts))} positions, none with part of a "
          f"transaction; the tables' newest commits held part of one {current_half} times")


def test_query_consistent_names_its_cut(postgres: Any, pg_conn: Any, warehouse: Path,
                                        tmp_path: Path, unique: str) -> None:
    """The command: the cut's position and snapshots on standard error, the query's result
    read at them; it refuses to mix with another point in time."""
    orders, lines = make_shop(pg_conn, unique)
    path = write_pipeline(as_file(make_config(postgres, warehouse, tmp_path / "segments",
                                              unique, [orders, lines])), tmp_path / "p.yaml")
    walberg_ok("-q", "run", "--once", "-c", str(path))
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {orders} VALUES (9001, 'x', 3)")
        cur.execute(f"INSERT INTO {lines} SELECT 9001, k, 1 FROM generate_series(1, 3) k")
    walberg_ok("-q", "run", "--once", "-c", str(path))
    namespace = f"ns_{unique}"
    done = walberg_cli("query", "--consistent", "-c", str(path),
                       f"SELECT count(*) AS n FROM lake.{namespace}.l_{unique} l JOIN "
                       f"lake.{namespace}.o_{unique} o ON o.id = l.order_id")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "consistent cut at LSN" in done.stderr and "at snapshot" in done.stderr
    assert "603" in done.stdout, done.stdout
    clash = walberg_cli("query", "--consistent", "--lsn", "0/1", "-c", str(path), "SELECT 1")
    assert clash.returncode != 0
