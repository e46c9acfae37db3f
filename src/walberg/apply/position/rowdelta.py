"""One Iceberg commit that deletes rows by position and adds new rows, without a join over the
table: the building block of an apply whose cost follows the changes, not the table.

A MERGE with merge-on-read has to find the position of every changed key, so it joins the
batch with every data file that may hold one; with keys spread at random that is the whole
table. When the positions are already known (from a key index kept beside the table), the
same result is one row delta:

- the rows to delete are written as a position-delete file: Parquet with the columns
  ``file_path`` and ``pos`` under the field ids the Iceberg spec reserves for them, sorted by
  both, written by Spark itself (so the work runs on the executors);
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
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.jvm.helper import JavaFiles, batch_helper
from walberg.apply.jvm.spark import java_causes, one_commit_at_a_time, spark_call
from walberg.apply.position import dv
from walberg.apply.position.datafiles import (
    data_folder,
    field_id_metadata,
    local_folder,
)
from walberg.apply.position.keycodec import KeyCodec
from walberg.apply.position.keyindex import Entry
from walberg.apply.position.livefiles import LiveFiles
from walberg.apply.session import SOURCE_COLUMN, java_table, quote_target
from walberg.errors import ApplyError
from walberg.faults import failure_point

# Field ids the Iceberg spec reserves for the columns of a position-delete file.
FILE_PATH_ID = 2147483546
POS_ID = 2147483545


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

    @property
    def added_files(self) -> tuple[str, ...]:
        """The locations of the data files the commit wrote."""
        return tuple(self.data_files.locations)


@dataclass(frozen=True)
class Positions:
    """Rows to delete, known on the driver, as a position-delete file written on this machine
    (``position_delete_file``) for the commit to put in the table."""

    local: Path
    rows: int
    data_files: list[str]  # the data files they point into, sorted
    # In a partitioned table: one of those data files, whose spec and partition the delete
    # file takes (see ``livefiles``). None: the table's spec, unpartitioned.
    partition_of: Optional[str] = None


# A data file's partition, for grouping: (spec id, partition values as text).
PartitionOf = Callable[[str], Hashable]


@dataclass(frozen=True)
class Vectors:
    """Rows to delete in a format-3 table, as deletion vectors written on this machine, a
    Puffin file of one blob per data file (``deletion_vectors``). One blob a file: DuckDB
    1.5.5 applies a Puffin file's first vector to every data file that points into it."""

    puffins: list[tuple[Path, dv.Blob]]
    replaced: list[str]  # the data files whose earlier deletion vectors these replace
    rows: int  # positions newly deleted


def deletion_vectors(files: Sequence[str], positions: np.ndarray, scratch: Path,
                     live: Callable[[str], Any], earlier: Callable[[Any], bytes]) -> Optional[Vectors]:
    """The rows at ``positions`` of data files ``files`` as deletion vectors, one per data file,
    each merged with the file's earlier vector (``live(path)``: its ``livefiles.LiveFile``;
    ``earlier(vector)``: the bytes of an earlier vector's blob)."""
    if not len(files):
        return None
    distinct, ranks = _ranked(files)
    order = np.argsort(ranks, kind="stable")
    bounds = np.searchsorted(ranks[order], np.arange(len(distinct) + 1))
    positions = np.asarray(positions, dtype=np.int64)[order]
    puffins: list[tuple[Path, dv.Blob]] = []
    replaced = []
    for i, path in enumerate(distinct):
        found = live(path)
        bitmap = dv.bitmap_of(positions[bounds[i]:bounds[i + 1]])
        if found.vector is not None:
            bitmap |= dv.decode(earlier(found.vector))
            replaced.append(path)
        local = scratch / f"walberg-dv-{uuid.uuid4().hex}.puffin"
        (blob,) = dv.write_puffin(local, [(path, dv.encode(bitmap), len(bitmap))], "walberg")
        puffins.append((local, blob))
    return Vectors(puffins, replaced, len(files))


