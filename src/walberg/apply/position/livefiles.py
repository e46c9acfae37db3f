"""What a delete written by position needs to know of the data file it points into, beyond the
key index: its partition (a position-delete file or deletion vector belongs to the data file's
spec and partition) and, in a format-version 3 table, its deletion vector (a new one replaces
it and holds its positions too).

Kept per table as of one snapshot: read from the table's manifests once, then followed through
the appends and compactions the index follows and through walberg's own commits. Only for
tables that need it (partitioned, or format 3); an unpartitioned format-2 table needs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from walberg.apply.position.keycodec import ByMerge
from walberg.apply.session import java_items
from walberg.errors import ApplyError


@dataclass(frozen=True)
class Vector:
    """A data file's deletion vector: the Java DeleteFile, and where its blob lies."""

    delete_file: Any
    location: str
    offset: int
    length: int


@dataclass(frozen=True)
class LiveFile:
    group: tuple[int, str]  # spec id, partition values as text: files that share a delete file
    data_file: Any  # Iceberg's Java DataFile
    vector: Optional[Vector] = None


class NotByPosition(ByMerge):
    """The table holds deletes walberg cannot extend by position (position-delete files in a
    format-3 table, which a deletion vector would have to absorb): it takes the MERGE."""


class LiveFiles:
    """The live data files of one partitioned or format-3 table, as of ``snapshot``."""

    def __init__(self, vectors: bool) -> None:
        self.vectors = vectors  # format 3: deletes are deletion vectors
        self.snapshot: Optional[int] = None
        self.files: dict[str, LiveFile] = {}

    @staticmethod
    def needed(table: Any) -> Optional["LiveFiles"]:
        """A tracker for ``table`` (Java), or None if its deletes need nothing of the files."""
        v3 = int(table.operations().current().formatVersion()) >= 3
        if not v3 and table.spec().isUnpartitioned() and table.specs().size() == 1:
            return None
        return LiveFiles(v3)

    def read(self, scan: Any, snapshot: Optional[int]) -> None:
        """Every live data file ``scan`` (of the table at ``snapshot``; None if the table is
        empty) plans, with its deletion vector, from the manifests."""
        self.files, self.snapshot = {}, snapshot
        if scan is None:
            return
        tasks = scan.planFiles()
        try:
            it = tasks.iterator()
            while it.hasNext():
                task = it.next()
                vector = None
                for delete in (java_items(task.deletes()) if self.vectors else ()):
                    if str(delete.format()) != "PUFFIN":
                        raise NotByPosition(
                            "it is format version 3 and holds position-delete files from "
                            "before; `walberg maintain` compacts them away")
                    vector = _vector(delete)
                self._add(task.file(), vector)
        finally:
            tasks.close()

    def _add(self, data_file: Any, vector: Optional[Vector] = None) -> None:
        self.files[str(data_file.location())] = LiveFile(
            (int(data_file.specId()), str(data_file.partition())), data_file, vector)

    def added(self, data_files: Sequence[Any], snapshot: int) -> bool:
        """Files an append or a compaction added, now at ``snapshot``. False if the tracker
        must be read anew instead (a compaction may have dropped deletion vectors)."""
        if self.vectors:
            return False
        for f in data_files:
            self._add(f)
        self.snapshot = snapshot
        return True

    def committed(self, data_files: Sequence[Any], vectors: Sequence[Any], snapshot: int) -> None:
        """walberg's own row delta: the data files it added, the deletion vectors it wrote
        (each replacing its data file's earlier one)."""
        for f in data_files:
            self._add(f)
        for delete in vectors:
            path = str(delete.referencedDataFile())
            found = self.files.get(path)
            if found is not None:
                self.files[path] = LiveFile(found.group, found.data_file, _vector(delete))
        self.snapshot = snapshot

    def of(self, path: str) -> LiveFile:
        found = self.files.get(path)
        if found is None:  # never: every live file is known
            raise ApplyError(f"data file {path} is not among the table's live files as walberg "
                             "read them")
        return found


def _vector(delete: Any) -> Vector:
    return Vector(delete, str(delete.location()), int(delete.contentOffset()),
                  int(delete.contentSizeInBytes()))


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
