"""A row delta by position (apply/rowdelta.py): new rows and position deletes in one commit,
without a join over the table, read back by Spark, PyIceberg and DuckDB; a compaction between
reading the positions and committing makes the commit fail rather than delete wrong rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lake import duckdb_rows, hadoop_table, iceberg_rows
from walberg.apply.rowdelta import commit_row_delta, java_table
from walberg.errors import ApplyError

ROWS = 2000


def _table(spark: Any, unique: str) -> str:
    target = f"lake.rd_{unique}.t"
    spark.sql(f"CREATE TABLE {target} (id bigint, v string) USING iceberg TBLPROPERTIES "
              "('format-version'='2', 'write.delete.mode'='merge-on-read')")
    # Two appends: two data files at least, so deletes point into several files.
    for lo, hi in ((1, ROWS // 2), (ROWS // 2 + 1, ROWS)):
        spark.range(lo, hi + 1).selectExpr("id", "concat('v', id) AS v").writeTo(target).append()
    return target


def _positions(spark: Any, target: str, ids: list[int]) -> Any:
    """What a key index would hold for ``ids``: their data file and position."""
    listed = ", ".join(map(str, ids))
    return spark.table(target).where(f"id IN ({listed})") \
        .selectExpr("_file AS file_path", "_pos AS pos").localCheckpoint()


def test_deletes_by_position_and_new_rows_land_in_one_commit(spark: Any, warehouse: Path,
                                                             unique: str) -> None:
    target = _table(spark, unique)
    base = java_table(spark, target).currentSnapshot()
    deleted = list(range(1, ROWS + 1, 7))  # spread over both files
    updated = list(range(3, ROWS + 1, 11))
    gone = sorted(set(deleted) | set(updated))
    new_rows = spark.createDataFrame([(i, f"new {i}") for i in updated] + [(ROWS + 1, "fresh")],
                                     "id bigint, v string")
    result = commit_row_delta(spark, target, new_rows, _positions(spark, target, gone),
                              {"walberg.lsn": "0/ABC"}, int(base.snapshotId()))
    assert (result.added_rows, result.deleted_rows) == (len(updated) + 1, len(gone))

    expected = {i: f"v{i}" for i in range(1, ROWS + 1)}
    for i in deleted:
        expected.pop(i, None)
    expected.update({i: f"new {i}" for i in updated})
    expected[ROWS + 1] = "fresh"
    rows = [{"id": k, "v": v} for k, v in sorted(expected.items())]
    assert sorted((r.asDict() for r in spark.table(target).collect()),
                  key=lambda r: r["id"]) == rows
    assert iceberg_rows(warehouse, target) == rows
    assert duckdb_rows(warehouse, target) == rows

    # One commit, on top of the base, carrying the mark; the staged snapshot is no ancestor.
    current = hadoop_table(warehouse, target).current_snapshot()
    assert current is not None and current.parent_snapshot_id == base.snapshotId()
    assert current.summary.additional_properties["walberg.lsn"] == "0/ABC"
    assert int(current.summary.additional_properties["added-position-deletes"]) == len(gone)


def test_a_compaction_in_between_fails_the_commit_instead_of_deleting_wrong_rows(
        spark: Any, warehouse: Path, unique: str) -> None:
    target = _table(spark, unique)
    base = java_table(spark, target).currentSnapshot()
    positions = _positions(spark, target, [5, 1500])
    spark.sql(f"CALL lake.system.rewrite_data_files(table => '{target.split('.', 1)[1]}', "
              "options => map('rewrite-all', 'true'))")
    before = iceberg_rows(warehouse, target)
    with pytest.raises(ApplyError, match="missing data files"):
        commit_row_delta(spark, target, None, positions, {"walberg.lsn": "0/1"},
                         int(base.snapshotId()))
    assert iceberg_rows(warehouse, target) == before and len(before) == ROWS
