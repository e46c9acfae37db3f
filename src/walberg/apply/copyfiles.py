"""An initial copy written as Iceberg data files on the driver, without a Spark job.

Staging (``batch.csv_to_parquet``) already parses Postgres's text into each column's Arrow type,
the one that reads back in Spark as exactly the table's type; Spark's part of a copy was then to
read those files, rename their columns, add ``_walberg_lsn`` and write them again: at 10M rows
two thirds of the copy. When every column is staged in its final type, the staged row groups
are written here straight into the table's data files (its column names and Iceberg field ids,
its compression, files of its target size), each file's metrics are read from its footer by
Iceberg's own ``ParquetUtil``, and one Iceberg commit replaces the table's rows with them,
carrying the copy's LSN as every walberg commit does.

Which copies: a table of one source (not a fan-in table), unpartitioned, whose Iceberg columns
are the source's (plus ``_walberg_lsn``), with columns of types staged in their final type
(integers, floats, numeric, boolean, date, timestamps, and text-like types held as strings).
Arrays and bytea are converted by Spark, so tables with them take Spark's path, as do tables
in a compression this writer does not make. Files go straight into a warehouse on this
machine's disk, and through Hadoop's file system (the session's storage settings) elsewhere.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.session import LSN_COLUMN, LakeSession, java_table
from walberg.apply.spark import spark_call
from walberg.apply.tables import Tables
from walberg.apply.types import SparkType
from walberg.faults import crash_point
from walberg.model import Column, Lsn

log = logging.getLogger("walberg")

# Iceberg's write.parquet.compression-codec values this writer makes, as pyarrow names them.
CODECS = {"zstd": "zstd", "snappy": "snappy", "gzip": "gzip", "uncompressed": "none"}
DEFAULT_TARGET_BYTES = 512 * 1024 * 1024  # Iceberg's write.target-file-size-bytes default


def final_when_staged(t: SparkType) -> bool:
    """Whether staging leaves a column of this type as the table holds it (Spark's convert
    would be a no-op): parsed into its Arrow type, or text kept as text."""
    return t.staged is not None or (t.convert == "{}" and not t.array_dims and t.sql == "STRING")


def _why_not(lake: LakeSession, tables: Tables, target: str, columns: Sequence[Column],
             table: Any, props: Mapping[str, str], files: Sequence[Path]) -> Optional[str]:
    """Why this copy goes through Spark instead (None: it can be written here)."""
    if lake.source is not None:
        return "the table is shared by several sources"
    if not table.spec().isUnpartitioned():
        return "the table is partitioned"
    slow = [c.name for c in columns if not final_when_staged(lake.types.spark_type(c, target))]
    if slow:
        return f"Spark converts column(s) {', '.join(slow)}"
    codec = props.get("write.parquet.compression-codec", "zstd")
    if codec.lower() not in CODECS:
        return f"its compression is {codec}"
    names = [str(f.name()) for f in table.schema().columns()]
    if names != [c.name for c in columns] + [LSN_COLUMN] or not tables.columns_match(target,
                                                                                     columns):
        return "its columns are not the source's"
    want = [lake.types.spark_type(c, target).staged or pa.string() for c in columns]
    if any(pq.read_schema(f).types != want for f in files):
        return "its staged files are not in the columns' types"
    return None


def write_copy(lake: LakeSession, tables: Tables, target: str, columns: Sequence[Column],
               files: Sequence[Path], lsn: Lsn, marks: Mapping[str, str]) -> Optional[int]:
    """Replace ``target``'s rows with the staged copy ``files`` in one commit carrying
    ``marks``; the number of data files it added, or None if this copy takes Spark's path
    (the log says why)."""
    spark = lake.spark
    table = java_table(spark, target)
    props = {str(k): str(v) for k, v in table.properties().items()}
    why = spark_call(f"checking {target} for a copy written on the driver",
                     lambda: _why_not(lake, tables, target, columns, table, props, files))
    if why is not None:
        log.info("initial copy of %s: written by Spark, because %s", target, why)
        return None
    schema = _arrow_schema(table, columns, lake, target)
    codec = CODECS[props.get("write.parquet.compression-codec", "zstd").lower()]
    level = props.get("write.parquet.compression-level")
    target_bytes = int(props.get("write.target-file-size-bytes", DEFAULT_TARGET_BYTES))
    folder = f"{str(table.location()).rstrip('/')}/data"
    local_folder = spark_call(f"looking up the storage of {target}",
                              lambda: _local_folder(spark, folder))
    scratch = Path(files[0]).parent if files else Path(".")
    written: list[tuple[str, Path]] = []  # (location, the file as written on this disk)

    def open_file() -> tuple[Any, Any, str, Path]:
        name = f"walberg-copy-{uuid.uuid4().hex}.parquet"
        path = (local_folder or scratch) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        sink = open(path, "wb")
        options: dict[str, Any] = {"compression": codec, "use_dictionary": False}
        if level is not None and codec in ("zstd", "gzip"):
            options["compression_level"] = int(level)
        try:  # decimals as INT32/INT64 where they fit, as Iceberg's own writer stores them
            writer = pq.ParquetWriter(sink, schema, store_decimal_as_integer=True, **options)
        except TypeError:  # an older pyarrow: fixed-length decimals, which every reader takes
            writer = pq.ParquetWriter(sink, schema, **options)
        return writer, sink, f"{folder}/{name}", path

    writer: Any = None
    sink: Any = None
    lsn_value = int(lsn)
    try:
        for staged in files:
            parquet = pq.ParquetFile(staged)
            for group in range(parquet.num_row_groups):
                part = parquet.read_row_group(group)
                if part.num_rows == 0:
                    continue
                if writer is None:
                    writer, sink, location, path = open_file()
                    written.append((location, path))
                arrays = [*part.columns,
                          pa.array(np.full(part.num_rows, lsn_value, np.int64), pa.int64())]
                writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
                if sink.tell() >= target_bytes:
                    writer.close()
                    sink.close()
                    writer = sink = None
    finally:
        if writer is not None:
            writer.close()
        if sink is not None:
            sink.close()
    crash_point("copy-files")
    added = spark_call(f"writing the initial copy of {target}",
                       lambda: _commit(spark, table, written, local_folder is None, marks))
    log.info("initial copy of %s: written on the driver as %d data file(s)", target, added)
    return added


def _arrow_schema(table: Any, columns: Sequence[Column], lake: LakeSession,
                  target: str) -> pa.Schema:
    """The data files' schema: the table's column names and field ids, the staged types."""
    fields = []
    iceberg = table.schema()
    for c in columns:
        t = lake.types.spark_type(c, target)
        fields.append(pa.field(c.name, t.staged or pa.string(), metadata={
            b"PARQUET:field_id": str(iceberg.findField(c.name).fieldId()).encode()}))
    fields.append(pa.field(LSN_COLUMN, pa.int64(), metadata={
        b"PARQUET:field_id": str(iceberg.findField(LSN_COLUMN).fieldId()).encode()}))
    return pa.schema(fields)


def _local_folder(spark: Any, location: str) -> Optional[Path]:
    """The folder on this machine's disk that ``location`` names, if Hadoop's file system for
    it is the local one (a path without a scheme is on the cluster's default file system)."""
    path = spark._jvm.org.apache.hadoop.fs.Path(location)
    fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    if str(fs.getUri().getScheme()) != "file":
        return None
    return Path(str(fs.makeQualified(path).toUri().getPath()))


def _commit(spark: Any, table: Any, written: list[tuple[str, Path]], upload: bool,
            marks: Mapping[str, str]) -> int:
    """Put the files in the table's storage (``upload``: through Hadoop's file system) and
    commit them in place of every row the table held."""
    jvm = spark._jvm
    iceberg = jvm.org.apache.iceberg
    conf = spark._jsc.hadoopConfiguration()
    overwrite = table.newOverwrite().overwriteByRowFilter(iceberg.expressions.Expressions
                                                          .alwaysTrue())
    metrics_config = iceberg.MetricsConfig.forTable(table)
    for location, path in written:
        dest = jvm.org.apache.hadoop.fs.Path(location)
        fs = dest.getFileSystem(conf)
        if upload:
            fs.copyFromLocalFile(True, True, jvm.org.apache.hadoop.fs.Path(path.resolve().as_uri()),
                                 dest)
        metrics = iceberg.parquet.ParquetUtil.fileMetrics(table.io().newInputFile(location),
                                                          metrics_config)
        overwrite.addFile(iceberg.DataFiles.builder(table.spec()).withPath(location)
                          .withFormat(iceberg.FileFormat.PARQUET)
                          .withFileSizeInBytes(fs.getFileStatus(dest).getLen())
                          .withMetrics(metrics).build())
    for key, value in marks.items():
        overwrite.set(key, value)
    overwrite.commit()
    return len(written)
