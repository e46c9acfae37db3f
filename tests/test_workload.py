"""A seeded random workload while walberg streams: mixed DML in transactions of one to many
statements over several tables (one partitioned, one with TOAST-sized values, two schemas),
key updates, TRUNCATE, and ALTER TABLE on the way; it ends with `walberg verify` equal for every
table and PyIceberg reading what Postgres holds."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from conftest import insert_lsn, make_config, running
from lake import iceberg_rows, postgres_rows
from walberg.lake.services import Lake
from walberg.ops.verify import verify
from walberg.pipeline import Pipeline

STEPS = int(os.environ.get("WALBERG_TEST_STEPS", "300"))


def test_random_workload_ends_with_verify_equal(pg_conn: Any, postgres: Any, spark: Any,
                                                warehouse: Path, tmp_path: Path,
                                                unique: str) -> None:
    seed = int(os.environ.get("WALBERG_TEST_SEED", "20261121"))
    rng = random.Random(seed)
    a, b, p = f"public.{unique}_a", f"{unique}_s.b", f"public.{unique}_p"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE SCHEMA {unique}_s")
        cur.execute(f"CREATE TABLE {a} (id int PRIMARY KEY, n numeric(12,2), t text, "
                    "ts timestamptz, arr int[])")
        cur.execute(f"CREATE TABLE {b} (k text PRIMARY KEY, v bigint, big text)")
        cur.execute(f"CREATE TABLE {p} (id int, region text, v int, PRIMARY KEY (id, region)) "
                    "PARTITION BY LIST (region)")
        cur.execute(f"CREATE TABLE {p}_eu PARTITION OF {p} FOR VALUES IN ('eu')")
        cur.execute(f"CREATE TABLE {p}_us PARTITION OF {p} FOR VALUES IN ('us')")
        cur.execute(f"INSERT INTO {a} SELECT g, g * 1.5, 't' || g, '2024-01-01'::timestamptz "
                    "+ g * interval '1 hour', ARRAY[g, NULL] FROM generate_series(1, 200) g")
        cur.execute(f"INSERT INTO {b} SELECT 'k' || g, g, repeat(md5(g::text), 400) "
                    "FROM generate_series(1, 50) g")  # 12.8 kB: TOASTed
        cur.execute(f"INSERT INTO {p} SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g "
                    "FROM generate_series(1, 100) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [a, b, p],
                         max_segment_bytes=64 * 1024)
    next_id = {"a": 10_000, "b": 10_000, "p": 10_000}
    altered: list[str] = []

    def statement() -> str:
        table = rng.choice("aaabbp")
        roll = rng.random()
        if table == "a":
            if roll < 0.3:
                next_id["a"] += 1
                return (f"INSERT INTO {a} (id, n, t, arr) VALUES ({next_id['a']}, "
                        f"{rng.randint(-10**9, 10**9) / 100}, 'i{rng.random()}', "
                        f"ARRAY[{rng.randint(0, 9)}, NULL, {rng.randint(0, 9)}])")
            if roll < 0.55:
                return (f"UPDATE {a} SET n = n + 1, t = t || 'u' WHERE id %% 7 = "
                        f"{rng.randint(0, 6)} AND id < {rng.randint(50, 400)}")
            if roll < 0.65:  # the primary key changes
                next_id["a"] += 1
                return f"UPDATE {a} SET id = {next_id['a']} WHERE id = {rng.randint(1, 300)}"
            if roll < 0.8:
                return f"DELETE FROM {a} WHERE id = {rng.randint(1, 300)}"
            if roll < 0.83 and len(altered) < 2:
                column = f"extra{len(altered)}"
                altered.append(column)
                return f"ALTER TABLE {a} ADD COLUMN {column} int DEFAULT {len(altered)}"
            if roll < 0.84:
                return f"TRUNCATE {a}"
            return f"UPDATE {a} SET ts = now() WHERE id = {rng.randint(1, 300)}"
        if table == "b":
            if roll < 0.3:
                next_id["b"] += 1
                return (f"INSERT INTO {b} VALUES ('k{next_id['b']}', {rng.randint(0, 99)}, "
                        f"repeat('{rng.choice('xyz')}', {rng.randint(1, 20000)}))")
            if roll < 0.7:  # leaves the TOASTed value untouched
                return f"UPDATE {b} SET v = v + 1 WHERE k = 'k{rng.randint(1, 60)}'"
            if roll < 0.85:
                return f"UPDATE {b} SET big = big || 'z' WHERE k = 'k{rng.randint(1, 60)}'"
            return f"DELETE FROM {b} WHERE k = 'k{rng.randint(1, 60)}'"
        if roll < 0.4:
            next_id["p"] += 1
            return f"INSERT INTO {p} VALUES ({next_id['p']}, '{rng.choice(['eu', 'us'])}', 1)"
        if roll < 0.7:
            return f"UPDATE {p} SET v = v + 1 WHERE id %% 5 = {rng.randint(0, 4)}"
        if roll < 0.85:  # moves a row to the other partition
            return (f"UPDATE {p} SET region = CASE region WHEN 'eu' THEN 'us' ELSE 'eu' END "
                    f"WHERE id = {rng.randint(1, 100)}")
        return f"DELETE FROM {p} WHERE id = {rng.randint(1, 120)}"

    pipeline = Pipeline(config, session=spark)
    with running(pipeline) as failures:
        # The workload runs while walberg streams, not before its slot exists.
        pipeline.wait_for(insert_lsn(pg_conn), timeout=120)
        done = 0
        with pg_conn.cursor() as cur:
            while done < STEPS and not failures:
                size = rng.choice([1, 1, 1, 3, 10])
                cur.execute("BEGIN")
                for _ in range(size):
                    text = statement()
                    if text.startswith("ALTER"):
                        cur.execute("COMMIT")  # ALTER in a transaction of its own
                        cur.execute(text)
                        cur.execute("BEGIN")
                    else:
                        cur.execute(text.replace("%%", "%"))
                cur.execute("ROLLBACK" if rng.random() < 0.05 else "COMMIT")
                done += size
            end = insert_lsn(pg_conn)
        pipeline.wait_for(end, timeout=300)
        assert not failures, failures
    with Lake(config, session=spark) as lake:
        verdicts = verify(lake)
    assert [v.source for v in verdicts if not v.equal] == [], (seed, verdicts)
    for table, key in ((a, "id"), (b, "k")):
        assert iceberg_rows(warehouse, config.target_for(table), key) == \
            postgres_rows(pg_conn, table, key), seed