def _ranked(files: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """The distinct data files, sorted, and each row's file as its rank among them."""
    distinct = sorted(set(files))
    rank = {path: i for i, path in enumerate(distinct)}
    return distinct, np.fromiter((rank[f] for f in files), dtype=np.int32, count=len(files))


def position_delete_file(files: Sequence[str], positions: np.ndarray, scratch: Path
                         ) -> Positions:
    """The rows at ``positions`` of data files ``files`` as one position-delete Parquet file in
    ``scratch``: sorted by file and position, the spec's field ids on its two columns."""
    (found,) = position_delete_files(files, positions, scratch)
    return found


def position_delete_files(files: Sequence[str], positions: np.ndarray, scratch: Path,
                          partition_of: Optional[PartitionOf] = None) -> list[Positions]:
    """``position_delete_file``, one file per partition of the data files (a position-delete
    file belongs to one partition of one spec, as Iceberg matches deletes to data files by
    partition): ``partition_of`` tells each data file's (None: one file for all)."""
    if not len(files):
        return []
    # Sorted by the rank of each row's path among the few distinct ones, not by the strings,
    # and first by the partition's group: each file's rows are then one slice (a scan of all
    # rows per partition cost 5 s for a batch over 8,760 partitions).
    distinct, ranks = _ranked(files)
    groups: dict[Hashable, int] = {}
    group_of = np.array([groups.setdefault(None if partition_of is None else partition_of(path),
                                           len(groups)) for path in distinct], np.int32)
    row_groups = group_of[ranks]
    order = np.lexsort((positions, ranks, row_groups))
    ranks, positions = ranks[order], np.asarray(positions)[order]
    bounds = np.searchsorted(row_groups[order], np.arange(len(groups) + 1))
    members = np.argsort(group_of, kind="stable")  # each group's files, in order
    member_bounds = np.searchsorted(group_of[members], np.arange(len(groups) + 1))
    schema = pa.schema([
        pa.field("file_path", pa.string(), nullable=False,
                 metadata=field_id_metadata(FILE_PATH_ID)),
        pa.field("pos", pa.int64(), nullable=False, metadata=field_id_metadata(POS_ID))])
    paths = pa.array(distinct, pa.string())
    out = []
    for g in range(len(groups)):
        start, end = int(bounds[g]), int(bounds[g + 1])
        local = scratch / f"walberg-deletes-{uuid.uuid4().hex}.parquet"
        with pa.OSFile(str(local), "wb") as sink:  # (no file system to resolve, per file)
            pq.write_table(pa.table([paths.take(pa.array(ranks[start:end])),
                                     pa.array(positions[start:end], pa.int64())],
                                    schema=schema), sink, compression="snappy")
        files_of = [distinct[i] for i in members[member_bounds[g]:member_bounds[g + 1]]]
        out.append(Positions(local, end - start, files_of,
                             None if partition_of is None else files_of[0]))
    return out


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
    try:
        files, deleted, referenced, replaced = upload_deletes(spark, table, deletes, live)
        written += files.locations
        clock.append(time.monotonic())
        if rows is not None:
            staged, rows_files = _stage_rows(spark, table, target, rows)  # refreshes ``table``
            new_files = new_files.plus(spark, rows_files)
        clock.append(time.monotonic())
        # One transaction: the row delta, and the staged snapshot's removal from the metadata
        # (readers and `history` see one snapshot a batch).
        txn = table.newTransaction()
        delta = txn.newRowDelta()
        if base_snapshot is not None:
            delta = delta.validateFromSnapshot(base_snapshot)
        delta = helper.fill(delta, new_files.java, files.java, replaced)
        delta = _validated(spark, delta, referenced, keys, source)
        added = new_files.records
        for key, value in properties.items():
            delta = delta.set(key, value)
        expire = staged is not None and _may_expire(table)

        def commit() -> None:
            delta.commit()  # into the transaction: its validation runs here
            if expire:
                # expireOlderThan(0): nothing but the staged snapshot expires.
                txn.expireSnapshots().expireSnapshotId(staged.snapshotId()) \
                    .expireOlderThan(0).cleanExpiredFiles(False).commit()
            txn.commitTransaction()
            failure_point("row-delta")

        committing = True
        spark_call(f"committing a row delta to {target}",
                   lambda: one_commit_at_a_time(target, commit))
        clock.append(time.monotonic())
    except BaseException as exc:
        # Not after a commit that may have landed (its outcome unknown: a timeout after the
        # catalog's swap, a storage outage): the table may hold these files now, and a retry
        # that finds the commit landed must find them too. An orphan is left at worst, for
        # `walberg maintain`.
        if not committing or _not_committed(exc):
            remove_files(spark, written)
        raise
    if expire:
        _remove_staged_metadata(spark, table, staged)
    table.refresh()
    mine = _committed(table, properties)
    parent = None if mine is None or mine.parentId() is None else int(mine.parentId())
    return RowDeltaResult(int((mine or table.currentSnapshot()).snapshotId()), added, deleted,
                          new_files, files,
                          (clock[1] - clock[0], clock[2] - clock[1], clock[3] - clock[2]),
                          parent)


def upload_deletes(spark: Any, table: Any,
                   deletes: "Optional[Any | Positions | list[Positions] | Vectors]",
                   live: Optional[LiveFiles]) -> tuple[JavaFiles, int, list[str], Any]:
    """``deletes`` (see ``commit_row_delta``) put in the table's data folder as Iceberg delete
    files: those files, the positions they delete, the data files they point into, and the
    earlier deletion vectors they replace (a Java list, empty but for deletion vectors)."""
    if isinstance(deletes, Positions):
        deletes = [deletes]
    replaced = spark._jvm.java.util.ArrayList()
    if isinstance(deletes, Vectors):
        assert live is not None
        files, deleted, referenced = _upload_vectors(spark, table, deletes, live)
        replaced = batch_helper(spark).pick(live.java_vectors, json.dumps(deletes.replaced))
    elif isinstance(deletes, list):
        if len(deletes) == 1 and deletes[0].partition_of is None:
            files, deleted, referenced = _upload_position_deletes(spark, table, deletes[0])
        else:
            assert live is not None or all(d.partition_of is None for d in deletes)
            files, deleted, referenced = _upload_partition_deletes(spark, table, deletes, live)
    elif deletes is not None:
        files, deleted, referenced = _write_position_deletes(spark, table, deletes)
    else:
        files, deleted, referenced = JavaFiles.empty(spark), 0, []
    return files, deleted, referenced, replaced


def _validated(spark: Any, delta: Any, referenced: list[str],
               keys: Optional[tuple[str, Any, Any]], source: Optional[str]) -> Any:
    """The row delta, told what to validate against the commits since its base snapshot (see
    ``commit_row_delta``): the data files its deletes point into (``referenced``) still there,
    and no other writer's deletes or new rows for its keys."""
    if referenced:
        refs = spark._jvm.java.util.ArrayList()
        for path in referenced:
            refs.add(path)
        delta = delta.validateDeletedFiles().validateDataFilesExist(refs)
    # What another writer did since the base snapshot: deletes or new rows for these keys.
    delta = delta.validateNoConflictingDeleteFiles().validateNoConflictingDataFiles()
    conflicts = _conflicts(spark, keys, source)
    if conflicts is not None:
        delta = delta.conflictDetectionFilter(conflicts)
    return delta


def _committed(table: Any, properties: Mapping[str, str]) -> Any:
    """The snapshot this commit made: the newest whose summary carries its marks (a later
    commit may be current already), or None."""
    at = table.currentSnapshot()
    for _ in range(100):
        if at is None or not properties:
            return None
        summary = at.summary()
        if all(str(summary.get(k)) == v for k, v in properties.items()):
            return at
        parent = at.parentId()
        at = None if parent is None else table.snapshot(parent)
    return None


def _not_committed(exc: BaseException) -> bool:
    """Whether a failed commit surely did not land: Iceberg refused it (a validation, or
    another commit first) and said so, not that its outcome is unknown."""
    names = {str(cause.getClass().getSimpleName()) for cause in java_causes(exc)}
    return bool(names & {"CommitFailedException", "ValidationException"}) and \
        "CommitStateUnknownException" not in names


def _conflicts(spark: Any, keys: Optional[tuple[str, Any, Any]], source: Optional[str]) -> Any:
    """The rows a concurrent commit conflicts on: the batch's key range, in its source's
    partition (None: any row)."""
    expressions = spark._jvm.org.apache.iceberg.expressions.Expressions
    found = None if keys is None else _key_range(spark, *keys)
    if source is not None:
        mine = expressions.equal(SOURCE_COLUMN, source)
        found = mine if found is None else getattr(expressions, "and")(found, mine)
    return found


def _key_range(spark: Any, key: str, lowest: Any, highest: Any) -> Any:
    """The Iceberg expression ``lowest <= key <= highest``."""
    expressions = spark._jvm.org.apache.iceberg.expressions.Expressions
    return getattr(expressions, "and")(expressions.greaterThanOrEqual(key, lowest),
                                       expressions.lessThanOrEqual(key, highest))


Entries = Iterator[Entry]


def lake_entries(spark: Any, target: str, keys: Sequence[str], codec: KeyCodec, scratch: Path,
                 files: list[str], source: Optional[str] = None) -> tuple[Optional[int], Entries]:
    """What a key index of ``target`` holds: (key, check, data file number in ``files``,
    position) of every row of the table's current snapshot, in batches; with that snapshot's
    id. Spark reads the key columns (in their canonical form, see ``keycodec``) with each row's
    file and position; for a key that sorts as its index entries do, Spark sorts too. The
    driver reads the result back from ``scratch`` a row group at a time, encodes the keys and
    numbers the files (appended to ``files`` as they come). ``source``: only that source's
    rows of a table several sources fan in to."""
    table = java_table(spark, target)
    current = table.currentSnapshot()
    snapshot = None if current is None else int(current.snapshotId())
    if snapshot is None:
        return None, iter(())
    forms = codec.spark_columns([_quote(k) for k in keys])
    frame = spark.read.option("snapshot-id", str(snapshot)).table(quote_target(target))
    if source is not None:
        frame = frame.where(frame[SOURCE_COLUMN] == source)
    frame = frame.selectExpr(*(f"{f} AS k{i}" for i, f in enumerate(forms)),
                             "_file AS file_path", "_pos AS pos")
    if codec.sorted_like_the_table:
        frame = frame.orderBy("k0")
    return snapshot, _encoded(codec, _read_back(spark, frame, scratch), files)


def _encoded(codec: KeyCodec, batches: Iterator[pa.RecordBatch], files: list[str]) -> Entries:
    """Record batches of (key columns..., file_path, pos) as index entries, files numbered."""
    numbers = {f: i for i, f in enumerate(files)}
    for batch in batches:
        n = batch.num_columns
        keys, checks = codec.encode(batch.columns[:n - 2])
        paths = batch.column(n - 2).dictionary_encode()
        ids = np.empty(len(paths.dictionary), np.int32)
        for i, path in enumerate(paths.dictionary.to_pylist()):
            found = numbers.get(path)
            if found is None:
                found = numbers[path] = len(files)
                files.append(path)
            ids[i] = found
        yield (keys, checks, ids[paths.indices.to_numpy(zero_copy_only=False)],
               batch.column(n - 1).to_numpy(zero_copy_only=False).astype(np.int64))


def scan_of(spark: Any, table: Any, snapshot: int, source: Optional[str]) -> Any:
    """A scan of ``table`` at ``snapshot``; of one source's partition when ``source`` is given
    (a fan-in table is partitioned by source first)."""
    scan = table.newScan().useSnapshot(snapshot)
    if source is not None:
        expressions = spark._jvm.org.apache.iceberg.expressions.Expressions
        scan = scan.filter(expressions.equal(SOURCE_COLUMN, source))
    return scan


def written_entries(spark: Any, files: tuple[str, ...], keys: Sequence[str], codec: KeyCodec,
                    scratch: Path) -> Iterator[tuple[np.ndarray, np.ndarray, list[str], np.ndarray]]:
    """(keys, checks, data file, position) of every row in the data files a commit wrote: each
    file's rows in their order (Parquet's row index is Iceberg's position)."""
    if not files:
        return iter(())
    local = [local_path(f) for f in files]
    if all(p is not None for p in local):
        # A warehouse on this machine's disk: read the key columns on the driver, no Spark job.
        return _local_entries(files, [p for p in local if p is not None], keys, codec)
    from pyspark.sql import functions as F

    forms = codec.spark_columns([_quote(k) for k in keys])
    frames = [spark.read.parquet(path).selectExpr(
        *(f"{f} AS k{i}" for i, f in enumerate(forms))).select(
        "*", F.lit(path).alias("file_path"), F.col("_metadata.row_index").alias("pos"))
        for path in files]
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionAll(other)
    return _as_paths(codec, _read_back(spark, frame, scratch))


def _as_paths(codec: KeyCodec, batches: Iterator[pa.RecordBatch]
              ) -> Iterator[tuple[np.ndarray, np.ndarray, list[str], np.ndarray]]:
    for batch in batches:
        n = batch.num_columns
        keys, checks = codec.encode(batch.columns[:n - 2])
        yield (keys, checks, batch.column(n - 2).to_pylist(),
               batch.column(n - 1).to_numpy(zero_copy_only=False).astype(np.int64))


def local_path(location: str) -> Optional[Path]:
    """The file on this machine's disk that ``location`` names, if it names one."""
    if location.startswith("file:"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(location).path))
    return Path(location) if location.startswith("/") else None


