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

The key indexes are kept by ``indexes.KeyIndexes`` (each brought to its table's snapshot
before a batch, and kept in the warehouse); a batch's keys and new rows are read from its
staged files by ``batchkeys``; the deletes are written by ``deletefiles``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from walberg.apply.batch import StagedTable
from walberg.apply.jvm.helper import JavaFiles, batch_helper
from walberg.apply.position import datafiles, rowdelta
from walberg.apply.position.batchkeys import concat_entries, entries_as_written, look_up, new_rows
from walberg.apply.position.entries import written_entries
from walberg.apply.position.indexes import KeyIndexes, source_field
from walberg.apply.position.keybase import KeysAsWritten
from walberg.apply.position.keycodec import ByMerge, KeyCodec
from walberg.apply.position.partitions import NotHere, Partitioner
from walberg.apply.position.rowdelta import commit_row_delta
from walberg.apply.session import LakeSession, java_table
from walberg.apply.tables import Tables
from walberg.apply.types import UUID
from walberg.faults import crash_point
from walberg.model import Column, Lsn

if TYPE_CHECKING:
    from walberg.apply.initial.files import CopyFiles

log = logging.getLogger("walberg")

# At most this many tables' lookups at once (a thread each, made when first needed): more than
# the tables a batch applies side by side (sink.commit_parallelism), so none waits for another.
LOOKUP_THREADS = 32


