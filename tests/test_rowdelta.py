"""A row delta by position (apply/position/rowdelta.py): new rows and position deletes in one commit,
without a join over the table, read back by Spark, PyIceberg and DuckDB; a compaction between
reading the positions and committing makes the commit fail rather than delete wrong rows."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from lake import duckdb_rows, hadoop_table, iceberg_rows
from walberg.apply.position.deletefiles import position_delete_files
from walberg.apply.position.rowdelta import commit_row_delta, java_table, warm
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


def test_index_and_row_deltas_keep_a_table_exact_over_rounds_and_a_compaction(
        spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """The index is built from the lake, each round's changes are looked up in it and
    committed as one row delta, the index learns the new rows' positions from the files the
    commit wrote; a compaction moves every row, so the index (at an older snapshot) is rebuilt
    from the lake. The lake equals the model after every round, for every reader."""
    import random

    import numpy as np

    from walberg.apply.position.entries import lake_entries, written_entries
    from walberg.apply.position.keycodec import KeyCodec
    from walberg.apply.position.keyindex import KeyIndex

    codec = KeyCodec(("int",))

    target = _table(spark, unique)
    model = {i: f"v{i}" for i in range(1, ROWS + 1)}
    index = KeyIndex(tmp_path / "index", chunk=300, max_delta=500)

    def rebuild() -> None:
        files: list[str] = []
        snapshot, entries = lake_entries(spark, target, ["id"], codec, tmp_path, files)
        index.rebuild(snapshot, entries, files)

    rebuild()
    assert index.size == ROWS
    rng = random.Random(7)
    for round_ in range(4):
        if round_ == 2:
            spark.sql(f"CALL lake.system.rewrite_data_files(table => "
                      f"'{target.split('.', 1)[1]}', options => map('rewrite-all', 'true'))")
            current = java_table(spark, target).currentSnapshot().snapshotId()
            assert index.snapshot != current  # the index no longer describes the table
            rebuild()
        held = sorted(model)
        deleted = rng.sample(held, 40)
        updated = rng.sample([k for k in held if k not in deleted], 60)
        inserted = list(range(max(held) + 1, max(held) + 31))
        hits = index.lookup(np.array(deleted + updated))
        assert sorted(hits.keys.tolist()) == sorted(deleted + updated)
        deletes = spark.createDataFrame(list(zip(hits.files, hits.positions.tolist(),
                                                 strict=True)), "file_path string, pos bigint")
        new = [(k, f"r{round_} {k}") for k in updated + inserted]
        result = commit_row_delta(spark, target, spark.createDataFrame(new, "id bigint, v string"),
                                  deletes, {"walberg.lsn": f"0/{round_ + 1}"}, index.snapshot)
        index.commit(result.snapshot_id, np.array(deleted + updated),
                     tuple(np.concatenate(parts) if i != 2 else sum(parts, [])  # type: ignore
                           for i, parts in enumerate(zip(*written_entries(
                               spark, result.added_files, ["id"], codec, tmp_path),
                               strict=True))))
        for k in deleted:
            del model[k]
        model.update(dict(new))
        rows = [{"id": k, "v": v} for k, v in sorted(model.items())]
        assert iceberg_rows(warehouse, target) == rows
    assert duckdb_rows(warehouse, target) == rows
    assert sorted(index.lookup(np.array(sorted(model))).keys.tolist()) == sorted(model)
    # Hadoop wrote the table's metadata without a checksum file beside each (each file it
    # makes on the local disk costs a `chmod` run: apply.jvm.spark._no_local_checksums).
    folder = warehouse.joinpath(*target.split(".")[1:])
    assert list(folder.rglob("*.metadata.json")) and not list(folder.rglob("*.crc"))
    # ... and set each one's permissions in the JVM (Batch.LocalPermissions), not by running
    # `chmod`: the same permissions a file made under this umask has.
    raw = spark._jvm.org.apache.hadoop.fs.FileSystem.getLocal(
        spark._jsc.hadoopConfiguration()).getRawFileSystem()
    assert raw.getClass().getName() == "walberg.Batch$LocalPermissions"
    umask = os.umask(0)
    os.umask(umask)
    made = [p for p in folder.rglob("*") if p.is_file()]
    assert made and {p.stat().st_mode & 0o777 for p in made} == {0o666 & ~umask}


def test_the_commit_code_is_loaded_ahead_on_files_of_its_own(spark: Any, tmp_path: Path) -> None:
    """What a run loads while it reads the lake, when a batch is on its way: a data and a
    delete file's metrics, their manifests written and read back; nothing in any table."""
    assert warm(spark, tmp_path) == 2
    made = sorted(p.suffix for p in tmp_path.iterdir() if p.suffix != ".crc")  # (Hadoop's)
    assert made == [".avro", ".avro", ".parquet", ".parquet"]