def _local_entries(files: tuple[str, ...], paths: list[Path], keys: Sequence[str],
                   codec: KeyCodec) -> Iterator[tuple[np.ndarray, np.ndarray, list[str], np.ndarray]]:
    """(keys, checks, data file, position) of each row of local data files, read on the
    driver: a row's position is its ordinal in its file."""
    for name, path in zip(files, paths, strict=True):
        offset = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1 << 20, columns=list(keys)):
            encoded, checks = codec.encode(batch.columns)
            yield (encoded, checks, [name] * len(encoded),
                   np.arange(offset, offset + len(encoded), dtype=np.int64))
            offset += len(encoded)


def _read_back(spark: Any, frame: Any, scratch: Path) -> Iterator[pa.RecordBatch]:
    """Write ``frame`` as Parquet under ``scratch`` and yield it back a row group at a time,
    in the order of its part files (a sorted frame stays sorted). On a cluster whose executors
    cannot write to the driver's disk, the rows come to the driver through Spark instead, a
    partition at a time, in the same order."""
    if not _driver_disk_shared(spark):
        yield from _stream_back(frame)
        return
    folder = Path(tempfile.mkdtemp(prefix="walberg-index-", dir=scratch))
    try:
        spark_call("reading key positions", lambda: frame.write.mode("overwrite")
                   .parquet(folder.as_uri() + "/rows"))
        if not (folder / "rows" / "_SUCCESS").exists():
            # Never an empty index for a table that has rows: that would skip deletes.
            raise ApplyError(f"reading key positions: Spark's output is not in {folder}; the "
                             "executors do not write to this machine's disk")
        for part in sorted((folder / "rows").glob("part-*.parquet")):
            yield from pq.ParquetFile(part).iter_batches(batch_size=1 << 20)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _driver_disk_shared(spark: Any) -> bool:
    """Whether the executors write to the driver's disk (local mode)."""
    return str(spark.sparkContext.master).startswith("local")


