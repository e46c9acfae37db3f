"""Per-table layout: target name, partitioning (and its evolution), properties, write mode and
format version, read back by PyIceberg and DuckDB as well as Spark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import as_file, make_config, run_once
from lake import duckdb_rows, hadoop_table, iceberg_rows, postgres_rows
from walberg.apply.iceberg import IcebergSink, normal_transform, spark_transform
from walberg.config import parse_config
from walberg.errors import ConfigError
from walberg.model import Layout
from walberg.pipeline import Pipeline


def _raw(tables: dict[str, Any], **sink: Any) -> dict[str, Any]:
    return {"source": {"postgres": {"dsn": "postgresql://x@127.0.0.1/db",
                                    "tables": ["public.orders", "public.items"]}},
            "sink": {"catalog": {"warehouse": "./wh"}, "tables": tables, **sink}}


def test_layout_config_is_validated_and_defaults_fill_in(tmp_path: Path) -> None:
    config = parse_config(_raw({"orders": {
        "target": "sales.orders_v", "partition_by": ["days(created_at)", "bucket(16, cust)"],
        "properties": {"write.parquet.compression-codec": "none"}, "format_version": 3,
        "write_mode": "copy-on-write"}}, properties={"write.target-file-size-bytes": "1000"}),
        tmp_path)
    assert config.target_for("public.orders") == "lake.sales.orders_v"
    assert config.target_for("public.items") == "lake.public.items"
    layout = config.layout_for("public.orders")
    assert layout.partition_by == ("days(created_at)", "bucket(16, cust)")
    assert layout.properties == {"write.target-file-size-bytes": "1000",
                                 "write.parquet.compression-codec": "uncompressed"}
    assert (layout.format_version, layout.write_mode) == (3, "copy-on-write")
    assert config.layout_for("public.items").format_version == 2
    for bad, message in [
        ({"orders": {"partition_by": ["weeks(x)"]}}, "is not a partition transform"),
        ({"nope": {}}, "sink.tables names public.nope"),
        ({"orders": {"properties": {"write.parquet.compression-codec": "brotli"}}},
         "BrotliCodec"),
        ({"orders": {"target": "public.items"}}, "the same Iceberg table"),
        ({"orders": {"format_version": 4}}, "format_version"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(_raw(bad), tmp_path)


@pytest.mark.parametrize("text, normal, spark", [
    ("days(created_at)", "days(created_at)", "days(`created_at`)"),
    ("day(created_at)", "days(created_at)", "days(`created_at`)"),
    ("bucket(16, customer_id)", "bucket(16,customer_id)", "bucket(16, `customer_id`)"),
    ("identity(region)", "region", "`region`"),
    ("region", "region", "`region`"),
    ("truncate(4, name)", "truncate(4,name)", "truncate(4, `name`)"),
])
def test_transforms_have_one_spelling(text: str, normal: str, spark: str) -> None:
    assert normal_transform(text) == normal and spark_transform(text) == spark


def test_partitioned_copy_on_write_table_and_partition_evolution(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, created_at timestamptz, "
                    "customer_id int, note text)")
        cur.execute(f"INSERT INTO {table} SELECT g, '2026-01-01'::timestamptz + g * interval "
                    "'7 hours', g % 13, 'n' || g FROM generate_series(1, 300) g")
    base = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])

    def with_layout(**layout: Any) -> Any:
        raw = as_file(base)
        raw["sink"]["tables"] = {table: {"target": f"{base.sink.namespace}.{unique}_v", **layout}}
        return parse_config(raw, tmp_path)

    def run(config: Any) -> None:
        p = Pipeline(config, session=spark)
        try:
            p.run(once=True)
        finally:
            p.close()

    config = with_layout(partition_by=["days(created_at)", "bucket(4, customer_id)"],
                         write_mode="copy-on-write",
                         properties={"write.parquet.compression-codec": "gzip"})
    target = config.target_for(table)
    assert target.endswith(f"{unique}_v")
    run(config)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET note = 'u' WHERE id % 10 = 0")
        cur.execute(f"DELETE FROM {table} WHERE id % 7 = 0")
    run(config)
    lake = hadoop_table(warehouse, target)
    assert [f.transform.__class__.__name__ for f in lake.spec().fields] == \
        ["DayTransform", "BucketTransform"]
    props = lake.properties
    assert props["write.merge.mode"] == "copy-on-write"
    assert props["write.parquet.compression-codec"] == "gzip"
    # Spark's writes sorted by partition, a file open at a time (not one per partition).
    assert props["write.spark.fanout.enabled"] == "false"
    files = lake.inspect.files().to_pylist()
    assert files and all(f["content"] == 0 for f in files), "copy-on-write: no delete files"
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)

    # A start with the same layout finds the table as the layout says: nothing to evolve.
    sink = IcebergSink(spark)
    layout = config.layout_for(table)
    assert sink.partitioning(target) == ["days(created_at)", "bucket(4,customer_id)"]
    assert sink.align(target, layout) == []
    also = Layout(("truncate(4, note)",), layout.properties, layout.format_version,
                  layout.write_mode)
    assert sink.align(target, also) == ["drop partition field days(created_at)",
                                        "drop partition field bucket(4,customer_id)",
                                        "add partition field truncate(4,note)"]
    assert sink.align(target, also) == []
    assert IcebergSink(spark).partitioning(target) == ["truncate(4,note)"]

    # Partition evolution: a new spec for new data, the old files stay as they are.
    before = {f["file_path"] for f in lake.inspect.files().to_pylist()}
    config = with_layout(partition_by=["months(created_at)"], write_mode="merge-on-read")
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} SELECT g, '2027-03-01'::timestamptz + g * interval "
                    "'1 day', g % 13, 'late' FROM generate_series(1001, 1100) g")
        cur.execute(f"UPDATE {table} SET note = 'v' WHERE id % 10 = 1")
    run(config)
    lake = hadoop_table(warehouse, target)
    assert [f.transform.__class__.__name__ for f in lake.spec().fields
            if f.transform.__class__.__name__ != "VoidTransform"] == ["MonthTransform"]
    assert len(lake.specs()) > 1  # one spec per ALTER; old files keep theirs
    after = {f["file_path"] for f in lake.inspect.files().to_pylist()}
    assert before & after, "partition evolution must not rewrite the existing data files"
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_format_version_3_table(pg_conn: Any, postgres: Any, spark: Any, warehouse: Path,
                                tmp_path: Path, unique: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 100) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["sink"]["format_version"] = 3
    config = parse_config(raw, tmp_path)
    target = config.target_for(table)
    for step in (None, f"UPDATE {table} SET v = 'x' WHERE id <= 20",
                 f"DELETE FROM {table} WHERE id > 90"):
        if step:
            with pg_conn.cursor() as cur:
                cur.execute(step)
        p = Pipeline(config, session=spark)
        try:
            p.run(once=True)
        finally:
            p.close()
    assert hadoop_table(warehouse, target).metadata.format_version == 3
    got = sorted(tuple(r) for r in spark.sql(f"SELECT id, v FROM {target}").collect())
    assert got == sorted((r["id"], r["v"]) for r in postgres_rows(pg_conn, table))
    # Deletion vectors are read by the other engines too.
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)
    # Going back to version 2 is impossible, and said so.
    raw["sink"]["format_version"] = 2
    with pytest.raises(Exception, match="cannot go back to 2"):
        p = Pipeline(parse_config(raw, tmp_path), session=spark)
        try:
            p.run(once=True)
        finally:
            p.close()


def test_an_lz4_table_warns_of_what_it_costs_its_readers(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """lz4 is a codec Iceberg takes, but Spark writes it with Hadoop's framing, which DuckDB
    refuses (and pyarrow fails on some files of): Spark reads the table back, and each run says
    so once for the table."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, note text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'n' || g FROM generate_series(1, 200) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["sink"]["tables"] = {table: {"properties": {"write.parquet.compression-codec": "LZ4"}}}
    config = parse_config(raw, tmp_path)
    target = config.target_for(table)

    def run() -> list[str]:
        caplog.clear()
        run_once(config, spark)
        return [r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and "lz4" in r.getMessage()]

    with caplog.at_level("INFO", logger="walberg"):
        said = run()
        with pg_conn.cursor() as cur:
            cur.execute(f"UPDATE {table} SET note = 'u' WHERE id % 10 = 0")
            cur.execute(f"INSERT INTO {table} VALUES (500, 'new')")
        said_again = run()
    assert len(said) == 1 and said[0].startswith(f"{target}: ") and "DuckDB" in said[0]
    assert len(said_again) == 1  # once for each run, not for each batch
    assert hadoop_table(warehouse, target).properties["write.parquet.compression-codec"] == "lz4"
    lake = sorted((r["id"], r["note"]) for r in spark.table(target).select("id", "note").collect())
    assert lake == sorted((r["id"], r["note"]) for r in postgres_rows(pg_conn, table))
    # What the warning says of DuckDB: true of this table.
    with pytest.raises(Exception, match="(?i)unsupported compression codec .?lz4"):
        duckdb_rows(warehouse, target)
