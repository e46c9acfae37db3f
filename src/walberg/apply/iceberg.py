"""The Iceberg sink: one source's way into the lake through Spark. ``IcebergSink`` holds no
logic of its own; like pyiceberg's ``Table`` it hands out a helper per concern, all sharing one
``LakeSession`` (the Spark session and the source written for):

- ``tables`` (apply.tables): creating tables, partitioning and properties, schema evolution;
- ``writes`` (apply.writes): the initial copy, applying a staged batch, changelog rows, dead letters;
- ``snapshots`` (apply.snapshots): the progress marks commits carry, history, files, counts;
- ``maintenance`` (apply.maintenance): compaction, snapshot expiry, orphan files;
- ``queries`` (apply.query): Spark SQL over the lake for people, and exporting results.

Its methods are the surface the pipeline calls; each hands over to one helper.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import pyarrow as pa

from walberg.apply.batch import StagedTable
from walberg.apply.evolution import Step
from walberg.apply.initial import refresh as copyrefresh
from walberg.apply.initial.files import CopyFiles
from walberg.apply.maintenance import Maintenance
from walberg.apply.position.keyed import KeyedApply
from walberg.apply.query import Queries, pin_tables
from walberg.apply.session import (
    COPY_PREFIX,
    LSN_PROPERTY,
    OFFSET_PROPERTY,
    OFFSETS_PAST_PROPERTY,
    LakeSession,
    offsets_past,
    offsets_past_value,
    quote_target,
)
from walberg.apply.snapshots import Snapshots, highest_marks
from walberg.apply.tables import Tables, normal_transform, spark_transform
from walberg.apply.types import TypeMap
from walberg.apply.writes import Writes
from walberg.model import Column, Layout, Lsn

# Re-exported for modules that import them from here; their homes are the modules above.
__all__ = ["COPY_PREFIX", "LSN_PROPERTY", "OFFSET_PROPERTY", "IcebergSink", "normal_transform",
           "pin_tables", "quote_target", "spark_transform"]


class IcebergSink:
    def __init__(self, session: Any, types: Optional[TypeMap] = None,
                 source: Optional[str] = None, stage_root: Optional[str] = None,
                 index_dir: Optional[Path] = None, keep_index: bool = True,
                 register_index: bool = False) -> None:
        """``source``: this sink writes one of several sources that fan in to shared tables:
        its rows carry ``_walberg_source``, and its commits record their LSN as
        ``walberg.lsn.<source>``. ``stage_root``: where staged files go for the executors
        (None: read from the driver's disk; see ``apply.staging``). ``index_dir``: where key
        indexes live, for applying batches by position (see apply.position.keyed; None: always by
        MERGE). ``keep_index``: keep each key index in the warehouse too, beside its table, for
        a driver on another machine (apply.position.keystore); ``register_index``: as a file
        the table's metadata names (apply.position.keystore), for catalogs that remove what no
        metadata names."""
        self.lake = LakeSession(session, types, source, stage_root)
        self.tables = Tables(self.lake)
        self.snapshots = Snapshots(self.lake)
        self.writes = Writes(self.lake, self.tables, self.snapshots,
                             KeyedApply(self.lake, self.tables, index_dir, keep_index,
                                        register_index))
        self.maintenance = Maintenance(self.lake, self.snapshots)
        self.queries = Queries(self.lake)

    @property
    def spark(self) -> Any:
        return self.lake.spark

    def close(self) -> None:
        """Before the process ends: finish keeping the key indexes in the warehouse."""
        self.writes.keyed.close()

    def warm(self, targets: Sequence[str] = ()) -> None:
        """A batch is on its way: load the JVM code of its commit now, in the background, and
        fetch the key indexes ``targets`` lack on this disk (kept in the warehouse)."""
        self.writes.keyed.warm(targets)

    @property
    def types(self) -> TypeMap:
        return self.lake.types

    @property
    def source(self) -> Optional[str]:
        return self.lake.source

    @property
    def lsn_property(self) -> str:
        return self.lake.lsn_property

    def sql(self, what: str, statement: str) -> Any:
        return self.lake.sql(what, statement)

    def read_staged(self, files: Sequence[Path]) -> Any:
        """Staged Parquet files as a DataFrame every executor can read (see apply.staging)."""
        return self.lake.read_staged(files)

    def release_staged(self, folder: Path) -> None:
        """The batch or copy staged in ``folder`` is over: remove what was sent for it."""
        self.lake.staging.release(folder)

    def table_exists(self, target: str) -> bool:
        return self.lake.table_exists(target)

    def known_to_exist(self, target: str) -> bool:
        """``table_exists``, answered without the catalog for a table this sink read already
        (at a start, every table is read once; asking the catalog again cost a round of Spark's
        name resolution per table)."""
        return self.tables.read_already(target) or self.table_exists(target)

    def forget(self, target: str) -> None:
        """Drop what is cached about ``target`` (after a failed commit: read it afresh)."""
        self.tables.forget(target)
        self.writes.forget(target)
        self.lake.refresh(target)

    # Tables: DDL and evolution (apply.tables).

    def ensure_table(self, target: str, columns: Sequence[Column],
                     layout: Optional[Layout] = None,
                     properties: Optional[dict[str, str]] = None) -> bool:
        return self.tables.ensure_table(target, columns, layout, properties)

    def ensure_changelog(self, target: str, columns: Sequence[Column],
                         layout: Optional[Layout] = None) -> bool:
        return self.tables.ensure_changelog(target, columns, layout)

    def replace_table(self, target: str, columns: Sequence[Column],
                      layout: Optional[Layout] = None) -> None:
        self.tables.replace(target, columns, layout)
        self.forget(target)

    def partitioning(self, target: str) -> list[str]:
        return self.tables.partitioning(target)

    def align(self, target: str, layout: Layout) -> list[str]:
        return self.tables.align(target, layout)

    def columns_match(self, target: str, columns: Sequence[Column]) -> bool:
        return self.tables.columns_match(target, columns)

    def schema(self, target: str) -> list[tuple[str, str]]:
        return self.tables.schema(target)

    def evolve(self, target: str, steps: Sequence[Step], after: dict[str, str]) -> None:
        self.tables.evolve(target, steps, after)

    def properties(self, target: str, prefix: str) -> dict[str, str]:
        return self.tables.properties(target, prefix)

    def set_property(self, target: str, key: str, value: Optional[str]) -> None:
        self.tables.set_property(target, key, value)

    def fill(self, target: str, column: str, value_expr: str) -> None:
        self.tables.fill(target, column, value_expr)

    # Writes (apply.writes).

    def apply(self, target: str, staged: StagedTable, lsn: Lsn, max_seq: int,
              void: Sequence[tuple[int, int]] = (),
              marks: Optional[Mapping[str, str]] = None, upsert: bool = False,
              since: Optional[Lsn] = None) -> None:
        self.writes.apply(target, staged, lsn, max_seq, void, marks, upsert, since)

    def append_copy(self, target: str, columns: Sequence[Column], files: Sequence[Path],
                    lsn: Lsn) -> None:
        self.writes.append_copy(target, columns, files, lsn)

    def append_changes(self, target: str, staged: StagedTable, lsn: Lsn, max_seq: int,
                       void: Sequence[tuple[int, int]],
                       txns: Sequence[tuple[int, int, int, int]], held: Optional[Lsn],
                       since: Optional[Lsn] = None) -> int:
        return self.writes.append_changes(target, staged, lsn, max_seq, void, txns, held, since)

    def load_copy(self, target: str, columns: Sequence[Column], files: Sequence[Path],
                  lsn: Lsn, on_driver: bool = True) -> None:
        self.writes.load_copy(target, columns, files, lsn, on_driver)

    def copy_here(self, target: str, columns: Sequence[Column],
                  staged: Sequence[pa.DataType]) -> bool:
        return self.writes.copy_here(target, columns, staged)

    def write_copy_parts(self, target: str, columns: Sequence[Column],
                         parts: Iterable[pa.Table], lsn: Lsn,
                         scratch: Path) -> Optional[CopyFiles]:
        return self.writes.write_copy_parts(target, columns, parts, lsn, scratch)

    def commit_copy(self, files: CopyFiles, columns: Sequence[Column], lsn: Lsn) -> None:
        self.writes.commit_copy(files, columns, lsn)

    def load_chunk(self, target: str, columns: Sequence[Column], df: Any, lsn: Lsn,
                   marks: Mapping[str, str], *, first: bool, done: bool,
                   dead_span: Optional[tuple[str, Optional[int], Optional[int]]]
                   ) -> tuple[int, int]:
        return self.writes.load_chunk(target, columns, df, lsn, marks, first=first, done=done,
                                      dead_span=dead_span)

    def drop_changed(self, target: str, key: str,
                     spans: Sequence[tuple[Optional[int], Optional[int]]], kept: Any) -> None:
        copyrefresh.drop_changed(self.lake, target, key, spans, kept)

    def dead_letter_target(self, target: str) -> str:
        return self.writes.dead_letter_target(target)

    def write_dead_letters(self, target: str, columns: Sequence[Column], path: Path, lsn: Lsn,
                           where: str = "true", snapshot: bool = False) -> int:
        return self.writes.write_dead_letters(target, columns, path, lsn, where, snapshot)

    def write_record_dead_letters(self, target: str, path: Path,
                                  marks: Mapping[str, str]) -> int:
        return self.writes.write_record_dead_letters(target, path, marks)

    # Progress marks and history (apply.snapshots).

    def committed_lsn(self, target: str) -> Optional[Lsn]:
        return self.snapshots.committed_lsn(target)

    def committed_server(self, target: str) -> Optional[str]:
        return self.snapshots.committed_server(target)

    def committed_marks(self, target: str, read_since: Optional[float] = None
                        ) -> tuple[Optional[Lsn], Optional[str]]:
        """``Snapshots.committed_marks``. ``read_since`` (``time.monotonic``): the marks read
        with the table's facts by a read that began then or later are taken instead of reading
        the table again (a start reads both of every table, one right after the other)."""
        if read_since is not None:
            held = self.tables.marks_read_since(target, read_since)
            if held is not None:
                return highest_marks(*held)
        return self.snapshots.committed_marks(target)

    def owe_copy(self, target: str, lsn: Lsn) -> None:
        """Say in the lake that ``target`` is owed a copy from at least ``lsn``, before the
        copy starts (see ``copy_owed``)."""
        self.tables.set_property(target, self.lake.owed_property, str(lsn))

    def copy_owed(self, target: str) -> Optional[Lsn]:
        """The LSN a copy of ``target`` is owed from, if one was said to be owed (``owe_copy``);
        the table still owes it while its committed LSN is below that."""
        key = self.lake.owed_property
        value = self.tables.properties(target, key).get(key)
        return Lsn.parse(value) if value else None

    def record_server(self, server: str) -> None:
        """From now on each commit records the source server its LSN belongs to."""
        self.lake.server = server

    def committed_offsets(self, target: str) -> dict[tuple[str, int], int]:
        """The next Kafka offset of each partition the table holds: what its commits cover,
        and past that what ``pass_offsets`` recorded while its snapshot stands."""
        held = self.snapshots.committed_offsets(target)
        if not held:  # (no table, or no Kafka commit)
            return held
        value = self.tables.properties(target, OFFSETS_PAST_PROPERTY).get(OFFSETS_PAST_PROPERTY)
        if value:
            ancestry = {i for i, _ in self.snapshots.lineage(target)}
            for tp, o in offsets_past(value, ancestry).items():
                held[tp] = max(held.get(tp, 0), o)
        return held

    def pass_offsets(self, target: str, offsets: dict[tuple[str, int], int]) -> None:
        """Record that the table's offsets may pass ``offsets``, read after its last commit and
        holding nothing to commit (a transaction's commit marker, a tombstone, dead letters),
        in a table property rather than a commit without rows: retention that deletes them
        then is not taken for records lost at the next start."""
        lineage = self.snapshots.lineage(target)
        if not lineage:
            return
        value = self.tables.properties(target, OFFSETS_PAST_PROPERTY).get(OFFSETS_PAST_PROPERTY)
        merged = offsets_past(value, {i for i, _ in lineage})
        for tp, o in offsets.items():
            merged[tp] = max(merged.get(tp, 0), o)
        self.tables.set_property(target, OFFSETS_PAST_PROPERTY,
                                 offsets_past_value(lineage[-1][0], merged))

    def copy_marks(self, target: str) -> list[dict[str, str]]:
        return self.snapshots.copy_marks(target)

    def last_commit(self, target: str) -> dict[str, int]:
        return self.snapshots.last_commit(target)

    def last_commit_records(self, target: str) -> int:
        return self.snapshots.last_commit_records(target)

    def history(self, target: str) -> list[dict[str, Any]]:
        return self.snapshots.history(target)

    def lineage(self, target: str) -> list[tuple[int, Optional[str]]]:
        return self.snapshots.lineage(target)

    def spans(self, target: str) -> list[tuple[int, Optional[str], Optional[str]]]:
        return self.snapshots.spans(target)

    def files(self, target: str) -> dict[str, int]:
        return self.snapshots.files(target)

    def count(self, target: str) -> int:
        return self.snapshots.count(target)

    # Maintenance (apply.maintenance) and reads for people (apply.query).

    def maintain(self, target: str, target_file_size: int, expire_older_than_ms: int,
                 retain_last: int, orphans_older_than_ms: int) -> dict[str, Any]:
        return self.maintenance.maintain(target, target_file_size, expire_older_than_ms,
                                         retain_last, orphans_older_than_ms)

    def query(self, statement: str, limit: int) -> tuple[list[tuple[Any, ...]], list[str]]:
        return self.queries.query(statement, limit)

    def export(self, statement: str, fmt: str, output: Path, limit: Optional[int]) -> int:
        return self.queries.export(statement, fmt, output, limit)
