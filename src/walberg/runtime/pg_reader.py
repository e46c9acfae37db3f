"""The Postgres reader: start-up (the source checked, the slot created or waited for, the tables
made and copied where owed) and the replication stream written to segment files, reconnecting
when the connection is lost. It runs in the pipeline's main thread, beside the applier; with a
slot that exists, the stream starts in a thread of its own during start-up (``_start_early``)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from walberg import metrics
from walberg.buffer import spill
from walberg.buffer.files import write_freshness
from walberg.buffer.spill import TxnSpill
from walberg.buffer.store import SegmentStore
from walberg.config import Config
from walberg.errors import SourceError, Terminal, Transient, WalbergError
from walberg.faults import crash_point
from walberg.model import Lsn, pg_epoch
from walberg.runtime.initial_copy import InitialCopy
from walberg.runtime.parking import Parking
from walberg.runtime.pg_stager import FRAME_PGOUTPUT, FRAME_PREAMBLE
from walberg.runtime.state import RunState, SegmentMeta
from walberg.runtime.tables import PgTables
from walberg.source import postgres as pg
from walberg.source.framing import (
    CHANGE_TAGS,
    Committed,
    StreamedTransactions,
    begin_final_lsn,
    commit_end_lsn,
    commit_time,
    relation_oid,
)
from walberg.source.pgoutput import Tag
from walberg.source.stream import ReplicationStream

log = logging.getLogger("walberg")


@dataclass
class Relations:
    """The last Relation message of each relation, repeated at the start of every segment so
    that each segment file can be decoded on its own."""

    raw: dict[int, bytes] = field(default_factory=dict)

    def keep(self, frame: bytes) -> None:
        """A Relation message: its relation's last description from now on."""
        self.raw[relation_oid(frame)] = frame

    def preamble(self) -> list[tuple[int, int, bytes]]:
        return [(0, FRAME_PREAMBLE, raw) for raw in self.raw.values()]


@dataclass
class _Cursor:
    """Where the reader is in the stream."""

    skip_before: Lsn  # transactions committing before this are in the segments already
    received: Lsn  # end of the last transaction written to a segment
    in_txn: bool = False
    skipping: bool = False  # inside a transaction the segments hold already


