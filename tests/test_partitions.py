"""The driver's partition transforms against Iceberg's own: the same rows, written by Spark
(whose Iceberg writer computes each row's partition) and split by ``Partitioner``, land in the
same partitions; then files written on the driver with those partitions read back whole, and
filtered reads (which prune by partition) find every row."""

from __future__ import annotations

import datetime
import gc
import itertools
import threading
from pathlib import Path
from typing import Any

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from walberg.apply.jvm.helper import batch_helper
from walberg.apply.position import datafiles
from walberg.apply.position.partitions import HIVE_NULL, NotHere, Partitioner, _murmur3_longs, _murmur3_text
from walberg.apply.session import java_items, java_table

UTC = datetime.timezone.utc
INTS = [0, 1, -1, 9, -9, 10, -10, 11, 2**31 - 1, -2**31, 123456, None]
LONGS = [0, -1, 7, -7, 2**63 - 1, -2**63 + 5, 123456789012, -123456789012, None]
TEXTS = ["", "a", "abc", "ü", "日本語テキスト", "😀x😀", "a/b=c%d", "null", "A longer text",
         "  spaces ", None]
DATES = [datetime.date(1970, 1, 1), datetime.date(1969, 12, 31), datetime.date(1900, 2, 28),
         datetime.date(2024, 2, 29), datetime.date(1, 1, 1), datetime.date(9999, 12, 31),
         datetime.date(1969, 1, 1), datetime.date(1968, 12, 31), None]
STAMPS = [datetime.datetime(1970, 1, 1, tzinfo=UTC),
          datetime.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
          datetime.datetime(1969, 12, 31, 23, 0, tzinfo=UTC),
          datetime.datetime(1900, 1, 1, 0, 30, tzinfo=UTC),
          datetime.datetime(2024, 3, 10, 2, 30, 0, 1, tzinfo=UTC),
          datetime.datetime(2024, 12, 31, 23, 59, 59, tzinfo=UTC),
          datetime.datetime(1950, 6, 15, 12, 0, tzinfo=UTC), None]
COLUMNS = ["i", "l", "s", "s2", "d", "d2", "d3", "t", "t2", "t3", "t4", "b"]
PARTITIONING = ("i, b, s2, bucket(16, i), truncate(10, i), bucket(5, l), truncate(7, l), "
                "bucket(9, s), truncate(2, s), years(d), months(d2), days(d3), bucket(4, d), "
                "hours(t), days(t2), months(t3), years(t4), bucket(6, t)")


def _rows(n: int) -> pa.Table:
    def cycle(values: list[Any], step: int) -> list[Any]:
        return [values[(k * step) % len(values)] for k in range(n)]

    stamp = pa.timestamp("us", "UTC")
    return pa.table({
        "id": pa.array(range(n), pa.int64()),
        "i": pa.array(cycle(INTS, 1), pa.int32()), "l": pa.array(cycle(LONGS, 1), pa.int64()),
        "s": pa.array(cycle(TEXTS, 1), pa.string()), "s2": pa.array(cycle(TEXTS, 3)),
        "d": pa.array(cycle(DATES, 1), pa.date32()), "d2": pa.array(cycle(DATES, 2), pa.date32()),
        "d3": pa.array(cycle(DATES, 4), pa.date32()), "t": pa.array(cycle(STAMPS, 1), stamp),
        "t2": pa.array(cycle(STAMPS, 3), stamp), "t3": pa.array(cycle(STAMPS, 5), stamp),
        "t4": pa.array(cycle(STAMPS, 7), stamp),
        "b": pa.array(cycle([True, False, None], 1), pa.bool_()),
    })


def _as_text(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime.date):
        return value.isoformat()
    return None if value is None else str(value)