def _stream_back(frame: Any, size: int = 1 << 20) -> Iterator[pa.RecordBatch]:
    names = frame.columns
    rows: list[Any] = []
    for row in frame.toLocalIterator(prefetchPartitions=True):
        rows.append(row)
        if len(rows) >= size:
            yield _batch(rows, names)
            rows = []
    if rows:
        yield _batch(rows, names)


def _batch(rows: list[Any], names: list[str]) -> pa.RecordBatch:
    """Rows of canonical key columns (BIGINT or STRING), file_path, pos as a record batch."""
    return pa.RecordBatch.from_arrays([pa.array([r[i] for r in rows])
                                       for i in range(len(names))], names=names)


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _write_position_deletes(spark: Any, table: Any, deletes: Any
                            ) -> tuple[JavaFiles, int, list[str]]:
    """Spark writes ``deletes`` as position-delete Parquet files in the table's data folder;
    returns them as Iceberg delete files, the positions they hold and the data files they
    point into."""
    from pyspark.sql import functions as F

    jvm = spark._jvm
    if not table.spec().isUnpartitioned():
        raise ApplyError("position deletes from a DataFrame need an unpartitioned table")
    frame = deletes.select(
        F.col("file_path").cast("string").alias("file_path",
                                                metadata={"parquet.field.id": FILE_PATH_ID}),
        F.col("pos").cast("long").alias("pos", metadata={"parquet.field.id": POS_ID}))
    referenced = [r[0] for r in frame.select("file_path").distinct().collect()]
    if not referenced:
        return JavaFiles.empty(spark), 0, []
    folder = f"{data_folder(table)}/walberg-deletes-{uuid.uuid4().hex}"
    # One file per group of data files, each sorted by (file_path, pos) as the spec asks.
    parts = max(1, min(len(referenced), int(spark.sparkContext.defaultParallelism)))
    spark_call("writing position deletes", lambda: (
        frame.repartition(parts, "file_path").sortWithinPartitions("file_path", "pos")
        .write.option("compression", "snappy").parquet(folder)))
    path = jvm.org.apache.hadoop.fs.Path(folder)
    fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    metrics_config = jvm.org.apache.iceberg.MetricsConfig.forPositionDelete(table)
    parquet = jvm.org.apache.iceberg.FileFormat.PARQUET
    files, count = [], 0
    for status in fs.listStatus(path):
        name = status.getPath().toString()
        if not name.endswith(".parquet"):
            fs.delete(status.getPath(), False)  # Spark's _SUCCESS marker
            continue
        metrics = jvm.org.apache.iceberg.parquet.ParquetUtil.fileMetrics(
            table.io().newInputFile(name), metrics_config)
        if int(metrics.recordCount()) == 0:
            fs.delete(status.getPath(), False)
            continue
        count += int(metrics.recordCount())
        files.append(jvm.org.apache.iceberg.FileMetadata.deleteFileBuilder(table.spec())
                     .ofPositionDeletes().withPath(name).withFormat(parquet)
                     .withFileSizeInBytes(status.getLen()).withMetrics(metrics).build())
    return JavaFiles.of(spark, files), count, referenced


