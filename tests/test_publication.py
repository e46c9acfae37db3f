"""The lake holds exactly what the publication publishes, from the initial copy on: row filters
and column lists (combined across publications as PostgreSQL's subscriber combines them) and
PostgreSQL 18's generated columns. The reference is a real PostgreSQL subscriber of the same
publications, in a database of its own on the test server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import insert_lsn, make_config, run_once
from lake import iceberg_rows, postgres_rows
from walberg.config import parse_config
from walberg.lake.services import Lake
from walberg.ops.check import check
from walberg.ops.resync import plan, resync
from walberg.ops.verify import verify


def _with_publications(postgres: Any, warehouse: Path, tmp_path: Path, name: str, table: str,
                       publications: list[str], method: str = "copy") -> Any:
    raw = {
        "source": {"postgres": {"dsn": postgres.dsn, "slot": f"slot_{name}",
                                "publication": publications, "tables": [table],
                                "status_interval_seconds": 1,
                                "initial_copy": {"method": method}}},
        "sink": {"catalog": {"name": "lake", "type": "hadoop", "warehouse": str(warehouse)},
                 "namespace": f"ns_{name}"},
        "buffer": {"dir": str(tmp_path / "segments"), "max_interval_seconds": 0.5},
        "spark": {"master": "local[2]"},
    }
    return parse_config(raw, tmp_path, "test config")


@pytest.mark.parametrize("method", ["copy", "jdbc"])
def test_row_filters_and_column_list_land_as_a_subscriber_holds_them(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        subscriber: Any, method: str) -> None:
    name = f"{unique}_{method}"
    table = f"public.{name}"
    pub_even, pub_range = f"pub_even_{name}", f"pub_range_{name}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, region text, v numeric(8,2), "
                    "secret text)")
        cur.execute(f"INSERT INTO {table} SELECT g, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' "
                    "END, g * 1.5, 'secret ' || g FROM generate_series(1, 100) g")
        # Two publications of one table: different row filters, the same column list.
        cur.execute(f"CREATE PUBLICATION {pub_even} FOR TABLE {table} (id, region, v) "
                    "WHERE (id % 2 = 0)")
        cur.execute(f"CREATE PUBLICATION {pub_range} FOR TABLE {table} (id, region, v) "
                    "WHERE (id BETWEEN 91 AND 95)")
    published = f"SELECT id, region, v FROM {table} WHERE id % 2 = 0 OR id BETWEEN 91 AND 95"
    sub = subscriber(f"sub_{name}", [pub_even, pub_range],
                     f"CREATE TABLE {table} (id int PRIMARY KEY, region text, v numeric(8,2))")
    config = _with_publications(postgres, warehouse, tmp_path, name, table,
                                [pub_even, pub_range], method)
    target = config.target_for(table)

    # check shows what will land.
    with Lake(config, session=spark) as lake:
        [checks] = check(lake)
    tables = next(r for r in checks.results if r.name == "tables")
    assert tables.ok, tables.detail
    assert "(id % 2) = 0" in tables.detail and "id >= 91" in tables.detail, tables.detail
    assert "columns (id, region, v)" in tables.detail, tables.detail

    report = run_once(config, spark)
    assert report.copied == {table: 53}  # 50 even ids, and 91, 93, 95
    sub.caught_up(insert_lsn(pg_conn))
    lake = iceberg_rows(warehouse, target)
    assert lake == sub.rows(table) == postgres_rows(pg_conn, f"({published}) AS p")
    assert "secret" not in lake[0]

    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (1000, 'eu', 1, 's'), (1001, 'us', 2, 's')")
        cur.execute(f"UPDATE {table} SET id = 2000 WHERE id = 3")  # into the filter: an insert
        cur.execute(f"UPDATE {table} SET id = 2001 WHERE id = 10")  # out of it: a delete
        cur.execute(f"UPDATE {table} SET v = v + 100 WHERE id IN (20, 93, 33)")  # 33: not published
        cur.execute(f"DELETE FROM {table} WHERE id IN (30, 31, 92)")
        cur.execute(f"UPDATE {table} SET secret = 'changed' WHERE id = 40")
    run_once(config, spark)
    sub.caught_up(insert_lsn(pg_conn))
    lake = iceberg_rows(warehouse, target)
    assert lake == sub.rows(table) == postgres_rows(pg_conn, f"({published}) AS p")
    ids = {r["id"] for r in lake}
    assert {1000, 2000} <= ids and not ids & {1001, 2001, 3, 10, 33, 30, 31}

    with Lake(config, session=spark) as opened:
        [verdict] = verify(opened)
        assert verdict.equal and verdict.source_rows == len(lake), verdict
        # A resync copies the same rows again, and still only those.
        resynced = resync(opened, plan(opened, [table]))
    assert resynced[None].copied == {table: len(lake)}
    assert iceberg_rows(warehouse, target) == sub.rows(table)

    # Published rows change (the filter now takes odd ids): the lake no longer holds what the
    # publication publishes, and verify says so.
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER PUBLICATION {pub_even} SET TABLE {table} (id, region, v) "
                    "WHERE (id % 2 = 1)")
    with Lake(config, session=spark) as opened:
        [verdict] = verify(opened, attempts=1)
    assert not verdict.equal


def test_generated_columns_land_only_where_the_publication_publishes_them(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    with pg_conn.cursor() as cur:
        cur.execute("SHOW server_version_num")
        if int(cur.fetchone()[0]) < 180000:
            pytest.skip("generated columns are published from PostgreSQL 18 on")
    landed = {}
    for publish in ("none", "stored"):
        name = f"{unique}_{publish}"
        table = f"public.{name}"
        with pg_conn.cursor() as cur:
            cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, a int, "
                        "doubled int GENERATED ALWAYS AS (a * 2) STORED)")
            cur.execute(f"INSERT INTO {table} (id, a) SELECT g, g FROM generate_series(1, 20) g")
            cur.execute(f"CREATE PUBLICATION pub_{name} FOR TABLE {table} "
                        f"WITH (publish_generated_columns = {publish})")
        config = make_config(postgres, warehouse, tmp_path / f"segments_{publish}", name,
                             [table])
        target = config.target_for(table)
        run_once(config, spark)
        with pg_conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} (id, a) VALUES (100, 50)")
            cur.execute(f"UPDATE {table} SET a = a + 1 WHERE id <= 5")
            cur.execute(f"DELETE FROM {table} WHERE id = 20")
        run_once(config, spark)
        columns = "id, a, doubled" if publish == "stored" else "id, a"
        landed[publish] = iceberg_rows(warehouse, target)
        assert landed[publish] == postgres_rows(pg_conn, f"(SELECT {columns} FROM {table}) AS p")
        with Lake(config, session=spark) as lake:
            [verdict] = verify(lake)
        assert verdict.equal, verdict
    assert "doubled" not in landed["none"][0]
    assert landed["stored"][0]["doubled"] == 2 * landed["stored"][0]["a"]


def test_tables_described_together_keep_each_its_own_columns_filter_and_key(
        pg_conn: Any, unique: str) -> None:
    """A start describes every table in three queries (``describe_tables``): each table keeps
    its own column list, row filter, replica identity, keys and array dimensions, as it is
    described alone, and one that does not exist is named."""
    from walberg.errors import SourceError
    from walberg.source.postgres import describe_table, describe_tables

    a, b, c = (f"public.{unique}_{x}" for x in "abc")
    pub, other = f"{unique}_pub", f"{unique}_other"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {a} (id int PRIMARY KEY, secret text, v int)")
        cur.execute(f"CREATE TABLE {b} (k1 int, k2 bigint, tags text[][], note text, "
                    f"PRIMARY KEY (k1, k2))")
        cur.execute(f"CREATE TABLE {c} (u uuid NOT NULL, w text)")
        cur.execute(f"CREATE UNIQUE INDEX {unique}_cu ON {c} (u)")
        cur.execute(f"ALTER TABLE {c} REPLICA IDENTITY USING INDEX {unique}_cu")
        cur.execute(f"CREATE PUBLICATION {pub} FOR TABLE {a} (id, v) WHERE (v > 3), {b}, {c}")
        cur.execute(f"CREATE PUBLICATION {other} FOR TABLE {b} WHERE (k1 < 10)")
    together = describe_tables(pg_conn, [a, b, c], [pub, other])
    assert together == {t: describe_table(pg_conn, t, [pub, other]) for t in (a, b, c)}
    assert [col.name for col in together[a].columns] == ["id", "v"]
    assert together[a].column_list and together[a].row_filter == "((v > 3))"
    assert [col.name for col in together[b].columns if col.is_key] == ["k1", "k2"]
    assert together[b].row_filter is None  # (published whole by one of the two)
    assert together[b].dims == {"tags": 2}
    assert (together[c].replica_identity, [x.name for x in together[c].columns if x.is_key]) \
        == ("i", ["u"])
    assert together[c].row_filter is None and not together[c].column_list
    with pytest.raises(SourceError, match=f"{unique}_gone .*does not exist"):
        describe_tables(pg_conn, [a, f"public.{unique}_gone"], [pub])
