"""What a delete written by position needs to know of the data file it points into, beyond the
key index: its partition (a position-delete file or deletion vector belongs to the data file's
spec and partition) and, in a format-version 3 table, its deletion vector (a new one replaces
it and holds its positions too).

Kept per table as of one snapshot: read from the table's manifests once, then followed through
the appends and compactions the index follows and through walberg's own commits. Only for
tables that need it (partitioned, or format 3); an unpartitioned format-2 table needs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from walberg.apply.jvm.helper import JavaFiles, batch_helper, info_of
from walberg.apply.position.keycodec import ByMerge
from walberg.errors import ApplyError


@dataclass(frozen=True)
class Vector:
    """A data file's deletion vector: where its blob lies."""

    location: str
    offset: int
    length: int


@dataclass(frozen=True)
class LiveFile:
    group: tuple[int, str]  # spec id, partition values as text: files that share a delete file
    vector: Optional[Vector] = None


class NotByPosition(ByMerge):
    """The table holds deletes walberg cannot extend by position (position-delete files in a
    format-3 table, which a deletion vector would have to absorb): it takes the MERGE."""


class LiveFiles:
    """The live data files of one partitioned or format-3 table, as of ``snapshot``: on this
    side, each file's partition and deletion vector; in the JVM, maps of the Java DataFile and
    deletion vector (DeleteFile) of each, by the data file's location, that the delete files
    and the row delta are built from (``Batch.positionDeletes``, ``Batch.vectors``)."""

    def __init__(self, spark: Any, vectors: bool) -> None:
        self.spark = spark
        self.vectors = vectors  # format 3: deletes are deletion vectors
        self.snapshot: Optional[int] = None
        self.files: dict[str, LiveFile] = {}
        self.java_files = spark._jvm.java.util.HashMap()
        self.java_vectors = spark._jvm.java.util.HashMap()

    @staticmethod
    def needed(spark: Any, table: Any) -> Optional["LiveFiles"]:
        """A tracker for ``table`` (Java), or None if its deletes need nothing of the files."""
        v3 = int(table.operations().current().formatVersion()) >= 3
        if not v3 and table.spec().isUnpartitioned() and table.specs().size() == 1:
            return None
        return LiveFiles(spark, v3)

    def read(self, scan: Any, snapshot: Optional[int]) -> None:
        """Every live data file ``scan`` (of the table at ``snapshot``; None if the table is
        empty) plans, with its deletion vector, from the manifests: in one call into the JVM."""
        self.files, self.snapshot = {}, snapshot
        jvm = self.spark._jvm
        self.java_files, self.java_vectors = jvm.java.util.HashMap(), jvm.java.util.HashMap()
        if scan is None:
            return
        planned = json.loads(batch_helper(self.spark).plan(
            scan, self.java_files, self.vectors, self.java_vectors))
        for data_row, delete_rows in planned:
            data = info_of(data_row)
            vector = None
            for row in delete_rows:
                delete = info_of(row)
                if delete.format != "PUFFIN":
                    raise NotByPosition(
                        "it is format version 3 and holds position-delete files from "
                        "before; `walberg maintain` compacts them away")
                vector = _vector(delete.location, delete.offset, delete.length)
            self.files[data.location] = LiveFile(data.group, vector)

    def added(self, data_files: JavaFiles, snapshot: int) -> bool:
        """Files an append or a compaction added, now at ``snapshot``. False if the tracker
        must be read anew instead (a compaction may have dropped deletion vectors)."""
        if self.vectors:
            return False
        self._add(data_files)
        self.snapshot = snapshot
        return True

    def _add(self, data_files: JavaFiles) -> None:
        batch_helper(self.spark).put(self.java_files, data_files.java)
        for f in data_files.info:
            self.files[f.location] = LiveFile(f.group)

    def committed(self, data_files: JavaFiles, vectors: JavaFiles, snapshot: int) -> None:
        """walberg's own row delta: the data files it added, the deletion vectors it wrote
        (each replacing its data file's earlier one)."""
        self._add(data_files)
        if self.vectors and len(vectors):
            batch_helper(self.spark).putVectors(self.java_vectors, vectors.java)
            for delete in vectors.info:
                found = self.files.get(delete.referenced or "")
                if found is not None and delete.referenced is not None:
                    self.files[delete.referenced] = LiveFile(
                        found.group, _vector(delete.location, delete.offset, delete.length))
        self.snapshot = snapshot

    def of(self, path: str) -> LiveFile:
        found = self.files.get(path)
        if found is None:  # never: every live file is known
            raise ApplyError(f"data file {path} is not among the table's live files as walberg "
                             "read them")
        return found


def _vector(location: str, offset: Optional[int], length: Optional[int]) -> Vector:
    assert offset is not None and length is not None  # (a deletion vector's always are)
    return Vector(location, int(offset), int(length))


def read_blob(spark: Any, vector: Vector, local: Optional[Path]) -> bytes:
    """The bytes of a deletion vector's blob: from this machine's disk when the file is here,
    else through the table's Hadoop file system."""
    if local is not None:
        with open(local, "rb") as f:
            f.seek(vector.offset)
            return f.read(vector.length)
    jvm = spark._jvm
    path = jvm.org.apache.hadoop.fs.Path(vector.location)
    fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    stream = fs.open(path)
    try:
        buffer = spark.sparkContext._gateway.new_array(jvm.byte, vector.length)
        stream.readFully(vector.offset, buffer)
        return bytes(jvm.java.util.Arrays.copyOf(buffer, vector.length))
    finally:
        stream.close()
