"""A table that cannot follow its source is parked; every other table goes on, run after run.

One pipeline of five tables; four are stopped at once, each by another of walberg's causes (a
type change Iceberg cannot make, a lost key, an ALTER TABLE amid a transaction's changes, a
column of a type walberg has no mapping for); the fifth keeps changing. Each later run
applies the fifth and ends with exit code 3; `status`, `check` and the metric say which tables
are parked and why; the slot still holds the parked tables' changes; `walberg resync` of a
parked table brings it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import make_config, run_once, walberg_cli, write_pipeline
from lake import iceberg_rows, postgres_rows
from walberg import metrics
from walberg.errors import TablesParked
from walberg.lake.services import Lake
from walberg.ops.check import check
from walberg.ops.resync import plan, resync
from walberg.ops.status import status

CAUSES = {
    # table suffix: (statements that stop it, words of its reason)
    "retyped": (["ALTER TABLE {t} ALTER COLUMN b TYPE int USING length(b)",
                 "INSERT INTO {t} VALUES (10, 10)"], "Iceberg cannot do in place"),
    "keyless": (["ALTER TABLE {t} REPLICA IDENTITY NOTHING", "INSERT INTO {t} VALUES (10, 'k')"],
                "REPLICA IDENTITY NOTHING"),
    "midtxn": (["BEGIN", "INSERT INTO {t} VALUES (10, 'm')", "ALTER TABLE {t} ADD c int",
                "INSERT INTO {t} VALUES (11, 'n', 11)", "COMMIT"],
               "inside a transaction that changed rows"),
    "cube": (["CREATE EXTENSION IF NOT EXISTS cube", "ALTER TABLE {t} ADD c cube",
              "INSERT INTO {t} VALUES (10, 'o', '(1,2)')"], "sink.text_types"),
}


def _equal(pg_conn: Any, warehouse: Path, config: Any, table: str) -> int:
    lake = iceberg_rows(warehouse, config.target_for(table), key="a")
    assert lake == postgres_rows(pg_conn, table, key="a"), table
    return len(lake)


def _streamed_again(pg_conn: Any, unique: str) -> set[str]:
    """The tables whose changes the slot still holds: what a next run is sent (peeked, the
    slot left where it is), named by pgoutput's relation messages."""
    names = set()
    with pg_conn.cursor() as cur:
        cur.execute("SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                    "'proto_version', '1', 'publication_names', %s)",
                    (f"slot_{unique}", f"pub_{unique}"))
        for (data,) in cur.fetchall():
            data = bytes(data)
            if data[:1] == b"R":  # 'R', oid (4 bytes), namespace NUL, name NUL, ...
                namespace, name = data[5:].split(b"\0")[:2]
                names.add(f"{namespace.decode()}.{name.decode()}")
    return names


def test_a_table_that_cannot_follow_is_parked_and_the_others_go_on(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    stopped = {cause: f"public.{unique}_{cause}" for cause in CAUSES}
    healthy = f"public.{unique}_ok"
    tables = [*stopped.values(), healthy]
    with pg_conn.cursor() as cur:
        for t in tables:
            cur.execute(f"CREATE TABLE {t} (a int PRIMARY KEY, b text)")
            cur.execute(f"INSERT INTO {t} SELECT g, 'v' || g FROM generate_series(1, 5) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, tables)
    run_once(config, spark)

    with pg_conn.cursor() as cur:
        for cause, (statements, _) in CAUSES.items():
            for statement in statements:
                cur.execute(statement.format(t=stopped[cause]))
        cur.execute(f"INSERT INTO {healthy} VALUES (6, 'six')")
        cur.execute(f"UPDATE {healthy} SET b = 'one' WHERE a = 1")

    with pytest.raises(TablesParked) as parked:
        run_once(config, spark)
    assert set(parked.value.parked) == set(stopped.values())
    for cause, (_, words) in CAUSES.items():
        assert words in parked.value.parked[stopped[cause]], (cause, parked.value.parked)
    assert _equal(pg_conn, warehouse, config, healthy) == 6
    for t in stopped.values():
        assert metrics.TABLE_STOPPED.labels(t)._value.get() == 1

    # Later runs: the parked tables are skipped from the start (none is stopped again, nor
    # stops the others), the healthy table goes on, the run says so with exit code 3.
    with pg_conn.cursor() as cur:
        cur.execute(f"DELETE FROM {healthy} WHERE a = 2")
        cur.execute(f"INSERT INTO {stopped['retyped']} VALUES (12, 12)")
    path = write_pipeline(config, tmp_path / "pipeline.yaml")
    done = walberg_cli("-q", "run", "--once", "-c", str(path))
    said = " ".join(done.stderr.split())
    assert done.returncode == 3, said[-3000:]
    assert "4 table(s) parked" in said and "walberg resync" in said, said[-3000:]
    assert _equal(pg_conn, warehouse, config, healthy) == 5
    # The slot keeps every parked table's changes for it: a next run is sent them again.
    assert set(stopped.values()) <= _streamed_again(pg_conn, unique)

    with Lake(config, session=spark) as lake:
        told = status(lake)[0].tables
        checked = {r.name: r for r in check(lake)[0].results}
    for cause, (_, words) in CAUSES.items():
        assert told[stopped[cause]].parked and words in told[stopped[cause]].parked
    assert told[healthy].parked is None
    assert not checked["parked tables"].ok
    assert all(t in checked["parked tables"].detail for t in stopped.values())

    # resync of a parked table ends its park: copied afresh, it follows its source again.
    with Lake(config, session=spark) as lake:
        resync(lake, plan(lake, [stopped["retyped"], stopped["midtxn"]]))
    for cause in ("retyped", "midtxn"):
        _equal(pg_conn, warehouse, config, stopped[cause])
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {stopped['midtxn']} VALUES (20, 'after', 20)")
        cur.execute(f"INSERT INTO {healthy} VALUES (7, 'seven')")
    with pytest.raises(TablesParked) as parked:
        run_once(config, spark)
    assert set(parked.value.parked) == {stopped["keyless"], stopped["cube"]}
    for t in (stopped["retyped"], stopped["midtxn"], healthy):
        _equal(pg_conn, warehouse, config, t)
