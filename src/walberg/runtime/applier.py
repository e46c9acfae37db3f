"""The applier: sealed segments -> Iceberg, the same for every source.

It picks the sealed segments of the next batch, has the source's stager decode and stage them
(batch N+1 in a helper thread while Spark commits batch N), commits each table's share with
retries and metrics, lets go of the segments once the lake holds what they hold, and runs
scheduled maintenance between batches. The sources differ only through ``Stager`` (how a batch
is staged, and what a table needs before its commit) and ``Marks`` (what a commit records of
the source's position: ``walberg.lsn`` or ``walberg.offset.<topic>.<partition>``).

Order of a table's commit (crash-safe at every step, see the pipeline's delivery contract):
schema first, then dead letters, then the changelog, then the table itself with its marks."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, TypeVar

from walberg import metrics
from walberg.apply.batch import BatchBuilder, StagedTable
from walberg.apply.iceberg import IcebergSink
from walberg.apply.jvm.commits import with_commit_properties
from walberg.apply.session import side_by_side
from walberg.apply.together import CatalogTransactions, CommitGroup, member_of
from walberg.buffer.store import SegmentInfo, SegmentStore
from walberg.config import Config
from walberg.faults import crash_point, failure_point
from walberg.model import Commit, Lsn, Op, pg_epoch
from walberg.runtime.lakeside import commit_with_retries, count_files
from walberg.runtime.parking import Parking
from walberg.runtime.state import RunState
from walberg.runtime.tables import SchemaStop, Tables

log = logging.getLogger("walberg")
T = TypeVar("T")

Partition = tuple[str, int]


@dataclass
class Batch:
    """A batch decoded and staged, waiting for its Spark commit."""

    segments: list[SegmentInfo]
    builder: BatchBuilder
    staged: dict[str, StagedTable]
    tables: list[str]  # the tables it commits to, in order
    max_seq: int
    changes: int
    staged_s: float
    lsn: Lsn = Lsn(0)  # Postgres: end LSN of its last transaction, what its commits record
    start: Lsn = Lsn(0)  # Postgres: the lake held everything before this when it was staged
    void: list[tuple[int, int]] = field(default_factory=list)
    txns: list[tuple[int, int, int, int]] = field(default_factory=list)  # for changelogs
    last_commit_ts: Optional[int] = None  # source commit time of its last transaction (µs, 2000)
    # Postgres: per table, the Commit of the batch's first transaction that changed it: its
    # time (when the table's changes became visible) and its commit LSN (every change the
    # table's commit holds ended after it: apply.session.FROM_PROPERTY)
    first_commit: dict[str, Commit] = field(default_factory=dict)
    cut: bool = False  # ended early, before a table's new columns: its segments are read again
    unknown: bool = False  # Postgres, staged before the lake was read: met a table not known
    # Postgres, staged before the lake was read: tables pgoutput described again amid their
    # rows, whose column numbers are compared once it is read (PgStager._take_early)
    described_early: set[str] = field(default_factory=set)
    offsets: dict[Partition, int] = field(default_factory=dict)  # Kafka: next offset read
    dead: list[Any] = field(default_factory=list)  # Kafka: records that could not be staged
    # Kafka: (last seq, topic, partition, offset) of each record staged, in seq order, of the
    # topics whose table has a changelog beside it (mode both: see OffsetMarks.in_changelog)
    records: list[tuple[int, str, int, int]] = field(default_factory=list)
    # Set once its commit is over (or failed): the next batch stops growing then.
    committed: threading.Event = field(default_factory=threading.Event)

    def since(self, table: str) -> Optional[Lsn]:
        """The commit LSN of the first transaction of this batch that changed ``table`` (None:
        none known, as in a Kafka batch): what the table's commit records as walberg.from-lsn."""
        first = self.first_commit.get(table)
        return None if first is None else first.commit_lsn


