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


def test_updates_after_key_changes_keep_the_toasted_value(pg_conn: Any, postgres: Any,
                                                          spark: Any, warehouse: Path,
                                                          tmp_path: Path, unique: str) -> None:
    """An UPDATE of a moved row in the same batch leaves the value unsent too: it is the moved
    row's, which is the old key's. Chains of any length of key changes and updates, and a key
    that a moved row takes over after the key's own row was deleted."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, n int, body text)")
        for i in (1, 2, 3, 5, 6):
            cur.execute(f"INSERT INTO {table} VALUES ({i}, 0, {BIG.format(seed=i)})")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        # The case as reported: a key change, then an update of the new key.
        cur.execute(f"UPDATE {table} SET id = 101 WHERE id = 1")
        cur.execute(f"UPDATE {table} SET n = n + 1 WHERE id = 101")
        # Inserted, moved, updated, in one batch.
        cur.execute(f"INSERT INTO {table} VALUES (7, 0, {BIG.format(seed=7)})")
        cur.execute(f"UPDATE {table} SET id = 70 WHERE id = 7")
        cur.execute(f"UPDATE {table} SET n = 5 WHERE id = 70")
        # Six key changes with updates between them (deeper than any fixed bound).
        cur.execute(f"UPDATE {table} SET n = n + 1 WHERE id = 2")
        for step in range(6):
            cur.execute(f"UPDATE {table} SET id = {300 + step} WHERE id = "
                        f"{2 if step == 0 else 299 + step}")
            cur.execute(f"UPDATE {table} SET n = n + 1 WHERE id = {300 + step}")
        # Key 5 deleted, then row 6 takes key 5 and is updated: its value is 6's, not 5's.
        cur.execute(f"DELETE FROM {table} WHERE id = 5")
        cur.execute(f"UPDATE {table} SET id = 5 WHERE id = 6")
        cur.execute(f"UPDATE {table} SET n = 9 WHERE id = 5")
        # A moved row whose value is then set: the change wins over the carried one.
        cur.execute(f"UPDATE {table} SET id = 30 WHERE id = 3")
        cur.execute(f"UPDATE {table} SET n = 1 WHERE id = 30")
        cur.execute(f"UPDATE {table} SET body = 'small now' WHERE id = 30")
        cur.execute(f"UPDATE {table} SET n = 2 WHERE id = 30")
    run_once(config, spark)
    lake = iceberg_rows(warehouse, config.target_for(table))
    source = postgres_rows(pg_conn, table)
    assert [r["id"] for r in lake] == [5, 30, 70, 101, 305]
    assert all(r["body"] for r in lake), [(r["id"], (r["body"] or "")[:10]) for r in lake]
    assert lake == source


def test_full_identity_update_carries_the_toasted_value_from_the_old_row(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Under REPLICA IDENTITY FULL the old row is sent whole, a value stored out of line
    included: an UPDATE that leaves it untouched still carries it (no key: the table is a
    multiset of rows; with a key too)."""
    bare, keyed = f"public.{unique}_f", f"public.{unique}_k"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {bare} (a int, b text, big text)")
        cur.execute(f"CREATE TABLE {keyed} (id int PRIMARY KEY, b text, big text)")
        for table in (bare, keyed):
            cur.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
            cur.execute(f"ALTER TABLE {table} ALTER big SET STORAGE EXTERNAL")
            cur.execute(f"INSERT INTO {table} SELECT g, 'x', repeat(md5(g::text), 300) "
                        "FROM generate_series(1, 3) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [bare, keyed])
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {bare} SET b = 'y' WHERE a = 1")
        cur.execute(f"UPDATE {keyed} SET b = 'y' WHERE id = 1")
        cur.execute(f"UPDATE {keyed} SET id = 10 WHERE id = 2")
    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(bare), key="a") == \
        postgres_rows(pg_conn, bare, key="a")
    lake = iceberg_rows(warehouse, config.target_for(keyed))
    assert all(len(r["big"] or "") == 9600 for r in lake)
    assert lake == postgres_rows(pg_conn, keyed)
