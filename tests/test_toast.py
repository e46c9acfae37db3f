"""Unchanged TOASTed values: an UPDATE that does not touch a large value does not carry it, and
the lake must keep it, also when the same UPDATE changes the primary key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import make_config, run_once
from lake import iceberg_rows, postgres_rows

BIG = "(SELECT string_agg(md5(g::text || {seed}), '') FROM generate_series(1, 400) g)"


def test_key_change_keeps_the_unsent_toasted_value(pg_conn: Any, postgres: Any, spark: Any,
                                                   warehouse: Path, tmp_path: Path,
                                                   unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int, big text)")
        for i in (1, 2, 3):
            cur.execute(f"INSERT INTO {table} VALUES ({i}, 0, {BIG.format(seed=i)})")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        # The old key's value is only in the lake:
        cur.execute(f"UPDATE {table} SET id = 10 WHERE id = 1")
        # ... or set earlier in the same batch (inserted, then moved, then moved again):
        cur.execute(f"INSERT INTO {table} VALUES (4, 0, {BIG.format(seed=4)})")
        cur.execute(f"UPDATE {table} SET id = 40 WHERE id = 4")
        cur.execute(f"UPDATE {table} SET id = 41, v = 1 WHERE id = 40")
        # ... or moved after an update that left it untouched too:
        cur.execute(f"UPDATE {table} SET v = 2 WHERE id = 2")
        cur.execute(f"UPDATE {table} SET id = 20 WHERE id = 2")
        # and a moved key that then gets the value changed: the change wins.
        cur.execute(f"UPDATE {table} SET id = 30 WHERE id = 3")
        cur.execute(f"UPDATE {table} SET big = 'small now' WHERE id = 30")
    run_once(config, spark)
    lake = iceberg_rows(warehouse, config.target_for(table))
    source = postgres_rows(pg_conn, table)
    assert [r["id"] for r in lake] == [10, 20, 30, 41]
    assert all(r["big"] for r in lake), [(r["id"], (r["big"] or "")[:10]) for r in lake]
    assert lake == source
