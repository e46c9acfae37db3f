"""Reads of the lake that need no JVM: a hadoop table's history from its metadata file says
what Iceberg's own ``history`` and ``snapshots`` metadata tables say (read by Spark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from walberg.apply.metadata import read_hadoop_history


def test_history_from_the_metadata_file_equals_sparks(spark: Any, warehouse: Path,
                                                      unique: str) -> None:
    target = f"lake.hist_{unique}.t"
    spark.sql(f"CREATE TABLE {target} (id bigint, v string) USING iceberg "
              "TBLPROPERTIES ('format-version'='2', 'write.delete.mode'='merge-on-read')")
    spark.range(1, 101).selectExpr("id", "'a' AS v").write.option(
        "snapshot-property.walberg.lsn", "0/10").mode("append").saveAsTable(target)
    spark.sql(f"DELETE FROM {target} WHERE id <= 10")
    spark.range(101, 111).selectExpr("id", "'b' AS v").write.option(
        "snapshot-property.walberg.lsn", "0/20").mode("append").saveAsTable(target)
    first = spark.sql(f"SELECT snapshot_id FROM {target}.history ORDER BY made_current_at") \
        .collect()[0][0]
    spark.sql(f"CALL lake.system.rollback_to_snapshot('hist_{unique}.t', {first})")
    spark.range(200, 205).selectExpr("id", "'c' AS v").writeTo(target).append()

    expected = [r.asDict() for r in spark.sql(
        f"SELECT h.made_current_at, s.snapshot_id, s.operation, h.is_current_ancestor, "
        f"s.summary['walberg.lsn'] AS lsn, s.summary['added-records'] AS added, "
        f"s.summary['deleted-records'] AS deleted, "
        f"s.summary['added-position-deletes'] AS pos_deletes "
        f"FROM {target}.history h JOIN {target}.snapshots s ON s.snapshot_id = h.snapshot_id "
        f"ORDER BY h.made_current_at").collect()]
    got = read_hadoop_history(warehouse, f"hist_{unique}", "t")
    assert got is not None and len(got) == 5
    # Spark renders made_current_at in the JVM's zone; compare the instants' order and the rest.
    for row in (*expected, *got):
        row.pop("made_current_at")
    assert got == expected
    assert [r["is_current_ancestor"] for r in got] == [True, False, False, True, True]
    assert read_hadoop_history(warehouse, f"hist_{unique}", "missing") is None
