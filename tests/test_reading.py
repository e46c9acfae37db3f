"""Reading the lake back: queries pinned to a timestamp, a snapshot or a Postgres LSN, results
written to files, and the net changes between two points of a table's history."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import insert_lsn, make_config, walberg_cli
from walberg.apply.iceberg import pin_tables
from walberg.errors import Terminal
from walberg.lake.changes import changes_sql
from walberg.lake.history import history
from walberg.lake.query import export, query
from walberg.lake.services import Lake
from walberg.model import Lsn
from walberg.pipeline import Pipeline


def test_pin_tables_adds_the_clause_after_each_reference() -> None:
    sql = ("SELECT * FROM lake.ns.t a JOIN `lake`.`ns`.`t` b ON a.id = b.id "
           "JOIN lake.ns.t2 c ON 1=1 WHERE lake.ns.tx IS NULL")
    assert pin_tables(sql, {"lake.ns.t": "VERSION AS OF 7"}) == (
        "SELECT * FROM lake.ns.t VERSION AS OF 7 a JOIN `lake`.`ns`.`t` VERSION AS OF 7 b "
        "ON a.id = b.id JOIN lake.ns.t2 c ON 1=1 WHERE lake.ns.tx IS NULL")


def test_time_travel_export_and_changes(pg_conn: Any, postgres: Any, spark: Any,
                                        warehouse: Path, tmp_path: Path, unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 10) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)

    def run() -> Lsn:
        """Run once; the source's WAL position afterwards (nothing changed since)."""
        p = Pipeline(config, session=spark)
        try:
            p.run(once=True)
        finally:
            p.close()
        return insert_lsn(pg_conn)

    at_copy = run()
    time.sleep(1.1)
    between = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    time.sleep(1.1)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 3")
        cur.execute(f"DELETE FROM {table} WHERE id = 10")
        cur.execute(f"INSERT INTO {table} VALUES (11, 'new')")
    after_changes = run()

    with Lake(config, session=spark) as lake:
        count = f"SELECT count(*), sum(CASE WHEN v = 'changed' THEN 1 ELSE 0 END) FROM {target}"
        assert query(lake, count)[0] == [(10, 3)]
        assert query(lake, count, lsn=at_copy)[0] == [(10, 0)]
        assert query(lake, count, as_of=between)[0] == [(10, 0)]
        assert query(lake, count, lsn=after_changes)[0] == [(10, 3)]
        first = history(lake, table)[0].snapshot_id
        assert query(lake, count, snapshot=first)[0] == [(10, 0)]
        with pytest.raises(Terminal, match="no table of this pipeline has a snapshot 12345"):
            query(lake, count, snapshot=12345)
        with pytest.raises(Terminal, match="held nothing of"):  # before the initial copy
            query(lake, count, lsn=Lsn(1))

        changes = changes_sql(lake, table, str(first))
        rows, names = query(lake, changes)
        got = {(r[names.index("_change")], r[names.index("id")], r[names.index("v")])
               for r in rows}
        assert got == {("update", 1, "changed"), ("update", 2, "changed"),
                       ("update", 3, "changed"), ("delete", 10, "v10"), ("insert", 11, "new")}
        assert query(lake, changes_sql(lake, table, between, str(first)))[0] == []

        out = tmp_path / "then.parquet"
        assert export(lake, f"SELECT id, v FROM {target} ORDER BY id", "parquet", out,
                      lsn=at_copy) == 10
        assert pq.read_table(out).column("v").to_pylist()[:3] == ["v1", "v2", "v3"]

    # The same through the command line: csv and json files.
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    out_csv = tmp_path / "now.csv"
    done = walberg_cli("query", "-c", str(path), f"SELECT id, v FROM {target} ORDER BY id",
                       "--format", "csv", "--output", str(out_csv))
    assert done.returncode == 0, done.stderr
    with open(out_csv) as f:
        assert list(csv.DictReader(f))[0] == {"id": "1", "v": "changed"}
    out_json = tmp_path / "changes.json"
    done = walberg_cli("changes", "-c", str(path), table, "--from", str(first), "--format", "json",
                       "--output", str(out_json))
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert sorted(r["_change"] for r in lines) == ["delete", "insert", "update", "update",
                                                   "update"]