def _merge_on_read(spark: Any, target: str) -> None:
    """Another writer's UPDATE then deletes by position too (as walberg's tables are set)."""
    spark.sql(f"ALTER TABLE {target} SET TBLPROPERTIES ('write.update.mode'='merge-on-read', "
              "'write.merge.mode'='merge-on-read')")


@pytest.mark.parametrize("other", ["DELETE FROM {t} WHERE id = 5",
                                   "UPDATE {t} SET v = 'theirs' WHERE id = 5",
                                   "INSERT INTO {t} VALUES (5, 'theirs')"])
def test_another_writer_on_the_same_keys_fails_the_commit_instead_of_a_second_row(
        spark: Any, warehouse: Path, unique: str, other: str) -> None:
    """Between reading the positions and committing, another writer deletes, updates (by
    position: merge-on-read) or inserts a key the row delta updates: validated from the base
    snapshot, the row delta fails (the caller tries again against the new state) rather than
    leave key 5 twice."""
    target = _table(spark, unique)
    _merge_on_read(spark, target)
    base = int(java_table(spark, target).currentSnapshot().snapshotId())
    positions = _positions(spark, target, [5, 6])
    spark.sql(other.format(t=target))
    before = iceberg_rows(warehouse, target)
    new_rows = spark.createDataFrame([(5, "ours"), (6, "ours")], "id bigint, v string")
    with pytest.raises(ApplyError, match="ValidationException: Found (new )?conflicting") as exc:
        commit_row_delta(spark, target, new_rows, positions, {"walberg.lsn": "0/1"}, base,
                         keys=("id", 5, 6))
    assert exc.value.retryable
    assert iceberg_rows(warehouse, target) == before


def test_another_writers_rows_outside_the_batch_keys_do_not_conflict(
        spark: Any, warehouse: Path, unique: str) -> None:
    """New rows of other keys (their files' key bounds outside the batch's range) are no
    conflict. (Any new delete file is: a position-delete file says nothing of the keys.)"""
    target = _table(spark, unique)
    base = int(java_table(spark, target).currentSnapshot().snapshotId())
    positions = _positions(spark, target, [6])
    spark.sql(f"INSERT INTO {target} VALUES ({ROWS + 500}, 'theirs')")
    commit_row_delta(spark, target, spark.createDataFrame([(6, "ours")], "id bigint, v string"),
                     positions, {"walberg.lsn": "0/2"}, base, keys=("id", 6, 6))
    rows = iceberg_rows(warehouse, target)
    assert len(rows) == ROWS + 1 and len({r["id"] for r in rows}) == ROWS + 1
    values = {r["id"]: r["v"] for r in rows}
    assert (values[6], values[ROWS + 500], values[7]) == ("ours", "theirs", "v7")


def test_position_deletes_are_one_file_per_partition_sorted_by_file_and_position(
        tmp_path: Path) -> None:
    """A batch's deletes over many partitions: each delete file holds exactly the rows of
    its partition's data files, sorted by path then position (as the spec requires), and
    says which data files it points into and whose partition it takes."""
    rng = np.random.default_rng(7)
    data = [f"file:/w/t/data/p={g % 9}/f-{g:03d}.parquet" for g in range(40)]
    files = [data[i] for i in rng.integers(0, len(data), 5000)]
    positions = rng.integers(0, 300, len(files))
    partition = {path: path.split("/")[-2] for path in data}
    found = position_delete_files(files, positions, tmp_path, partition.__getitem__)
    seen = 0
    for each in found:
        rows = pq.read_table(each.local).to_pylist()
        assert rows == sorted(rows, key=lambda r: (r["file_path"], r["pos"]))
        assert each.rows == len(rows)
        assert each.data_files == sorted({r["file_path"] for r in rows})
        assert {partition[p] for p in each.data_files} == {partition[each.partition_of]}
        want = sorted((f, int(p)) for f, p in zip(files, positions, strict=True)
                      if partition[f] == partition[each.partition_of])
        assert [(r["file_path"], r["pos"]) for r in rows] == want
        seen += len(rows)
    assert seen == len(files) and len(found) == len(set(partition[f] for f in files))
    (one,) = position_delete_files(files, positions, tmp_path)  # unpartitioned: one file
    assert one.partition_of is None and one.rows == len(files)
    assert one.data_files == sorted(set(files))
