"""The pipeline: the only module that knows all three stages.

    source (replication stream, initial copy) -> buffer (segment files) -> apply (Spark/Iceberg)

Delivery contract. The replication slot delivers at least once; walberg makes replays harmless:
- every Iceberg commit carries the LSN it covers (``walberg.lsn``), atomically with the data;
- a transaction is applied to a table only if it committed after that table's LSN;
- the slot's confirmed flush position only advances to what every table holds in Iceberg;
- segments are removed only once what they hold is in Iceberg.
So a crash at any point is followed by a run that ends with each table equal to its source.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from walberg import metrics
from walberg.apply import evolution, jdbc
from walberg.apply.batch import (
    BatchBuilder,
    DeadLetters,
    SchemaChanged,
    StagedTable,
    csv_to_parquet,
    seq_filter,
)
from walberg.apply.iceberg import COPY_PREFIX, IcebergSink
from walberg.apply.types import TextPrep, TypeMap, parse_array, sql_string
from walberg.buffer import spill
from walberg.buffer.spill import TxnSpill
from walberg.buffer.store import SegmentStore
from walberg.config import Config, load_config
from walberg.errors import (
    ConfigError,
    DecodeError,
    SourceError,
    Terminal,
    Transient,
    WalbergError,
)
from walberg.faults import crash_point
from walberg.lake.maintain import maintain_tables
from walberg.lakeside import commit_with_retries, count_files, open_session, release
from walberg.model import (
    Begin,
    Column,
    Commit,
    Lsn,
    Relation,
    Truncate,
)
from walberg.progress import CopyProgress
from walberg.source import chunks
from walberg.source import postgres as pg
from walberg.source.chunks import Span
from walberg.source.columnar import Changes, Malformed, decode_changes
from walberg.source.pgoutput import Decoder
from walberg.source.snapshot import copy_table
from walberg.source.stream import CreatedSlot, ReplicationStream

log = logging.getLogger("walberg")

# Table property holding the default of a column added in Postgres, until the lake's existing
# rows have it.
FILL_PROPERTY = "walberg.fill."

FRAME_PGOUTPUT = 0  # a pgoutput message as the server sent it
FRAME_PREAMBLE = 1  # a Relation message repeated at the start of a segment (self-contained files)

_TAG_BEGIN, _TAG_COMMIT, _TAG_RELATION = ord("B"), ord("C"), ord("R")
# Protocol 2: transactions streamed while in progress.
_TAG_STREAM_START, _TAG_STREAM_STOP = ord("S"), ord("E")
_TAG_STREAM_COMMIT, _TAG_STREAM_ABORT = ord("c"), ord("A")
_XID = struct.Struct(">I")
_STREAM_TAGS = frozenset({_TAG_STREAM_START, _TAG_STREAM_STOP, _TAG_STREAM_COMMIT,
                          _TAG_STREAM_ABORT})
_STREAM_COMMIT = struct.Struct(">IBQQq")  # xid, flags, commit LSN, end LSN, commit time
_TAG_INSERT, _TAG_UPDATE, _TAG_DELETE = ord("I"), ord("U"), ord("D")
_CHANGE_TAGS = frozenset((_TAG_INSERT, _TAG_UPDATE, _TAG_DELETE))
_BEGIN_FINAL_LSN = struct.Struct(">Q")  # at offset 1 of a Begin
_COMMIT_END_LSN = struct.Struct(">Q")  # at offset 10 of a Commit (after flags, commit LSN)
_RELATION_OID = struct.Struct(">I")  # at offset 1 of a Relation (protocol v1)


@dataclass
class SegmentMeta:
    """What the pipeline knows about a sealed segment without reading it again."""

    last_commit_end: Optional[Lsn]  # end LSN of the last transaction that commits in it
    clean_end: bool  # its last frame is a Commit (no transaction continues in the next one)


class SchemaStop(Terminal):
    """A table's columns changed in a way its Iceberg table cannot follow."""


@dataclass
class PreparedBatch:
    """A batch decoded and staged, waiting for its Spark commit."""

    segments: list[Any]
    end: Lsn  # end LSN of its last transaction: what its commits record
    builder: BatchBuilder
    staged: dict[str, StagedTable]
    live: set[str]  # tables with changes from committed transactions
    max_seq: int
    void: list[tuple[int, int]]
    changes: int
    staged_s: float
    last_commit_ts: Optional[int]  # Postgres commit time of its last transaction (µs since 2000)
    cut: bool = False  # ended early, before a table's new columns: its segments are read again
    txns: list[tuple[int, int, int, int]] = field(default_factory=list)  # for changelogs
    start: Lsn = Lsn(0)  # the lake held everything before this when the batch was staged
    # Set once its commit is over (or failed): the next batch stops growing then.
    committed: threading.Event = field(default_factory=threading.Event)


@dataclass
class RunReport:
    copied: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    changes: int = 0
    applied_lsn: Lsn = Lsn(0)