class PgReader:
    """Reads a Postgres source into segment files."""

    def __init__(self, config: Config, store: SegmentStore, state: RunState, tables: PgTables,
                 copier: InitialCopy, relations: Relations, recopy: set[str],
                 slot_wait_seconds: float,
                 streaming_early: Callable[[bool], None] = lambda once: None,
                 parking: Optional[Parking] = None) -> None:
        """``streaming_early``: called when the stream starts before the lake is read (the
        applier's side may stage what it writes meanwhile), with whether the run reads to a
        target (--once). ``parking``: the tables parked by earlier runs, read with the lake."""
        self.parking = parking
        self._refused: dict[str, str] = {}  # refused at the start (no key, a type not mapped)
        self.config = config
        self.pg = config.postgres
        self.store = store
        self.state = state
        self.tables = tables
        self.copier = copier
        self.relations = relations
        self.recopy = recopy  # tables `resync` copies again
        self.slot_wait_seconds = slot_wait_seconds
        self.reached_source = False  # the source answered once: later failures are retried
        self._active_commit: Optional[Lsn] = None  # end of the last transaction in the active seg
        self._streamed_since_start = False
        self._gauge_conn: Any = None
        # (end LSN, commit time) of received transactions not yet in the lake: the first
        # commit of each tenth of a second, so a backlog of many keeps this short.
        self._unapplied: deque[tuple[int, int]] = deque()
        self._told_freshness = 0.0
        self._source = config.source_name or "postgres"  # the gauges' label
        # Streaming that starts while the lake is still being checked (see _start_early).
        self._early: Optional[threading.Thread] = None
        self._early_error: Optional[BaseException] = None
        self._lake_ready = threading.Event()  # the lake is read: the slot may follow WAL's end
        self._halt_early = threading.Event()
        self._streaming_early = streaming_early
        # The source server as first met (system identifier, timeline): a reconnect that
        # finds another system, or a promoted standby, is checked against it.
        self._server: Optional[tuple[str, int]] = None

    def close(self) -> None:
        self._stop_early()  # (a run that failed before ``stream``)
        if self._gauge_conn is not None:
            self._gauge_conn.close()
            self._gauge_conn = None

    # ---- start-up ----------------------------------------------------------------------------

    def start_with_retries(self, once: bool
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
                if not self.reached_source:
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
                if self.state.stop.wait(delay):
                    return None
                delay = min(delay * 2, 30.0)

    def _describe(self, conn: Any) -> dict[str, pg.TableInfo]:
        """The configured tables (and, with follow_publication, the publication's), checked."""
        # The tables as the publication publishes them (its column lists and row filters),
        # read before ensure_publication so that a missing table is named as missing. A
        # publication walberg creates below publishes every row and column, which is what a
        # table no publication has yet is described with.
        infos = {t: pg.describe_table(conn, t, self.pg.publications) for t in self.tables.tables}
        self._refused = {}
        for t, info in infos.items():
            try:
                pg.require_key(info)
            except SourceError as exc:
                if self.parking is None:
                    raise
                self._refused[t] = str(exc)  # (parked if the lake holds it: see _park_refused)
        pg.ensure_publication(conn, self.pg.publication, self.tables.tables)
        if self.pg.follow_publication:
            for t in pg.published_tables(conn, self.pg.publication):
                if self.tables.add(t):
                    infos[t] = pg.describe_table(conn, t, self.pg.publications)
                    pg.require_key(infos[t])
        self.tables.learn_types(conn, infos, None if self.parking is None else self._refused)
        return infos

    def _start(self, once: bool) -> tuple[ReplicationStream, Optional[Lsn]]:
        """Check the source, open the stream (creating the slot if missing), make the Iceberg
        tables and copy the tables owed a copy; returns the open stream and, with ``once``, the
        WAL position to stop at."""
        opened: list[ReplicationStream] = []
        conn = pg.connect(self.pg.dsn)
        self.reached_source = True
        try:
            pg.check_wal_level(conn)
            infos = self._describe(conn)
            slot = pg.slot_state(conn, self.pg.slot)
            if slot is not None and slot.active_pid is not None:
                slot = self._wait_for_free_slot(conn, slot)
            stream = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication,
                                       self.pg.status_interval_seconds)
            opened.append(stream)
            stream.open()
            server = stream.identify()
            if slot is None:
                # Before a new slot is made: a lake written from another server, or before a
                # failover that lost the slot, is not silently copied again.
                self._same_server_as_lake(server, slot_exists=False)
            failover = self._failover_wanted(conn)
            created = stream.create_slot(failover=failover) if slot is None else None
            if created:
                log.info("created replication slot %s at %s%s", created.name,
                         created.consistent_point, " (a failover slot)" if failover else "")
            elif failover and slot is not None and slot.failover is False:
                stream.make_failover()
                log.info("replication slot %s is a failover slot now: standbys with "
                         "sync_replication_slots = on keep it in step", self.pg.slot)
            target = pg.current_wal_lsn(conn) if once else None
            if created is None:
                self._start_early(stream, target)
                crash_point("lake-check", delay=1.0)  # while Spark starts and the stream runs
            sink = self.tables.sink
            for t, info in infos.items():
                self.tables.ensure(t, info)
                lsn = sink.committed_lsn(self.tables.targets[t])
                if lsn is not None:
                    self.state.set_committed(t, lsn)
            if slot is not None:
                self._same_server_as_lake(server, slot_exists=True)
            if self.parking is not None:
                self.parking.load(self.tables.tables)
                self._park_refused()
            # Copies owed are said in the lake before they start (``owe_copy``): a run that
            # stops before one lands leaves the table's old mark, and the next run must not
            # take it for a table that holds what the slot does not stream again.
            if created is not None:
                # A new slot streams only what commits after its consistent point; a table whose
                # lake copy is older than that would miss changes, so it is copied again.
                for t, lsn in self.state.committed().items():
                    if lsn < created.consistent_point:
                        log.warning("%s holds data up to LSN %s but the replication slot is new "
                                    "(starts at %s): copying it again", t, lsn,
                                    created.consistent_point)
                        sink.owe_copy(self.tables.targets[t], created.consistent_point)
                        self.state.forget_committed(t)
            if self.recopy:
                now = pg.current_wal_lsn(conn)
                for t in self.recopy:
                    if self.state.committed_at(t) is not None:
                        sink.owe_copy(self.tables.targets[t], now)
                    self.state.forget_committed(t)
            for t, lsn in self.state.committed().items():
                since = sink.copy_owed(self.tables.targets[t])
                if since is not None and lsn < since:
                    log.warning("%s was to be copied again (from LSN %s at least: a new "
                                "replication slot, or walberg resync) and that copy did not "
                                "land: copying it now", t, since)
                    self.state.forget_committed(t)
            committed = self.state.committed()
            owed = [t for t in self.tables.tables if t not in committed]
            for t in owed:
                if self.parking is not None and self.state.is_halted(t):
                    self.parking.lift(t, "it is copied again now")
            for t in committed:
                self.copier.catchup_after_resume(t)
            if owed:
                self.copier.copy([infos[t] for t in owed], created,
                                 None if slot is None else slot.confirmed_flush)
            return stream, target
        except BaseException:
            self._stop_early()
            for each in opened:
                each.close()
            raise
        finally:
            try:
                conn.close()
            except Exception:
                pass

    def _park_refused(self) -> None:
        """A table that lost its key after the lake took it (REPLICA IDENTITY NOTHING, its
        primary key dropped) or gained a column of a type walberg cannot map is parked; one the
        lake does not hold yet is refused."""
        assert self.parking is not None
        for t, why in self._refused.items():
            if self.state.committed_at(t) is None:
                raise SourceError(why)
            self.parking.park(t, f"{why} (Once that is done, `walberg resync -c <pipeline "
                                 f"file> {t}` copies it afresh.)")
        self.parking.record()

    def _failover_wanted(self, conn: Any) -> bool:
        """Whether the slot is to be a failover slot: as configured, else wherever the server
        has them (PostgreSQL 17+). Asked of an older server, it is reported, not required."""
        supported = pg.supports_failover_slots(conn)
        if self.pg.failover_slot and not supported:
            log.warning("source.postgres.failover_slot is set, but PostgreSQL %s has no "
                        "failover slots (they exist from 17 on): the slot is an ordinary one, "
                        "and a promoted standby will not have it",
                        pg.server_version(conn) // 10000)
        return supported and self.pg.failover_slot is not False

    def _same_server(self, stream: ReplicationStream, slot_exists: bool) -> None:
        """After a reconnect: the server ``stream`` reached, judged against the one this run
        met first (see ``_judge``), with what the run holds (segments and lake) at stake."""
        system, timeline = stream.identify()
        if self._server is not None:
            self._judge(self._server, (system, timeline), slot_exists, self._held(),
                        "what walberg read before")
        self._met(system, timeline)

    def _held(self) -> Lsn:
        """The furthest position this run holds changes up to: read, applied or committed."""
        return max([self.state.received, self.state.applied, *self.state.committed().values()])

    def _same_server_as_lake(self, server: tuple[str, int], slot_exists: bool) -> None:
        """At start: the server (system identifier, timeline) judged against the one each
        table's last commit recorded (``walberg.server``), with the table's LSN at stake: a
        failover while walberg was down is caught as one while it runs."""
        system, timeline = server
        sink = self.tables.sink
        for t in self.tables.tables:
            if t in self.recopy:
                continue  # copied again (walberg resync): what it held does not matter
            target = self.tables.targets[t]
            recorded = sink.committed_server(target)
            if recorded is None:
                continue
            known_system, _, known_timeline = recorded.partition("/")
            held = self.state.committed_at(t) or sink.committed_lsn(target) or Lsn(0)
            self._judge((known_system, int(known_timeline or 0)), (system, timeline),
                        slot_exists, held, f"the lake's {target}")
        self._met(system, timeline)

    def _met(self, system: str, timeline: int) -> None:
        self._server = (system, timeline)
        self.tables.sink.record_server(f"{system}/{timeline}")

    def _judge(self, known: tuple[str, int], now: tuple[str, int], slot_exists: bool,
               held: Lsn, holder: str) -> None:
        """Whether walberg may stream from the server it reached (``now``: system identifier,
        timeline) on from what it knew (``known``), ``holder`` holding changes up to ``held``.
        Another system (a different cluster behind the same address) has no position in
        common with the lake: stop. The same system on a later timeline is a promoted standby
        (a failover): it may go on only if it has the slot and nothing held was written by
        the old primary after the standby branched off, since LSNs from there on are the new
        primary's own. An earlier timeline is a server the lake has moved past (an old
        primary back): stop."""
        (known_system, known_timeline), (system, timeline) = known, now
        if system != known_system:
            raise Terminal(
                f"source.postgres.dsn now reaches another PostgreSQL server (system identifier "
                f"{system}; {holder} came from {known_system}): its WAL positions have nothing "
                "in common with the lake's, so walberg stops rather than skip or repeat "
                "changes. If this server is the source from now on, run `walberg resync -c "
                "<pipeline.yaml>` to copy the tables from it.")
        if timeline == known_timeline:
            return
        if timeline < known_timeline:
            raise Terminal(
                f"source.postgres.dsn reaches a server on timeline {timeline}, but {holder} "
                f"came from timeline {known_timeline} of the same system: this is a server the "
                "source failed over from (an old primary back online). Point the DSN at the "
                "current primary; if this server is the source from now on, run `walberg "
                "resync -c <pipeline.yaml>`.")
        if not slot_exists:
            raise Terminal(
                f"the source failed over (timeline {known_timeline} -> {timeline}) to a server "
                f"without replication slot {self.pg.slot}: the slot was not synchronised to "
                "the standby, so the changes since the lake's last commit cannot be read there. "
                "Run `walberg resync -c <pipeline.yaml>` to copy the tables again; to survive "
                "the next failover, see docs/operations.md#failover (failover slots, "
                "sync_replication_slots on the standby, synchronized_standby_slots on the "
                "primary).")
        # (a connection of its own: ``stream`` may be streaming already)
        probe = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication)
        probe.open()
        try:
            switch = probe.timeline_switch(known_timeline)
        finally:
            probe.close()
        if switch is not None and held > switch:
            raise Terminal(
                f"the source failed over (timeline {known_timeline} -> {timeline}); the new "
                f"primary branched off at {switch}, but {holder} holds changes of the old "
                f"primary up to {held}: the transactions in between were lost with the old "
                "primary and must not stay in the lake. Run `walberg resync -c "
                "<pipeline.yaml>`; set synchronized_standby_slots on the primary so that "
                "walberg never reads past what the standby has (docs/operations.md#failover).")
        log.warning("the source failed over (timeline %s -> %s); replication slot %s was "
                    "synchronised to the new primary: streaming on from it", known_timeline,
                    timeline, self.pg.slot)

    def _start_early(self, stream: ReplicationStream, target: Optional[Lsn]) -> None:
        """Start streaming into segments now, in a thread, while the lake is checked (the Spark
        session, the tables, their marks, copies owed): a backlog is read while Spark starts
        instead of after. Only with a slot that exists already: a new slot's snapshot must
        serve the copy before the stream starts, and an existing slot's copies use temporary
        slots of their own. Nothing is applied or confirmed to the slot before the lake has
        been read (the applied position stays at zero until then), and an idle slot does not
        follow the server's WAL end before ``stream`` says the lake is ready; the segments
        decide what is applied, as always."""
        self._resume_after_segments()
        self._lake_ready.clear()
        self._halt_early.clear()
        self.state.read_to_target.clear()
        self._early_error = None

        def run() -> None:
            try:
                self.stream_with_reconnect(stream, target)
            except BaseException as exc:  # raised in the main thread by ``stream``
                self._early_error = exc
                self.state.wake.set()
            finally:
                self.state.reading_early.clear()

        self._early = threading.Thread(target=run, name="walberg-read", daemon=True)
        self.state.reading_early.set()
        self._early.start()
        self._streaming_early(target is not None)

    def _resume_after_segments(self) -> None:
        """Before the stream starts: what the sealed segments hold (or the lake, through the
        applied position) is not written to segments again. Forward only: an early stream
        halted by a failed start may have got further."""
        self.state.set_received(max(self.state.received, self.state.last_received()))

    def _stop_early(self) -> None:
        """The start failed: stop the early streaming before its stream is closed."""
        early, self._early = self._early, None
        if early is not None:
            self._halt_early.set()
            early.join()

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds``; True if the run stopped (or the early streaming was halted)."""
        end = time.monotonic() + seconds
        while not self._halt_early.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            if self.state.stop.wait(min(left, 0.2)):
                return True
        return True

    def stream(self, stream: ReplicationStream, target: Optional[Lsn]) -> None:
        """Stream until stopped (or, with a target, done): in this thread, or by letting the
        streaming that started early go on from here (the lake is ready now)."""
        early, self._early = self._early, None
        if early is None:
            self._resume_after_segments()
            self._lake_ready.set()
            self.stream_with_reconnect(stream, target)
            return
        self._lake_ready.set()
        while early.is_alive():
            early.join(0.5)  # in steps, so that the main thread still takes signals
        if self._early_error is not None:
            raise self._early_error

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

    # ---- streaming ---------------------------------------------------------------------------

    def stream_with_reconnect(self, stream: ReplicationStream, target: Optional[Lsn]) -> None:
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
                        self._same_server(stream, self._slot_exists())
                    self._stream_loop(stream, target)
                    if self._halt_early.is_set():
                        return
                    if self.state.error is None:
                        # Report the final position while the connection is still open.
                        stream.confirm(self.state.confirmable())
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
                    if self._pause(delay):
                        return
                    delay = min(delay * 2, 30.0)
                    stream = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication,
                                               self.pg.status_interval_seconds)
        finally:
            stream.close()

    def _slot_exists(self) -> bool:
        conn = pg.connect(self.pg.dsn)
        try:
            return pg.slot_state(conn, self.pg.slot) is not None
        finally:
            conn.close()

    def _slot_gone(self) -> Optional[Terminal]:
        """After a lost connection: a slot the server invalidated or someone dropped will not
        come back by reconnecting, so say so instead of retrying."""
        try:
            conn = pg.connect(self.pg.dsn)
        except WalbergError:
            return None  # the server is unreachable: reconnecting is the right thing
        try:
            if pg.slot_state(conn, self.pg.slot) is None:
                moved = self._moved_without_slot()
                if moved is not None:
                    return moved
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

    def _moved_without_slot(self) -> Optional[Terminal]:
        """A missing slot on a server other than the one this run met (a standby promoted
        without it, another system): ``_judge``'s word for it, which says so and what to do.
        Asked before the slot is said to be dropped: the DSN may already reach the new primary
        when the lost connection is looked into."""
        if self._server is None:
            return None
        probe = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication)
        try:
            probe.open()
            now = probe.identify()
        except WalbergError:
            return None
        finally:
            probe.close()
        if now == self._server:
            return None
        try:
            self._judge(self._server, now, False, self._held(), "what walberg read before")
        except Terminal as exc:
            return exc
        return None

    def _await_slot_confirmation(self, timeout: float = 10.0) -> None:
        """The server takes our last status update asynchronously; wait (briefly) until the slot
        shows it, so that a finished run leaves the slot exactly where the lake is."""
        conn = pg.connect(self.pg.dsn)
        try:
            deadline = time.monotonic() + timeout
            while True:
                state = pg.slot_state(conn, self.pg.slot)
                if state is None or state.confirmed_flush >= self.state.confirmable():
                    return
                if time.monotonic() > deadline:
                    log.warning("slot %s still confirms %s, not %s; the next run resumes from "
                                "there and skips what the lake already holds", self.pg.slot,
                                state.confirmed_flush, self.state.confirmable())
                    return
                time.sleep(0.05)
        finally:
            conn.close()

    def _stream_loop(self, stream: ReplicationStream, target: Optional[Lsn]) -> None:
        store, state = self.store, self.state
        self._streamed_since_start = False
        # Transactions already in segments are not written twice.
        at = _Cursor(skip_before=state.received, received=state.received)
        stream.confirm(state.confirmable())
        in_progress = self.pg.stream_in_progress and stream.server_version() >= 140000
        stream.start(state.confirmable(), in_progress=in_progress)
        spill_dir = self.config.segment_dir / "spill"
        spill.clear(spill_dir)  # an unfinished streamed transaction is streamed again
        streamed = StreamedTransactions(lambda xid: TxnSpill(spill_dir, xid), at.skip_before)
        interval = self.config.buffer.max_interval_seconds
        backlog_limit = 4 * self.config.buffer.max_batch_bytes
        last_ask = last_gauges = 0.0
        while not state.stop.is_set() and not self._halt_early.is_set():
            if state.error is not None:
                return
            if state.release_source.is_set():
                state.release_source.clear()
                raise Transient("another connection to the source could not be made (the server "
                                "may be shutting down): closing the replication connection, so "
                                "that it does not hold the server's shutdown up")
            ready = self._lake_ready.is_set()
            if not at.in_txn and store.pending_bytes() > backlog_limit:
                # Spark is behind: stop reading for a moment (status updates keep flowing).
                # Only between transactions, with what was read sealed: a batch ends at a
                # commit, so a reader paused inside a transaction larger than this (sent whole,
                # not streamed in progress), or with the commit that ends one in the active
                # segment, would wait for a batch that cannot come.
                if store.active_bytes():
                    self.seal(clean=True)
                stream.confirm(state.confirmable())
                stream.keepalive()
                self._await_progress()
                continue
            # --once: what committed after the target is left for the next run, so a source
            # that never stops writing cannot keep this run from ending.
            reached = target is not None and not at.in_txn and at.received >= target
            if reached:
                stream.keepalive()
                self._await_progress()
            # (--once: a short wait when idle, so that the run ends soon after the lake is read)
            wait = 0.05 if target is not None else 0.2
            for wal_start, payload in () if reached else stream.messages(timeout=wait):
                if payload[0] in CHANGE_TAGS and streamed.chunk_xid is None and not at.skipping:
                    # The common case, without a call of its own (per change, it counts): a
                    # change of the transaction being written.
                    store.append(wal_start, FRAME_PGOUTPUT, payload)
                    crash_point("segment-write")
                    if store.should_seal():
                        self.seal(clean=False)
                elif self._message(payload, wal_start, streamed, at, target):
                    break

            caught_up = target is not None and not at.in_txn and (
                at.received >= target or stream.wal_end >= target)
            if store.active_bytes() and (caught_up or store.active_age_seconds() >= interval):
                self.seal(clean=not at.in_txn)
            if caught_up and not store.active_bytes():
                # (an early batch need not wait for more; a transaction still open, streamed
                # in progress, is not one that committed before the target)
                state.read_to_target.set()
            idle = not at.in_txn and not streamed.pending and store.pending_bytes() == 0
            # (past the target, messages may wait unread: the server's WAL end says nothing then)
            reached = target is not None and not at.in_txn and at.received >= target
            if ready and idle and not reached and stream.wal_end > state.applied:
                # Nothing of ours is pending: positions up to the server's WAL end hold no
                # change for our tables, so the slot may move on (keeps retained WAL bounded).
                state.advance_applied(stream.wal_end)
            stream.confirm(state.confirmable(), written=at.received)
            self._note_pending()
            if time.monotonic() - last_gauges >= self.pg.status_interval_seconds:
                self._update_slot_gauges()
                last_gauges = time.monotonic()
            if target is not None and idle and state.applied >= target:
                stream.keepalive(force=True)
                return
            if (caught_up and streamed.pending and not store.active_bytes()
                    and store.pending_bytes() == 0 and state.applied >= at.received):
                # --once, with a transaction still open (or prepared, undecided) that the server
                # streamed in progress: everything committed before the target is in the lake,
                # and that transaction is not. The slot is confirmed up to what the lake holds,
                # a commit position: the open transaction commits after it, so the server
                # decodes it again, whole, for the next run (its spilled part is dropped).
                log.info("--once: done; a transaction still open on the server (streamed in "
                         "progress) is left for a later run")
                stream.keepalive(force=True)
                return
            if idle and time.monotonic() - last_ask >= (0.2 if target is not None else 1.0):
                # Ask for a keepalive: its WAL end tells how far the server has looked.
                stream.keepalive(force=True, reply=True)
                last_ask = time.monotonic()

    def _message(self, payload: bytes, wal_start: int, streamed: StreamedTransactions,
                 at: "_Cursor", target: Optional[Lsn]) -> bool:
        """One message from the server into the segments; True once the ``--once`` target's
        transaction is written (read no further)."""
        store = self.store
        tag = payload[0]
        if streamed.takes(tag):
            done = streamed.message(tag, payload, wal_start)
            if done is not None and done.held:
                # Already in the segments: pgoutput counts its descriptions as sent, so the
                # next segments start with them.
                for _, frame in done.frames:
                    if frame[0] == Tag.RELATION:
                        self.relations.keep(frame)
            elif done is not None:
                at.received = self._write_streamed(done)
            return False
        if tag == Tag.RELATION:
            self.relations.keep(bytes(payload))
        elif tag == Tag.BEGIN:
            at.in_txn = True
            at.skipping = begin_final_lsn(payload) < at.skip_before
        if at.skipping:
            if tag == Tag.COMMIT:
                at.skipping = at.in_txn = False
            return False
        if tag == Tag.COMMIT:
            end = commit_end_lsn(payload)
            store.append(end, FRAME_PGOUTPUT, payload)
            at.in_txn = False
            self._active_commit = at.received = end
            self.state.set_received(end)
            self._received_commit(end, payload)
            self._streamed_since_start = True
            if store.should_seal():
                self.seal(clean=True)
            return target is not None and end >= target
        store.append(wal_start, FRAME_PGOUTPUT, payload)
        crash_point("segment-write")
        if store.should_seal():
            self.seal(clean=False)
        return False

    def _write_streamed(self, done: Committed) -> Lsn:
        """A streamed transaction that committed, written to the segments as an ordinary one;
        returns its end."""
        store = self.store
        for lsn, frame in done.frames:
            tag = frame[0]
            if tag == Tag.RELATION:
                self.relations.keep(frame)
            store.append(lsn, FRAME_PGOUTPUT, frame)
            if tag == Tag.COMMIT:
                self._active_commit = done.end
                self.state.set_received(done.end)
                self._received_commit(done.end, frame)
                self._streamed_since_start = True
                if store.should_seal():
                    self.seal(clean=True)
            elif tag != Tag.BEGIN and store.should_seal():
                self.seal(clean=False)
        return done.end

    def _await_progress(self) -> None:
        """Wait (at most 0.2 s) for the applier to finish a batch. Waiting on an event of its
        own, not on ``wake`` (which stays set while the applier is busy): the reader must not
        spin, taking a core and the GIL from the staging and Spark."""
        self.state.progress.wait(0.2)
        self.state.progress.clear()

    def _note_pending(self) -> None:
        """The gauges of what waits for the lake: segment bytes, and the age of the oldest
        transaction received but not applied (its source commit time to now)."""
        metrics.PENDING_BYTES.labels(self._source).set(self.store.pending_bytes())
        applied, waiting = int(self.state.applied), self._unapplied
        while waiting and waiting[0][0] <= applied:
            waiting.popleft()
        oldest = pg_epoch(waiting[0][1]) if waiting else None
        metrics.LAG_SECONDS.labels(self._source).set(
            max(time.time() - oldest, 0.0) if oldest is not None else 0.0)
        if time.monotonic() - self._told_freshness >= 1.0:
            # For `walberg status` (a process of its own): what the gauge says, in a file.
            self._told_freshness = time.monotonic()
            write_freshness(self.config.segment_dir, oldest)

    def _received_commit(self, end: Lsn, payload: bytes) -> None:
        """A transaction is in the segments: remember when it committed (see _unapplied)."""
        ts = commit_time(payload)
        if not self._unapplied or ts - self._unapplied[-1][1] >= 100_000:
            self._unapplied.append((int(end), ts))

    def _update_slot_gauges(self) -> None:
        """Lag and retained WAL as the server sees them; a failed look is tried next time."""
        try:
            if self._gauge_conn is None or self._gauge_conn.closed:
                self._gauge_conn = pg.connect(self.pg.dsn)
            slot = pg.slot_state(self._gauge_conn, self.pg.slot)
            now = pg.current_wal_lsn(self._gauge_conn)
        except Exception as exc:  # metrics must never stop the stream
            log.debug("slot metrics not updated: %s", exc)
            self._gauge_conn = None
            return
        if slot is not None:
            metrics.LAG_BYTES.labels(self._source).set(max(int(now) - int(slot.confirmed_flush), 0))
            metrics.RETAINED_WAL_BYTES.labels(self._source).set(
                max(int(now) - int(slot.restart_lsn), 0))

    def seal(self, clean: bool) -> None:
        info = self.store.seal()
        if info is not None:
            crash_point("seal")
            metrics.SEGMENTS_SEALED.inc()
            self.state.sealed(info.seq, SegmentMeta(self._active_commit, clean))
            self._active_commit = None
            self.state.wake.set()