class Marks(Protocol):
    """What a commit records of the source's position, and how to tell it landed."""

    def marks(self, table: str, batch: Batch) -> Optional[dict[str, str]]:
        """Snapshot properties of the table's commit (None: the sink's ``walberg.lsn``)."""

    def landed(self, sink: IcebergSink, table: str, target: str, batch: Batch) -> bool:
        """Whether the table holds the batch (after a commit whose outcome is unknown)."""

    def upto(self, table: str, batch: Batch) -> str:
        """What the table's commit covers, for messages (``LSN 0/1A``)."""

    def held(self, table: str) -> str:
        """What the table held before, for messages."""

    def record(self, table: str, batch: Batch) -> None:
        """The table's commit landed: remember what it holds now."""

    def in_changelog(self, table: str, batch: Batch) -> tuple[Optional[Lsn], list[tuple[int, int]]]:
        """What the changelog beside the table (mode both) holds of the batch already, left out
        of its append: the rows of transactions up to an LSN, and rows in seq ranges."""

    def changelog_holds(self, table: str, batch: Batch) -> None:
        """The changelog beside the table took the batch: a retry or the next batch leaves it
        out."""

    def read_changelog(self, sink: IcebergSink, table: str, changelog: str) -> None:
        """What the changelog beside the table holds, read from the lake: at the start, and
        after an append whose outcome is unknown (it may have landed)."""


class Stager(Protocol):
    """How a source's batch is staged and what a table needs before its commit."""

    @property
    def marks(self) -> Marks:
        """What this source's commits record."""

    def prepare_next(self, after: Optional[Batch]) -> Optional[Batch]:
        """Stage the next batch: the sealed segments after ``after`` (not yet committed)."""

    def follow(self, table: str, staged: StagedTable, batch: Batch) -> None:
        """Before the table's commit: its Iceberg table exists and takes the staged columns."""

    def dead_letters(self, table: str, staged: StagedTable, batch: Batch) -> None:
        """Before the table's commit: write the staged rows it cannot take."""

    def before_commit(self, batch: Batch) -> None:
        """Before any table's commit of the batch."""

    def replays_inserts(self, table: str) -> bool:
        """Whether the source may send an insert again for a key the table holds (its inserts
        are then merged by key, never appended)."""

    def applied(self, batch: Batch) -> None:
        """Every table of the batch holds it: advance the source's applied position."""

    def done_with(self, batch: Batch) -> list[SegmentInfo]:
        """The segments the lake now holds whole: removed."""


def grow_batch(size: int, limit: int, stop: threading.Event,
               look: Callable[[int], Optional[T]], wait: Callable[[], bool]) -> Optional[T]:
    """More for a batch of ``size`` bytes, as long as it is under ``limit``: ``look(size)``
    finds what was sealed since (None or empty: nothing yet); ``wait`` waits a moment for more,
    or says (False) that the batch ends here, after one more look (at a segment sealed as the
    wait ended). When a source outpaces the commits, batches grow and the lake gets fewer,
    larger commits."""
    waiting = True
    while not stop.is_set() and size < limit:
        found = look(size)
        if found:
            return found
        if not waiting:
            return None
        waiting = wait()
    return None


def let_go(store: SegmentStore, state: RunState, segments: list[SegmentInfo]) -> None:
    """Remove sealed segments whose changes the lake holds, from the disk and from the run's
    account, then tell a reader waiting for room (after they are gone: a reader woken before
    would see them still pending and wait once more)."""
    store.remove(segments)
    state.forget_segments([info.seq for info in segments])
    state.progress.set()


