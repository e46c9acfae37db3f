"""The Postgres reader: start-up (the source checked, the slot created or waited for, the tables
made and copied where owed), then the replication stream, which ``runtime.pg_stream`` writes to
segment files. It runs in the pipeline's main thread, beside the applier; with a slot that
exists, the stream starts in a thread of its own during start-up (``PgStream.start_early``)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from walberg.apply.session import jvm_map
from walberg.buffer.store import SegmentStore
from walberg.config import Config
from walberg.errors import SourceError, Terminal, Transient
from walberg.faults import crash_point
from walberg.model import Lsn
from walberg.runtime.initial_copy import InitialCopy
from walberg.runtime.parking import Parking
from walberg.runtime.pg_server import ServerCheck
from walberg.runtime.pg_stream import PgStream, Relations
from walberg.runtime.state import RunState
from walberg.runtime.tables import PgTables
from walberg.source import postgres as pg
from walberg.source import slots
from walberg.source.stream import CreatedSlot, ReplicationStream

log = logging.getLogger("walberg")


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
        self.state = state
        self.tables = tables
        self.copier = copier
        self.recopy = recopy  # tables `resync` copies again
        self.slot_wait_seconds = slot_wait_seconds
        self.reached_source = False  # the source answered once: later failures are retried
        self.server = ServerCheck(self.pg, state, tables, recopy)
        self.streamer = PgStream(config, store, state, relations, self.server, streaming_early)

    def close(self) -> None:
        self.streamer.close()

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
        infos = pg.describe_tables(conn, list(self.tables.tables), self.pg.publications)
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
            slot = slots.slot_state(conn, self.pg.slot)
            if slot is not None and slot.active_pid is not None:
                slot = self._wait_for_free_slot(conn, slot)
            stream = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication,
                                       self.pg.status_interval_seconds)
            opened.append(stream)
            stream.open()
            server = stream.identify()
            self.server.first_met(server)
            created = self._make_slot(conn, stream, slot, server)
            target = pg.current_wal_lsn(conn) if once else None
            if created is None:
                self.streamer.start_early(stream, target)
                crash_point("lake-check", delay=1.0)  # while Spark starts and the stream runs
            sink = self.tables.sink

            servers: dict[str, Optional[str]] = {}  # (for the failover check below)

            def ensure(t: str) -> None:
                began = time.monotonic()
                self.tables.ensure(t, infos[t])
                # (the table's marks as ensure just read it, if it did: one load a table)
                lsn, servers[t] = sink.committed_marks(self.tables.targets[t], read_since=began)
                if lsn is not None:
                    self.state.set_committed(t, lsn)

            # Side by side: each table is a few JVM round trips and catalog reads of its own,
            # which overlap (hundreds of tables start in a fraction of the time).
            jvm_map(ensure, list(infos))
            if slot is not None:
                self.server.same_server_as_lake(server, slot_exists=True, recorded=servers)
            if self.parking is not None:
                self.parking.load(self.tables.tables)
                self._park_refused()
            self._owe_copies(conn, created)
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
            self.streamer.stop_early()
            for each in opened:
                each.close()
            raise
        finally:
            try:
                conn.close()
            except Exception:
                pass

    def _make_slot(self, conn: Any, stream: ReplicationStream, slot: Optional[slots.SlotState],
                   server: tuple[str, int]) -> Optional[CreatedSlot]:
        """The slot made where missing (a failover slot where wanted), or an existing one made a
        failover slot; returns the slot made, if any."""
        if slot is None:
            # Before a new slot is made: a lake written from another server, or before a
            # failover that lost the slot, is not silently copied again.
            self.server.same_server_as_lake(server, slot_exists=False)
        failover = self._failover_wanted(conn)
        created = stream.create_slot(failover=failover) if slot is None else None
        if created:
            log.info("created replication slot %s at %s%s", created.name,
                     created.consistent_point, " (a failover slot)" if failover else "")
        elif failover and slot is not None and slot.failover is False:
            stream.make_failover()
            log.info("replication slot %s is a failover slot now: standbys with "
                     "sync_replication_slots = on keep it in step", self.pg.slot)
        return created

    def _owe_copies(self, conn: Any, created: Optional[CreatedSlot]) -> None:
        """The tables to copy again (a new slot, `walberg resync`, a copy owed that did not land)
        lose their mark in the run state.

        Copies owed are said in the lake before they start (``owe_copy``): a run that stops
        before one lands leaves the table's old mark, and the next run must not take it for a
        table that holds what the slot does not stream again."""
        sink = self.tables.sink
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
        supported = slots.supports_failover_slots(conn)
        if self.pg.failover_slot and not supported:
            log.warning("source.postgres.failover_slot is set, but PostgreSQL %s has no "
                        "failover slots (they exist from 17 on): the slot is an ordinary one, "
                        "and a promoted standby will not have it",
                        pg.server_version(conn) // 10000)
        return supported and self.pg.failover_slot is not False

    def _wait_for_free_slot(self, conn: Any, slot: slots.SlotState) -> Optional[slots.SlotState]:
        """Another process streams from our slot. A walberg that just died leaves its server
        process behind for a moment, so wait a little; then refuse, naming the other side."""
        deadline = time.monotonic() + self.slot_wait_seconds
        state: Optional[slots.SlotState] = slot
        while state is not None and state.active_pid is not None:
            if time.monotonic() > deadline:
                who = slots.describe_backend(conn, state.active_pid)
                raise Terminal(
                    f"replication slot {self.pg.slot} is in use by another process: {who}. "
                    "Another walberg may be running this pipeline already; stop it first, or "
                    "give this pipeline its own slot (source.postgres.slot). If that process "
                    "died, the server frees the slot within wal_sender_timeout; run again then."
                )
            time.sleep(0.2)
            state = slots.slot_state(conn, self.pg.slot)
        return state

    def stream(self, stream: ReplicationStream, target: Optional[Lsn]) -> None:
        """Stream until stopped (or, with a target, done): see ``PgStream.stream``."""
        self.streamer.stream(stream, target)