class Pipeline:
    """Keeps the configured Iceberg tables in step with their Postgres tables."""

    # How long a run waits for a replication slot that another process still streams from.
    slot_wait_seconds = 15.0

    def __init__(self, config: Config, session: Any = None) -> None:
        """``session``: an existing SparkSession with the sink catalog configured (walberg then
        leaves it running on close); by default walberg builds and owns one."""
        self.config = config
        self._owns_session = session is None
        self.pg = config.postgres
        self.tables = list(self.pg.tables)
        self.targets = {t: config.target_for(t) for t in self.tables}
        # Changelog tables (sink mode append or both); in append mode it is the target itself.
        self.changelogs = {t: config.changelog_for(t) for t in self.tables
                           if config.layout_for(t).mode in ("append", "both")}
        self._changelog_held: dict[str, Optional[Lsn]] = {}
        self._recopy: set[str] = set()  # tables `resync` copies again
        # Tables stopped by a change Iceberg cannot follow, with why: the others go on.
        self.halted: dict[str, str] = {}
        self.committed: dict[str, Lsn] = {}
        # Tables whose resumed copy the stream has not yet caught up with: the LSN to pass.
        self._catchup: dict[str, Lsn] = {}
        self.report = RunReport()
        self.types = TypeMap(config.sink.numeric_default, frozenset(config.sink.text_types))
        self._session: Any = session
        # One of several sources fanning in to shared tables: its rows are tagged.
        self.source_name = config.source_name
        self._tag = config.source_name if config.sink.fan_in else None
        self._sink: Optional[IcebergSink] = (IcebergSink(session, self.types, self._tag)
                                             if session is not None else None)
        self._store: Optional[SegmentStore] = None
        self._meta: dict[int, SegmentMeta] = {}
        self._relations_raw: dict[int, bytes] = {}
        self._applied = Lsn(0)  # every table holds everything up to here
        self._received = Lsn(0)  # end of the last transaction written to a segment
        self._active_commit: Optional[Lsn] = None  # ... and to the active segment
        self._streamed_since_start = False
        self._last_maintenance = time.monotonic()
        self._gauge_conn: Any = None
        self._oldest_unapplied_ts: Optional[float] = None  # wall time the oldest pending change arrived
        self._apply_error: Optional[BaseException] = None
        self._run_error: Optional[BaseException] = None
        self._reached_source = False  # the source answered once: later failures are retried
        self._wake = threading.Event()  # reader -> applier: a segment was sealed
        self._progress = threading.Event()  # applier -> reader: a batch was applied
        self._stop = threading.Event()
        self._lock = threading.Lock()

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Pipeline":
        return cls(load_config(path))

    # ---- wiring ------------------------------------------------------------------------------

    def _preamble(self) -> list[tuple[int, int, bytes]]:
        return [(0, FRAME_PREAMBLE, raw) for raw in self._relations_raw.values()]

    def session(self) -> Any:
        if self._session is None:
            self._session = open_session(self.config)
            self._sink = IcebergSink(self._session, self.types, self._tag)
        return self._session

    @property
    def sink(self) -> IcebergSink:
        self.session()
        assert self._sink is not None
        return self._sink

    def stop(self) -> None:
        """Ask a running ``run`` to stop after the current step (safe from signal handlers)."""
        self._stop.set()
        self._wake.set()
        self._progress.set()

    def close(self) -> None:
        release(self._store, self._session if self._owns_session else None)
        self._store = None
        if self._owns_session:
            self._session = self._sink = None

    @property
    def applied_lsn(self) -> Lsn:
        """Every configured table holds every change that committed before this position."""
        return self._applied

    def wait_for(self, lsn: Lsn, timeout: float = 120.0) -> None:
        """Block until the lake holds everything that committed before ``lsn``."""
        deadline = time.monotonic() + timeout
        while self._applied < lsn:
            for error in (self._apply_error, self._run_error):
                if error is not None:
                    raise error
            if time.monotonic() > deadline:
                raise Terminal(f"the lake did not reach LSN {lsn} within {timeout:.0f} s "
                               f"(it holds up to {self._applied})")
            time.sleep(0.05)

    def copy_again(self, tables: set[str]) -> None:
        """Have the next ``run`` copy these tables again (``walberg resync``; see
        walberg.ops.resync), replacing their Iceberg tables' rows in one commit each."""
        self._recopy = set(tables)

    # ---- run ---------------------------------------------------------------------------------

    def run(self, once: bool = False) -> RunReport:
        """Initial copy where owed, then stream. With ``once``, return as soon as everything up
        to the WAL position current at the start is committed to Iceberg."""
        try:
            return self._run(once)
        except BaseException as exc:
            self._run_error = exc  # for wait_for() in another thread
            raise

    def _run(self, once: bool) -> RunReport:
        if self.config.metrics.port:
            metrics.serve(self.config.metrics.port, self.config.metrics.host)
        store = SegmentStore(self.config.segment_dir, self.config.buffer.max_segment_bytes,
                             preamble=self._preamble)
        self._store = store
        recovery = store.recover()
        log.info("segments: %s", recovery)
        for segment in store.sealed():
            self._meta[segment.seq] = self._scan_meta(segment)

        started = self._start_with_retries(once)
        if started is None:  # stopped while the source was unreachable
            self.report.applied_lsn = self._applied
            return self.report
        stream, target = started

        # Whatever survived in sealed segments from an earlier run goes first.
        self._apply_ready(drain=True)
        self._applied = max(self._applied, min(self.committed.values()))

        applier = threading.Thread(target=self._apply_loop, name="walberg-apply", daemon=True)
        applier.start()
        self._received = max([m.last_commit_end or Lsn(0) for m in self._meta.values()]
                             + [self._applied])
        try:
            self._stream_with_reconnect(stream, target)
        finally:
            self._stop.set()
            self._wake.set()
            applier.join()
            if self._gauge_conn is not None:
                self._gauge_conn.close()
                self._gauge_conn = None
        if self._apply_error is not None:
            raise self._apply_error
        self.report.applied_lsn = self._confirmable()
        if self.halted:
            raise Terminal(" ".join(self.halted.values()) + " The other tables were applied.")
        return self.report

    def _confirmable(self) -> Lsn:
        """What the slot may be told: everything applied, but not past a stopped table's last
        commit (its changes must be read again once it is fixed)."""
        if not self.halted:
            return self._applied
        return Lsn(min([self._applied, *(self.committed.get(t, Lsn(0)) for t in self.halted)]))

    def _start_with_retries(self, once: bool
                            ) -> Optional[tuple[ReplicationStream, Optional[Lsn]]]:
        """Connect, check, create what is missing and copy what is owed. A source lost on the
        way (restarting, say) is tried again with backoff (0.5 s doubling to 30 s) for up to
        reconnect_max_seconds; one never reached fails at once (a wrong DSN should not wait).
        None if stopped meanwhile."""
        first_failure: Optional[float] = None
        delay = 0.5
        while True:
            try:
                return self._start(once)
            except Exception as exc:
                if not (isinstance(exc, Transient) or pg.is_connection_error(exc)):
                    raise
                if not self._reached_source:
                    # Never reached: a wrong DSN or a server that is down, said at once (a
                    # configuration problem: exit code 2).
                    if isinstance(exc, Transient):
                        raise SourceError(str(exc)) from None
                    raise
                now = time.monotonic()
                first_failure = first_failure or now
                reason = " ".join(str(exc).split())
                if now - first_failure > self.pg.reconnect_max_seconds:
                    raise Terminal(
                        f"cannot start: {reason} Gave up after "
                        f"{self.pg.reconnect_max_seconds:.0f} s of trying "
                        "(source.postgres.reconnect_max_seconds); run walberg again once the "
                        "server is reachable: nothing is lost.") from None
                log.warning("cannot start (%s); trying again in %.1f s", reason, delay)
                if self._stop.wait(delay):
                    return None
                delay = min(delay * 2, 30.0)

    def _start(self, once: bool) -> tuple[ReplicationStream, Optional[Lsn]]:
        """Check the source, open the stream (creating the slot if missing), make the Iceberg
        tables and copy the tables owed a copy; returns the open stream and, with ``once``, the
        WAL position to stop at."""
        opened: list[ReplicationStream] = []
        conn = pg.connect(self.pg.dsn)
        self._reached_source = True
        try:
            pg.check_wal_level(conn)
            infos = {t: pg.describe_table(conn, t) for t in self.tables}
            for info in infos.values():
                pg.require_key(info)
            pg.ensure_publication(conn, self.pg.publication, self.tables)
            # The tables as the publication publishes them: its column lists and row filters.
            infos = {t: pg.describe_table(conn, t, self.pg.publications) for t in infos}
            if self.pg.follow_publication:
                for t in pg.published_tables(conn, self.pg.publication):
                    if self._add_table(t):
                        infos[t] = pg.describe_table(conn, t, self.pg.publications)
                        pg.require_key(infos[t])
            self._learn_types(conn, infos)
            slot = pg.slot_state(conn, self.pg.slot)
            if slot is not None and slot.active_pid is not None:
                slot = self._wait_for_free_slot(conn, slot)
            stream = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication,
                                       self.pg.status_interval_seconds)
            opened.append(stream)
            stream.open()
            created = stream.create_slot() if slot is None else None
            if created:
                log.info("created replication slot %s at %s", created.name, created.consistent_point)

            for t, info in infos.items():
                self._ensure_tables(t, info)
                lsn = self.sink.committed_lsn(self.targets[t])
                if lsn is not None:
                    self.committed[t] = lsn
            if created is not None:
                # A new slot streams only what commits after its consistent point; a table whose
                # lake copy is older than that would miss changes, so it is copied again.
                for t, lsn in list(self.committed.items()):
                    if lsn < created.consistent_point:
                        log.warning("%s holds data up to LSN %s but the replication slot is new "
                                    "(starts at %s): copying it again", t, lsn,
                                    created.consistent_point)
                        del self.committed[t]
            for t in self._recopy:
                self.committed.pop(t, None)
            owed = [t for t in self.tables if t not in self.committed]
            for t in self.committed:
                self._catchup_after_resume(t)
            if owed:
                self._initial_copy([infos[t] for t in owed], created,
                                   None if slot is None else slot.confirmed_flush)
            target = pg.current_wal_lsn(conn) if once else None
            return stream, target
        except BaseException:
            for each in opened:
                each.close()
            raise
        finally:
            try:
                conn.close()
            except Exception:
                pass

    def _stream_with_reconnect(self, stream: ReplicationStream, target: Optional[Lsn]) -> None:
        """Stream until stopped (or, with a target, done). A lost connection is re-opened with
        exponential backoff and streaming resumes from the slot; what is already in segments is
        not written twice, and a transaction cut off mid-way is sent again whole and replaces its
        partial copy. Gives up after ``reconnect_max_seconds`` without a working connection."""
        give_up_after = self.pg.reconnect_max_seconds
        failing_since: Optional[float] = None
        delay = 0.5
        try:
            while True:
                try:
                    if not stream.is_open:
                        stream.open()
                    self._stream_loop(stream, target)
                    if self._apply_error is None:
                        # Report the final position while the connection is still open.
                        stream.confirm(self._confirmable())
                        stream.keepalive(force=True)
                        self._await_slot_confirmation()
                    return
                except Transient as exc:
                    gone = self._slot_gone()
                    if gone is not None:
                        raise gone from None
                    now = time.monotonic()
                    if failing_since is None or self._streamed_since_start:
                        failing_since, delay = now, 0.5
                    if now - failing_since > give_up_after:
                        raise Terminal(
                            f"{exc} Gave up after {give_up_after:.0f} s of reconnecting "
                            "(source.postgres.reconnect_max_seconds); run walberg again once the "
                            "server is reachable: nothing is lost.") from None
                    log.warning("%s; reconnecting in %.1f s", exc, delay)
                    stream.close()
                    if self._stop.wait(delay):
                        return
                    delay = min(delay * 2, 30.0)
                    stream = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication,
                                               self.pg.status_interval_seconds)
        finally:
            stream.close()

    def _slot_gone(self) -> Optional[Terminal]:
        """After a lost connection: a slot the server invalidated or someone dropped will not
        come back by reconnecting, so say so instead of retrying."""
        try:
            conn = pg.connect(self.pg.dsn)
        except WalbergError:
            return None  # the server is unreachable: reconnecting is the right thing
        try:
            if pg.slot_state(conn, self.pg.slot) is None:
                return Terminal(
                    f"replication slot {self.pg.slot} was dropped while walberg streamed from it: "
                    "the changes since the lake's last commit cannot be read any more. Run "
                    "`walberg resync -c <pipeline.yaml>` to copy the tables again.")
            return None
        except SourceError as exc:
            return exc
        except WalbergError:
            return None
        finally:
            conn.close()

    def _wait_for_free_slot(self, conn: Any, slot: pg.SlotState) -> Optional[pg.SlotState]:
        """Another process streams from our slot. A walberg that just died leaves its server
        process behind for a moment, so wait a little; then refuse, naming the other side."""
        deadline = time.monotonic() + self.slot_wait_seconds
        state: Optional[pg.SlotState] = slot
        while state is not None and state.active_pid is not None:
            if time.monotonic() > deadline:
                who = pg.describe_backend(conn, state.active_pid)
                raise Terminal(
                    f"replication slot {self.pg.slot} is in use by another process: {who}. "
                    "Another walberg may be running this pipeline already; stop it first, or "
                    "give this pipeline its own slot (source.postgres.slot). If that process "
                    "died, the server frees the slot within wal_sender_timeout; run again then."
                )
            time.sleep(0.2)
            state = pg.slot_state(conn, self.pg.slot)
        return state

    def _await_slot_confirmation(self, timeout: float = 10.0) -> None:
        """The server takes our last status update asynchronously; wait (briefly) until the slot
        shows it, so that a finished run leaves the slot exactly where the lake is."""
        conn = pg.connect(self.pg.dsn)
        try:
            deadline = time.monotonic() + timeout
            while True:
                state = pg.slot_state(conn, self.pg.slot)
                if state is None or state.confirmed_flush >= self._confirmable():
                    return
                if time.monotonic() > deadline:
                    log.warning("slot %s still confirms %s, not %s; the next run resumes from "
                                "there and skips what the lake already holds", self.pg.slot,
                                state.confirmed_flush, self._confirmable())
                    return
                time.sleep(0.05)
        finally:
            conn.close()

    def _initial_copy(self, infos: list[pg.TableInfo], created: Optional[CreatedSlot],
                      slot_flushed: Optional[Lsn] = None) -> None:
        """Copy tables inside a snapshot exported by a replication slot: the slot's own when it
        was just created, else a temporary slot's. Either way the copy is marked with the slot's
        consistent point, and the stream applies exactly the transactions after it.
        ``slot_flushed``: where the existing slot resumes (None: the slot is new), which tells
        whether a chunked copy cut short can resume."""
        temp: Optional[ReplicationStream] = None
        if created is None:
            temp = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication)
            temp.open()
            created = temp.create_slot(name=f"{self.pg.slot}_copy_{id(self) % 100000}",
                                       temporary=True)
        workdir = Path(tempfile.mkdtemp(prefix="walberg-copy-", dir=self.config.segment_dir))
        try:
            for info in infos:
                started = time.monotonic()
                target = self.targets[info.qualified_name]
                if self._chunked(info):
                    rows, point = self._copy_chunked(info, created,
                                                     slot_flushed if temp is not None else None)
                else:
                    rows = self._copy_whole(info, created, workdir)
                    point = created.consistent_point
                self.committed[info.qualified_name] = point
                self.report.copied[info.qualified_name] = rows
                metrics.COPIED_ROWS.labels(info.qualified_name).inc(rows)
                metrics.COMMITTED_LSN.labels(info.qualified_name).set(int(point))
                log.info("initial copy of %s -> %s: %d rows in %.1f s (at LSN %s)",
                         info.qualified_name, target, rows, time.monotonic() - started, point)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if temp is not None:
                temp.close()

    def _copy_whole(self, info: pg.TableInfo, created: CreatedSlot, workdir: Path) -> int:
        """The default copy: one COPY stream staged as local Parquet, loaded in one commit
        marked with the slot's consistent point (and appended to the changelog, if any).
        Returns the rows copied."""
        parquet = workdir / f"{info.qualified_name}.parquet"
        dead = DeadLetters(workdir / f"dlq-{info.qualified_name}.parquet", len(info.columns))
        rows = self._copy_to_parquet(info, workdir, created.snapshot_name, parquet,
                                     (dead, int(created.consistent_point)))
        target = self.targets[info.qualified_name]
        dead.close()
        # Dead letters first: if the copy itself then fails, the next copy replaces them.
        dropped = self.sink.write_dead_letters(
            target, info.columns, dead.path, created.consistent_point,
            snapshot=True) if dead.rows else 0
        self._count_dead(info.qualified_name, target, dropped)
        changelog = self.changelogs.get(info.qualified_name)
        if changelog is not None:
            self.sink.append_copy(changelog, info.columns, [parquet],
                                  created.consistent_point)
            self._changelog_held[info.qualified_name] = created.consistent_point
        if changelog != target:
            self.sink.load_copy(target, info.columns, [parquet], created.consistent_point)
        return rows

    def _chunked(self, info: pg.TableInfo) -> bool:
        """Whether this table's copy is read by Spark over JDBC in chunks."""
        if self.pg.initial_copy.method != "jdbc":
            return False
        source = info.qualified_name
        why = None
        if self.config.layout_for(source).mode != "upsert":
            why = "its sink mode keeps a changelog"
        elif any(self.types.spark_type(c, source).array_dims for c in info.columns):
            why = "it has array columns"
        if why:
            log.info("initial copy of %s: through COPY, not jdbc, because %s", source, why)
            return False
        return True

    def _copy_chunked(self, info: pg.TableInfo, created: CreatedSlot,
                      slot_flushed: Optional[Lsn]) -> tuple[int, Lsn]:
        """The parallel initial copy: Spark reads the table over JDBC in chunks, each a commit
        recording the span it covers (``walberg.copy.*``); the last also carries the LSN mark.

        Resuming: a copy cut by key ranges that an interruption left unfinished goes on with
        the spans not yet committed, read in this (newer) snapshot, provided the slot still
        starts at or before the copy's start (``slot_flushed``). The table is then marked with
        the copy's original start, so the stream replays everything after it; rows read in the
        newer snapshot already hold part of that replay, which is harmless as long as the
        replayed inserts are merged by key rather than appended: they are, until the stream
        passes the newer snapshot (``walberg.copy.catchup``). Returns the rows copied and the
        LSN the table is marked with."""
        source, target = info.qualified_name, self.targets[info.qualified_name]
        settings = self.pg.initial_copy
        key = chunks.range_key(info)
        kind = "key" if key else "ctid"
        point, catchup = created.consistent_point, None
        done: list[Span] = []
        if key is not None and slot_flushed is not None:
            history = self.sink.copy_marks(target)
            if history and history[0].get(COPY_PREFIX + "key") == key:
                start = Lsn.parse(history[0][COPY_PREFIX + "point"])
                if start >= slot_flushed:
                    done = [Span.decode(m[COPY_PREFIX + "span"]) for m in history
                            if COPY_PREFIX + "span" in m]
                    point, catchup = start, created.consistent_point
                    log.info("resuming the initial copy of %s: %d chunk(s) were committed (from "
                             "LSN %s); the rest is read at LSN %s", source, len(done), start,
                             catchup)
        conn = pg.connect(self.pg.dsn, autocommit=False)
        try:
            conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
            with conn.cursor() as cur:
                cur.execute("SET TRANSACTION SNAPSHOT %s", (created.snapshot_name,))
                extent = chunks.table_extent(cur, info, key)
            conn.rollback()
        finally:
            conn.close()
        todo = chunks.remaining(done) if key else [Span(kind, None, None)]
        parallel = settings.parallelism or int(self.session().sparkContext.defaultParallelism)
        plan = chunks.plan_chunks(extent, info.estimated_rows, settings.chunk_rows, parallel,
                                  kind, todo)
        url, props = chunks.jdbc_target(self.pg.dsn)
        init = chunks.session_init(created.snapshot_name)
        progress = CopyProgress(source, info.estimated_rows)
        gauge = metrics.COPY_PROGRESS.labels(source)
        rows = dead = 0
        for n, chunk in enumerate(plan):
            started = time.monotonic()
            df = jdbc.read_text(self.session(), url, props,
                                [chunks.text_query(info, part, key) for part in chunk.parts],
                                init, settings.fetch_size)
            last = n == len(plan) - 1
            marks = {COPY_PREFIX + "point": str(point), COPY_PREFIX + "key": key or "",
                     COPY_PREFIX + "span": chunk.span.encode()}
            first = not done and n == 0
            if first:
                marks[COPY_PREFIX + "first"] = "true"
            if last and catchup is not None:
                marks[COPY_PREFIX + "catchup"] = str(catchup)
            added, bad = self.sink.load_chunk(
                target, info.columns, df, point, marks, first=first, done=last,
                dead_span=(key, chunk.span.lo, chunk.span.hi) if key else None)
            crash_point("chunk")
            rows, dead = rows + added, dead + bad
            progress.update(rows)
            if info.estimated_rows:
                gauge.set(min(rows / info.estimated_rows, 0.99))
            log.info("initial copy of %s: chunk %d of %d (%s) -> %d rows in %.1f s", source,
                     n + 1, len(plan), chunk.span.encode(), added, time.monotonic() - started)
        progress.done(rows)
        gauge.set(1)
        self._count_dead(source, target, dead)
        if catchup is not None:
            self._catchup[source] = catchup
        return rows, point

    def _catchup_after_resume(self, source: str) -> None:
        """A table whose copy was resumed merges the stream's inserts by key until the stream
        passes the snapshot the copy finished in (see ``_copy_chunked``)."""
        if self.pg.initial_copy.method != "jdbc":
            return
        marks = self.sink.copy_marks(self.targets[source])
        value = marks[-1].get(COPY_PREFIX + "catchup") if marks else None
        if value is not None and Lsn.parse(value) > self.committed[source]:
            self._catchup[source] = Lsn.parse(value)

    def _copy_to_parquet(self, info: pg.TableInfo, workdir: Path, snapshot: str,
                         parquet: Path, dead: tuple[DeadLetters, int]) -> int:
        """COPY the table through a named pipe into the Parquet writer: Postgres renders rows
        while pyarrow parses them, and no CSV file ever lands on disk."""
        fifo = workdir / f"{info.qualified_name}.csv"
        os.mkfifo(fifo, 0o600)
        result: list[int] = []
        failure: list[BaseException] = []

        def produce() -> None:
            try:
                result.append(copy_table(self.pg.dsn, info, fifo, snapshot))
            except BaseException as exc:
                failure.append(exc)
                # Unblock the reader side if the writer never opened the pipe.
                with open(fifo, "wb"):
                    pass

        producer = threading.Thread(target=produce, name=f"copy-{info.qualified_name}")
        producer.start()
        try:
            progress = CopyProgress(info.qualified_name, info.estimated_rows)
            gauge = metrics.COPY_PROGRESS.labels(info.qualified_name)
            gauge.set(0)

            def copied(rows: int) -> None:
                progress.update(rows)
                if info.estimated_rows:
                    gauge.set(min(rows / info.estimated_rows, 0.99))

            rows = csv_to_parquet(fifo, len(info.columns), parquet,
                                  self._prep(info.qualified_name, info.columns), dead, copied)
            progress.done(rows)
            gauge.set(1)
        finally:
            producer.join()
            fifo.unlink(missing_ok=True)
        if failure:
            raise failure[0]
        return result[0]

    # ---- reading: stream -> segments ----------------------------------------------------------

    def _stream_loop(self, stream: ReplicationStream, target: Optional[Lsn]) -> None:
        store = self._store
        assert store is not None
        self._streamed_since_start = False
        skip_before = self._received  # transactions already in segments are not written twice
        received = self._received
        stream.confirm(self._confirmable())
        in_progress = self.pg.stream_in_progress and stream.server_version() >= 140000
        stream.start(self._confirmable(), in_progress=in_progress)
        spill_dir = self.config.segment_dir / "spill"
        spill.clear(spill_dir)  # an unfinished streamed transaction is streamed again
        spills: dict[int, TxnSpill] = {}
        chunk_xid: Optional[int] = None  # inside a Stream Start .. Stream Stop block
        interval = self.config.buffer.max_interval_seconds
        in_txn = skipping = False
        backlog_limit = 4 * self.config.buffer.max_batch_bytes
        last_ask = last_gauges = 0.0
        while not self._stop.is_set():
            if self._apply_error is not None:
                return
            if store.pending_bytes() > backlog_limit:
                # Spark is behind: stop reading for a moment (status updates keep flowing).
                stream.confirm(self._confirmable())
                stream.keepalive()
                self._await_progress()
                continue
            # --once: what committed after the target is left for the next run, so a source
            # that never stops writing cannot keep this run from ending.
            reached = target is not None and not in_txn and received >= target
            if reached:
                stream.keepalive()
                self._await_progress()
            for wal_start, payload in () if reached else stream.messages(timeout=0.2):
                tag = payload[0]
                if tag in _STREAM_TAGS or chunk_xid is not None:
                    chunk_xid, done = self._streamed(tag, payload, wal_start, chunk_xid, spills,
                                                     spill_dir, skip_before)
                    if done is not None:
                        received = done
                    continue
                if tag == _TAG_RELATION:
                    self._relations_raw[_RELATION_OID.unpack_from(payload, 1)[0]] = bytes(payload)
                elif tag == _TAG_BEGIN:
                    in_txn = True
                    skipping = Lsn(_BEGIN_FINAL_LSN.unpack_from(payload, 1)[0]) < skip_before
                if skipping:
                    if tag == _TAG_COMMIT:
                        skipping = in_txn = False
                    continue
                if tag == _TAG_COMMIT:
                    end = Lsn(_COMMIT_END_LSN.unpack_from(payload, 10)[0])
                    store.append(end, FRAME_PGOUTPUT, payload)
                    in_txn = False
                    self._active_commit = received = self._received = end
                    self._streamed_since_start = True
                    if store.should_seal():
                        self._seal(clean=True)
                    if target is not None and end >= target:
                        break
                else:
                    store.append(wal_start, FRAME_PGOUTPUT, payload)
                    crash_point("segment-write")
                    if store.should_seal():
                        self._seal(clean=False)

            caught_up = target is not None and not in_txn and (
                received >= target or stream.wal_end >= target)
            if store.active_bytes() and (caught_up or store.active_age_seconds() >= interval):
                self._seal(clean=not in_txn)
            idle = not in_txn and not spills and store.pending_bytes() == 0
            # (past the target, messages may wait unread: the server's WAL end says nothing then)
            reached = target is not None and not in_txn and received >= target
            if idle and not reached and stream.wal_end > self._applied:
                # Nothing of ours is pending: positions up to the server's WAL end hold no
                # change for our tables, so the slot may move on (keeps retained WAL bounded).
                with self._lock:
                    self._applied = max(self._applied, stream.wal_end)
            stream.confirm(self._confirmable(), written=received)
            pending = store.pending_bytes()
            metrics.PENDING_BYTES.set(pending)
            if pending == 0:
                self._oldest_unapplied_ts = None
            elif self._oldest_unapplied_ts is None:
                self._oldest_unapplied_ts = time.time()
            if time.monotonic() - last_gauges >= self.pg.status_interval_seconds:
                self._update_slot_gauges()
                last_gauges = time.monotonic()
            if target is not None and idle and self._applied >= target:
                stream.keepalive(force=True)
                return
            if idle and time.monotonic() - last_ask >= (0.2 if target is not None else 1.0):
                # Ask for a keepalive: its WAL end tells how far the server has looked.
                stream.keepalive(force=True, reply=True)
                last_ask = time.monotonic()

    def _await_progress(self) -> None:
        """Wait (at most 0.2 s) for the applier to finish a batch. Waiting on an event of its
        own, not on ``_wake`` (which stays set while the applier is busy): the reader must not
        spin, taking a core and the GIL from the staging and Spark."""
        self._progress.wait(0.2)
        self._progress.clear()

    def _update_slot_gauges(self) -> None:
        """Lag and retained WAL as the server sees them; a failed look is tried next time."""
        try:
            if self._gauge_conn is None or self._gauge_conn.closed:
                self._gauge_conn = pg.connect(self.pg.dsn)
            state = pg.slot_state(self._gauge_conn, self.pg.slot)
            now = pg.current_wal_lsn(self._gauge_conn)
        except Exception as exc:  # metrics must never stop the stream
            log.debug("slot metrics not updated: %s", exc)
            self._gauge_conn = None
            return
        if state is not None:
            metrics.LAG_BYTES.set(max(int(now) - int(state.confirmed_flush), 0))
            metrics.RETAINED_WAL_BYTES.set(max(int(now) - int(state.restart_lsn), 0))
        oldest = self._oldest_unapplied_ts
        metrics.LAG_SECONDS.set(0.0 if oldest is None else max(time.time() - oldest, 0.0))

    def _streamed(self, tag: int, payload: bytes, wal_start: int, chunk_xid: Optional[int],
                  spills: dict[int, TxnSpill], spill_dir: Path,
                  skip_before: Lsn) -> tuple[Optional[int], Optional[Lsn]]:
        """One message of protocol 2's in-progress streaming. Changes go to their transaction's
        spill file (without the xid protocol 2 puts after the tag, so they read like protocol
        1); at Stream Commit the transaction is written to the segments as an ordinary one
        (Begin, changes, Commit) at its commit position; Stream Abort drops it, or a
        subtransaction's part of it. Returns the open chunk's xid and, after a commit written
        to the segments, its end LSN."""
        store = self._store
        assert store is not None
        if tag == _TAG_STREAM_START:
            xid, first = _XID.unpack_from(payload, 1)[0], payload[5] == 1
            if first or xid not in spills:  # (sent again from its start after a reconnect)
                if xid in spills:
                    spills[xid].discard()
                spills[xid] = TxnSpill(spill_dir, xid)
            return xid, None
        if tag == _TAG_STREAM_STOP:
            return None, None
        if tag == _TAG_STREAM_ABORT:
            xid, subxid = struct.unpack_from(">II", payload, 1)
            if xid == subxid:
                dropped = spills.pop(xid, None)
                if dropped is not None:
                    dropped.discard()
            elif xid in spills:
                spills[xid].abort(subxid)
            return chunk_xid, None
        if tag == _TAG_STREAM_COMMIT:
            xid, _flags, commit_lsn, end_lsn, commit_ts = _STREAM_COMMIT.unpack_from(payload, 1)
            txn = spills.pop(xid, None)
            if txn is None:
                return chunk_xid, None
            try:
                if Lsn(commit_lsn) < skip_before:
                    return chunk_xid, None  # already in the segments
                store.append(commit_lsn, FRAME_PGOUTPUT,
                             struct.pack(">cQqI", b"B", commit_lsn, commit_ts, xid))
                for lsn, change in txn.changes():
                    if change[0] == _TAG_RELATION:
                        self._relations_raw[_RELATION_OID.unpack_from(change, 1)[0]] = change
                    store.append(lsn, FRAME_PGOUTPUT, change)
                    if store.should_seal():
                        self._seal(clean=False)
                end = Lsn(end_lsn)
                store.append(end, FRAME_PGOUTPUT,
                             struct.pack(">cBQQq", b"C", 0, commit_lsn, end_lsn, commit_ts))
                self._active_commit = self._received = end
                self._streamed_since_start = True
                if store.should_seal():
                    self._seal(clean=True)
                return chunk_xid, end
            finally:
                txn.discard()
        # A change (or relation, type, message) inside a streamed chunk: Int32 xid after the tag.
        assert chunk_xid is not None
        if chunk_xid in spills:
            subxid = _XID.unpack_from(payload, 1)[0]
            spills[chunk_xid].add(subxid, wal_start, bytes(payload[:1]) + bytes(payload[5:]))
        return chunk_xid, None

    def _seal(self, clean: bool) -> None:
        assert self._store is not None
        info = self._store.seal()
        if info is not None:
            crash_point("seal")
            metrics.SEGMENTS_SEALED.inc()
            self._meta[info.seq] = SegmentMeta(self._active_commit, clean)
            self._active_commit = None
            self._wake.set()

    def _scan_meta(self, info: Any) -> SegmentMeta:
        assert self._store is not None
        last: Optional[Lsn] = None
        clean = False
        for lsn, kind, payload in self._store.read(info):
            if kind != FRAME_PGOUTPUT:
                continue
            if payload[0] == _TAG_COMMIT:
                last, clean = Lsn(lsn), True
            else:
                clean = False
        return SegmentMeta(last, clean)

    # ---- applying: segments -> Iceberg --------------------------------------------------------

    def _apply_loop(self) -> None:
        try:
            while True:
                self._wake.wait(0.5)
                self._wake.clear()
                if self._stop.is_set():
                    # Stopping: the batch in flight has finished; what is still sealed is
                    # durable and is applied by the next run, so shutdown stays short.
                    return
                self._apply_ready(drain=False)
                every = self.config.maintenance.every
                if every and time.monotonic() - self._last_maintenance >= every:
                    # Between batches, in this thread: never racing walberg's own commits.
                    # The reader keeps filling segments meanwhile.
                    maintain_tables(self.sink, self.config.maintenance, self.targets.values())
                    self._last_maintenance = time.monotonic()
        except BaseException as exc:  # surfaced by run() in the main thread
            self._apply_error = exc
            self._stop.set()

    def _apply_ready(self, drain: bool) -> None:
        """Apply sealed segments, a batch at a time, while some hold unapplied commits.

        Batch N+1 is decoded and staged (Python, pyarrow) in a helper thread while Spark
        commits batch N, so the two kinds of work overlap."""
        prepared = self._prepare_next(self._applied, None)
        if prepared is None:
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="walberg-stage") as pool:
            while prepared is not None:
                upcoming = pool.submit(self._prepare_next, prepared.end, prepared)
                try:
                    self._commit_batch(prepared)
                except BaseException:
                    prepared.committed.set()
                    self._discard(upcoming)
                    raise
                prepared.committed.set()
                if self._stop.is_set() and not drain:
                    self._discard(upcoming)
                    return
                prepared = upcoming.result()

    @staticmethod
    def _discard(upcoming: "Future[Optional[PreparedBatch]]") -> None:
        try:
            batch = upcoming.result()
        except BaseException:
            return
        if batch is not None:
            batch.builder.discard()

    def _prepare_next(self, floor: Lsn, after: "Optional[PreparedBatch]") -> "Optional[PreparedBatch]":
        """Choose the sealed segments of the next batch (those holding commits after ``floor``)
        and decode them into staged Parquet. ``after`` is the batch before it, not yet
        committed: its segments are left out, except a last one that a transaction runs on
        from. The batch grows by the segments sealed while it is decoded, and while ``after``
        commits it waits for more (up to ``buffer.max_batch_bytes`` in all): when the source
        outpaces Spark, batches grow and the lake gets fewer, larger commits instead of falling
        further behind."""
        assert self._store is not None
        first_seq = 0
        if after is not None and after.cut:
            first_seq = after.segments[0].seq  # what it left is skipped by LSN
        elif after is not None:
            last = after.segments[-1]
            first_seq = last.seq if not self._meta[last.seq].clean_end else last.seq + 1
        batch, end = self._segments_after(first_seq - 1, 0)
        if end is None or end <= floor:
            return None
        committed = after.committed if after is not None else None

        def grow(staged: list[Any]) -> Optional[tuple[list[Any], Lsn]]:
            size = sum(info.size_bytes for info in staged)
            while not self._stop.is_set() and size < self.config.buffer.max_batch_bytes:
                more, more_end = self._segments_after(staged[-1].seq, size)
                if more and more_end is not None:
                    return more, more_end
                if committed is None or committed.is_set():
                    return None
                committed.wait(0.05)
            return None

        return self._stage_batch(batch, end, floor, grow)

    def _segments_after(self, seq: int, size: int) -> tuple[list[Any], Optional[Lsn]]:
        """The sealed segments after ``seq`` up to the last one that ends a transaction, and that
        transaction's end; no more than reach ``buffer.max_batch_bytes`` with ``size``."""
        assert self._store is not None
        batch: list[Any] = []
        end: Optional[Lsn] = None
        for info in self._store.sealed():
            if info.seq <= seq:
                continue
            batch.append(info)
            size += info.size_bytes
            meta = self._meta.get(info.seq)  # (none yet: sealed this instant, no commit known)
            if meta is not None and meta.last_commit_end is not None:
                end = meta.last_commit_end
                if size >= self.config.buffer.max_batch_bytes:
                    break
        # Segments after the one holding the last commit wait for their commits.
        while batch and (self._meta.get(batch[-1].seq) or SegmentMeta(None, False)
                         ).last_commit_end != end:
            batch.pop()
        return batch, end

    def _stage_batch(self, segments: list[Any], end: Lsn, floor: Lsn,
                     grow: "Optional[Callable[[list[Any]], Optional[tuple[list[Any], Lsn]]]]"
                     = None) -> "PreparedBatch":
        """Decode the segments' transactions up to ``end`` into staged Parquet, per table.
        Having reached ``end``, ``grow`` may hand more segments and a later end to go on to.

        Control messages go through the scalar decoder; Insert/Update/Delete messages are only
        routed here (a byte and a relation id per message) and decoded in columnar chunks."""
        assert self._store is not None
        started = time.monotonic()
        workdir = Path(tempfile.mkdtemp(prefix="batch-", dir=self.config.segment_dir))
        builder = BatchBuilder(workdir, prep=self._prep)
        chunks = _Chunks(builder)
        decoder = Decoder()
        seq = 0
        txn: Optional[Begin] = None
        txn_first_seq = 0
        wanted: dict[int, _Chunk] = {}  # relations this transaction applies to
        touched: set[str] = set()
        live: set[str] = set()  # tables with changes from committed transactions
        void: list[tuple[int, int]] = []
        changes = 0
        done = cut = False
        last_commit_ts: Optional[int] = None
        last_end: Optional[Lsn] = None  # end of the last transaction staged whole, and its seq
        last_seq = 0
        txn_lsn = 0
        txns: dict[int, tuple[int, int, int]] = {}  # commit LSN: xid, commit time, first seq
        try:
            for info in segments:
                for lsn, _kind, payload in self._store.read(info):
                    tag = payload[0]
                    if tag in _CHANGE_TAGS:
                        if txn is None:
                            continue  # the tail of a transaction applied in an earlier batch
                        chunk = wanted.get(_RELATION_OID.unpack_from(payload, 1)[0])
                        if chunk is None:
                            self._check_known(decoder, payload, lsn)
                            continue
                        seq += 2  # room for the delete half of a key-changing update
                        chunk.add(payload, seq, txn_lsn)
                        touched.add(chunk.relation.qualified_name)
                        changes += 1
                        continue
                    msg = decoder.decode(payload, lsn)
                    if isinstance(msg, Relation):
                        chunks.relation_changed(msg)
                        if txn is not None:
                            before = builder.columns_of(msg.qualified_name)
                            if before is not None and before != msg.columns \
                                    and self._wanted(msg, txn):
                                if last_end is None:  # ALTER amid this transaction's changes
                                    raise SchemaChanged(msg.qualified_name)
                                # The table's columns changed (ALTER TABLE): this batch ends
                                # with the transaction before; the next one starts with the
                                # new columns, after the Iceberg schema has followed.
                                end, cut, done = last_end, True, True
                                break
                            self._learn_relation(msg)
                            wanted = self._wanted_chunks(decoder, chunks, txn)
                    elif isinstance(msg, Begin):
                        if txn is not None and seq >= txn_first_seq:
                            # A transaction cut off by a crash and sent again in full.
                            void.append((txn_first_seq, seq))
                        txn, txn_first_seq, touched = msg, seq + 1, set()
                        # (a transaction sent again after a crash: its last sending counts)
                        txns[int(msg.final_lsn)] = (msg.xid, msg.commit_ts, seq + 1)
                        txn_lsn = int(msg.final_lsn)  # _walberg_lsn: the commit LSN
                        if msg.final_lsn < floor:
                            txn = None  # already in the batch before this one
                        else:
                            wanted = self._wanted_chunks(decoder, chunks, txn)
                    elif txn is None:
                        continue
                    elif isinstance(msg, Commit):
                        live |= touched
                        txn = None
                        last_commit_ts = msg.commit_ts
                        last_end, last_seq = msg.end_lsn, seq
                        if msg.end_lsn >= end:
                            more = grow(segments) if grow is not None else None
                            if more is None:
                                done = True
                                break
                            segments.extend(more[0])  # read on by this loop, in order
                            end = more[1]
                    elif isinstance(msg, Truncate):
                        for oid in msg.relation_oids:
                            if oid in wanted:
                                seq += 2
                                rel = wanted[oid].relation
                                builder.truncate(rel.qualified_name, rel.columns, seq, txn_lsn)
                                touched.add(rel.qualified_name)
                                changes += 1
                if done:
                    break
            chunks.flush_all()
            staged = builder.finish((last_seq if cut else seq, void), self._nettable)
        except SchemaChanged as exc:
            builder.discard()
            rel = next(r for r in decoder.relations.values() if r.qualified_name == exc.source)
            raise self._schema_error(exc.source, rel.columns, txn.final_lsn if txn else end) from None
        except BaseException:
            builder.discard()
            raise
        return PreparedBatch(segments, end, builder, staged, live, last_seq if cut else seq, void,
                             changes, time.monotonic() - started, last_commit_ts, cut,
                             [(lsn, *t) for lsn, t in txns.items()], floor)

    @property
    def _nettable(self) -> frozenset[str]:
        """Tables whose batches may be netted while staging: not those with a changelog, which
        records every change."""
        return frozenset(t for t in self.tables if t not in self.changelogs)

    def _wanted_chunks(self, decoder: Decoder, chunks: "_Chunks", txn: Begin) -> dict[int, "_Chunk"]:
        return {oid: chunks.for_relation(rel) for oid, rel in decoder.relations.items()
                if self._wanted(rel, txn)}

    @staticmethod
    def _check_known(decoder: Decoder, payload: bytes, lsn: int) -> None:
        """A change for a relation nobody described is a broken stream: let the scalar decoder
        say so, with the LSN."""
        if _RELATION_OID.unpack_from(payload, 1)[0] not in decoder.relations:
            decoder.decode(payload, lsn)

    def _commit_batch(self, batch: "PreparedBatch") -> None:
        """Commit a staged batch to Iceberg (one commit per table), then let go of its segments."""
        assert self._store is not None
        started = time.monotonic()
        log.info("applying %d segment(s) up to LSN %s", len(batch.segments), batch.end)
        try:
            for source in sorted(batch.live):
                st = batch.staged[source]
                if source in self.halted:
                    continue
                commit_started = time.monotonic()
                try:
                    self._with_retries(source, batch.end,
                                       functools.partial(self._commit_table, source, batch))
                except SchemaStop as exc:
                    # This table cannot follow its source; the others go on.
                    self.halted[source] = str(exc)
                    metrics.TABLE_STOPPED.labels(source).set(1)
                    log.error("%s; the other tables go on", exc)
                    continue
                except BaseException:
                    metrics.COMMITS.labels(source, "failure").inc()
                    raise
                metrics.COMMITS.labels(source, "success").inc()
                self._count_files(source)
                metrics.COMMIT_SECONDS.labels(source).observe(time.monotonic() - commit_started)
                for op in ("I", "U", "D"):
                    metrics.RECORDS_WRITTEN.labels(source, _OP_NAMES[op]).inc(st.ops[op])
                metrics.COMMITTED_LSN.labels(source).set(int(batch.end))
                self.committed[source] = batch.end
                log.info("applied %s: %d changes (I %d, U %d, D %d%s), LSN %s..%s, in %.2f s",
                         source, st.rows, st.ops["I"], st.ops["U"], st.ops["D"],
                         ", truncated" if st.truncates else "", batch.start, batch.end,
                         time.monotonic() - commit_started)
        finally:
            batch.builder.discard()
        crash_point("committed")
        with self._lock:
            self._applied = max(self._applied, batch.end)
        self._progress.set()
        self.report.batches += 1
        self.report.changes += batch.changes
        segments = batch.segments
        last = self._meta[segments[-1].seq]
        if batch.cut:
            done_with = []  # the next batch reads them again, from after this one's end
        else:
            done_with = segments if last.clean_end else segments[:-1]
        self._store.remove(done_with)
        for info in done_with:
            self._meta.pop(info.seq, None)
        metrics.BATCHES.inc()
        metrics.SEGMENTS_APPLIED.inc(len(done_with))
        metrics.BATCH_CHANGES.observe(batch.changes)
        metrics.BATCH_SECONDS.observe(batch.staged_s + time.monotonic() - started)
        if batch.last_commit_ts is not None:
            metrics.END_TO_END_SECONDS.observe(max(time.time() - _pg_epoch(batch.last_commit_ts),
                                                   0.0))
        log.info("batch of %d segment(s), %d changes, LSN %s..%s: staged in %.2f s, "
                 "committed in %.2f s", len(segments), batch.changes, batch.start, batch.end,
                 batch.staged_s, time.monotonic() - started)

    def _ensure_tables(self, source: str, info: pg.TableInfo) -> None:
        """Create the source's Iceberg table(s) (mirror, changelog, or both) or bring them to
        their layout."""
        layout = self.config.layout_for(source)
        made: list[tuple[str, bool]] = []
        if layout.mode != "append":
            made.append((self.targets[source],
                         self.sink.ensure_table(self.targets[source], info.columns, layout)))
        changelog = self.changelogs.get(source)
        if changelog is not None:
            made.append((changelog, self.sink.ensure_changelog(changelog, info.columns, layout)))
        for target, created in made:
            if not created:
                changed = self.sink.align(target, layout)
                if changed:
                    log.info("%s follows its layout in the pipeline file: %s", target,
                             "; ".join(changed))
        if layout.mode != "append" and not made[0][1]:
            self._finish_fills(source)
        if layout.mode == "both" and changelog is not None:
            self._changelog_held[source] = self.sink.committed_lsn(changelog)

    def _commit_table(self, source: str, batch: "PreparedBatch") -> None:
        """One table's share of a batch: schema first, then dead letters, then its commit (the
        changelog's first when the table has both)."""
        st, target = batch.staged[source], self.targets[source]
        changelog = self.changelogs.get(source)
        for t in ([target] if changelog in (None, target) else [changelog, target]):
            if not self.sink.columns_match(t, st.columns):
                self._evolve(source, st.columns, batch.end, t)
        if st.dead_letters is not None:
            # Before the table's own commit: a replay skips what the DLQ holds.
            dropped = self.sink.write_dead_letters(
                target, st.columns, st.dead_letters, batch.end,
                where=seq_filter(batch.max_seq, batch.void, []))
            self._count_dead(source, target, dropped)
        if changelog is not None:
            held = self._changelog_held.get(source) if changelog != target else None
            self.sink.append_changes(changelog, st, batch.end, batch.max_seq, batch.void,
                                     batch.txns, held)
            if changelog != target:
                self._changelog_held[source] = batch.end
        if changelog != target:
            crash_point("commit", delay=0.5)
            catchup = self._catchup.get(source)
            self.sink.apply(target, st, batch.end, batch.max_seq, batch.void,
                            upsert=catchup is not None)
            if catchup is not None and batch.end >= catchup:
                del self._catchup[source]

    def _with_retries(self, source: str, lsn: Lsn, commit: Callable[[], None]) -> None:
        """``commit`` tried again on storage or catalog failures (see
        ``lakeside.commit_with_retries``); it landed if the table holds ``lsn``."""
        target = self.targets[source]

        def landed() -> bool:
            held = self.sink.committed_lsn(target)
            return held is not None and held >= lsn

        commit_with_retries(self.config.sink, self._stop, self.sink, source, target, commit,
                            landed, f"LSN {lsn}", f"LSN {self.committed.get(source, '-')}")

    def _learn_relation(self, rel: Relation) -> None:
        """A relation description with types the type map has not seen (a column added with a
        new type): ask the source catalog about them, and about the table's array dimensions."""
        if rel.qualified_name not in self.targets or \
                all(c.type_oid in self.types.types for c in rel.columns):
            return
        conn = pg.connect(self.pg.dsn)
        try:
            try:
                dims = pg.describe_table(conn, rel.qualified_name).dims
            except WalbergError:
                dims = {}  # dropped or renamed since: the OIDs still tell the types
            found = pg.describe_types(conn, {c.type_oid for c in rel.columns})
            self.types.learn(found, self.targets[rel.qualified_name], dims)
        finally:
            conn.close()

    def _evolve(self, source: str, columns: tuple[Column, ...], lsn: Lsn,
                target: Optional[str] = None) -> None:
        """Make the Iceberg table's schema follow the source's columns (after ALTER TABLE),
        as far as ``sink.schema_evolution`` allows; otherwise stop with what to do."""
        target = target or self.targets[source]
        wanted = [(c.name, self.types.spark_type(c, target).describe()) for c in columns]
        current = self.sink.schema(target)
        mode = self.config.layout_for(source).schema_evolution
        try:
            steps = evolution.plan(current, wanted)
            refused = [s for s in steps if mode == "strict"
                       or (mode == "add_columns" and s.kind != "add")]
            if refused:
                raise evolution.NotEvolvable(
                    f"{'; '.join(s.describe() for s in refused)} is not allowed by "
                    f"sink.schema_evolution: {mode}")
        except evolution.NotEvolvable as exc:
            raise self._schema_error(source, columns, lsn, str(exc)) from None
        after = {name: (wanted[i - 1][0] if i else "") for i, (name, _) in enumerate(wanted)}
        conn = pg.connect(self.pg.dsn)
        try:
            for step in steps:
                if step.kind != "add":
                    continue
                has_default, value = pg.column_default(conn, source, step.name)
                if has_default and value is None:
                    log.warning(
                        "column %s of %s was added with a volatile default (or an identity): "
                        "Postgres gave the existing rows values that the replication stream "
                        "does not carry, so those rows have NULL there in %s. To get the "
                        "values, copy the table again (drop %s in Spark SQL and run walberg).",
                        step.name, source, target, target)
                elif value is not None:
                    parsed = parse_array(value)  # attmissingval is a one-element array
                    if not parsed or isinstance(parsed[0], list) or parsed[0] is None:
                        continue
                    col = next(c for c in columns if c.name == step.name)
                    expr = self.types.spark_type(col, target).convert.format(
                        sql_string(parsed[0]))
                    # Recorded before the column exists, so a crash part-way is finished on start.
                    self.sink.set_property(target, FILL_PROPERTY + step.name, expr)
        finally:
            conn.close()
        self.sink.evolve(target, steps, after)
        log.info("evolved the schema of %s to follow %s (before LSN %s): %s", target, source,
                 lsn, "; ".join(s.describe() for s in steps))
        if target == self.targets[source] and target not in self.changelogs.values():
            self._finish_fills(source)
        else:  # a changelog records changes; its old rows keep what they were
            for key in self.sink.properties(target, FILL_PROPERTY):
                self.sink.set_property(target, key, None)

    def _finish_fills(self, source: str) -> None:
        """Columns added in Postgres with a default: existing rows get the default in the lake
        too (Postgres keeps it in pg_attribute.attmissingval and never streams it). Pending
        fills are table properties, so one cut short by a crash is finished on the next start."""
        target = self.targets[source]
        names = {name for name, _ in self.sink.schema(target)}
        for key, expr in self.sink.properties(target, FILL_PROPERTY).items():
            name = key[len(FILL_PROPERTY):]
            if name in names:
                self.sink.fill(target, name, expr)
            self.sink.set_property(target, key, None)

    def _count_files(self, source: str) -> None:
        count_files(self.sink, source, self.targets[source])

    def _count_dead(self, source: str, target: str, rows: int) -> None:
        if rows:
            metrics.DEAD_LETTERS.labels(source).inc(rows)
            log.warning("%d row(s) of %s could not be written exactly and went to %s with the "
                        "reason in _dlq_reason", rows, source, self.sink.dead_letter_target(target))

    def _schema_error(self, source: str, columns: tuple[Column, ...], lsn: Lsn,
                      reason: str = "") -> "SchemaStop":
        target = self.targets[source]
        now = ", ".join(f"{c.name} {self.types.spark_type(c, target).describe()}" for c in columns)
        why = (f"{reason}." if reason else
               "The ALTER TABLE ran inside a transaction that changed rows of the table before "
               "it, so no commit separates the old columns from the new.")
        return SchemaStop(
            f"{source} changed its columns in Postgres (ALTER TABLE) before LSN {lsn}; it now "
            f"has ({now}), and {target} cannot follow: {why} To go on, either set "
            f"sink.schema_evolution to allow the change (if it is allowed by Iceberg), or copy "
            f"the table afresh: drop the Iceberg table (DROP TABLE {target} in Spark SQL) and "
            "run walberg again; it copies the table and streams on from there. Nothing after "
            "the last commit was confirmed to the slot, so nothing is lost meanwhile."
        )

    def _learn_types(self, conn: Any, infos: dict[str, pg.TableInfo]) -> None:
        """Tell the type map what the source catalog says about the tables' column types, and
        refuse, before anything runs, a column whose type walberg cannot map."""
        found = pg.describe_types(conn, {c.type_oid for i in infos.values() for c in i.columns})
        for t, info in infos.items():
            self.types.learn(found, self.targets[t], info.dims)
            for c in info.columns:
                self.types.spark_type(c, self.targets[t])

    def _prep(self, source: str, columns: tuple[Column, ...]) -> TextPrep:
        return self.types.prep(columns, self.targets[source])

    def _add_table(self, table: str) -> bool:
        """Take a table of the publication into the pipeline (follow_publication)."""
        if table in self.targets:
            return False
        self.tables.append(table)
        self.targets[table] = self.config.target_for(table)
        return True

    def _adopt(self, rel: Relation) -> None:
        """A table added to the publication while walberg runs: copy it inside a temporary
        slot's snapshot; its changes count from that snapshot's position on."""
        table = rel.qualified_name
        conn = pg.connect(self.pg.dsn)
        try:
            if table not in pg.published_tables(conn, self.pg.publication):
                return
            info = pg.describe_table(conn, table, self.pg.publications)
            pg.require_key(info)
            self._add_table(table)
            self._learn_types(conn, {table: info})
        finally:
            conn.close()
        log.info("%s joined publication %s: copying it", table, self.pg.publication)
        self._ensure_tables(table, info)
        self._initial_copy([info], None)

    def _wanted(self, rel: Relation, txn: Begin) -> bool:
        if rel.qualified_name not in self.targets and self.pg.follow_publication:
            self._adopt(rel)
        if rel.qualified_name in self.halted:
            return False
        committed = self.committed.get(rel.qualified_name)
        return committed is not None and txn.final_lsn >= committed


