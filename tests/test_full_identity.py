"""A table with no primary key, REPLICA IDENTITY FULL, where equal rows repeat: the lake holds
the same multiset of rows as Postgres through inserts, deletes and updates of one copy, and a
TRUNCATE."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

from conftest import make_config, run_once
from lake import iceberg_rows
from walberg.lake.services import Lake
from walberg.ops.verify import verify


def test_duplicate_rows_without_a_key_stay_duplicates(pg_conn: Any, postgres: Any, spark: Any,
                                                     warehouse: Path, tmp_path: Path,
                                                     unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (n int, v text)")
        cur.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'a'), (1, 'a'), (1, 'a'), (2, 'b'), "
                    "(3, NULL), (3, NULL)")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)

    def source() -> Counter[tuple[Any, ...]]:
        with pg_conn.cursor() as cur:
            cur.execute(f"SELECT n, v FROM {table}")
            return Counter(cur.fetchall())

    def lake() -> Counter[tuple[Any, ...]]:
        return Counter((r["n"], r["v"]) for r in iceberg_rows(warehouse, target, key="n"))

    run_once(config, spark)
    assert lake() == source()
    one = f"(SELECT ctid FROM {table} WHERE n = %s AND v IS NOT DISTINCT FROM %s LIMIT 1)"
    with pg_conn.cursor() as cur:
        cur.execute(f"DELETE FROM {table} WHERE ctid = {one}", (1, "a"))  # one of three copies
        cur.execute(f"UPDATE {table} SET v = 'c' WHERE ctid = {one}", (3, None))  # one of two
        cur.execute(f"INSERT INTO {table} VALUES (2, 'b'), (4, 'd')")
        cur.execute(f"DELETE FROM {table} WHERE ctid = {one}", (4, "d"))  # in the same batch
    run_once(config, spark)
    assert lake() == source() == Counter({(1, "a"): 2, (2, "b"): 2, (3, None): 1, (3, "c"): 1})
    with pg_conn.cursor() as cur:
        cur.execute(f"TRUNCATE {table}")
        cur.execute(f"INSERT INTO {table} VALUES (5, 'e'), (5, 'e')")
    run_once(config, spark)
    assert lake() == source() == Counter({(5, "e"): 2})
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake)
    assert verdict.equal, verdict


def test_replica_identity_using_index_and_a_truncate_of_two_tables(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """REPLICA IDENTITY USING INDEX (a unique index, no primary key) identifies rows by that
    index's columns; a TRUNCATE of two tables in one statement empties both."""
    a, b = f"public.{unique}_a", f"public.{unique}_b"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {a} (code text NOT NULL, n int, note text)")
        cur.execute(f"CREATE UNIQUE INDEX {unique}_code ON {a} (code)")
        cur.execute(f"ALTER TABLE {a} REPLICA IDENTITY USING INDEX {unique}_code")
        cur.execute(f"CREATE TABLE {b} (id int PRIMARY KEY)")
        cur.execute(f"INSERT INTO {a} SELECT 'c' || g, g, 'x' FROM generate_series(1, 20) g")
        cur.execute(f"INSERT INTO {b} SELECT g FROM generate_series(1, 5) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [a, b])
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {a} SET n = n * 10 WHERE n <= 5")
        cur.execute(f"UPDATE {a} SET code = 'moved' WHERE code = 'c6'")  # the identity changes
        cur.execute(f"DELETE FROM {a} WHERE n = 20")
    run_once(config, spark)
    key = "code"
    assert iceberg_rows(warehouse, config.target_for(a), key) == \
        _rows(pg_conn, a, key)
    with pg_conn.cursor() as cur:
        cur.execute(f"TRUNCATE {a}, {b}")
        cur.execute(f"INSERT INTO {b} VALUES (42)")
    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(a), key) == []
    assert iceberg_rows(warehouse, config.target_for(b)) == [{"id": 42}]


def _rows(conn: Any, table: str, key: str) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {table} ORDER BY {key}")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def test_a_delete_whose_old_row_holds_a_value_the_lake_cannot_store(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """REPLICA IDENTITY FULL with a primary key: the old row of an update or a delete is sent
    whole. Rows updated to values the lake cannot store ('infinity', NaN in a decimal) and then
    deleted are gone from the lake, as from Postgres."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, n numeric(6,2), ts timestamp)")
        cur.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
        cur.execute(f"INSERT INTO {table} SELECT g, g, '2020-01-01' FROM generate_series(1, 4) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET ts = 'infinity' WHERE id = 1")
        cur.execute(f"UPDATE {table} SET n = 'NaN' WHERE id IN (2, 3)")
        cur.execute(f"INSERT INTO {table} VALUES (5, 'NaN', 'infinity')")
        cur.execute(f"DELETE FROM {table} WHERE id IN (1, 2, 5)")
    run_once(config, spark)
    # 3's update is a dead letter: under FULL every column is the key, so it is the old row's
    # delete and the new row's insert, which cannot be written; the lake holds neither.
    assert [r["id"] for r in iceberg_rows(warehouse, target)] == [4]
    assert _rows(pg_conn, table, "id")[0]["id"] == 3
    # The change that makes a row writable again puts it back (docs/types.md, dead letters),
    # and a key change away from a value the lake could not hold deletes nothing it holds.
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET n = 3.5 WHERE id = 3")
        cur.execute(f"UPDATE {table} SET ts = 'infinity' WHERE id = 4")
    run_once(config, spark)
    assert [(r["id"], r["n"]) for r in iceberg_rows(warehouse, target)] == [(3, Decimal("3.50"))]
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET id = 6, ts = '2021-01-01' WHERE id = 4")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == _rows(pg_conn, table, "id")
    assert [r["id"] for r in iceberg_rows(warehouse, target)] == [3, 6]