def _upload_position_deletes(spark: Any, table: Any, deletes: Positions
                             ) -> tuple[JavaFiles, int, list[str]]:
    """Put the position-delete file written on the driver for an unpartitioned table in its
    data folder through Hadoop's file system, whatever the warehouse's storage, and describe
    it with the metrics of its footer (the bounds of its ``file_path`` tell readers which data
    files it applies to). No Spark job: the positions were on the driver already."""
    if not deletes.rows:
        return JavaFiles.empty(spark), 0, []
    local = deletes.local
    jvm = spark._jvm
    name = f"{data_folder(table)}/{local.name}"
    dest = jvm.org.apache.hadoop.fs.Path(name)
    fs = dest.getFileSystem(spark._jsc.hadoopConfiguration())
    spark_call("uploading position deletes", lambda: fs.copyFromLocalFile(
        True, True, jvm.org.apache.hadoop.fs.Path(local.resolve().as_uri()), dest))
    metrics = jvm.org.apache.iceberg.parquet.ParquetUtil.fileMetrics(
        table.io().newInputFile(name), jvm.org.apache.iceberg.MetricsConfig.forPositionDelete(table))
    builder = jvm.org.apache.iceberg.FileMetadata.deleteFileBuilder(table.spec()) \
        .ofPositionDeletes()
    delete = (builder.withPath(name).withFormat(jvm.org.apache.iceberg.FileFormat.PARQUET)
              .withFileSizeInBytes(fs.getFileStatus(dest).getLen()).withMetrics(metrics).build())
    return JavaFiles.of(spark, [delete]), deletes.rows, deletes.data_files


