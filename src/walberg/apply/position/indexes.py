"""The key index of each table applied by position, kept up to date (``KeyIndexes``).

The index describes one snapshot of one table (by table-uuid: one dropped and made again is
another). Before a batch it is brought to the table's current snapshot: nothing to do when it is
there already; the rows of appends since (an insert-only batch, a chunk of the initial copy) and
of compactions (``walberg maintain``) are taken from the files they wrote; anything else (a MERGE,
a crash between a commit and the index's update, a copy that replaced the table) rebuilds it from
the lake. So the index is derived from the lake and never needs to be committed with it: a kill -9
at any point costs at most one rebuild.

Besides: each index kept in the warehouse at its snapshot and fetched from there by a driver
that has none (``keystore``), the live data files of a partitioned or format-3 table
(``livefiles``), and the scratch folders under the indexes' root.
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
from typing import Any, Optional, Sequence

import numpy as np

from walberg.apply.jvm.helper import JavaFiles
from walberg.apply.position.batchkeys import concat_entries
from walberg.apply.position.entries import lake_entries, scan_of, written_entries
from walberg.apply.position.keybase import KeysAsWritten
from walberg.apply.position.keycodec import ByMerge, KeyCodec
from walberg.apply.position.keyindex import MANIFEST, Hits, KeyIndex, encoding_of
from walberg.apply.position.keystore import (
    KeyStore,
    Place,
    Registry,
    place_of,
    registered_indexes,
)
from walberg.apply.position.lakekeys import Files, live_scan, table_uuid
from walberg.apply.position.livefiles import LiveFiles
from walberg.apply.position.rowdelta import RowDeltaResult
from walberg.apply.readahead import ahead
from walberg.apply.session import LSN_PROPERTY, SOURCE_COLUMN, LakeSession, find_java_table, java_table

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
# A key index registered in its table's metadata (keystore) costs a metadata commit each time
# it is kept, which every other commit to the table then has to retry over: kept at most this
# often a table while walberg runs, and once more as it stops. So is an index of fewer than
# SMALL_INDEX_KEYS keys, wherever it is kept: keeping costs the same few milliseconds of the
# driver's CPU whatever the index's size (reading its manifest, linking or sending its files),
# which at hundreds of small tables a batch was a fifth of the driver's work, while a driver
# that starts elsewhere after a crash reads so small a table's keys from the lake in well under
# a second. A larger index is kept after every commit.
KEEP_EVERY_S = 60.0
SMALL_INDEX_KEYS = 1_000_000


class KeyIndexes:
    """The key indexes of the tables applied by position, under ``root``, each brought to its
    table's current snapshot when asked for (see the module docstring)."""

    def __init__(self, lake: LakeSession, root: Path, keep: bool = True,
                 registered: bool = False) -> None:
        """``keep``: keep each index in the warehouse too, for a driver on another machine
        (``keystore``); ``registered``: as a Puffin file the table's metadata names (a catalog
        that removes files no metadata names; see ``keystore``), not in a folder beside it."""
        self.lake = lake
        self.root = root
        self._registered = registered
        self._store = KeyStore(self._registry()) if keep else None
        self._places: dict[str, Optional[Place]] = {}
        self._kept: dict[str, int] = {}  # the snapshot each index was last kept at
        # Registered and small indexes: when each was last kept, and those whose keeping waits.
        self._kept_at: dict[str, float] = {}
        self._deferred: dict[str, tuple[Any, KeyIndex]] = {}
        self._files: Optional[Files] = None
        self._fetching: dict[str, Future[None]] = {}  # kept indexes fetched ahead
        self._indexes: dict[str, KeyIndex] = {}
        # Of a partitioned or format-3 table: its live data files' partitions and deletion
        # vectors (see livefiles), as of a snapshot.
        self._live: dict[str, Optional[LiveFiles]] = {}
        self._swept = False
        self._sweep_lock = threading.Lock()  # (see _scratch_root)

    def fetch_ahead(self, targets: Sequence[str]) -> None:
        """Fetch the kept index of each of ``targets`` that has none on this disk (a driver
        that moved), in a thread."""
        if self._store is not None:
            missing = [t for t in targets if t not in self._fetching
                       and not (self._directory(t) / MANIFEST).exists()]
            if missing:
                pool = ThreadPoolExecutor(1, thread_name_prefix="walberg-prefetch")
                for target in missing:
                    self._fetching[target] = pool.submit(self._fetch_ahead, target)
                pool.shutdown(wait=False)

    def live(self, target: str) -> Optional[LiveFiles]:
        """The table's live files as last known (None: none kept, or not needed)."""
        return self._live.get(target)

    def forget(self, target: str) -> None:
        """The table may have been replaced or repartitioned: look at it afresh."""
        self._indexes.pop(target, None)
        self._live.pop(target, None)
        self._places.pop(target, None)

    def drop(self, target: str) -> None:
        """The table's index is of no use in this process (its keys clash)."""
        self._indexes.pop(target, None)

    def close(self) -> None:
        """Before the process ends: keep the newest state of each index whose keeping waits,
        then wait for the indexes still being kept in the warehouse."""
        if self._store is not None:
            for target, (table, index) in list(self._deferred.items()):
                self._keep(target, table, index, now=True)
            self._store.close()

    # ---- the index ----------------------------------------------------------------------------

    def _directory(self, target: str) -> Path:
        return self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", target)

    def index(self, target: str, keys: Sequence[str], codec: KeyCodec, table: Any = None
              ) -> KeyIndex:
        """The table's key index (of the key columns ``keys``, encoded by ``codec``), brought
        to its current snapshot (that of ``table``, the Iceberg Java table as just loaded;
        None: load it)."""
        self.wait_for_fetch(target)
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
        with self.scratch() as scratch:
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

    def after_commit(self, target: str, table: Any, index: KeyIndex, live: Optional[LiveFiles],
                     result: RowDeltaResult, hits: Hits,
                     added: tuple[np.ndarray, np.ndarray, list[str], np.ndarray]) -> bool:
        """After a batch's commit: the index (and the live files) brought to it, and kept; or,
        if another writer committed in between, False: the caller forgets the table, and the
        index is built again."""
        if self._appends_since(table, index.snapshot, result.parent) == []:
            # (on the index's snapshot, or on other sources' commits to a shared table after it)
            index.commit(result.snapshot_id, hits.keys, added)
            if live is not None:
                live.committed(result.data_files, result.delete_files, result.snapshot_id)
            self._keep(target, table, index)
            return True
        # Iceberg put the commit on top of another writer's that did not conflict with it (a
        # compaction of other files, say): the index does not know what that one did, and is
        # built again for the next batch.
        log.info("%s by position: another writer committed between the key index's "
                 "snapshot and this batch's commit; the index is read again", target)
        return False

    def from_copy(self, target: str, codec: KeyCodec, keys: KeysAsWritten, snapshot: int,
                  table: Any) -> bool:
        """The table's index (``table``: the Iceberg Java table) made from the keys its copy's
        rows gave as they were written, as of the copy's commit ``snapshot``; on a failure
        other than ``ByMerge``, False (with a warning): the caller forgets the table and
        ``index`` makes it from the lake."""
        started = time.monotonic()
        index = self._indexes[target] = KeyIndex(self._directory(target), encoding=codec.name,
                                                 keys=keys.names, table=table_uuid(table))
        try:
            keys.finish(index, snapshot)
        except ByMerge:
            raise
        except Exception as exc:
            log.warning("key index of %s: not made from the copy's rows (%s); made from the "
                        "lake instead", target, exc)
            return False
        log.info("key index of %s made from the copy's rows as they were written: %d keys, "
                 "%.2f s after its commit", target, index.size, time.monotonic() - started)
        return True

    # ---- the index in the warehouse (keystore) -----------------------------------------------

    def _registry(self) -> Registry:
        """The table metadata's side of registered indexes (``keystore.Registry``)."""
        from walberg.apply.jvm.calls import spark_call
        from walberg.apply.jvm.commits import one_commit_at_a_time
        from walberg.apply.jvm.helper import batch_helper

        spark = self.lake.spark

        def listed(target: str, source: Optional[str]) -> list[tuple[int, str]]:
            table = java_table(spark, target)
            return registered_indexes(json.loads(batch_helper(spark).statistics(table)), source)

        def register(target: str, snapshot: int, path: str, size: int, footer: int,
                     blobs: list[list[Any]], replaced: list[int]) -> None:
            def commit() -> None:
                batch_helper(spark).setStatistics(java_table(spark, target), snapshot, path,
                                                  size, footer, json.dumps(blobs),
                                                  json.dumps(replaced))

            spark_call(f"registering the key index of {target} in its metadata",
                       lambda: one_commit_at_a_time(target, commit))

        def sequence(target: str, snapshot: int) -> int:
            found = java_table(spark, target).snapshot(snapshot)
            return 0 if found is None else int(found.sequenceNumber())

        return Registry(listed, register, sequence)

    def _place(self, target: str, table: Any) -> Optional[Place]:
        """Where the table's index is kept in the warehouse (None: nowhere the driver writes;
        said once)."""
        if target not in self._places:
            location = str(table.location())
            place = self._places[target] = place_of(location, self.lake.source,
                                                    lambda: self._lake_files().s3_fs(),
                                                    self._registered)
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
                lambda s: s == now or self._appends_since(table, s, now) is not None, target)
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

    def wait_for_fetch(self, target: str) -> None:
        """Before the table's index folder is used: the fetch begun ahead, if any, is over
        (it says its own failures)."""
        pending = self._fetching.pop(target, None)
        if pending is not None:
            pending.result()

    def _keep(self, target: str, table: Any, index: KeyIndex, now: bool = False) -> None:
        """Have the index kept in the warehouse at its snapshot, unless it is already. A
        registered index (a metadata commit each time) and a small one are kept at most every
        KEEP_EVERY_S seconds a table, and their newest state when the sink closes (``now``)."""
        if self._store is None or index.snapshot is None or \
                self._kept.get(target) == index.snapshot:
            return
        place = self._place(target, table)
        if place is None:
            return
        if (place.registered or index.size < SMALL_INDEX_KEYS) and not now:
            last = self._kept_at.get(target)
            if last is not None and time.monotonic() - last < KEEP_EVERY_S:
                self._deferred[target] = (table, index)
                return
            self._kept_at[target] = time.monotonic()
        self._deferred.pop(target, None)
        try:
            self._store.keep(target, place, index.directory, self._scratch_root())
        except OSError as exc:
            log.warning("key index of %s: not kept in the warehouse (%s)", target, exc)
            return
        self._kept[target] = index.snapshot

    # ---- what the index follows -------------------------------------------------------------

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
        at = source_field(table, spec)
        assert at is not None  # (keyed._positional made sure of it)
        jvm = self.lake.spark._jvm
        return str(data_file.partition().get(at, jvm.java.lang.String._java_lang_class)) \
            == self.lake.source

    # ---- scratch folders --------------------------------------------------------------------

    def scratch(self) -> "_Scratch":
        """A temporary folder under the index root, removed on exit."""
        return _Scratch(self._scratch_root())

    def _scratch_root(self) -> Path:
        """The index root, made if need be; on first use, swept of the scratch folders and
        links to keep that a killed run left (this process holds buffer.dir's lock). The
        sweep is done once, under a lock, before any caller makes a folder there: tables
        copied or applied side by side ask at once, and a second sweep would remove the
        folder another had just made (a base index moved in without its keys)."""
        with self._sweep_lock:
            if not self._swept:
                for left in [*self.root.glob("scratch-*"), *self.root.glob("keep-*")]:
                    shutil.rmtree(left, ignore_errors=True)
                self._swept = True
            self.root.mkdir(parents=True, exist_ok=True)
        return self.root


def source_field(table: Any, spec: Any) -> Optional[int]:
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