class KeyedApply:
    """Applies batches by position to the tables that allow it (see the module docstring)."""

    def __init__(self, lake: LakeSession, tables: Tables, root: Optional[Path],
                 keep: bool = True, registered: bool = False) -> None:
        """``root``: where the key indexes live (None: never by position). ``keep``: keep each
        index in the warehouse too, for a driver on another machine (``keystore``; as a file
        the table's metadata names if ``registered``)."""
        self.lake = lake
        self.tables = tables
        self.root = root
        self.indexes = None if root is None else KeyIndexes(lake, root, keep, registered)
        self._told: dict[str, str] = {}  # the reason last logged for new rows by Spark
        self._positional: dict[str, bool] = {}
        self._clashed: set[str] = set()  # tables whose keys share index entries: MERGE
        # How each table's new rows are written, for the table's shape (schema, spec, sort
        # order, properties), source columns and staged types it was worked out for.
        self._plans: dict[str, tuple[Any, _Plan]] = {}
        self._pool: Optional[ThreadPoolExecutor] = None  # (see _lookups)
        self._lock = threading.Lock()

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
        if self.indexes is None:
            return
        scratch = self.indexes.scratch()  # (swept of what a killed run left, before the thread)
        self.indexes.fetch_ahead(targets)

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
        self._plans.pop(target, None)
        if self.indexes is not None:
            self.indexes.forget(target)

    def close(self) -> None:
        """Before the process ends: wait for the indexes still being kept in the warehouse."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self.indexes is not None:
            self.indexes.close()

    def _lookups(self) -> ThreadPoolExecutor:
        """The threads that look a batch's keys up beside its new rows' writing, one a table
        applied at once, kept for the process: a thread made per table and batch was a Python
        thread, a py4j connection and a JVM thread each time (200 of each a batch at 200
        tables)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="walberg-lookup")
            return self._pool

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
        if self.indexes is not None:
            self.indexes.drop(target)
        log.warning("%s: applied by MERGE from now on, not by position: %s", target, why)

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
        assert self.indexes is not None  # (as key_of found)
        index = self.indexes.index(target, key_names, codec, table)
        live = self.indexes.live(target)
        clock.append(time.monotonic())
        with self.indexes.scratch() as scratch:
            looked_up = self._lookups().submit(look_up, spark, index, staged, positions, codec,
                                               key_names, max_seq, void, live, scratch)
            try:
                # The new rows' keys as they are written on the driver, by data file and first
                # position: the index's entries for them, with nothing read back after the commit
                # (on object storage that was a Spark job over every new file, one per partition).
                as_written: list[tuple[str, int, pa.Table]] = []
                plan = self._plan(target, staged, table)
                started = time.monotonic()
                rows, new_files, why = self._write_new_rows(target, staged, netted, table, plan,
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
                if result.summary is not None:
                    self.lake.last_summaries[target] = result.summary
                crash_point("indexed", delay=0.5)
                if new_files is not None and \
                        set(result.added_files) == {location for location, _, _ in as_written}:
                    added = entries_as_written(as_written, key_names, codec)
                else:
                    added = concat_entries(list(written_entries(spark, result.added_files,
                                                                key_names, codec, Path(scratch))))
            finally:
                wait([looked_up])  # (what it writes is in scratch, removed next)
        if not self.indexes.after_commit(target, table, index, live, result, hits, added):
            self.forget(target)
        clock.append(time.monotonic())
        log.info("%s by position: %d deleted, %d added (%s); index %.2f s, row delta %.2f s "
                 "(new rows %.2f s, beside them the lookup and delete file %.2f s; deletes "
                 "%.2f s, commit %.2f s), index update %.2f s",
                 target, result.deleted_rows, result.added_rows,
                 "written on the driver" if why is None else "written by Spark",
                 clock[1] - clock[0], clock[2] - clock[1], result.seconds[1] + written_in,
                 lookup_s, result.seconds[0], result.seconds[2], clock[3] - clock[2])

    def _write_new_rows(self, target: str, staged: StagedTable, netted: Callable[[], Any],
                        table: Any, plan: "_Plan", max_seq: int,
                        void: Sequence[tuple[int, int]], scratch: Path,
                        key_names: Sequence[str], as_written: list[tuple[str, int, pa.Table]]
                        ) -> tuple[Any, Optional[JavaFiles], Optional[str]]:
        """The batch's new rows: as data files written on the driver unless ``plan`` (or the
        writing) says why not, their keys noted in ``as_written``; else as the DataFrame for
        Spark to write, from ``netted()``. With the reason they are not written here (None:
        they are)."""
        spark = self.lake.spark
        columns = staged.columns
        rows: Any = None
        new_files: Optional[JavaFiles] = None
        why, schema, partitioner = plan
        if why is None:
            assert schema is not None and partitioner is not None  # (as ``why`` found)
            try:
                written = datafiles.write(
                    spark, table, schema,
                    new_rows(staged.files, schema, max_seq, void, self.lake.source),
                    scratch, "walberg-rows",
                    partitioner if partitioner.fields else None,
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

    def _plan(self, target: str, staged: StagedTable, table: Any) -> "_Plan":
        """How this batch's new rows are written: why by Spark (None: on the driver), and
        then the data files' schema and partitioner. Worked out once per table shape, source
        columns and staged types (over py4j it is a few dozen round trips a table, which a
        database of many small tables paid every batch). The reason is said in the log once
        per table and reason."""
        if not staged.unique_keys:
            plan: _Plan = ("the batch was not netted per key when it was staged", None, None)
        else:
            key = (str(batch_helper(self.lake.spark).shape(table)), tuple(staged.columns),
                   tuple(tuple(pq.read_schema(f).types) for f in staged.files))
            kept = self._plans.get(target)
            if kept is None or kept[0] != key:
                why = datafiles.why_not_staged(self.lake, self.tables, target, staged.columns,
                                               table, [list(types) for types in key[2]])
                schema = partitioner = None
                if why is None:
                    schema = datafiles.arrow_schema(table, staged.columns, self.lake, target)
                    found = Partitioner.of(table, schema)
                    assert isinstance(found, Partitioner)  # (as ``why_not_staged`` found)
                    partitioner = found
                kept = self._plans[target] = (key, (why, schema, partitioner))
            plan = kept[1]
        why = plan[0]
        if why is not None and self._told.get(target) != why:
            self._told[target] = why
            log.info("%s by position: new rows written by Spark, because %s", target, why)
        return plan

    def keys_as_written(self, target: str, columns: Sequence[Column]
                        ) -> Optional[KeysAsWritten]:
        """For a copy written on the driver: what takes its rows' keys as they are written,
        for ``prepare``; None if the table is not applied by position."""
        found = self.key_of(target, columns)
        if found is None:
            return None
        positions, codec = found
        assert self.indexes is not None  # (as key_of found)
        return KeysAsWritten([columns[i].name for i in positions], codec,
                             Path(self.indexes.scratch().path))

    def prepare(self, target: str, columns: Sequence[Column],
                copied: Optional[CopyFiles] = None) -> None:
        """After the table was (re)written whole (an initial copy): build its index now, so
        that the first batch does not wait for it; from the keys taken as the copy was
        written when ``copied`` (committed) holds them, else from the lake."""
        keys = None if copied is None else copied.keys
        try:
            if self.indexes is None:
                return  # (never by position)
            self.indexes.wait_for_fetch(target)  # (its folder is about to be made anew)
            self.forget(target)
            found = self.key_of(target, columns)
            if found is None:
                return
            try:
                table = java_table(self.lake.spark, target)
                if keys is not None and copied is not None and copied.snapshot is not None:
                    if not self.indexes.from_copy(target, found[1], keys, copied.snapshot,
                                                  table):
                        self.forget(target)
                self.indexes.index(target, [columns[i].name for i in found[0]], found[1], table)
            except ByMerge as exc:
                self.clashed(target, exc)
        finally:
            if keys is not None:
                keys.discard()


# How a batch's new rows are written (KeyedApply._plan): why by Spark (None: on the driver),
# the data files' Arrow schema and the partitioner of the table's spec.
_Plan = tuple[Optional[str], Optional[pa.Schema], Optional[Partitioner]]


def _positional(table: Any, source: Optional[str]) -> bool:
    """Whether the Iceberg table takes deletes by position: format 2 (position-delete files)
    or 3 (deletion vectors), merge-on-read (a copy-on-write table is meant to have no delete
    files). Partitioned or not: the deletes are written per partition. A table several
    sources fan in to, when every spec keeps each source's rows in partitions of their own
    (identity on the source column, as walberg makes them): the index holds one source's."""
    props = table.properties()
    modes = [props.get(f"write.{op}.mode") for op in ("update", "delete", "merge")]
    if source is not None and any(source_field(table, spec) is None
                                  for spec in table.specs().values()):
        return False
    return (int(table.operations().current().formatVersion()) in (2, 3)
            and "copy-on-write" not in modes)


