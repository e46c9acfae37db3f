"""A key index's entries read from the lake on the driver, with no Spark job.

When a table's key index must be made anew (a driver on a fresh machine, a lost or changed
index, a batch that clashed), every live row's key, data file and position is read from the
table's current snapshot: the key columns of each data file (found by their Iceberg field
ids), less the positions its deletes remove: position-delete files (each read once, whatever
the number of data files it covers) and deletion vectors. A row's position is its ordinal in
its file, as Iceberg counts it.

The files are read where they are: from this machine's disk, or from S3 through Arrow's S3
client, set up from the session's own ``fs.s3a.*`` settings (endpoint, credentials, path
style, region), reading only the key columns' byte ranges. Tables with equality deletes
(written by other engines, never by walberg), and storage Arrow does not reach here, are read
by Spark instead (``entries.lake_entries``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from walberg.apply.position.datafiles import FIELD_ID_KEY
from walberg.apply.position.dv import decode
from walberg.apply.position.entries import local_path, scan_of
from walberg.apply.position.keycodec import KeyCodec
from walberg.apply.session import java_items
from walberg.errors import ApplyError


def table_uuid(table: Any) -> Optional[str]:
    """The Iceberg Java table's table-uuid, what a key index describes besides a snapshot id
    (None: its metadata has none, as some written by old Iceberg versions)."""
    found = table.operations().current().uuid()
    return None if found is None else str(found)


@dataclass(frozen=True)
class Delete:
    """A delete file that applies to a data file: a position-delete file (Parquet), or a
    deletion vector (a blob of a Puffin file)."""

    location: str
    vector: bool
    offset: int = 0
    length: int = 0


@dataclass
class LiveScan:
    """A snapshot's data files, each with the deletes that apply to it, and the key columns'
    Iceberg field ids; ``files`` reads them."""

    snapshot: int
    locations: list[str]
    deletes: list[list[Delete]]
    field_ids: list[int]
    files: "Files"
    _positions: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @property
    def delete_files(self) -> int:
        return len({d.location for applies in self.deletes for d in applies})

    def rows(self, codec: KeyCodec) -> Iterator[tuple[int, Any, np.ndarray, Optional[np.ndarray]]]:
        """(file number, positions, keys, checks) of the live rows of each data file, about 1M
        rows at a time; positions as the first row's (every row of the group is live) or
        as an array (some were deleted)."""
        for number, location in enumerate(self.locations):
            deleted = self._deleted(location, self.deletes[number])
            with self.files.open(location) as source:
                parquet = pq.ParquetFile(source)
                names = _columns_by_id(parquet.schema_arrow, self.field_ids, location)
                offset = 0
                for groups in _spans(parquet.metadata):
                    part = parquet.read_row_groups(groups, columns=names)
                    keys, checks = codec.encode([part.column(n) for n in names])
                    count = len(keys)
                    low, high = np.searchsorted(deleted, [offset, offset + count])
                    if low == high:
                        yield number, offset, keys, checks
                    else:
                        keep = np.ones(count, np.bool_)
                        keep[deleted[low:high] - offset] = False
                        yield (number, np.arange(offset, offset + count, dtype=np.int64)[keep],
                               keys[keep], None if checks is None else checks[keep])
                    offset += count

    def _deleted(self, location: str, deletes: Sequence[Delete]) -> np.ndarray:
        """The sorted positions of ``location`` its deletes remove."""
        found = []
        for delete in deletes:
            if delete.vector:
                blob = self.files.read_range(delete.location, delete.offset, delete.length)
                found.append(np.asarray(decode(blob).to_array(), dtype=np.int64))
                continue
            if delete.location not in self._positions:
                self._positions[delete.location] = self._read_positions(delete.location)
            found.append(self._positions[delete.location].get(location, np.empty(0, np.int64)))
        if not found:
            return np.empty(0, np.int64)
        return np.unique(np.concatenate(found))

    def _read_positions(self, location: str) -> dict[str, np.ndarray]:
        """A position-delete file's positions by the data file they delete in."""
        with self.files.open(location) as source:
            table = pq.read_table(source, columns=["file_path", "pos"])
        paths = pc.dictionary_encode(table.column("file_path")).combine_chunks()
        positions = table.column("pos").to_numpy().astype(np.int64)
        indices = paths.indices.to_numpy(zero_copy_only=False)
        return {str(path): positions[indices == i]
                for i, path in enumerate(paths.dictionary.to_pylist())}