class _Chunk:
    """Change messages of one relation waiting to be decoded together."""

    def __init__(self, relation: Relation, builder: BatchBuilder, size: int) -> None:
        self.relation = relation
        self.builder = builder
        self.size = size
        self.payloads: list[bytes] = []
        self.seqs: list[int] = []
        self.lsns: list[int] = []

    def add(self, payload: bytes, seq: int, lsn: int) -> None:
        self.payloads.append(payload)
        self.seqs.append(seq)
        self.lsns.append(lsn)
        if len(self.payloads) >= self.size:
            self.flush()

    def flush(self) -> None:
        if not self.payloads:
            return
        rel = self.relation
        try:
            decoded = decode_changes(self.payloads, len(rel.columns))
        except Malformed:
            # The scalar decoder names the exact message, LSN and byte.
            scalar = Decoder()
            scalar.relations[rel.oid] = rel
            for payload, lsn in zip(self.payloads, self.lsns, strict=True):
                scalar.decode(payload, lsn)
            raise DecodeError(f"could not decode changes of {rel.qualified_name} near LSN "
                              f"{Lsn(self.lsns[0])}: the messages are malformed") from None
        crash_point("decode")
        _stage_changes(self.builder, rel, decoded, np.asarray(self.seqs, dtype=np.int64),
                       np.asarray(self.lsns, dtype=np.int64))
        self.payloads, self.seqs, self.lsns = [], [], []


