"""A Postgres batch: which sealed segments it takes, and their transactions decoded into
staged changes per table (the applier then commits them). Commits of a Postgres batch are
marked with the end LSN of its last transaction (``walberg.lsn``)."""

from __future__ import annotations

import logging
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from walberg import metrics
from walberg.apply.batch import (
    BatchBuilder,
    SchemaChanged,
    StagedTable,
    dead_rows,
    seq_filter,
)
from walberg.apply.iceberg import IcebergSink
from walberg.apply.types import UnsupportedType
from walberg.buffer.kinds import FrameKind, refuse_foreign
from walberg.buffer.store import SegmentInfo, SegmentStore
from walberg.config import Config
from walberg.errors import DecodeError
from walberg.faults import crash_point, failure_point
from walberg.model import Begin, Commit, Lsn, Relation, Truncate
from walberg.runtime.applier import Batch, grow_batch, let_go
from walberg.runtime.pg_decode import Chunk, Chunks
from walberg.runtime.state import RunState, SegmentMeta
from walberg.runtime.tables import PgTables, SchemaStop, count_dead
from walberg.source.framing import CHANGE_TAGS, relation_oid
from walberg.source.pgoutput import Decoder, Tag

log = logging.getLogger("walberg")

FRAME_PGOUTPUT = int(FrameKind.PGOUTPUT)  # a pgoutput message as the server sent it
FRAME_PREAMBLE = int(FrameKind.PREAMBLE)  # a Relation message repeated at a segment's start

_oid = struct.Struct(">I").unpack_from  # a change's relation, at offset 1

# Grows a batch that reached its end: more segments and a later end, or None.
Grow = Callable[[list[SegmentInfo]], Optional[tuple[list[SegmentInfo], Lsn]]]


class LsnMarks:
    """A Postgres commit records the end LSN of the batch's last transaction."""

    def __init__(self, state: RunState, tables: PgTables) -> None:
        self.state = state
        self.tables = tables

    def marks(self, table: str, batch: Batch) -> Optional[dict[str, str]]:
        return None  # the sink's own walberg.lsn[.<source>]

    def landed(self, sink: IcebergSink, table: str, target: str, batch: Batch) -> bool:
        held = sink.committed_lsn(target)
        return held is not None and held >= batch.lsn

    def upto(self, table: str, batch: Batch) -> str:
        return f"LSN {batch.lsn}" if not table else f"LSN {batch.start}..{batch.lsn}"

    def held(self, table: str) -> str:
        return f"LSN {self.state.committed_at(table) or '-'}"

    def record(self, table: str, batch: Batch) -> None:
        metrics.COMMITTED_LSN.labels(table).set(int(batch.lsn))
        self.state.set_committed(table, batch.lsn)

    def in_changelog(self, table: str, batch: Batch) -> tuple[Optional[Lsn], list[tuple[int, int]]]:
        # Whole transactions: those up to the LSN its last commit carries.
        return self.tables.changelog_held.get(table), []

    def changelog_holds(self, table: str, batch: Batch) -> None:
        self.tables.changelog_held[table] = batch.lsn

    def read_changelog(self, sink: IcebergSink, table: str, changelog: str) -> None:
        self.tables.changelog_held[table] = sink.committed_lsn(changelog)


