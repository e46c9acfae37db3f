"""A key index's entries read back by Spark, or from data files on this machine's disk:
(key, check, data file, position) of every row of a table's snapshot (``lake_entries``, when
``lakekeys`` cannot read the files on the driver) or of the data files a commit wrote
(``written_entries``). Spark writes what it read under the index's scratch folder and the
driver reads it back a row group at a time (or streams it, when the executors do not share the
driver's disk).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.jvm.calls import spark_call
from walberg.apply.position.keybase import Entry
from walberg.apply.position.keycodec import KeyCodec
from walberg.apply.session import SOURCE_COLUMN, java_table, quote_target
from walberg.errors import ApplyError

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
