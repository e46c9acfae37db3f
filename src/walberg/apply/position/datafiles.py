"""Iceberg data files written on the driver from staged Parquet, without a Spark job.

Staging (``apply.batch``) parses Postgres's text into each column's Arrow type, the one that
reads back in Spark as exactly the table's type. For a table whose columns are all staged in
their final type, Spark's part of a write is a rename plus ``_walberg_lsn``: cheap work that
costs a cold process its first Spark SQL job (seconds). Here the staged row groups go straight
into the table's data files instead: its column names and Iceberg field ids, decimals stored
as integers (as Iceberg's own writer does), its compression and level, files rolled at its
``write.target-file-size-bytes``. Each file's metrics are read from its footer by Iceberg's
``ParquetUtil``, and the caller commits the files through Iceberg's API: the initial copy
(``apply.initial.files``) in an overwrite, a batch applied by position (``apply.position.keyed``) in its
row delta.

Which tables (``why_not``): without a sort order, partitioned by transforms ``Partitioner``
computes or not at all, whose Iceberg columns are the source's plus ``_walberg_lsn`` (and, in
a table several sources share, ``_walberg_source``), with columns staged in their final
type (every Postgres type is: integers, floats, numeric, boolean, date, timestamps, bytea
decoded from its hex form, arrays as lists, and text-like types held as strings) and a
compression this writer makes. Files go straight into a warehouse on this machine's disk, and
through Hadoop's file system (the session's storage settings) elsewhere.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.jvm.helper import JavaFiles, batch_helper
from walberg.apply.position.partitions import Partitioner
from walberg.apply.session import (
    LSN_COLUMN,
    SOURCE_COLUMN,
    LakeSession,
    java_properties,
)
from walberg.apply.tables import Tables
from walberg.apply.types import SparkType
from walberg.model import Column

log = logging.getLogger("walberg")

# Iceberg's write.parquet.compression-codec values this writer makes, as pyarrow names them.
CODECS = {"zstd": "zstd", "snappy": "snappy", "gzip": "gzip", "uncompressed": "none"}
DEFAULT_TARGET_BYTES = 512 * 1024 * 1024  # Iceberg's write.target-file-size-bytes default


def final_when_staged(t: SparkType) -> bool:
    """Whether staging leaves a column of this type as the table holds it (Spark's convert
    would be a no-op): parsed into its Arrow type, or text kept as text."""
    return t.staged is not None or (t.convert == "{}" and t.sql == "STRING")


def why_not(lake: LakeSession, tables: Tables, target: str, columns: Sequence[Column],
            table: Any, props: Mapping[str, str]) -> Optional[str]:
    """Why rows of this table are written by Spark instead (None: they can be written here,
    partitioned by ``write`` as the table's spec says, and in a table several sources share,
    with the source's name)."""
    if not table.sortOrder().isUnsorted():
        return "the table has a sort order"
    slow = [c.name for c in columns if not final_when_staged(lake.types.spark_type(c, target))]
    if slow:
        return f"Spark converts column(s) {', '.join(slow)}"
    codec = props.get("write.parquet.compression-codec", "zstd")
    if codec.lower() not in CODECS:
        return f"its compression is {codec}"
    # (one round trip: py4j iterates a Java list in a dozen)
    names = json.loads(batch_helper(lake.spark).columnNames(table))
    if names != [c.name for c in columns] + written_columns(lake) or \
            not tables.columns_match(target, columns):
        return "its columns are not the source's"
    found = Partitioner.of(table, arrow_schema(table, columns, lake, target))
    return found if isinstance(found, str) else None


def written_columns(lake: LakeSession) -> list[str]:
    """The columns walberg adds after the source's: the change's LSN, and in a table several
    sources share, the source's name."""
    return [LSN_COLUMN] + ([SOURCE_COLUMN] if lake.source is not None else [])


def why_not_staged(lake: LakeSession, tables: Tables, target: str, columns: Sequence[Column],
                   table: Any, staged: Sequence[Sequence[pa.DataType]]) -> Optional[str]:
    """``why_not``, and whether the staged tables (a copy's or a batch's: ``c0..cN``, then any
    change metadata; ``staged`` holds each one's column types) hold the columns in their
    types."""
    why = why_not(lake, tables, target, columns, table,
                  java_properties(lake.spark, table))
    want = staged_types(lake, target, columns)
    if why is None and any(list(types[:len(want)]) != want for types in staged):
        why = "its staged files are not in the columns' types"
    return why


def staged_types(lake: LakeSession, target: str, columns: Sequence[Column]) -> list[pa.DataType]:
    """The Arrow type each column is staged in (text-like columns: string)."""
    return [lake.types.spark_type(c, target).staged or pa.string() for c in columns]


FIELD_ID_KEY = b"PARQUET:field_id"  # where Arrow keeps a Parquet column's field id


def field_id_metadata(field_id: int) -> dict[bytes, bytes]:
    """An Arrow field's metadata that gives its Parquet column an Iceberg field id."""
    return {FIELD_ID_KEY: str(field_id).encode()}


def arrow_schema(table: Any, columns: Sequence[Column], lake: LakeSession,
                 target: str) -> pa.Schema:
    """The data files' schema: the table's column names and field ids, the staged types."""
    iceberg = table.schema()
    fields = [_with_ids(c.name, t, iceberg.findField(c.name))
              for c, t in zip(columns, staged_types(lake, target, columns), strict=True)]
    fields.append(pa.field(LSN_COLUMN, pa.int64(),
                           metadata=field_id_metadata(iceberg.findField(LSN_COLUMN).fieldId())))
    if lake.source is not None:
        fields.append(pa.field(SOURCE_COLUMN, pa.string(), metadata=field_id_metadata(
            iceberg.findField(SOURCE_COLUMN).fieldId())))
    return pa.schema(fields)


def _with_ids(name: str, staged: pa.DataType, field: Any) -> pa.Field:
    """An Arrow field of ``staged`` type for the Iceberg (Java) ``field``: its id, and a list's
    element (at each depth) the element's id, as Iceberg reads nested columns by them."""
    if pa.types.is_list(staged):
        element = field.type().asListType().fields().get(0)
        staged = pa.list_(_with_ids("element", staged.value_type, element))
    return pa.field(name, staged, metadata=field_id_metadata(field.fieldId()))


def local_folder(spark: Any, location: str) -> Optional[Path]:
    """The folder on this machine's disk that ``location`` names, if Hadoop's file system for
    it is the local one (a path without a scheme is on the cluster's default file system).
    Asked of Hadoop once per Spark context and location (a table's batches ask each time)."""
    key = (id(spark._jsc), location)
    if key not in _LOCAL_FOLDERS:
        path = spark._jvm.org.apache.hadoop.fs.Path(location)
        fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
        _LOCAL_FOLDERS[key] = None if str(fs.getUri().getScheme()) != "file" else \
            Path(str(fs.makeQualified(path).toUri().getPath()))
    return _LOCAL_FOLDERS[key]


_LOCAL_FOLDERS: dict[tuple[int, str], Optional[Path]] = {}


def data_folder(table: Any) -> str:
    """Where an Iceberg Java table's data files go."""
    return f"{str(table.location()).rstrip('/')}/data"


@dataclass(frozen=True)
class Written:
    """A data file ``write`` made: its location in the table, the file as written here, and
    its partition's values (as ``withPartitionValues`` takes them; empty if unpartitioned)."""

    location: str
    path: Path
    partition: list[Optional[str]] = field(default_factory=list)


# Files a copy keeps open at once, one a partition; past it, a partition's file is closed
# once its held rows are written, and its next rows start another (more, smaller files).
MAX_OPEN_PARTITIONS = 1000
FANOUT_BUDGET_BYTES = 256 * 1024 * 1024  # a copy's rows held back, over all its partitions


def write(spark: Any, table: Any, schema: pa.Schema, parts: Iterable[pa.Table],
          scratch: Path, prefix: str, partitioner: Optional[Partitioner] = None,
          fanout: bool = False, on_rows: Optional[OnRows] = None) -> list[Written]:
    """Write ``parts`` (tables in ``schema``) as data files of ``table`` named ``prefix-*``:
    in its data folder when that is on this disk, else under ``scratch`` for ``data_files``
    to upload. With a ``partitioner``, each partition's rows go to files of their own, under a
    folder named for it: gathered first and written a partition at a time (a batch's new
    rows), or with ``fanout`` (a copy, too large to gather) as they come, a file open per
    partition; over ``MAX_OPEN_PARTITIONS`` of them, none is kept open (each write of a
    partition's held rows is a file of its own). ``on_rows`` is told each part as it is
    written: its data file's location and the position of its first row there."""
    props = java_properties(spark, table)
    codec = CODECS[props.get("write.parquet.compression-codec", "zstd").lower()]
    level = props.get("write.parquet.compression-level")
    options: dict[str, Any] = {"compression": codec, "use_dictionary": False}
    if level is not None and codec in ("zstd", "gzip"):
        options["compression_level"] = int(level)
    folder = data_folder(table)
    target = _Target(folder, local_folder(spark, folder) or scratch, options,
                     int(props.get("write.target-file-size-bytes", DEFAULT_TARGET_BYTES)))
    outs: dict[tuple[Optional[str], ...], _Files] = {}

    def many() -> bool:
        """Over MAX_OPEN_PARTITIONS partitions: no file is kept open."""
        return len(outs) > MAX_OPEN_PARTITIONS

    def out(values: list[Optional[str]]) -> _Files:
        found = outs.get(tuple(values))
        if found is None:
            if fanout and len(outs) == MAX_OPEN_PARTITIONS:  # (the one partition too many)
                log.info("%s: over %d partitions, so no file is kept open for each: a "
                         "partition's rows held back are written as a file of their own each "
                         "time (more, smaller files; walberg maintain compacts them)",
                         table.name(), MAX_OPEN_PARTITIONS)
                for each in outs.values():
                    each.close()
            found = outs[tuple(values)] = _Files(
                target, schema, prefix, partitioner.folder(values) if partitioner else "",
                values, on_rows)
        return found

    try:
        if partitioner is None:
            for part in parts:
                out([]).add(part)
        elif fanout:
            # Each partition's rows are held until the rows held for all reach the budget,
            # then the largest partitions' are written: row groups of many rows, in bounded
            # memory, whatever the order the rows come in.
            held: dict[tuple[Optional[str], ...], list[pa.Table]] = {}
            sizes: dict[tuple[Optional[str], ...], int] = {}

            def flush(key: tuple[Optional[str], ...]) -> None:
                outs[key].add(pa.concat_tables(held.pop(key)))
                sizes.pop(key)
                if many():
                    outs[key].close()

            for part in parts:
                for values, members in partitioner.split(part):
                    key = tuple(values)
                    out(values)
                    held.setdefault(key, []).append(members)
                    sizes[key] = sizes.get(key, 0) + members.nbytes
                if sum(sizes.values()) > FANOUT_BUDGET_BYTES:
                    for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
                        flush(key)
                        if sum(sizes.values()) <= FANOUT_BUDGET_BYTES // 2:
                            break
            for key in list(held):
                flush(key)
        else:
            gathered = list(parts)
            rows = pa.concat_tables(gathered) if gathered else schema.empty_table()
            for values, members in partitioner.split(rows):
                out(values).add(members)
                out(values).close()  # one partition at a time: one file open
    except BaseException:
        for each in outs.values():
            each.close()
            for written in each.written:
                written.path.unlink(missing_ok=True)
        raise
    for each in outs.values():
        each.close()
    return [w for each in outs.values() for w in each.written]


# Told each part ``write`` writes: its data file's location, its first row's position there.
OnRows = Callable[[str, int, pa.Table], None]


@dataclass(frozen=True)
class _Target:
    """Where and how ``write`` writes: the table's data folder, the folder on this disk the
    files go to (the data folder itself, or a scratch folder to upload from), the Parquet
    writer's options, and the size a file rolls at."""

    folder: str
    here: Path
    options: dict[str, Any]
    roll_bytes: int


class _Files:
    """The data files of one partition (or of an unpartitioned table) as they are written:
    one open at a time, rolled at the table's target size."""

    def __init__(self, target: _Target, schema: pa.Schema, prefix: str, subfolder: str,
                 partition: list[Optional[str]], on_rows: Optional[OnRows] = None) -> None:
        self.target, self.schema, self.prefix = target, schema, prefix
        self.subfolder, self.partition = subfolder, partition
        self.on_rows = on_rows
        self.written: list[Written] = []
        self._writer: Any = None
        self._sink: Any = None
        self._rows = 0  # in the file open now

    def add(self, part: pa.Table) -> None:
        if part.num_rows == 0:
            return
        if self._writer is None:
            name = f"{self.prefix}-{uuid.uuid4().hex}.parquet"
            if self.subfolder:
                name = f"{self.subfolder}/{name}"
            path = self.target.here / name
            path.parent.mkdir(parents=True, exist_ok=True)
            # Arrow's own file, not Python's: the writer's many small writes then need no GIL,
            # which the copy's other threads (COPY's reader, the parser, the keys) hold often
            # (2M rows beside a thread holding the GIL: 5.2 s through a Python file, 0.54 s).
            self._sink = pa.OSFile(str(path), "wb")
            self.written.append(Written(f"{self.target.folder}/{name}", path, self.partition))
            self._rows = 0
            try:  # decimals as INT32/INT64 where they fit, as Iceberg's own writer does
                self._writer = pq.ParquetWriter(self._sink, self.schema,
                                                store_decimal_as_integer=True,
                                                **self.target.options)
            except TypeError:  # an older pyarrow: fixed-length decimals, read by all
                self._writer = pq.ParquetWriter(self._sink, self.schema, **self.target.options)
        self._writer.write_table(part)
        if self.on_rows is not None:
            self.on_rows(self.written[-1].location, self._rows, part)
        self._rows += part.num_rows
        if self._sink.tell() >= self.target.roll_bytes:
            self.close()

    def close(self) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            if self._sink is not None:
                self._sink.close()
            self._writer = self._sink = None


def data_files(spark: Any, table: Any, written: Sequence[Written]) -> JavaFiles:
    """Put the files ``write`` made in the table's storage (uploaded through Hadoop's file
    system unless they are there already) and describe each as an Iceberg data file of the
    table's current spec, with its partition and the metrics Iceberg reads from its footer.
    The footers are read here, from this disk, before the files go to the table's storage
    (which would cost a request to read each back); all in one call into the JVM
    (``Batch.dataFiles``), in four threads there."""
    if not written:
        return JavaFiles.empty(spark)
    upload = local_folder(spark, data_folder(table)) is None  # as ``write`` decided
    described = [[each.location, str(each.path.resolve()), each.path.stat().st_size,
                  list(each.partition)] for each in written]
    files = batch_helper(spark).dataFiles(
        table, json.dumps(described), spark._jsc.hadoopConfiguration() if upload else None, 4)
    return JavaFiles.of(spark, files)