class PgStager:
    """Stages the transactions of sealed pgoutput segments for the applier."""

    def __init__(self, config: Config, store: SegmentStore, state: RunState, tables: PgTables,
                 sink: Callable[[], IcebergSink], adopt: Callable[[Relation], None],
                 report: Any, park: Optional[Callable[[str, str], None]] = None) -> None:
        """``park``: stops one table (with why) whose changes cannot be staged; None: the
        batch fails."""
        self.config = config
        self._park = park
        self.store = store
        self.state = state
        self.tables = tables
        self._sink = sink
        self._adopt = adopt
        self.report = report
        self.marks = LsnMarks(state, tables)
        # A first batch staged while the lake is still being read (see start_early).
        self._early: Optional[threading.Thread] = None
        self._early_batch: Optional[Batch] = None
        self._early_done = threading.Event()  # the early batch stops growing now
        self._lake_read = threading.Event()  # the lake is read: the early batch is awaited
        self._early_once = False  # (a --once run: its early batch grows until all is read)
        # The (table, batch LSN) whose dead letters this run has said: a commit tried again
        # says only what it adds; a batch replayed after a restart says them all again.
        self._dead_said: set[tuple[str, Lsn]] = set()

    # ---- which segments ----------------------------------------------------------------------

    def scan(self, info: SegmentInfo) -> SegmentMeta:
        """What a segment left by an earlier run holds: its last commit, whether it ends clean.
        A frame a Kafka pipeline writes is refused: this directory is not this pipeline's."""
        last: Optional[Lsn] = None
        clean = False
        for lsn, kind, payload in self.store.read(info):
            if kind != FRAME_PGOUTPUT:
                if kind != FRAME_PREAMBLE:
                    raise refuse_foreign(info.path, kind, "Postgres")
                continue
            if payload[0] == Tag.COMMIT:
                last, clean = Lsn(lsn), True
            else:
                clean = False
        return SegmentMeta(last, clean)

    def prepare_next(self, after: Optional[Batch]) -> Optional[Batch]:
        """The batch staged early (see ``start_early``) if it holds for the lake as read; else
        choose the sealed segments of the next batch (those holding commits after what the
        lake holds) and decode them into staged Parquet. ``after`` is the batch before it, not
        yet committed: its segments are left out, except a last one that a transaction runs on
        from. The batch grows by the segments sealed while it is decoded, and while ``after``
        commits it waits for more (up to ``buffer.max_batch_bytes`` in all): when the source
        outpaces Spark, batches grow and the lake gets fewer, larger commits instead of falling
        further behind."""
        if after is None and self._early is not None:
            early = self._take_early()
            if early is not None:
                return early
        floor = after.lsn if after is not None else self.state.applied
        first_seq = 0
        if after is not None and after.cut:
            first_seq = after.segments[0].seq  # what it left is skipped by LSN
        elif after is not None:
            last = after.segments[-1]
            meta = self.state.segment(last.seq)
            first_seq = last.seq if meta is None or not meta.clean_end else last.seq + 1
        batch, end = self._segments_after(first_seq - 1, 0, floor)
        if end is None:  # (no commit after the floor sealed yet)
            if after is None:
                self._let_go_applied(floor)
            return None
        committed = after.committed if after is not None else None

        def while_committing() -> bool:
            if committed is None or committed.is_set():
                return False
            committed.wait(0.05)
            return True

        return self.stage(batch, end, floor, lambda staged: self._grow(staged, while_committing))

    def _let_go_applied(self, floor: Lsn) -> None:
        """Remove the sealed segments, from the first on, whose transactions all end at or
        before ``floor``, what every table holds: nothing in them is to be applied. A stream
        that starts before the lake is read may be sent again what a stop left unconfirmed,
        and seal it only after the lake's marks have become the applied position; no batch
        would ever take such a segment, and a --once run would wait for it for ever."""
        spent: list[SegmentInfo] = []
        run: list[SegmentInfo] = []  # segments up to one ending inside a transaction
        for info in self.store.sealed():
            meta = self.state.segment(info.seq)
            if meta is None or (meta.last_commit_end or 0) > floor:
                break
            run.append(info)
            if meta.clean_end:  # (with no commit: frames outside any transaction)
                spent += run  # a transaction that spans segments goes with all of them
                run = []
        if spent:
            log.info("%d segment(s) up to LSN %s hold only what the lake holds (sent again "
                     "after a stop the slot was not told of): removed", len(spent), floor)
            let_go(self.store, self.state, spent)

    def _grow(self, staged: list[SegmentInfo], wait: Callable[[], bool]
              ) -> Optional[tuple[list[SegmentInfo], Lsn]]:
        """More sealed segments for a batch that reached its end, and their end; ``wait``
        waits a moment for more to be sealed, or says (False) that the batch ends here. Up to
        ``buffer.max_batch_bytes`` in all."""
        def look(size: int) -> Optional[tuple[list[SegmentInfo], Lsn]]:
            more, more_end = self._segments_after(staged[-1].seq, size)
            return (more, more_end) if more and more_end is not None else None

        return grow_batch(sum(info.size_bytes for info in staged),
                          self.config.buffer.max_batch_bytes, self.state.stop, look, wait)

    def _segments_after(self, seq: int, size: int, floor: Optional[Lsn] = None
                        ) -> tuple[list[SegmentInfo], Optional[Lsn]]:
        """The sealed segments after ``seq`` up to the last one that ends a transaction after
        ``floor``, and that transaction's end; no more than reach ``buffer.max_batch_bytes``
        with ``size``. (A segment whose last commit the lake holds already, the next
        transaction begun in it, ends no batch: were it as large as a batch may be, the next
        batch would end there, at the floor, every time, and nothing more would be applied.)"""
        batch: list[SegmentInfo] = []
        end: Optional[Lsn] = None
        for info in self.store.sealed():
            if info.seq <= seq:
                continue
            batch.append(info)
            size += info.size_bytes
            meta = self.state.segment(info.seq)  # (none yet: sealed this instant)
            if meta is not None and meta.last_commit_end is not None and \
                    (floor is None or meta.last_commit_end > floor):
                end = meta.last_commit_end
                if size >= self.config.buffer.max_batch_bytes:
                    break
        # Segments after the one holding the last commit wait for their commits.
        while batch and (self.state.segment(batch[-1].seq) or SegmentMeta(None, False)
                         ).last_commit_end != end:
            batch.pop()
        return batch, end

    # ---- staging before the lake is read --------------------------------------------------------

    def start_early(self, once: bool = False) -> None:
        """The stream started before the lake was read (a slot that exists, see
        ``PgStream.start_early``): stage the first batch now, in a thread, from the segments it writes,
        while the Spark session starts and the tables are checked. It is staged as if every
        table's mark lay before the first transaction it holds (the case after a clean stop),
        and used only if the lake, once read, says so (``_take_early``); otherwise it is thrown
        away and the batch staged again. Nothing is committed or confirmed from here.
        ``once``: the reader stops at a target (--once), see ``_stage_early``."""
        self.discard_early()  # (a start tried again)
        self._early_done.clear()
        self._lake_read.clear()
        self._early_once = once
        self._early = threading.Thread(target=self._stage_early, name="walberg-prestage",
                                       daemon=True)
        self._early.start()

    def _stage_early(self) -> None:
        """The early batch: the sealed segments up to the last whole transaction, growing by the
        segments sealed meanwhile until the batch is full, a --once run's reader has sealed all
        it reads (or stopped), or, in a run that streams on, the lake is read. A --once run's
        backlog that fits a batch is then one commit: cut where the lake happened to be read,
        its rest was a second batch, whose commit (a third of the first's for a tenth of its
        changes) the run waited for after the first."""
        waited = 0.0

        def grow(staged: list[SegmentInfo]) -> Optional[tuple[list[SegmentInfo], Lsn]]:
            nonlocal waited
            started = time.monotonic()
            try:
                return self._grow(staged, lambda: not (
                    self.state.read_to_target.is_set() or self._early_done.wait(0.05)
                    or (self._lake_read.is_set() and not self.state.reading_early.is_set())))
            finally:
                waited += time.monotonic() - started

        try:
            while True:
                segments, end = self._segments_after(-1, 0)
                if end is not None:
                    self.state.staging_early.set()
                    break
                if (self._early_done.wait(0.05) or self._lake_read.is_set()
                        or self.state.stop.is_set()):
                    return
            batch = self.stage(segments, end, Lsn(0), grow, early=True)
            batch.staged_s -= waited  # (the time it staged, not the time it waited for more)
            self._early_batch = batch
        except BaseException as exc:
            # Staged again once the lake is read, where a real failure is raised and said.
            log.debug("staging before the lake was read failed (staged again after): %s", exc)

    def _take_early(self) -> Optional[Batch]:
        """The early batch, once finished, if the lake holds what it assumed: every table has a
        mark (none was owed a copy), no mark lies after the first transaction the batch holds
        (so every transaction it staged is one the lake lacks: the same batch the usual way
        would stage) and no table was met that the pipeline did not know. (One that cannot hold,
        a table owed a copy, is not waited for to grow.)"""
        marks = self.state.committed()
        possible = not self.state.halted() and all(t in marks for t in self.tables.targets)
        batch = self._finish_early(grown=possible)
        if batch is None:
            return None
        crash_point("early-staged")
        first = min((Lsn(t[0]) for t in batch.txns), default=None)
        holds = (possible and not batch.unknown and first is not None
                 and all(marks[t] <= first for t in self.tables.targets)
                 and not any(self.tables.renumbered(t, unsure=True)
                             for t in sorted(batch.described_early)))
        if not holds:
            log.info("the batch staged while the lake was read does not match what the lake "
                     "holds (a table's mark after %s): staging it again", first)
            batch.builder.discard()
            return None
        batch.start = min(marks.values())
        log.info("the first batch (%d changes, up to LSN %s) was staged while the lake was read",
                 batch.changes, batch.lsn)
        return batch

    def discard_early(self) -> None:
        """Stop staging early and drop what it staged (a start that failed, a run that ends)."""
        batch = self._finish_early()
        if batch is not None:
            batch.builder.discard()

    def _finish_early(self, grown: bool = False) -> Optional[Batch]:
        """Have the early staging end its batch and hand it over, if any: at once, or with
        ``grown`` once it has grown as far as it does (see ``_stage_early``)."""
        self._lake_read.set()
        if not (grown and self._early_once):
            self._early_done.set()
        self.state.staging_early.clear()
        thread, self._early = self._early, None
        if thread is not None:
            thread.join()
        batch, self._early_batch = self._early_batch, None
        return batch

    # ---- staging -----------------------------------------------------------------------------

    def stage(self, segments: list[SegmentInfo], end: Lsn, floor: Lsn,
              grow: Optional[Grow] = None, early: bool = False) -> Batch:
        """Decode the segments' transactions up to ``end`` into staged Parquet, per table.
        Having reached ``end``, ``grow`` may hand more segments and a later end to go on to.
        ``early``: before the lake is read (see ``start_early``), every transaction of a known
        table is staged.

        Control messages go through the scalar decoder; Insert/Update/Delete messages are only
        routed here (a byte and a relation id per message) and decoded in columnar chunks."""
        while True:
            started = time.monotonic()
            workdir = Path(tempfile.mkdtemp(prefix="batch-", dir=self.config.segment_dir))
            builder = BatchBuilder(workdir, prep=self.tables.prep)
            run = _Staging(self, builder, floor, early)
            try:
                read = list(segments)  # (grown while read)
                end = run.read(read, end, grow)
                run.chunks.flush_all()
                staged = builder.finish((run.last_seq if run.cut else run.seq, run.void),
                                        self.tables.nettable())
                segments = read
                break
            except SchemaChanged as exc:
                builder.discard()
                rel = next(r for r in run.decoder.relations.values()
                           if r.qualified_name == exc.source)
                stop = self.tables.schema_error(
                    exc.source, rel.columns, run.txn.final_lsn if run.txn else end)
                if self._park is None or early:
                    raise stop from None
                # This table alone stops; the batch is staged again without it.
                self._park(exc.source, str(stop))
            except UnsupportedType as exc:  # (a column added with such a type)
                builder.discard()
                source = next((s for s, t in self.tables.targets.items() if t == exc.table), None)
                if self._park is None or early or source is None:
                    raise
                self._park(source, _unmapped(source, exc, run.txn_lsn))
            except BaseException:
                builder.discard()
                raise
        return Batch(segments, builder, staged, sorted(run.live),
                     run.last_seq if run.cut else run.seq, run.changes,
                     time.monotonic() - started, lsn=end, start=floor, void=run.void,
                     txns=[(lsn, *t) for lsn, t in run.txns.items()],
                     last_commit_ts=run.last_commit_ts, first_commit=run.first_commit,
                     cut=run.cut, unknown=run.unknown, described_early=run.described_early)

    def wanted(self, rel: Relation, txn: Begin, early: bool = False) -> bool:
        if early:
            return rel.qualified_name in self.tables.targets and \
                not self.state.is_halted(rel.qualified_name)
        if rel.qualified_name not in self.tables.targets and self.config.postgres.follow_publication:
            self._adopt(rel)
        if self.state.is_halted(rel.qualified_name):
            return False
        committed = self.state.committed_at(rel.qualified_name)
        return committed is not None and txn.final_lsn >= committed

    # ---- before and after the commits --------------------------------------------------------

    def follow(self, table: str, staged: StagedTable, batch: Batch) -> None:
        try:
            self.tables.follow(table, staged.columns, batch.lsn, staged.described,
                               staged.renumbered_after)
        except UnsupportedType as exc:  # (a column added with such a type: this table stops)
            raise SchemaStop(_unmapped(table, exc, batch.lsn)) from None

    def dead_letters(self, table: str, staged: StagedTable, batch: Batch) -> None:
        assert staged.dead_letters is not None
        target = self.tables.targets[table]
        sink = self._sink()
        written = sink.write_dead_letters(target, staged.columns, staged.dead_letters, batch.lsn,
                                          where=seq_filter(batch.max_seq, batch.void, []))
        failure_point("dead-letters")
        count_dead(sink, table, target, written)
        if (table, batch.lsn) in self._dead_said:
            return
        self._dead_said.add((table, batch.lsn))
        # The rest were in the dead-letter table already: written by a run (or an attempt)
        # that stopped before the table's commit, perhaps before it could say so.
        held = dead_rows(staged.dead_letters, batch.max_seq, batch.void) - written
        if held > 0:
            log.warning("%d row(s) of %s could not be written exactly and are in %s with the "
                        "reason in _dlq_reason (written there before a restart, or a retry, of "
                        "the commit up to LSN %s)", held, table,
                        sink.dead_letter_target(target), batch.lsn)

    def before_commit(self, batch: Batch) -> None:
        pass

    def replays_inserts(self, table: str) -> bool:
        return False  # a transaction is applied once: the slot's replays are skipped by LSN

    def applied(self, batch: Batch) -> None:
        self.state.advance_applied(batch.lsn)
        self.report.batches += 1
        self.report.changes += batch.changes

    def done_with(self, batch: Batch) -> list[SegmentInfo]:
        if batch.cut:
            return []  # the next batch reads them again, from after this one's end
        last = self.state.segment(batch.segments[-1].seq)
        return batch.segments if last is not None and last.clean_end else batch.segments[:-1]