class _Chunks:
    """One ``_Chunk`` per relation oid, re-made when a relation's description changes."""

    SIZE = 100_000

    def __init__(self, builder: BatchBuilder) -> None:
        self.builder = builder
        self._by_oid: dict[int, _Chunk] = {}

    def for_relation(self, rel: Relation) -> _Chunk:
        chunk = self._by_oid.get(rel.oid)
        if chunk is None or chunk.relation != rel:
            if chunk is not None:
                chunk.flush()  # decoded with the columns they were sent with
            chunk = self._by_oid[rel.oid] = _Chunk(rel, self.builder, self.SIZE)
        return chunk

    def relation_changed(self, rel: Relation) -> None:
        chunk = self._by_oid.get(rel.oid)
        if chunk is not None and chunk.relation != rel:
            chunk.flush()
            del self._by_oid[rel.oid]

    def flush_all(self) -> None:
        for chunk in self._by_oid.values():
            chunk.flush()


def _stage_changes(builder: BatchBuilder, rel: Relation, changes: Changes,
                   seq: npt.NDArray[np.int64], lsn: npt.NDArray[np.int64]) -> None:
    """Turn decoded changes into staged rows: inserts and updates from their new tuple,
    deletes from their old one, and an update that changed the key into a delete of the old key
    (one sequence number earlier) plus an insert of the new row."""
    tag = changes.tag
    is_delete = tag == _TAG_DELETE
    key_changed = np.zeros(len(tag), dtype=np.bool_)
    if changes.old is not None:
        is_update_with_old = (tag == _TAG_UPDATE) & changes.has_old
        if is_update_with_old.any():
            same = np.ones(len(tag), dtype=np.bool_)
            for i, col in enumerate(rel.columns):
                if col.is_key:
                    old_v, new_v = changes.old.values[i], changes.new.values[i]
                    eq = pc.fill_null(pc.equal(old_v, new_v), False)
                    both_null = pc.and_(pc.is_null(old_v), pc.is_null(new_v))
                    same &= pc.or_(eq, both_null).to_numpy(zero_copy_only=False)
            key_changed = is_update_with_old & ~same
    source, columns = rel.qualified_name, rel.columns
    new_rows = np.flatnonzero(~is_delete)
    if len(new_rows):
        ops = np.where((tag[new_rows] == _TAG_INSERT) | key_changed[new_rows], "I", "U")
        take = pa.array(new_rows)
        builder.add_columns(
            source, columns, ops, seq[new_rows], lsn[new_rows],
            [v.take(take) for v in changes.new.values],
            [None if u is None else u[new_rows] for u in changes.new.unchanged])
    old_rows = np.flatnonzero(is_delete | key_changed)
    if len(old_rows):
        assert changes.old is not None
        take = pa.array(old_rows)
        builder.add_columns(
            source, columns, np.full(len(old_rows), "D"),
            np.where(key_changed[old_rows], seq[old_rows] - 1, seq[old_rows]), lsn[old_rows],
            [v.take(take) for v in changes.old.values], [None] * len(columns))