def test_partitions_are_icebergs(spark: Any, tmp_path: Path, unique: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every transform the driver computes (identity, bucket, truncate, years, months, days,
    hours over ints, longs, text, dates, timestamps, booleans; before 1970, negatives, nulls,
    text beyond ASCII) puts each row in the partition Iceberg's writer puts it in."""
    rows = _rows(200)
    staged = tmp_path / "rows.parquet"
    pq.write_table(rows, staged)
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    by_spark, by_driver = f"lake.parts.{unique}_spark", f"lake.parts.{unique}_driver"
    for name in (by_spark, by_driver):
        spark.sql(f"CREATE TABLE {name} (id BIGINT, i INT, l BIGINT, s STRING, s2 STRING, "
                  "d DATE, d2 DATE, d3 DATE, t TIMESTAMP, t2 TIMESTAMP, t3 TIMESTAMP, "
                  f"t4 TIMESTAMP, b BOOLEAN) USING iceberg PARTITIONED BY ({PARTITIONING}) "
                  "TBLPROPERTIES ('format-version'='2')")
    spark.read.option("datetimeRebaseMode", "CORRECTED").parquet(str(staged)) \
        .writeTo(by_spark).append()
    theirs = {r["id"]: [_as_text(v) for v in r["_partition"]]
              for r in spark.sql(f"SELECT id, _partition FROM {by_spark}").collect()}

    table = java_table(spark, by_driver)
    schema = pa.schema([pa.field(f.name, f.type, metadata=datafiles.field_id_metadata(
        table.schema().findField(f.name).fieldId())) for f in rows.schema])
    partitioner = Partitioner.of(table, schema)
    assert isinstance(partitioner, Partitioner), partitioner
    ours = {}
    groups = 0
    for values, members in partitioner.split(rows):
        groups += 1
        for row_id in members.column("id").to_pylist():
            ours[row_id] = values
    assert groups == len({tuple(v) for v in theirs.values()}) > 100
    wrong = {i: (ours.get(i), theirs[i]) for i in theirs if ours.get(i) != theirs[i]}
    assert not wrong, list(wrong.items())[:5]

    # Written on the driver in those partitions: the same partitions in the table's metadata,
    # and filtered reads (pruned by partition) find each row.
    rows = rows.cast(schema)
    written = datafiles.write(spark, table, schema, [rows.slice(0, 120), rows.slice(120)],
                              tmp_path, "test", partitioner)
    append = table.newAppend()
    iceberg = spark._jvm.org.apache.iceberg
    config = iceberg.MetricsConfig.forTable(table)
    # Described in a few calls into the JVM, not several per file (each is a round trip).
    # Counted: this thread's calls, not the frees py4j sends when Python's collector
    # happens to run (one round trip per Java object dropped anywhere, earlier).
    batch_helper(spark)  # (compiled once per JVM, before the count)
    client = spark.sparkContext._gateway._gateway_client
    calls: list[str] = []
    real_send = client.send_command
    counting = threading.get_ident()

    def send(command: str, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == counting and not command.startswith("m\nd\n"):
            calls.append(command[:40])
        return real_send(command, *args, **kwargs)

    gc.collect()
    monkeypatch.setattr(client, "send_command", send)
    described = datafiles.data_files(spark, table, written)
    monkeypatch.undo()
    assert len(written) > 100 and len(calls) < 20, calls
    assert described.locations == [w.location for w in written]
    for each, file in zip(java_items(described.java), written, strict=True):
        # Its metrics (what readers prune files by) are those Iceberg's own footer reader
        # finds in the file.
        theirs_metrics = iceberg.parquet.ParquetUtil.fileMetrics(
            iceberg.Files.localInput(str(file.path)), config)
        for facet in ("recordCount", "columnSizes", "valueCounts", "nullValueCounts",
                      "nanValueCounts", "lowerBounds", "upperBounds"):
            mine = getattr(each, facet)()
            theirs_facet = getattr(theirs_metrics, facet)()
            assert (mine == theirs_facet if facet == "recordCount"
                    else mine.equals(theirs_facet)), (facet, str(mine), str(theirs_facet))
        append.appendFile(each)
    append.commit()
    spark.sql(f"REFRESH TABLE {by_driver}")
    read_back = {r["id"]: [_as_text(v) for v in r["_partition"]]
                 for r in spark.sql(f"SELECT id, _partition FROM {by_driver}").collect()}
    assert read_back == theirs
    # A text Iceberg would read back as a null partition value: this batch goes to Spark.
    odd = rows.set_column(rows.schema.get_field_index("s2"), schema.field("s2"),
                          pa.array([HIVE_NULL] * rows.num_rows))
    with pytest.raises(NotHere, match=HIVE_NULL):
        list(partitioner.split(odd))
    for column, value in [("i", -9), ("s", "😀x😀"), ("d3", datetime.date(1969, 12, 31)),
                          ("t2", STAMPS[1]), ("l", 2**63 - 1), ("s2", "a/b=c%d"), ("b", False)]:
        want = [r["id"] for r in rows.to_pylist() if r[column] == value]
        for name in (by_spark, by_driver):
            found = spark.sql(f"SELECT id FROM {name} WHERE {column} = ?", args=[value]).collect()
            assert sorted(r["id"] for r in found) == want, (name, column, value)


def test_unsupported_partitions_say_why(spark: Any, unique: str) -> None:
    """A transform or type the driver does not compute leaves the rows to Spark, saying which
    partition field."""
    name = f"lake.parts.{unique}_other"
    spark.sql(f"CREATE TABLE {name} (id BIGINT, t TIMESTAMP, m DECIMAL(10, 2)) USING iceberg "
              "PARTITIONED BY (bucket(4, m), t)")
    table = java_table(spark, name)
    schema = pa.schema([("id", pa.int64()), ("t", pa.timestamp("us", "UTC")),
                        ("m", pa.decimal128(10, 2))])
    why = Partitioner.of(table, schema)
    assert why == "its partition field m_bucket is bucket[4] of a decimal", why


def test_a_copy_into_too_many_partitions_leaves_nothing_written(
        spark: Any, tmp_path: Path, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy's rows are written as they come, a file open per partition; past the limit of
    open files the copy is Spark's (``NotHere``), and the files begun are removed."""
    name = f"lake.parts.{unique}_many"
    spark.sql(f"CREATE TABLE {name} (id BIGINT, i INT) USING iceberg PARTITIONED BY (i)")
    table = java_table(spark, name)
    schema = pa.schema([pa.field(n, t, metadata=datafiles.field_id_metadata(
        table.schema().findField(n).fieldId())) for n, t in (("id", pa.int64()),
                                                               ("i", pa.int32()))])
    partitioner = Partitioner.of(table, schema)
    assert isinstance(partitioner, Partitioner)
    assert list(partitioner.split(schema.empty_table())) == []  # (no rows: no partition)
    parts = [pa.table({"id": pa.array(range(k * 10, k * 10 + 10), pa.int64()),
                       "i": pa.array([k % 3] * 5 + [k % 5] * 5, pa.int32())}, schema=schema)
             for k in range(6)]
    written = datafiles.write(spark, table, schema, parts, tmp_path, "ok", partitioner,
                              fanout=True)
    assert sorted(tuple(w.partition) for w in written) == [(str(i),) for i in range(5)]
    for each in written:  # a partition's rows in one file, one row group: held, then written
        assert pq.ParquetFile(each.path).metadata.num_row_groups == 1
    # Past the files it may keep open, a file each time a partition's held rows are let go:
    # every row once, in its partition, in order, at the position ``on_rows`` was told.
    monkeypatch.setattr(datafiles, "MAX_OPEN_PARTITIONS", 3)
    monkeypatch.setattr(datafiles, "FANOUT_BUDGET_BYTES", 300)
    told: dict[str, list[tuple[int, list[int]]]] = {}
    written = datafiles.write(
        spark, table, schema, parts, tmp_path, "many", partitioner, fanout=True,
        on_rows=lambda location, first, part: told.setdefault(location, []).append(
            (first, part.column("id").to_pylist())))
    assert len(written) > 5
    by_partition: dict[str, list[int]] = {}
    for each in written:
        ids = pq.read_table(each.path).column("id").to_pylist()
        assert [first for first, _ in told[each.location]] == \
            list(itertools.accumulate([0] + [len(i) for _, i in told[each.location]][:-1]))
        assert [i for _, got in told[each.location] for i in got] == ids
        by_partition.setdefault(each.partition[0], []).extend(ids)
    source = pa.concat_tables(parts).to_pylist()
    assert by_partition == {str(i): [r["id"] for r in source if r["i"] == i] for i in range(5)}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=200))
def test_bucket_hash_in_columns_is_murmur3(values: list[int]) -> None:
    """The columnar hash of ints, longs, dates and timestamps is murmur3's, value by value
    (the spec's example: 34 hashes to 2017239379)."""
    got = _murmur3_longs(np.array([*values, 34], np.int64)).tolist()
    assert got == [mmh3.hash(v.to_bytes(8, "little", signed=True), 0, signed=True)
                   for v in [*values, 34]]
    assert got[-1] == 2017239379


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=40)),
                max_size=120))
def test_bucket_hash_of_text_in_columns_is_murmur3(values: list[str | None]) -> None:
    """Text of every length (each tail of 0-3 bytes, beyond ASCII) hashes as murmur3 of its
    UTF-8 bytes; a null's bucket stays null."""
    from walberg.apply.position.partitions import _Field, _transform

    got = _murmur3_text(pa.array(values, pa.string()).slice(0)).tolist()
    want = [mmh3.hash((v or "").encode(), 0, signed=True) for v in values]
    assert got == want
    field = _Field(name="b", column="s", transform="bucket", argument=7, source_type="STRING",
                   dated=False)
    buckets = _transform(field, pa.array(values, pa.string())).to_pylist()
    assert buckets == [None if v is None else (h & 0x7FFFFFFF) % 7
                       for v, h in zip(values, want, strict=True)]
