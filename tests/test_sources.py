"""Several sources in one pipeline: two PostgreSQL databases whose `orders` tables fan in to one
Iceberg table, each row tagged with its source, each source exactly once by its own LSN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg2
from pyiceberg.table import StaticTable

from lake import duckdb_rows
from walberg.config import parse_config
from walberg.pipeline import Pipelines


def test_two_databases_fan_in_to_one_table(pg_conn: Any, postgres: Any, spark: Any,
                                           warehouse: Path, tmp_path: Path,
                                           unique: str) -> None:
    second = f"{unique}_db2"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {second}")
    dsns = {"east": postgres.dsn, "west": postgres.dsn.rsplit("/", 1)[0] + f"/{second}"}
    conns = {}
    for name, dsn in dsns.items():
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE {unique} (id int PRIMARY KEY, v text)")
            cur.execute(f"INSERT INTO {unique} SELECT g, '{name}' || g "
                        "FROM generate_series(1, 20) g")  # the same ids in both
        conns[name] = conn
    raw = {
        "sources": {name: {"postgres": {"dsn": dsn, "tables": [unique], "slot": f"s_{name}_{unique}",
                                        "publication": f"p_{unique}",
                                        "status_interval_seconds": 1}}
                    for name, dsn in dsns.items()},
        "sink": {"catalog": {"name": "lake", "warehouse": str(warehouse)},
                 "namespace": f"ns_{unique}"},
        "buffer": {"dir": str(tmp_path / "segments"), "max_interval_seconds": 0.5},
    }
    config = parse_config(raw, tmp_path)
    target = config.for_source("east").target_for(f"public.{unique}")
    assert target == config.for_source("west").target_for(f"public.{unique}")

    def run() -> None:
        several = Pipelines(config, session=spark)
        try:
            several.run(once=True)
        finally:
            several.close()

    def expected() -> list[tuple[str, int, str]]:
        rows = []
        for name, conn in conns.items():
            with conn.cursor() as cur:
                cur.execute(f"SELECT id, v FROM {unique}")
                rows += [(name, i, v) for i, v in cur.fetchall()]
        return sorted(rows)

    run()
    with conns["east"].cursor() as cur:
        cur.execute(f"UPDATE {unique} SET v = 'changed' WHERE id <= 5")
        cur.execute(f"DELETE FROM {unique} WHERE id > 18")
    with conns["west"].cursor() as cur:
        cur.execute(f"INSERT INTO {unique} VALUES (100, 'only west')")
        cur.execute(f"TRUNCATE {unique}")
        cur.execute(f"INSERT INTO {unique} VALUES (1, 'after truncate')")
    run()

    _, namespace, name = target.split(".")
    meta = warehouse / namespace / name / "metadata"
    version = (meta / "version-hint.text").read_text().strip()
    table = StaticTable.from_metadata(str(meta / f"v{version}.metadata.json"))
    got = sorted((r["_walberg_source"], r["id"], r["v"])
                 for r in table.scan().to_arrow().to_pylist())
    assert got == expected()
    assert sorted((r["id"], r["v"]) for r in duckdb_rows(warehouse, target, key="id")) == \
        sorted((i, v) for _, i, v in expected())
    summaries = [s.summary.additional_properties for s in table.snapshots()]
    assert any("walberg.lsn.east" in s for s in summaries)
    assert any("walberg.lsn.west" in s for s in summaries)
    assert [f.name for f in table.spec().fields][0] == "_walberg_source"

    several = Pipelines(config, session=spark)
    try:
        verdicts = several.verify()
    finally:
        several.close()
    assert [(v.source, v.equal) for v in verdicts] == [
        (f"east:public.{unique}", True), (f"west:public.{unique}", True)]
    for conn in conns.values():
        conn.close()
    # status (and check) go through every source, without Spark.
    import json
    import subprocess
    import sys

    import yaml

    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, "-m", "walberg.cli", "status", "-c", str(path),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert sorted(status) == ["east", "west"]
    for name in ("east", "west"):
        table_status = status[name]["tables"][f"public.{unique}"]
        assert table_status["iceberg_table"] == target and table_status["last_lsn"]
        assert status[name]["slot"]["name"] == f"s_{name}_{unique}"