_OP_NAMES = {"I": "insert", "U": "update", "D": "delete"}
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc).timestamp()


def _pg_epoch(micros: int) -> float:
    """Unix time of a Postgres timestamp sent as microseconds since 2000-01-01 UTC."""
    return _PG_EPOCH + micros / 1_000_000


__all__ = ["Pipeline", "Pipelines", "RunReport"]


class Pipelines:
    """A pipeline file with several ``sources``: one ``Pipeline`` per source (its own slot,
    publication and segment directory), one Spark session, run side by side. Tables of the same
    name fan in to one Iceberg table (``sink.fan_in``), each source's rows tagged with
    ``_walberg_source`` and recorded exactly once by its own ``walberg.lsn.<source>``."""

    def __init__(self, config: Config, session: Any = None,
                 names: Optional[list[str]] = None) -> None:
        """``names``: the sources to open (default: all of them)."""
        if not config.sources:
            raise ConfigError("this pipeline file has one source; use Pipeline")
        self.config = config
        names = names or list(config.sources)
        first = Pipeline(config.for_source(names[0]), session=session)
        shared = first.session()
        self.pipelines = {names[0]: first}
        for name in names[1:]:
            self.pipelines[name] = Pipeline(config.for_source(name), session=shared)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Pipelines":
        return cls(load_config(path))

    def run(self, once: bool = False) -> dict[str, RunReport]:
        """Run every source's pipeline; if one fails, the others are stopped and its error
        raised."""
        reports: dict[str, RunReport] = {}
        failures: list[BaseException] = []

        def run_one(name: str, pipeline: Pipeline) -> None:
            try:
                reports[name] = pipeline.run(once=once)
            except BaseException as exc:
                failures.append(exc)
                self.stop()

        threads = [threading.Thread(target=run_one, args=(n, p), name=f"walberg-{n}")
                   for n, p in self.pipelines.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        return reports

    def stop(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.stop()

    def close(self) -> None:
        # The first pipeline owns the Spark session (when it built it): closed last.
        for pipeline in reversed(list(self.pipelines.values())):
            pipeline.close()