def _move_in(spark: Any, table: Any, locals_: Sequence[Path], what: str
             ) -> tuple[str, list[int]]:
    """Move files written on the driver into the table's data folder in one Hadoop call,
    whatever the warehouse's storage; the folder and each file's size."""
    jvm = spark._jvm
    folder = data_folder(table)
    sizes = [local.stat().st_size for local in locals_]
    here = local_folder(spark, folder)
    if here is not None:
        # The warehouse is on this disk: a rename each (Hadoop's local copy would write each
        # file again, with a checksum file beside it).
        here.mkdir(parents=True, exist_ok=True)
        for local in locals_:
            shutil.move(str(local), str(here / local.name))
        return folder, sizes
    dest = jvm.org.apache.hadoop.fs.Path(folder)
    fs = dest.getFileSystem(spark._jsc.hadoopConfiguration())
    sources = spark.sparkContext._gateway.new_array(jvm.org.apache.hadoop.fs.Path, len(locals_))
    for i, local in enumerate(locals_):
        sources[i] = jvm.org.apache.hadoop.fs.Path(local.resolve().as_uri())
    spark_call(f"uploading {what}", lambda: fs.copyFromLocalFile(True, True, sources, dest))
    return folder, sizes


def _upload_partition_deletes(spark: Any, table: Any, deletes: Sequence[Positions],
                              live: Optional[LiveFiles]) -> tuple[JavaFiles, int, list[str]]:
    """Position-delete files of several partitions, put in the table's data folder in one
    Hadoop call and described without reading their footers back: a partition's delete file
    is matched to its data files by partition, so column bounds would add little, and reading
    hundreds of footers (a table partitioned by day) cost more than the rest of the commit.
    Each takes the spec and partition of a data file it points into, as ``live`` knows it."""
    deletes = [d for d in deletes if d.rows]
    if not deletes:
        return JavaFiles.empty(spark), 0, []
    folder, sizes = _move_in(spark, table, [d.local for d in deletes], "position deletes")
    described = [[f"{folder}/{d.local.name}", size, d.rows, d.partition_of]
                 for d, size in zip(deletes, sizes, strict=True)]
    java_live = spark._jvm.java.util.HashMap() if live is None else live.java_files
    files = JavaFiles.of(spark, batch_helper(spark).positionDeletes(
        table, java_live, json.dumps(described)))
    return files, sum(d.rows for d in deletes), [p for d in deletes for p in d.data_files]


def _upload_vectors(spark: Any, table: Any, vectors: Vectors, live: LiveFiles
                    ) -> tuple[JavaFiles, int, list[str]]:
    """Put the Puffin files of deletion vectors in the table's data folder and describe each
    blob as a delete file of its data file's spec and partition (as ``live`` knows them)."""
    folder, sizes = _move_in(spark, table, [local for local, _ in vectors.puffins],
                             "deletion vectors")
    described = [[f"{folder}/{local.name}", size, blob.cardinality, blob.data_file,
                  blob.offset, blob.length]
                 for (local, blob), size in zip(vectors.puffins, sizes, strict=True)]
    files = JavaFiles.of(spark, batch_helper(spark).vectors(table, live.java_files,
                                                            json.dumps(described)))
    return files, vectors.rows, [b.data_file for _, b in vectors.puffins]


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
