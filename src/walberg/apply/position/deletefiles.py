"""The rows a row delta deletes, as files the table takes: position-delete files and deletion
vectors, written and put in the table's data folder, described as Iceberg delete files.

- Position-delete files (format 2): Parquet with the columns ``file_path`` and ``pos`` under
  the field ids the Iceberg spec reserves for them, sorted by both. Written on the driver, one
  file per partition of the data files they point into (a position-delete file belongs to one
  partition of one spec), or by Spark from a DataFrame (unpartitioned tables).
- Deletion vectors (format 3): a Puffin file of one blob per data file, each merged with the
  file's earlier vector, which it replaces.

``rowdelta.commit_row_delta`` commits them (``upload_deletes``).
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.jvm.calls import spark_call
from walberg.apply.jvm.helper import JavaFiles, batch_helper
from walberg.apply.position import dv
from walberg.apply.position.datafiles import (
    data_folder,
    field_id_metadata,
    local_folder,
)
from walberg.apply.position.livefiles import LiveFiles
from walberg.errors import ApplyError

# Field ids the Iceberg spec reserves for the columns of a position-delete file.
FILE_PATH_ID = 2147483546


POS_ID = 2147483545


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
    data folder, whatever the warehouse's storage, described with the metrics of its footer
    (the bounds of its ``file_path`` tell readers which data files it applies to). No Spark
    job: the positions were on the driver already."""
    if not deletes.rows:
        return JavaFiles.empty(spark), 0, []
    local = deletes.local
    # Described from its footer here, then moved in (a rename where the warehouse is on
    # this disk).
    delete = batch_helper(spark).positionDeleteFile(
        table, f"{data_folder(table)}/{local.name}", str(local.resolve()), local.stat().st_size)
    _move_in(spark, table, [local], "position deletes")
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
