"""Applying a batch by position: the apply path whose cost follows the changes, not the table.

A MERGE with merge-on-read finds the row of every changed key by joining the batch with every
data file that may hold one; with keys spread at random that is the whole table, so each batch
costs about as much as reading the table. For a table whose rows are known by position (a key
index, ``keyindex.KeyIndex``, kept on local disk beside the segments) the same batch is one
row delta (``rowdelta.commit_row_delta``): the rows of the keys it changes or deletes are
deleted by (data file, position), its new rows are added, in one commit that carries the
source's marks. Nothing reads the table.

Which tables: a key of integer, date, timestamp or text-like columns (uuid, text, varchar, and
any combination of them; ``keycodec`` says how each key becomes an index entry), partitioned or
not (deletes are written per partition), format 2 (position-delete files) or 3 (deletion
vectors), merge-on-read, written by one source or fanned in from several (each source's index
holds its own partition), in upsert mode, with ``sink.apply_by_position`` on (the default).
Which batches: those without a TRUNCATE and without an UPDATE that left a TOASTed value unsent
(its value has to come from the lake's row). Every other table or batch takes the MERGE, as
before; so does a table two of whose keys share an index entry (``KeyClash``, a 64-bit clash:
about one table in 400,000 at ten million keys).

The index describes one snapshot of one table (by table-uuid: one dropped and made again is
another). Before a batch it is brought to the table's current snapshot: nothing to do when it is
there already; the rows of appends since (an insert-only batch, a chunk of the initial copy) and
of compactions (``walberg maintain``) are taken from the files they wrote; anything else (a MERGE,
a crash between a commit and the index's update, a copy that replaced the table) rebuilds it from
the lake. So the index is derived from the lake and never needs to be committed with it: a kill -9
at any point costs at most one rebuild.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.batch import StagedTable
from walberg.apply.jvm.helper import JavaFiles
from walberg.apply.position import datafiles, rowdelta
from walberg.apply.position.batchkeys import concat_entries, entries_as_written, look_up, new_rows
from walberg.apply.position.copykeys import KeysAsWritten
from walberg.apply.position.entries import lake_entries, scan_of, written_entries
from walberg.apply.position.keycodec import ByMerge, KeyCodec
from walberg.apply.position.keyindex import (
    MANIFEST,
    Hits,
    KeyIndex,
    encoding_of,
)
from walberg.apply.position.keystore import KeyStore, Place, place_of
from walberg.apply.position.lakekeys import Files, live_scan, table_uuid
from walberg.apply.position.livefiles import LiveFiles
from walberg.apply.position.partitions import NotHere, Partitioner
from walberg.apply.position.rowdelta import RowDeltaResult, commit_row_delta
from walberg.apply.readahead import ahead
from walberg.apply.session import (
    LSN_PROPERTY,
    SOURCE_COLUMN,
    LakeSession,
    find_java_table,
    java_table,
)
from walberg.apply.tables import Tables
from walberg.apply.types import UUID
from walberg.faults import crash_point
from walberg.model import Column, Lsn

if TYPE_CHECKING:
    from walberg.apply.copyfiles import CopyFiles

log = logging.getLogger("walberg")

# Commits since the index's snapshot that it follows file by file (past MAX_APPENDS of them,
# it is rebuilt): an append adds rows; a compaction ("replace") writes every live row of the
# files it removes into the files it adds, so the added files' rows are every moved key's new
# place (a deleted key has no entry left to move).
FOLLOWED = ("append", "replace")
MAX_APPENDS = 64
# Past this many rows in the files to follow (a compaction of a large table, mostly), the index
# is rebuilt instead: every key moved, and reading the keys anew beats merging that many moves
# into the index, entry by entry (after `walberg maintain` of a 10M-row table, following took
# 11.6 s; a rebuild reads 10M keys in 1.6 s, 13M in 3.1 s).
FOLLOW_MAX_ROWS = 2_000_000


class KeyedApply:
    """Applies batches by position to the tables that allow it (see the module docstring)."""

    def __init__(self, lake: LakeSession, tables: Tables, root: Optional[Path],
                 keep: bool = True) -> None:
        """``root``: where the key indexes live (None: never by position). ``keep``: keep each
        index in the warehouse too, for a driver on another machine (``keystore``)."""
        self.lake = lake
        self.tables = tables
        self.root = root
        self._store = KeyStore() if keep and root is not None else None
        self._places: dict[str, Optional[Place]] = {}
        self._kept: dict[str, int] = {}  # the snapshot each index was last kept at
        self._files: Optional[Files] = None
        self._fetching: dict[str, Future[None]] = {}  # kept indexes fetched ahead (``warm``)
        self._told: dict[str, str] = {}  # the reason last logged for new rows by Spark
        self._indexes: dict[str, KeyIndex] = {}
        self._positional: dict[str, bool] = {}
        self._clashed: set[str] = set()  # tables whose keys share index entries: MERGE
        # Of a partitioned or format-3 table: its live data files' partitions and deletion
        # vectors (see livefiles), as of a snapshot.
        self._live: dict[str, Optional[LiveFiles]] = {}
        self._swept = False

    @property
    def _enabled(self) -> bool:
        """Whether any table may go by position: a place for the indexes."""
        return self.root is not None

    def warm(self, targets: Sequence[str] = ()) -> None:
        """Load the JVM code of a row delta's commit now, in a thread, while the caller goes on
        reading the lake (see ``rowdelta.warm``): a run's first batch applied by position then
        commits as fast as later ones; and fetch the kept index of each of ``targets`` that
        has none on this disk (a driver that moved), in a thread too. Best effort: a failure
        is logged at debug level."""
        if not self._enabled:
            return
        scratch = self._scratch()  # (swept of what a killed run left, here, before the thread)
        if self._store is not None:
            missing = [t for t in targets if t not in self._fetching
                       and not (self._directory(t) / MANIFEST).exists()]
            if missing:
                pool = ThreadPoolExecutor(1, thread_name_prefix="walberg-prefetch")
                for target in missing:
                    self._fetching[target] = pool.submit(self._fetch_ahead, target)
                pool.shutdown(wait=False)

        def run() -> None:
            started = time.monotonic()
            try:
                with scratch as folder:
                    rowdelta.warm(self.lake.spark, folder)
                log.debug("row delta's JVM code loaded in %.2f s", time.monotonic() - started)
            except Exception as exc:
                log.debug("loading the row delta's JVM code failed: %s", exc)

        threading.Thread(target=run, name="walberg-warm", daemon=True).start()

    def forget(self, target: str) -> None:
        """The table may have been replaced or repartitioned: look at it afresh."""
        self._positional.pop(target, None)
        self._indexes.pop(target, None)
        self._live.pop(target, None)
        self._places.pop(target, None)

    def close(self) -> None:
        """Before the process ends: wait for the indexes still being kept in the warehouse."""
        if self._store is not None:
            self._store.close()

    # ---- which tables -----------------------------------------------------------------------

    def key_of(self, target: str, columns: Sequence[Column]
               ) -> Optional[tuple[list[int], KeyCodec]]:
        """The positions of the table's key columns and how the index encodes them, if the
        table is applied by position; None if it takes the MERGE."""
        if not self._enabled or target in self._clashed:
            return None
        keys = [i for i, c in enumerate(columns) if c.is_key]
        if not keys or len(keys) == len(columns):
            return None
        codec = KeyCodec.for_types([self.lake.types.spark_type(columns[i], target).sql
                                    for i in keys], [columns[i].type_oid == UUID for i in keys])
        if codec is None:
            return None
        if target not in self._positional:
            self._positional[target] = _positional(java_table(self.lake.spark, target),
                                                   self.lake.source)
        return (keys, codec) if self._positional[target] else None

    def takes(self, target: str, staged: StagedTable) -> bool:
        """Whether this batch of the table goes by position."""
        return (not staged.truncates and not staged.unchanged_columns
                and not staged.moved_unchanged and self.key_of(target, staged.columns) is not None)

    def clashed(self, target: str, why: Exception) -> None:
        """Two keys of the table share an index entry, or a key could not be encoded: the
        table is applied by MERGE from now on in this process (a later run finds it out again
        when it builds the index)."""
        self._clashed.add(target)
        self._indexes.pop(target, None)
        log.warning("%s: applied by MERGE from now on, not by position: %s", target, why)

    # ---- the index --------------------------------------------------------------------------

    def _directory(self, target: str) -> Path:
        assert self.root is not None
        return self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", target)

    def index(self, target: str, columns: Sequence[Column], table: Any = None) -> KeyIndex:
        """The table's key index, brought to its current snapshot (that of ``table``, the
        Iceberg Java table as just loaded; None: load it)."""
        found_key = self.key_of(target, columns)
        assert found_key is not None
        positions, codec = found_key
        keys = [columns[i].name for i in positions]
        self._wait_for_fetch(target)
        table = java_table(self.lake.spark, target) if table is None else table
        uuid, found = table_uuid(table), self._indexes.get(target)
        if found is None or (found.encoding, found.table) != (codec.name, uuid) or \
                found.keys not in (None, tuple(keys)):
            found = self._indexes[target] = KeyIndex(self._directory(target),
                                                     encoding=codec.name, keys=keys, table=uuid)
        current = table.currentSnapshot()
        now = None if current is None else int(current.snapshotId())
        if not found.built and self._store is not None:
            found = self._fetched(target, table, codec, keys, now) or found
        if found.built and now == found.snapshot:
            self._know_files(target, table, now)
            self._keep(target, table, found)
            return found
        appended = self._appends_since(table, found.snapshot, now) if found.built else None
        started = time.monotonic()
        with self._scratch() as scratch:
            if appended is not None:
                entries = list(written_entries(self.lake.spark,
                                               tuple(str(f.location()) for f in appended),
                                               keys, codec, scratch))
                assert now is not None
                live = self._live.get(target)
                if live is not None and live.snapshot == found.snapshot:
                    # (else _know_files reads them all below)
                    live.added(JavaFiles.of(self.lake.spark, appended), now)
                found.commit(now, np.empty(0, np.int64), concat_entries(entries))
                log.info("key index of %s: followed %d new data file(s), in %.2f s", target,
                         len(appended), time.monotonic() - started)
            else:
                scan = live_scan(self.lake.spark, table, keys, self.lake.source)
                if scan is not None:
                    # The key columns and the deletes are read on the driver and sorted on
                    # disk, with no Spark job.
                    found.rebuild_from_files(scan.snapshot, scan.locations,
                                             ahead(scan.rows(codec), "keys"), scratch)
                    deletes = (f" and {scan.delete_files} delete file(s)"
                               if scan.delete_files else "")
                    how = f"{len(scan.locations)} data file(s){deletes} read on the driver"
                else:
                    files: list[str] = []
                    snapshot, entries_ = lake_entries(self.lake.spark, target, keys, codec,
                                                      scratch, files, self.lake.source)
                    if codec.sorted_like_the_table:
                        found.rebuild(snapshot, entries_, files)
                        how = "read and sorted by Spark"
                    else:
                        found.rebuild_unsorted(snapshot, files, entries_, scratch)
                        how = "read by Spark, sorted on the driver"
                log.info("key index of %s rebuilt from the lake (%s): %d keys, in %.2f s",
                         target, how, found.size, time.monotonic() - started)
        self._know_files(target, table, found.snapshot)
        self._keep(target, table, found)
        return found

    # ---- the index in the warehouse (keystore) -----------------------------------------------

    def _place(self, target: str, table: Any) -> Optional[Place]:
        """Where the table's index is kept in the warehouse (None: nowhere the driver writes;
        said once)."""
        if target not in self._places:
            location = str(table.location())
            place = self._places[target] = place_of(location, self.lake.source,
                                                    lambda: self._lake_files().s3_fs())
            if place is None:
                log.info("key index of %s: not kept in the warehouse (%s is neither on this "
                         "machine nor on S3); a driver on another machine reads its keys",
                         target, location)
        return self._places[target]

    def _lake_files(self) -> Files:
        if self._files is None:
            self._files = Files(self.lake.spark)
        return self._files

    def _fetched(self, target: str, table: Any, codec: Optional[KeyCodec],
                 keys: Optional[Sequence[str]], now: Optional[int]) -> Optional[KeyIndex]:
        """A driver with no index of the table: the one kept in the warehouse, if it describes
        the current snapshot or one it follows to it by appends (made for ``codec``'s key
        encoding and the key columns ``keys``; None: any); else None."""
        place = self._place(target, table)
        if place is None or now is None:
            return None
        assert self._store is not None
        started = time.monotonic()
        directory = self._directory(target)
        try:
            snapshot = self._store.fetch(
                place, directory, None if codec is None else codec.name, keys, table_uuid(table),
                lambda s: s == now or self._appends_since(table, s, now) is not None)
        except Exception as exc:
            log.warning("key index of %s: the copy in the warehouse could not be read (%s); "
                        "made from the lake instead", target, exc)
            return None
        if snapshot is None:
            return None
        encoding = encoding_of(json.loads((directory / MANIFEST).read_text()))
        found = KeyIndex(directory, encoding=encoding)
        if codec is not None:
            self._indexes[target] = found
        self._kept[target] = snapshot
        log.info("key index of %s fetched from the warehouse (snapshot %d, %d keys) in %.2f s",
                 target, snapshot, found.size, time.monotonic() - started)
        return found

    def _fetch_ahead(self, target: str) -> None:
        """The kept index of ``target``, fetched before its first batch needs it (``index``
        waits for it, then checks its encoding and follows the table from its snapshot)."""
        try:
            table = find_java_table(self.lake.spark, target)
            current = None if table is None else table.currentSnapshot()
            if current is None:
                return
            self._fetched(target, table, None, None, int(current.snapshotId()))
        except Exception as exc:
            log.debug("fetching the kept key index of %s ahead failed: %s", target, exc)

    def _wait_for_fetch(self, target: str) -> None:
        """Before the table's index folder is used: the fetch begun ahead, if any, is over
        (it says its own failures)."""
        pending = self._fetching.pop(target, None)
        if pending is not None:
            pending.result()

    def _keep(self, target: str, table: Any, index: KeyIndex) -> None:
        """Have the index kept in the warehouse at its snapshot, unless it is already."""
        if self._store is None or index.snapshot is None or \
                self._kept.get(target) == index.snapshot:
            return
        place = self._place(target, table)
        if place is None:
            return
        try:
            self._store.keep(target, place, index.directory, self._scratch_root())
        except OSError as exc:
            log.warning("key index of %s: not kept in the warehouse (%s)", target, exc)
            return
        self._kept[target] = index.snapshot

    def _know_files(self, target: str, table: Any, snapshot: Optional[int]) -> None:
        """Of a partitioned or format-3 table, the partition and deletion vector of every live
        data file at ``snapshot`` (the index's), read from the manifests unless known."""
        if target not in self._live:
            self._live[target] = LiveFiles.needed(self.lake.spark, table)
        live = self._live[target]
        if live is not None and (live.snapshot != snapshot or not live.files):
            live.read(None if snapshot is None else
                      scan_of(self.lake.spark, table, snapshot, self.lake.source), snapshot)

    def _appends_since(self, table: Any, since: Optional[int], now: Optional[int]
                       ) -> Optional[list[Any]]:
        """The data files added by the appends and compactions that lead from snapshot
        ``since`` to ``now``, oldest first; None if anything else happened in between, if they
        hold more than FOLLOW_MAX_ROWS rows, or if the way back is lost."""
        files: list[Any] = []
        rows = 0
        at = now
        for _ in range(MAX_APPENDS):
            if at == since:
                return files
            if at is None:
                return None
            snap = table.snapshot(at)
            if snap is None:
                return None
            if self._by_another_source(snap):
                # It changed that source's partition only: nothing of this source's moved.
                parent = snap.parentId()
                at = None if parent is None else int(parent)
                continue
            if str(snap.operation()) not in FOLLOWED:
                return None
            added = [f for f in snap.addedDataFiles(table.io()) if self._ours(table, f)]
            rows += sum(int(f.recordCount()) for f in added)
            if rows > FOLLOW_MAX_ROWS:
                return None
            files[:0] = added
            parent = snap.parentId()
            at = None if parent is None else int(parent)
        return None

    def _by_another_source(self, snap: Any) -> bool:
        """Whether a snapshot of a fan-in table was committed by another source (its marks
        are another's)."""
        if self.lake.source is None:
            return False
        marks = [str(k) for k in snap.summary().keySet() if str(k).startswith(LSN_PROPERTY)]
        return bool(marks) and self.lake.lsn_property not in marks

    def _ours(self, table: Any, data_file: Any) -> bool:
        """Whether a data file is in this source's partition (always, with one source)."""
        if self.lake.source is None:
            return True
        spec = table.specs().get(data_file.specId())
        at = _source_field(table, spec)
        assert at is not None  # (_positional made sure of it)
        jvm = self.lake.spark._jvm
        return str(data_file.partition().get(at, jvm.java.lang.String._java_lang_class)) \
            == self.lake.source

    def _scratch(self) -> "_Scratch":
        return _Scratch(self._scratch_root())

    def _scratch_root(self) -> Path:
        """The index root, made if need be; on first use, swept of the scratch folders and
        links to keep that a killed run left (this process holds buffer.dir's lock)."""
        assert self.root is not None
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self._swept:
            for left in [*self.root.glob("scratch-*"), *self.root.glob("keep-*")]:
                shutil.rmtree(left, ignore_errors=True)
        self._swept = True
        return self.root

    # ---- a batch ----------------------------------------------------------------------------

    def apply(self, target: str, staged: StagedTable, netted: Callable[[], Any], lsn: Lsn,
              max_seq: int, void: Sequence[tuple[int, int]], marks: Mapping[str, str]) -> None:
        """Apply one table's batch as one row delta. Its new rows are written on the driver
        when ``apply.position.datafiles`` allows, else by Spark from ``netted()`` (the batch's last
        change per key, as a DataFrame). The rows to delete are looked up in the index and
        written as a position-delete file in a thread meanwhile (numpy and Arrow leave the
        GIL to the other; ``look_up``)."""
        columns = staged.columns
        found_key = self.key_of(target, columns)
        assert found_key is not None
        positions, codec = found_key
        key_names = [columns[i].name for i in positions]
        clock = [time.monotonic()]
        spark = self.lake.spark
        table = java_table(spark, target)  # one load for the index, the new rows, the commit
        index = self.index(target, columns, table)
        live = self._live.get(target)
        clock.append(time.monotonic())
        with self._scratch() as scratch, \
                ThreadPoolExecutor(1, thread_name_prefix="walberg-lookup") as pool:
            looked_up = pool.submit(look_up, spark, index, staged, positions, codec, key_names,
                                    max_seq, void, live, scratch)
            # The new rows' keys as they are written on the driver, by data file and first
            # position: the index's entries for them, with nothing read back after the commit
            # (on object storage that was a Spark job over every new file, one per partition).
            as_written: list[tuple[str, int, pa.Table]] = []
            why = self._why_not_here(target, staged, table)
            started = time.monotonic()
            rows, new_files, why = self._write_new_rows(target, staged, netted, table, why,
                                                        max_seq, void, scratch, key_names,
                                                        as_written)
            written_in = time.monotonic() - started
            try:
                hits, deletes, keys, lookup_s = looked_up.result()
            except ByMerge:
                if new_files is not None:
                    rowdelta.remove_files(spark, new_files.locations)
                raise
            crash_point("row-delta")
            # Validated from the index's snapshot: a commit by another writer since then that
            # touched these rows fails it, and the caller tries again (lakeside's retries,
            # which forget the table, so the index is brought to the new state first).
            result = commit_row_delta(spark, target, rows, deletes, marks, index.snapshot,
                                      new_files, table, keys, self.lake.source, live)
            clock.append(time.monotonic())
            crash_point("indexed", delay=0.5)
            if new_files is not None and \
                    set(result.added_files) == {location for location, _, _ in as_written}:
                added = entries_as_written(as_written, key_names, codec)
            else:
                added = concat_entries(list(written_entries(spark, result.added_files,
                                                            key_names, codec, Path(scratch))))
        self._follow_commit(target, table, index, live, result, hits, added)
        clock.append(time.monotonic())
        log.info("%s by position: %d deleted, %d added (%s); index %.2f s, row delta %.2f s "
                 "(new rows %.2f s, beside them the lookup and delete file %.2f s; deletes "
                 "%.2f s, commit %.2f s), index update %.2f s",
                 target, result.deleted_rows, result.added_rows,
                 "written on the driver" if why is None else "written by Spark",
                 clock[1] - clock[0], clock[2] - clock[1], result.seconds[1] + written_in,
                 lookup_s, result.seconds[0], result.seconds[2], clock[3] - clock[2])

    def _write_new_rows(self, target: str, staged: StagedTable, netted: Callable[[], Any],
                        table: Any, why: Optional[str], max_seq: int,
                        void: Sequence[tuple[int, int]], scratch: Path,
                        key_names: Sequence[str], as_written: list[tuple[str, int, pa.Table]]
                        ) -> tuple[Any, Optional[JavaFiles], Optional[str]]:
        """The batch's new rows: as data files written on the driver unless ``why`` (or the
        writing) says why not, their keys noted in ``as_written``; else as the DataFrame for
        Spark to write, from ``netted()``. With the reason they are not written here (None:
        they are)."""
        spark = self.lake.spark
        columns = staged.columns
        rows: Any = None
        new_files: Optional[JavaFiles] = None
        if why is None:
            schema = datafiles.arrow_schema(table, columns, self.lake, target)
            partitioner = Partitioner.of(table, schema)
            assert isinstance(partitioner, Partitioner)  # as ``why`` found
            try:
                written = datafiles.write(
                    spark, table, schema,
                    new_rows(staged.files, schema, max_seq, void, self.lake.source),
                    scratch, "walberg-rows",
                    None if table.spec().isUnpartitioned() else partitioner,
                    on_rows=lambda location, first, part: as_written.append(
                        (location, first, part.select(key_names))))
                new_files = datafiles.data_files(spark, table, written)
            except NotHere as exc:
                as_written.clear()
                why = str(exc)
                log.info("%s by position: this batch's new rows written by Spark, because "
                         "%s", target, why)
        if why is not None:
            rows = self.lake.typed(netted().where("_wb_op <> 'D'"), target, columns, "_wb_lsn")
        return rows, new_files, why

    def _follow_commit(self, target: str, table: Any, index: KeyIndex,
                       live: Optional[LiveFiles], result: RowDeltaResult, hits: Hits,
                       added: tuple[np.ndarray, np.ndarray, list[str], np.ndarray]) -> None:
        """After the batch's commit: the index (and the live files) brought to it, and kept;
        or, if another writer committed in between, forgotten, to be built again."""
        if self._appends_since(table, index.snapshot, result.parent) == []:
            # (on the index's snapshot, or on other sources' commits to a shared table after it)
            index.commit(result.snapshot_id, hits.keys, added)
            if live is not None:
                live.committed(result.data_files, result.delete_files, result.snapshot_id)
            self._keep(target, table, index)
        else:
            # Iceberg put the commit on top of another writer's that did not conflict with it
            # (a compaction of other files, say): the index does not know what that one did,
            # and is built again for the next batch.
            log.info("%s by position: another writer committed between the key index's "
                     "snapshot and this batch's commit; the index is read again", target)
            self.forget(target)

    def _why_not_here(self, target: str, staged: StagedTable, table: Any) -> Optional[str]:
        """Why this batch's new rows are written by Spark (None: on the driver). Said in the
        log once per table and reason."""
        why = ("the batch was not netted per key when it was staged" if not staged.unique_keys
               else datafiles.why_not_staged(self.lake, self.tables, target, staged.columns,
                                             table, [pq.read_schema(f).types
                                                     for f in staged.files]))
        if why is not None and self._told.get(target) != why:
            self._told[target] = why
            log.info("%s by position: new rows written by Spark, because %s", target, why)
        return why

    def keys_as_written(self, target: str, columns: Sequence[Column]
                        ) -> Optional[KeysAsWritten]:
        """For a copy written on the driver: what takes its rows' keys as they are written,
        for ``prepare``; None if the table is not applied by position."""
        found = self.key_of(target, columns)
        if found is None:
            return None
        positions, codec = found
        return KeysAsWritten([columns[i].name for i in positions], codec,
                             Path(self._scratch().path))

    def prepare(self, target: str, columns: Sequence[Column],
                copied: Optional[CopyFiles] = None) -> None:
        """After the table was (re)written whole (an initial copy): build its index now, so
        that the first batch does not wait for it; from the keys taken as the copy was
        written when ``copied`` (committed) holds them, else from the lake."""
        keys = None if copied is None else copied.keys
        try:
            self._wait_for_fetch(target)  # (its folder is about to be made anew)
            self.forget(target)
            found = self.key_of(target, columns)
            if found is None:
                return
            try:
                table = java_table(self.lake.spark, target)
                if keys is not None and copied is not None and copied.snapshot is not None:
                    self._index_from_copy(target, found[1], keys, copied.snapshot, table)
                self.index(target, columns, table)
            except ByMerge as exc:
                self.clashed(target, exc)
        finally:
            if keys is not None:
                keys.discard()

    def _index_from_copy(self, target: str, codec: KeyCodec, keys: KeysAsWritten,
                         snapshot: int, table: Any) -> None:
        """The table's index (``table``: the Iceberg Java table) made from the keys its copy's
        rows gave as they were written, as of the copy's commit ``snapshot``; on a failure
        other than ``ByMerge``, left for ``index`` to make from the lake (with a warning)."""
        started = time.monotonic()
        index = self._indexes[target] = KeyIndex(self._directory(target), encoding=codec.name,
                                                 keys=keys.names, table=table_uuid(table))
        try:
            keys.finish(index, snapshot)
        except ByMerge:
            raise
        except Exception as exc:
            self.forget(target)
            log.warning("key index of %s: not made from the copy's rows (%s); made from the "
                        "lake instead", target, exc)
            return
        log.info("key index of %s made from the copy's rows as they were written: %d keys, "
                 "%.2f s after its commit", target, index.size, time.monotonic() - started)


def _positional(table: Any, source: Optional[str]) -> bool:
    """Whether the Iceberg table takes deletes by position: format 2 (position-delete files)
    or 3 (deletion vectors), merge-on-read (a copy-on-write table is meant to have no delete
    files). Partitioned or not: the deletes are written per partition. A table several
    sources fan in to, when every spec keeps each source's rows in partitions of their own
    (identity on the source column, as walberg makes them): the index holds one source's."""
    props = table.properties()
    modes = [props.get(f"write.{op}.mode") for op in ("update", "delete", "merge")]
    if source is not None and any(_source_field(table, spec) is None
                                  for spec in table.specs().values()):
        return False
    return (int(table.operations().current().formatVersion()) in (2, 3)
            and "copy-on-write" not in modes)


def _source_field(table: Any, spec: Any) -> Optional[int]:
    """The position of the identity partition on the source column in ``spec``, if any."""
    column = table.schema().findField(SOURCE_COLUMN)
    if column is None:
        return None
    for i, field in enumerate(spec.fields()):
        if int(field.sourceId()) == int(column.fieldId()) and \
                str(field.transform()) == "identity":
            return i
    return None


class _Scratch:
    """A temporary folder under the index root, removed on exit."""

    def __init__(self, root: Path) -> None:
        self.path = tempfile.mkdtemp(prefix="scratch-", dir=root)

    def __enter__(self) -> Path:
        return Path(self.path)

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