def _unmapped(table: str, exc: UnsupportedType, lsn: int) -> str:
    """Why ``table`` stops: a column added with a type walberg has no mapping for (whether
    staging or the commit met it first)."""
    return (f"{table} has a new column before LSN {Lsn(lsn)}: {exc} Then run walberg again: "
            "the table is tried again.")


class _Staging:
    """One batch being read: the transaction it is in, what it has staged so far."""

    def __init__(self, stager: PgStager, builder: BatchBuilder, floor: Lsn, early: bool) -> None:
        self.stager = stager
        self.builder = builder
        self.floor = floor
        self.early = early
        self.unknown = False  # (early) a relation of a table the pipeline does not know
        self.described_early: set[str] = set()  # (early) see Batch.described_early
        self.chunks = Chunks(builder)
        self.decoder = Decoder()
        self.seq = 0
        self.txn: Optional[Begin] = None
        self.txn_first_seq = 0
        # The relations this transaction applies to (None: not), asked of each relation at
        # its first change in the transaction: a database of many tables has every one
        # described, and a transaction touches a few.
        self.wanted: dict[int, Optional[Chunk]] = {}
        self.touched: set[str] = set()
        self.live: set[str] = set()  # tables with changes from committed transactions
        self.void: list[tuple[int, int]] = []
        self.changes = 0
        self.cut = False
        self.last_commit_ts: Optional[int] = None
        self.first_commit: dict[str, Commit] = {}  # per table, its first transaction's
        self.last_end: Optional[Lsn] = None  # end of the last transaction staged whole
        self.last_seq = 0  # ... and its last seq
        self.txn_lsn = 0
        self.txns: dict[int, tuple[int, int, int]] = {}  # commit LSN: xid, commit time, seq

    def read(self, segments: list[SegmentInfo], end: Lsn, grow: Optional[Grow]) -> Lsn:
        """Stage the segments' transactions up to ``end`` (or a later end ``grow`` hands);
        returns the end reached."""
        store = self.stager.store
        relations = self.decoder.relations
        for info in segments:  # (grows while read)
            for lsn, kind, payload in store.read(info):
                tag = payload[0]
                if tag in CHANGE_TAGS:
                    if self.txn is None:
                        continue  # the tail of a transaction applied in an earlier batch
                    oid = _oid(payload, 1)[0]
                    chunk = self.wanted[oid] if oid in self.wanted else self._want(oid)
                    if chunk is None:
                        self._unwanted(payload, lsn)
                        continue
                    # (inline: this runs once per change)
                    self.seq += 2  # room for the delete half of a key-changing update
                    chunk.add(payload, self.seq, self.txn_lsn)
                    self.touched.add(chunk.name)
                    self.changes += 1
                    continue
                before = relations.get(relation_oid(payload)) if kind == FRAME_PREAMBLE else None
                msg = self.decoder.decode(payload, lsn)
                if before is not None and msg == before:
                    # A segment's repetition of what an earlier one of the batch described, not
                    # a description by the server (which may end the batch: see _relation).
                    relations[before.oid] = before
                    continue
                if isinstance(msg, Relation):
                    if self._relation(msg):
                        assert self.last_end is not None
                        return self.last_end
                elif isinstance(msg, Begin):
                    self._begin(msg)
                elif self.txn is None:
                    continue
                elif isinstance(msg, Commit):
                    self.live |= self.touched
                    for table in self.touched:
                        self.first_commit.setdefault(table, msg)
                    self.txn = None
                    self.last_commit_ts = msg.commit_ts
                    self.last_end, self.last_seq = msg.end_lsn, self.seq
                    if msg.end_lsn >= end:
                        more = grow(segments) if grow is not None else None
                        if more is None:
                            return end
                        segments.extend(more[0])  # read on by this loop, in order
                        end = more[1]
                elif isinstance(msg, Truncate):
                    self._truncate(msg)
        return end

    def _unwanted(self, payload: bytes, lsn: int) -> None:
        """A change of a relation this transaction does not apply to."""
        if relation_oid(payload) not in self.decoder.relations:
            # A change for a relation nobody described is a broken stream: the scalar
            # decoder says so, with the LSN.
            self.decoder.decode(payload, lsn)

    def _relation(self, msg: Relation) -> bool:
        """A relation (re)described; True if the batch ends before it (new columns)."""
        self.chunks.relation_changed(msg)
        if self.txn is None:
            return False
        before = self.builder.columns_of(msg.qualified_name)
        # (rows of the table in this batch: staged, or waiting in its chunk under this very
        # description, which a changed description would have flushed)
        held = (before is not None or self.chunks.holds(msg.oid)) and self._wants(msg, self.txn)
        changed = before is not None and before != msg.columns
        if held and not changed and self.early:
            # Before the lake is read, the numbers it follows are not known: whether a column
            # went and came back is asked once they are (_take_early stages the batch again
            # if so), not answered by ending the batch here.
            self.described_early.add(msg.qualified_name)
        elif held and (changed or self.stager.tables.renumbered(
                msg.qualified_name, unsure=self.last_end is not None)):
            if self.last_end is None:  # ALTER amid this transaction's changes
                raise SchemaChanged(msg.qualified_name)
            # The table's columns changed (ALTER TABLE), or one was dropped and added again
            # under its name and type: this batch ends with the transaction before; the next
            # one starts with the new columns, after the Iceberg schema has followed. (This
            # one's rows are from before, whatever the catalog says by its commit; where the
            # columns are the same, this batch's own description may be what brought the new
            # numbers, which Tables.follow tells from the lake's columns.)
            self.builder.describe(msg.qualified_name, "" if changed else "renumbered-after")
            self.cut = True
            return True
        self.builder.describe(msg.qualified_name,
                              self.stager.tables.description(msg.qualified_name, self.txn_lsn))
        self.stager.tables.learn_relation(msg)
        self.wanted = {}
        return False

    def _begin(self, msg: Begin) -> None:
        if self.txn is not None and self.seq >= self.txn_first_seq:
            # A transaction cut off by a crash and sent again in full.
            self.void.append((self.txn_first_seq, self.seq))
        self.txn, self.txn_first_seq, self.touched = msg, self.seq + 1, set()
        # (a transaction sent again after a crash: its last sending counts)
        self.txns[int(msg.final_lsn)] = (msg.xid, msg.commit_ts, self.seq + 1)
        self.txn_lsn = int(msg.final_lsn)  # _walberg_lsn: the commit LSN
        if msg.final_lsn < self.floor:
            self.txn = None  # already in the batch before this one
        else:
            self.wanted = {}

    def _truncate(self, msg: Truncate) -> None:
        for oid in msg.relation_oids:
            if oid not in self.decoder.relations:
                # pgoutput describes every table before truncating it: the description was
                # lost, and which table this is cannot be told (skipping it would leave the
                # table's rows in the lake).
                raise DecodeError(
                    f"a TRUNCATE in the transaction committed at LSN {Lsn(self.txn_lsn)} names "
                    f"relation oid {oid}, which the stream has not described (pgoutput sends a "
                    "Relation message before a table's first change on every connection). "
                    "Report this as a walberg bug; `walberg resync` of the tables of the "
                    "publication copies them afresh.")
            chunk = self.wanted[oid] if oid in self.wanted else self._want(oid)
            if chunk is not None:
                self.seq += 2
                rel = chunk.relation
                self.builder.truncate(rel.qualified_name, rel.columns, self.seq, self.txn_lsn)
                self.touched.add(rel.qualified_name)
                self.changes += 1

    def _want(self, oid: int) -> Optional[Chunk]:
        """The chunk a change of the relation goes to in this transaction (None: not applied
        to), asked once per relation and transaction."""
        rel = self.decoder.relations.get(oid)
        assert self.txn is not None
        chunk = None if rel is None or not self._wants(rel, self.txn) else \
            self.chunks.for_relation(rel)
        self.wanted[oid] = chunk
        return chunk

    def _wants(self, rel: Relation, txn: Begin) -> bool:
        wanted = self.stager.wanted(rel, txn, self.early)
        if self.early and not wanted and self.stager.config.postgres.follow_publication:
            self.unknown = True  # adopted (and copied) only once the lake is read
        return wanted
