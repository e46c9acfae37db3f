"""An initial copy written as Iceberg data files on the driver, without a Spark job.

Spark's part of a copy whose columns are all staged in their final type was to read the staged
files, rename their columns, add ``_walberg_lsn`` and write them again: at 10M rows two thirds
of the copy. Here the copy's rows become the table's data files (``apply.position.datafiles``)
and one Iceberg commit replaces the table's rows with them, carrying the copy's LSN as every
walberg commit does. The rows come as COPY's stream is parsed (``write_files``; nothing staged
on disk first), or from staged files (``write_copy``). Which tables: those
``datafiles.why_not`` lets through.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.jvm.calls import spark_call
from walberg.apply.jvm.commits import one_commit_at_a_time
from walberg.apply.jvm.helper import batch_helper
from walberg.apply.position import datafiles
from walberg.apply.position.keybase import KeysAsWritten
from walberg.apply.position.partitions import NotHere, Partitioner
from walberg.apply.readahead import ahead
from walberg.apply.session import SOURCE_COLUMN, LakeSession, java_table
from walberg.apply.tables import Tables
from walberg.faults import crash_point
from walberg.model import Column, Lsn

log = logging.getLogger("walberg")


@dataclass
class CopyFiles:
    """A copy's data files, written and not yet committed."""

    target: str
    table: Any
    written: list[datafiles.Written]
    keys: Optional[KeysAsWritten] = None  # the rows' keys, taken as they were written
    snapshot: Optional[int] = None  # the commit's, once ``commit`` made it

    def discard(self) -> None:
        """Remove the files (a copy that failed after writing them; they are still only on
        this disk: ``commit`` uploads them)."""
        if self.keys is not None:
            self.keys.discard()
        for each in self.written:
            each.path.unlink(missing_ok=True)


def why_not_here(lake: LakeSession, tables: Tables, target: str, columns: Sequence[Column],
                 staged: Sequence[Sequence[pa.DataType]]) -> Optional[str]:
    """Why a copy staged in these column types (one list per staged file or stream) is written
    by Spark (None: on the driver)."""
    table = java_table(lake.spark, target)
    return spark_call(f"checking {target} for a copy written on the driver",
                      lambda: datafiles.why_not_staged(lake, tables, target, columns, table,
                                                       staged))


def write_files(lake: LakeSession, target: str, columns: Sequence[Column],
                parts: Iterable[pa.Table], lsn: Lsn, scratch: Path,
                keys: Optional[KeysAsWritten] = None) -> CopyFiles:
    """Write the copy's rows (``parts``: tables of the staged columns ``c0..cN``, as they come)
    as the table's data files, each row marked ``lsn``; for ``commit``. A table this cannot
    partition raises ``NotHere`` and leaves nothing written. ``keys`` takes the rows' keys
    as they are written (discarded if this fails)."""
    spark = lake.spark
    table = java_table(spark, target)
    schema = datafiles.arrow_schema(table, columns, lake, target)
    partitioner = None if table.spec().isUnpartitioned() else Partitioner.of(table, schema)
    assert not isinstance(partitioner, str)  # as ``why_not_here`` found
    # (the next rows parsed while the ones before are written)
    rows = ahead(_with_lsn(parts, schema, int(lsn), lake.source), "copy")
    try:
        written = spark_call(f"writing the initial copy of {target}", lambda: datafiles.write(
            spark, table, schema, rows, scratch, "walberg-copy", partitioner, fanout=True,
            on_rows=None if keys is None else keys.add))
    except BaseException:
        if keys is not None:
            keys.discard()
        raise
    finally:
        rows.close()  # (its thread stopped before the caller closes ``parts``)
    if keys is not None:
        keys.written()  # (its runs merged while the files are committed)
    return CopyFiles(target, table, written, keys)


def commit(lake: LakeSession, files: CopyFiles, marks: Mapping[str, str]) -> int:
    """Commit the written files in place of the table's rows, in one commit carrying ``marks``;
    the number of data files it added. If it fails, the keys taken as they were written go."""
    crash_point("copy-files")
    try:
        added, files.snapshot = spark_call(
            f"committing the initial copy of {files.target}",
            lambda: one_commit_at_a_time(files.target, lambda: _commit(
                lake.spark, files.table, files.written, marks, lake.source)))
    except BaseException:
        if files.keys is not None:
            files.keys.discard()
        raise
    log.info("initial copy of %s: written on the driver as %d data file(s)", files.target, added)
    return added


def write_copy(lake: LakeSession, tables: Tables, target: str, columns: Sequence[Column],
               files: Sequence[Path], lsn: Lsn, marks: Mapping[str, str],
               keys: Callable[[], Optional[KeysAsWritten]] = lambda: None
               ) -> Optional[CopyFiles]:
    """Replace ``target``'s rows with the staged copy ``files`` in one commit carrying
    ``marks``; the files committed, or None if this copy takes Spark's path (the log says
    why). ``keys``: what takes the rows' keys as they are written, if anything."""
    why = why_not_here(lake, tables, target, columns, [pq.read_schema(f).types for f in files])
    if why is not None:
        log.info("initial copy of %s: written by Spark, because %s", target, why)
        return None
    scratch = Path(files[0]).parent if files else Path(".")
    try:
        written = write_files(lake, target, columns, _staged(files), lsn, scratch, keys())
    except NotHere as exc:
        log.info("initial copy of %s: written by Spark, because %s", target, exc)
        return None
    commit(lake, written, marks)
    return written


def _staged(files: Sequence[Path]) -> Iterator[pa.Table]:
    """The staged copy's row groups."""
    for staged in files:
        parquet = pq.ParquetFile(staged)
        for group in range(parquet.num_row_groups):
            yield parquet.read_row_group(group)


def _with_lsn(parts: Iterable[pa.Table], schema: pa.Schema, lsn: int,
              source: Optional[str]) -> Iterator[pa.Table]:
    """The copy's rows in the data files' schema, each row marked ``lsn`` (and in a table
    several sources share, with the ``source`` it came from)."""
    for part in parts:
        added = [pa.array(np.full(part.num_rows, lsn, np.int64), pa.int64())]
        if source is not None:
            added.append(pa.repeat(pa.scalar(source, pa.string()), part.num_rows))
        yield pa.Table.from_arrays([*part.columns, *added], schema=schema)


def _commit(spark: Any, table: Any, written: list[datafiles.Written],
            marks: Mapping[str, str], source: Optional[str]) -> tuple[int, int]:
    """Commit the written files in place of every row the table held (or in a shared table,
    every row of ``source``: its partition, the first field of a shared table's spec); the
    number of files and the commit's snapshot."""
    expressions = spark._jvm.org.apache.iceberg.expressions.Expressions
    rows = (expressions.alwaysTrue() if source is None
            else expressions.equal(SOURCE_COLUMN, source))
    overwrite = batch_helper(spark).addFiles(table.newOverwrite().overwriteByRowFilter(rows),
                                             datafiles.data_files(spark, table, written).java)
    for key, value in marks.items():
        overwrite.set(key, value)
    overwrite.commit()
    return len(written), int(table.currentSnapshot().snapshotId())