def s3_path(location: str) -> Optional[str]:
    """``bucket/key`` of an S3 location (any of Hadoop's schemes for it), or None."""
    for scheme in ("s3a://", "s3://", "s3n://"):
        if location.startswith(scheme):
            return location[len(scheme):]
    return None


class Files:
    """Opens a table's files on the driver: on this machine's disk, or on S3 through Arrow."""

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self._s3: Any = None

    def reachable(self, location: str) -> bool:
        return local_path(location) is not None or s3_path(location) is not None

    def open(self, location: str) -> Any:
        local = local_path(location)
        if local is not None:
            return pa.OSFile(str(local), "rb")
        path = s3_path(location)
        assert path is not None
        return self.s3_fs().open_input_file(path)

    def read_range(self, location: str, offset: int, length: int) -> bytes:
        with self.open(location) as source:
            return bytes(source.read_at(length, offset))

    def s3_fs(self) -> Any:
        if self._s3 is None:
            from pyarrow import fs

            conf = self.spark._jsc.hadoopConfiguration()

            def get(name: str) -> Optional[str]:
                value = conf.get(f"fs.s3a.{name}")
                return None if value is None or str(value) == "" else str(value)

            endpoint = get("endpoint")
            scheme, _, host = (endpoint or "").rpartition("://")
            secure = (get("connection.ssl.enabled") or "true") == "true"
            self._s3 = fs.S3FileSystem(
                access_key=get("access.key"), secret_key=get("secret.key"),
                region=get("endpoint.region") or "us-east-1",
                endpoint_override=host or None,
                scheme=scheme or ("https" if secure else "http"),
                force_virtual_addressing=(get("path.style.access") or "false") != "true",
                connect_timeout=float(get("connection.establish.timeout") or 5000) / 1000,
                request_timeout=float(get("connection.timeout") or 200000) / 1000,
                allow_delayed_open=True)
        return self._s3


def live_scan(spark: Any, table: Any, keys: Sequence[str], source: Optional[str] = None
              ) -> Optional[LiveScan]:
    """The current snapshot's data files and their deletes, if the driver can read them all
    (None: Spark reads the table; also when it has no snapshot). ``source``: only that
    source's partition of a fan-in table."""
    current = table.currentSnapshot()
    if current is None:
        return None
    snapshot = int(current.snapshotId())
    fields = [table.schema().findField(k) for k in keys]
    if any(f is None for f in fields):
        return None
    files = Files(spark)
    locations: list[str] = []
    deletes: list[list[Delete]] = []
    tasks = scan_of(spark, table, snapshot, source).planFiles()
    try:
        it = tasks.iterator()
        while it.hasNext():
            task = it.next()
            data_file = task.file()
            location = str(data_file.location())
            if str(data_file.format()) != "PARQUET" or not files.reachable(location):
                return None
            applies = []
            for delete in java_items(task.deletes()):
                if str(delete.content()) != "POSITION_DELETES":
                    return None  # equality deletes: Spark applies them
                where = str(delete.location())
                if not files.reachable(where):
                    return None
                if str(delete.format()) == "PUFFIN":
                    applies.append(Delete(where, True, int(delete.contentOffset()),
                                          int(delete.contentSizeInBytes())))
                elif str(delete.format()) == "PARQUET":
                    applies.append(Delete(where, False))
                else:
                    return None
            locations.append(location)
            deletes.append(applies)
    finally:
        tasks.close()
    return LiveScan(snapshot, locations, deletes, [int(f.fieldId()) for f in fields], files)


def _spans(metadata: Any, rows: int = 1 << 20) -> Iterator[list[int]]:
    """A file's row groups in runs of about ``rows`` rows: small row groups (a copy's are
    64k rows) read and encoded one by one cost more in Python than in Arrow and numpy."""
    run: list[int] = []
    held = 0
    for group in range(metadata.num_row_groups):
        run.append(group)
        held += metadata.row_group(group).num_rows
        if held >= rows:
            yield run
            run, held = [], 0
    if run:
        yield run


def _columns_by_id(schema: pa.Schema, field_ids: Sequence[int], location: str) -> list[str]:
    names = []
    for field_id in field_ids:
        at = [f.name for f in schema
              if f.metadata and f.metadata.get(FIELD_ID_KEY) == str(field_id).encode()]
        if len(at) != 1:
            raise ApplyError(f"{location} has no column with field id {field_id}: it is not a "
                             "data file of this table as walberg knows it")
        names.append(at[0])
    return names
