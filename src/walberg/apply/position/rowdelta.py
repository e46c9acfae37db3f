"""One Iceberg commit that deletes rows by position and adds new rows, without a join over the
table: the building block of an apply whose cost follows the changes, not the table.

A MERGE with merge-on-read has to find the position of every changed key, so it joins the
batch with every data file that may hold one; with keys spread at random that is the whole
table. When the positions are already known (from a key index kept beside the table), the
same result is one row delta:

- the rows to delete are written as a position-delete file: Parquet with the columns
  ``file_path`` and ``pos`` under the field ids the Iceberg spec reserves for them, sorted by
  both, written by Spark itself (so the work runs on the executors), or as deletion vectors
  (see ``deletefiles``);
- the new rows come as data files written on the driver (``apply.position.datafiles``), or are
  written by Iceberg's own Spark writer into a *staged* snapshot (write-audit-publish:
  ``spark.wap.id``), which is never part of the table's history; its data files are taken
  from it;
- both go into one ``RowDelta`` with walberg's marks in its summary, validated against the
  snapshot the positions were read from: if a concurrent commit removed a data file the
  deletes point into (a compaction, say), or deleted or added rows of the same keys (another
  writer's UPDATE, DELETE or MERGE), the commit fails instead of deleting the wrong rows or
  leaving a key twice; the caller tries again against the new state.

Position deletes, not equality deletes: every reader (Spark, PyIceberg, DuckDB, Trino) applies
them cheaply, and ``walberg maintain`` compacts them away. In a partitioned table the deletes
are written one file per partition of the data files they point into (a position-delete file
belongs to one partition of one spec).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.jvm.calls import java_causes, spark_call
from walberg.apply.jvm.commits import one_commit_at_a_time
from walberg.apply.jvm.helper import JavaFiles, batch_helper
from walberg.apply.position.datafiles import (
    field_id_metadata,
)
from walberg.apply.position.deletefiles import (
    Positions,
    Vectors,
    position_delete_file,
    upload_deletes,
)
from walberg.apply.position.livefiles import LiveFiles
from walberg.apply.session import SOURCE_COLUMN, java_table, quote_target
from walberg.apply.together import joined_group
from walberg.errors import ApplyError
from walberg.faults import failure_point


@dataclass(frozen=True)
class RowDeltaResult:
    snapshot_id: int
    added_rows: int
    deleted_rows: int
    data_files: JavaFiles  # the data files the commit wrote
    delete_files: JavaFiles  # the delete files it added
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)  # deletes, new rows, commit
    # The snapshot the commit landed on (None: none, or not found): the base snapshot unless
    # another writer's commit landed between (Iceberg retries a commit on top of one it does
    # not conflict with, such as a compaction of other files).
    parent: Optional[int] = None
    summary: Optional[Mapping[str, str]] = None  # the summary of the snapshot it made

    @property
    def added_files(self) -> tuple[str, ...]:
        """The locations of the data files the commit wrote."""
        return tuple(self.data_files.locations)


def commit_row_delta(spark: Any, target: str, rows: Optional[Any],
                     deletes: "Optional[Any | Positions | list[Positions] | Vectors]",
                     properties: Mapping[str, str], base_snapshot: Optional[int],
                     data_files: Optional[JavaFiles] = None, table: Any = None,
                     keys: Optional[tuple[str, Any, Any]] = None,
                     source: Optional[str] = None,
                     live: Optional[LiveFiles] = None) -> RowDeltaResult:
    """Add ``rows`` (a DataFrame in the table's schema) and ``data_files`` (Iceberg data files
    written already, see ``apply.position.datafiles``) and delete the rows at ``deletes``
    (``Positions``, or a DataFrame of ``file_path`` string, ``pos`` long) in one commit carrying
    ``properties`` in its summary. ``table``: the Iceberg Java table, if the caller has just
    loaded it.

    ``base_snapshot``: the snapshot the positions were read from (None: the table was empty).
    The commit is validated against every commit since, by any writer: it fails (an
    ``ApplyError`` the caller may retry against the new state) if a data file the deletes
    point into was removed or rewritten, if delete files were added (another writer deleted or
    updated rows, perhaps the same ones: committing too would leave a key twice) or if data
    files were added that may hold rows of the same keys. ``keys``: (a key column, the lowest
    and highest of its values the batch changes) narrows the last two to commits whose files may hold keys
    in that range (None: any such commit conflicts); ``source``, to that source's partition of
    a fan-in table (another source's commits never conflict). ``live``: the table's live
    files, which position deletes of a partitioned table and deletion vectors are described
    from."""
    if table is None:
        table = java_table(spark, target)
    helper = batch_helper(spark)
    new_files = data_files if data_files is not None else JavaFiles.empty(spark)
    written: list[str] = new_files.locations
    staged: Any = None
    clock = [time.monotonic()]
    committing = False
    group = joined_group()  # (the batch's tables commit together: apply.together)
    try:
        files, deleted, referenced, replaced = upload_deletes(spark, table, deletes, live)
        written += files.locations
        clock.append(time.monotonic())
        if rows is not None:
            staged, rows_files = _stage_rows(spark, table, target, rows)  # refreshes ``table``
            new_files = new_files.plus(spark, rows_files)
        clock.append(time.monotonic())
        # Built, validated and committed in one call into the JVM (Batch.rowDelta): by itself,
        # or in a transaction with the staged snapshot's removal from the metadata (readers
        # and `history` see one snapshot a batch) or with the batch's other tables.
        added = new_files.records
        expire = staged is not None and _may_expire(table)
        params = json.dumps({
            "base": base_snapshot, "referenced": referenced,
            "key": None if keys is None else list(keys),
            "source": source, "source_column": SOURCE_COLUMN, "properties": dict(properties),
            "expire": int(staged.snapshotId()) if expire else None})

        def commit() -> None:
            txn = helper.rowDelta(table, new_files.java, files.java, replaced, params,
                                  group is None)
            if group is not None:  # with the batch's other tables, in one catalog transaction
                group[0].commit(group[1], target, txn)
            failure_point("row-delta")

        committing = True  # (a group's commit is not held behind this process's others)
        spark_call(f"committing a row delta to {target}",
                   commit if group is not None else lambda: one_commit_at_a_time(target, commit))
        clock.append(time.monotonic())
    except BaseException as exc:
        # Not after a commit that may have landed (its outcome unknown: a timeout after the
        # catalog's swap, a storage outage): the table may hold these files now, and a retry
        # that finds the commit landed must find them too. An orphan is left at worst, for
        # `walberg maintain`.
        # Nor after a group's commit (apply.together; its outcome comes through another
        # thread and a catalog that may retry): orphans at worst, for `walberg maintain`.
        if not committing or (group is None and _not_committed(exc)):
            remove_files(spark, written)
        raise
    if expire:
        _remove_staged_metadata(spark, table, staged)
    # The table refreshed; the snapshot this commit made (the newest carrying its marks: a
    # later commit may be current already), its parent and summary.
    mine = json.loads(helper.committed(table, json.dumps(dict(properties))))
    return RowDeltaResult(int(mine["snapshot"]), added, deleted, new_files, files,
                          (clock[1] - clock[0], clock[2] - clock[1], clock[3] - clock[2]),
                          None if mine["parent"] is None else int(mine["parent"]),
                          {str(k): str(v) for k, v in mine["summary"].items()})


def _not_committed(exc: BaseException) -> bool:
    """Whether a failed commit surely did not land: Iceberg refused it (a validation, or
    another commit first) and said so, not that its outcome is unknown."""
    names = {str(cause.getClass().getSimpleName()) for cause in java_causes(exc)}
    return bool(names & {"CommitFailedException", "ValidationException"}) and \
        "CommitStateUnknownException" not in names


def _may_expire(table: Any) -> bool:
    """Iceberg refuses any snapshot expiry on a table with ``gc.enabled=false``; there the
    staged snapshots stay until the table's owner expires them."""
    return str(table.properties().get("gc.enabled") or "true").lower() != "false"


def _remove_staged_metadata(spark: Any, table: Any, staged: Any) -> None:
    """Best effort: delete the manifest list and manifests of an expired staged snapshot
    (its data files now belong to the row delta's snapshot)."""
    paths = [str(staged.manifestListLocation())]
    for manifest in staged.allManifests(table.io()):
        if manifest.snapshotId() is not None and int(manifest.snapshotId()) == int(staged.snapshotId()):
            paths.append(str(manifest.path()))
    remove_files(spark, paths)


def _stage_rows(spark: Any, table: Any, target: str, rows: Any) -> tuple[Any, JavaFiles]:
    """Write ``rows`` with Iceberg's Spark writer into a staged snapshot (never part of the
    table's history; the row delta expires it) and return it and its data files. The write
    runs in a session of its own, so a staging id never leaks into another thread's writes."""
    props = table.properties()
    if props.get("write.wap.enabled") != "true":
        table.updateProperties().set("write.wap.enabled", "true").commit()
    wap = f"walberg-{uuid.uuid4().hex}"
    view = f"walberg_stage_{uuid.uuid4().hex}"
    rows.createOrReplaceGlobalTempView(view)
    staging = spark.newSession()
    try:
        staging.conf.set("spark.wap.id", wap)
        spark_call(f"staging rows for {target}",
                   lambda: staging.table(f"global_temp.{view}").writeTo(quote_target(target)).append())
    finally:
        spark.catalog.dropGlobalTempView(view)
    table.refresh()
    # The staged snapshot is the newest one added to the metadata; look there first, so a
    # table with a long history is not walked snapshot by snapshot over py4j.
    snapshots = table.operations().current().snapshots()
    newest = [snapshots.get(i) for i in range(snapshots.size() - 1, max(snapshots.size() - 4, -1), -1)]
    for snapshot in itertools.chain(newest, table.snapshots()):
        if snapshot.summary().get("wap.id") == wap:
            return snapshot, JavaFiles.of(spark, snapshot.addedDataFiles(table.io()))
    raise ApplyError(f"staging rows for {target}: the staged snapshot {wap} was not found")


def remove_files(spark: Any, paths: list[str]) -> None:
    """Best effort: delete files a failed commit wrote (what is left is an orphan for
    ``walberg maintain`` to remove)."""
    jvm = spark._jvm
    for name in paths:
        try:
            path = jvm.org.apache.hadoop.fs.Path(name)
            path.getFileSystem(spark._jsc.hadoopConfiguration()).delete(path, False)
        except Exception:
            pass


def warm(spark: Any, scratch: Path) -> int:
    """Load and run, once, the JVM code a row delta's commit uses, on files of its own under
    ``scratch`` (none in any table): walberg's Java helper (compiled, or defined from its
    remembered class files), the footer metrics of a data file and of a position-delete file,
    the building and describing of both (``Batch.warm``), a data and a delete manifest written
    and read back. A process's first row delta otherwise pays for loading it (0.6-0.8 s more than a
    later one on two cores). Nothing is committed. Returns the entries read back (2)."""
    jvm = spark._jvm
    iceberg = jvm.org.apache.iceberg
    conf = spark._jsc.hadoopConfiguration()
    io = iceberg.hadoop.HadoopFileIO(conf)
    spec = iceberg.PartitionSpec.unpartitioned()
    data = scratch / f"warm-{uuid.uuid4().hex}.parquet"
    pq.write_table(pa.table(
        [pa.array([1], pa.int64()), pa.array(["a"]), pa.array([1], pa.decimal128(12, 2))],
        schema=pa.schema([pa.field("k", pa.int64(), metadata=field_id_metadata(1)),
                          pa.field("s", pa.string(), metadata=field_id_metadata(2)),
                          pa.field("d", pa.decimal128(12, 2), metadata=field_id_metadata(3))])),
        data, compression="zstd", store_decimal_as_integer=True)
    deletes = position_delete_file([data.resolve().as_uri()], np.zeros(1, np.int64),
                                   scratch).local
    # The files described as a batch's are (walberg's Java helper, compiled or defined now).
    described = batch_helper(spark).warm(json.dumps([str(data.resolve()),
                                                     str(deletes.resolve())]))
    made = [described.get(0), described.get(1)]
    snapshot = spark._jvm.java.lang.Long.valueOf(1)
    entries = 0
    for number, (kind, file) in enumerate((("write", made[0]), ("writeDeleteManifest", made[1]))):
        out = io.newOutputFile((scratch / f"warm-{number}-{uuid.uuid4().hex}.avro").resolve().as_uri())
        writer = getattr(iceberg.ManifestFiles, kind)(2, spec, out, snapshot)
        writer.add(file)
        writer.close()
        manifest = writer.toManifestFile()
        reader = (iceberg.ManifestFiles.read(manifest, io) if number == 0 else
                  iceberg.ManifestFiles.readDeleteManifest(manifest, io, None))
        it = reader.iterator()
        while it.hasNext():
            it.next()
            entries += 1
        reader.close()
    return entries