class Applier:
    """Applies sealed segments to Iceberg, batch after batch, in its own thread."""

    def __init__(self, config: Config, store: SegmentStore, state: RunState, stager: Stager,
                 tables: Tables, sink: Callable[[], IcebergSink],
                 maintain: Optional[Callable[[], Any]] = None,
                 parking: Optional[Parking] = None) -> None:
        """``parking``: where a table that cannot follow is parked (None: stopped for this run
        only)."""
        self.config = config
        self.parking = parking
        self.store = store
        self.state = state
        self.stager = stager
        self.tables = tables
        self._sink = sink
        self._maintain = maintain
        self._last_maintenance = time.monotonic()
        self.batches = 0
        self.changes = 0
        # Tables whose changelog's last append failed: what it holds is read before the next.
        self._unsure: set[str] = set()
        # What a batch's tables share while they commit side by side (the source's catalog
        # connection, the dead-letter table, the parks): one table at a time.
        self._serial = threading.Lock()
        # The catalog's multi-table commits (sink.atomic_commits), once first needed.
        self._transactions: Optional[CatalogTransactions] = None

    @property
    def sink(self) -> IcebergSink:
        return self._sink()

    def loop(self) -> None:
        """The applier thread: apply whatever is sealed, until stopped. A failure stops the
        reader and is raised by the pipeline's ``run`` in the main thread."""
        try:
            while True:
                self.state.wake.wait(0.5)
                self.state.wake.clear()
                if self.state.stop.is_set():
                    # Stopping: the batch in flight has finished; what is still sealed is
                    # durable and is applied by the next run, so shutdown stays short.
                    return
                self.apply_ready(drain=False)
                every = self.config.maintenance.every
                if (self._maintain is not None and every
                        and time.monotonic() - self._last_maintenance >= every):
                    # Between batches, in this thread: never racing walberg's own commits.
                    # The reader keeps filling segments meanwhile.
                    self._maintain()
                    self._last_maintenance = time.monotonic()
        except BaseException as exc:
            self.state.fail(exc)

    def apply_ready(self, drain: bool) -> None:
        """Apply sealed segments, a batch at a time, while some hold unapplied changes.

        Batch N+1 is decoded and staged (Python, pyarrow) in a helper thread while Spark
        commits batch N, so the two kinds of work overlap."""
        prepared = self._prepare(None)
        if prepared is None:
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="walberg-stage") as pool:
            while prepared is not None:
                upcoming = pool.submit(self._prepare, prepared)
                try:
                    self.commit(prepared)
                except BaseException:
                    prepared.committed.set()
                    _discard(upcoming)
                    raise
                prepared.committed.set()
                if self.state.stop.is_set() and not drain:
                    _discard(upcoming)
                    return
                prepared = upcoming.result()

    def _prepare(self, after: Optional[Batch]) -> Optional[Batch]:
        batch = self.stager.prepare_next(after)
        if batch is not None:
            log.debug("staged %d segment(s), %d changes, in %.2f s", len(batch.segments),
                      batch.changes, batch.staged_s)
        return batch

    def commit(self, batch: Batch) -> None:
        """Commit a staged batch to Iceberg (one commit per table), then let go of its
        segments."""
        started = time.monotonic()
        log.info("applying %d segment(s) up to %s", len(batch.segments),
                 self.stager.marks.upto("", batch))
        try:
            self.stager.before_commit(batch)
            if self.parking is not None:
                self.parking.record()  # (tables parked while the batch was staged)
            self._commit_tables([t for t in batch.tables if not self.state.is_halted(t)],
                                batch)
        finally:
            batch.builder.discard()
            self.sink.release_staged(batch.builder.directory)
        crash_point("committed")
        self.stager.applied(batch)
        self.batches += 1
        self.changes += batch.changes
        done_with = self.stager.done_with(batch)
        let_go(self.store, self.state, done_with)
        metrics.BATCHES.inc()
        metrics.SEGMENTS_APPLIED.inc(len(done_with))
        metrics.BATCH_CHANGES.observe(batch.changes)
        metrics.BATCH_SECONDS.observe(batch.staged_s + time.monotonic() - started)
        log.info("batch of %d segment(s), %d changes, %s: staged in %.2f s, committed in "
                 "%.2f s", len(batch.segments), batch.changes,
                 self.stager.marks.upto("", batch), batch.staged_s, time.monotonic() - started)

    def _commit_tables(self, tables: list[str], batch: Batch) -> None:
        """Each table's commit, side by side (``sink.commit_parallelism`` at once): tables are
        independent Iceberg commits, each carrying what it covers, so their order does not
        matter to exactly once. After a failure no further table starts; those under way
        finish, and the first failure (in the batch's table order) is raised."""
        group = self._group(tables)

        def one(table: str) -> None:
            with member_of(group, table):
                self._commit_counted(table, batch)
            # (a kill here: some tables of the batch committed, others under way or not begun)
            crash_point("table-committed")

        # In a group every table has a thread (each waits for the others at its commit); the
        # group's semaphore keeps the work itself to sink.commit_parallelism at once.
        side_by_side(one, [(t,) for t in tables],
                     len(tables) if group is not None else self.config.sink.commit_parallelism)
        if group is not None and group.rounds:
            log.info("%d table(s) of the batch committed together in one catalog transaction",
                     group.committed)

    def _group(self, tables: list[str]) -> Optional[CommitGroup]:
        """The batch's tables committed in one catalog transaction, where the catalog can
        (sink.atomic_commits; a REST catalog with the endpoint); None: each on its own."""
        sink = self.config.sink
        if not sink.atomic_commits or sink.catalog.type != "rest" or len(tables) < 2:
            return None
        if self._transactions is None:
            from walberg.apply.jvm.sparkargs import session_args

            self._transactions = CatalogTransactions(
                self.sink.spark, sink.catalog.name, session_args(self.config).catalog_properties)
        if not self._transactions.supported:
            return None
        return CommitGroup(self._transactions, tables,
                           threading.Semaphore(sink.commit_parallelism))

    def _commit_counted(self, table: str, batch: Batch) -> None:
        """One table's commit, tried again on storage failures, with its metrics; a schema
        change it cannot follow stops this table only."""
        st = batch.staged[table]
        started = time.monotonic()
        try:
            self._with_retries(table, batch, functools.partial(self._commit_table, table, batch))
        except SchemaStop as exc:
            # This table cannot follow its source; the others go on.
            if self.parking is None:
                self.state.halt(table, str(exc))
                metrics.TABLE_STOPPED.labels(table).set(1)
                log.error("%s; the other tables go on", exc)
            else:
                with self._serial:
                    self.parking.park(table, str(exc))
                    self.parking.record()
            return
        except BaseException:
            metrics.COMMITS.labels(table, "failure").inc()
            raise
        metrics.COMMITS.labels(table, "success").inc()
        first = batch.first_commit.get(table)
        oldest = first.commit_ts if first is not None else batch.last_commit_ts
        if oldest is not None:  # the moment its changes became visible
            metrics.END_TO_END_SECONDS.labels(table).observe(
                max(time.time() - pg_epoch(oldest), 0.0))
        count_files(self.sink, table, self.tables.targets[table])
        metrics.COMMIT_SECONDS.labels(table).observe(time.monotonic() - started)
        for op, count in st.ops.items():
            metrics.RECORDS_WRITTEN.labels(table, op.label).inc(count)
        self.stager.marks.record(table, batch)
        log.info("applied %s: %d changes (I %d, U %d, D %d%s), %s, in %.2f s", table, st.rows,
                 st.ops[Op.INSERT], st.ops[Op.UPDATE], st.ops[Op.DELETE],
                 ", truncated" if st.truncates else "",
                 self.stager.marks.upto(table, batch), time.monotonic() - started)

    def _commit_table(self, table: str, batch: Batch) -> None:
        """One table's share of a batch: schema first, then dead letters, then its commit (the
        changelog's first when the table has both)."""
        st, target = batch.staged[table], self.tables.targets[table]
        changelog = self.tables.changelogs.get(table)
        with self._serial:  # (the table's own commits below go side by side with the others')
            self.stager.follow(table, st, batch)
            if st.dead_letters is not None:
                # Before the table's own commit: a replay skips what the DLQ holds.
                self.stager.dead_letters(table, st, batch)
        marks = self.stager.marks.marks(table, batch)
        if changelog is not None:
            if table in self._unsure and changelog != target:
                # The last append failed and may have landed all the same (its commit's
                # outcome unknown): what the changelog holds is read again, or the retry
                # appends the batch's rows twice.
                self.sink.forget(changelog)
                self.stager.marks.read_changelog(self.sink, table, changelog)
                self._unsure.discard(table)
            held, skip = (self.stager.marks.in_changelog(table, batch) if changelog != target
                          else (None, []))

            def append() -> None:
                self.sink.append_changes(changelog, st, batch.lsn, batch.max_seq,
                                         batch.void + skip, batch.txns, held,
                                         batch.since(table))

            try:
                if marks:
                    # The changelog's commit carries the source's marks too: a replay knows
                    # what it holds.
                    with_commit_properties(self.sink.spark, marks, append)
                else:
                    append()
                failure_point("changelog")
            except BaseException:
                if changelog != target:
                    self._unsure.add(table)
                raise
            if changelog != target:
                self.stager.marks.changelog_holds(table, batch)
        if changelog != target:
            crash_point("commit", delay=0.5)
            catchup = self.state.catchup(table)
            self.sink.apply(target, st, batch.lsn, batch.max_seq, batch.void, marks,
                            upsert=catchup is not None or self.stager.replays_inserts(table),
                            since=batch.since(table))
            if catchup is not None:
                self.state.caught_up(table, batch.lsn)

    def _with_retries(self, table: str, batch: Batch, commit: Callable[[], None]) -> None:
        """``commit`` tried again on storage or catalog failures (see
        ``lakeside.commit_with_retries``); it landed if the table holds the batch."""
        target = self.tables.targets[table]
        marks = self.stager.marks
        commit_with_retries(self.config.sink, self.state.stop, self.sink, table, target, commit,
                            lambda: marks.landed(self.sink, table, target, batch),
                            marks.upto(table, batch), marks.held(table))


def _discard(upcoming: "Future[Optional[Batch]]") -> None:
    try:
        batch = upcoming.result()
    except BaseException:
        return
    if batch is not None:
        batch.builder.discard()
