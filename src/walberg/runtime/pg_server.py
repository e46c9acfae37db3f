"""Which PostgreSQL server the Postgres reader streams from: the one this run met first and the
one each table's last lake commit recorded (system identifier, timeline), and whether a server
reached at start or after a reconnect may be streamed from (a promoted standby with the slot may;
another system, an old primary back, or a standby without the slot may not)."""

from __future__ import annotations

import logging
import threading
from typing import Mapping, Optional

from walberg.apply.session import jvm_map
from walberg.config import PostgresSource
from walberg.errors import Terminal, WalbergError
from walberg.model import Lsn
from walberg.runtime.state import RunState
from walberg.runtime.tables import PgTables
from walberg.source.stream import ReplicationStream

log = logging.getLogger("walberg")


class ServerCheck:
    """The server a Postgres reader streams from, checked against what the run and the lake hold."""

    def __init__(self, pg: PostgresSource, state: RunState, tables: PgTables,
                 recopy: set[str]) -> None:
        self.pg = pg
        self.state = state
        self.tables = tables
        self.recopy = recopy  # tables `resync` copies again
        # The source server as last met (system identifier, timeline): a reconnect that
        # finds another system, or a promoted standby, is checked against it. Set by the
        # start's thread and by the stream's (which reconnects while the start reads the lake).
        self._server: Optional[tuple[str, int]] = None
        self._lock = threading.Lock()

    def first_met(self, server: tuple[str, int]) -> None:
        """At start, as soon as the stream's first connection names its server: a reconnect
        while the lake is still being read (and judged against it) is judged against this."""
        with self._lock:
            if self._server is None:
                self._server = server

    def same_server(self, stream: ReplicationStream, slot_exists: bool) -> None:
        """After a reconnect: the server ``stream`` reached, judged against the one this run
        met before (see ``_judge``), with what the run holds (segments and lake) at stake."""
        system, timeline = stream.identify()
        with self._lock:
            known = self._server
        if known is not None:
            self._judge(known, (system, timeline), slot_exists, self._held(),
                        "what walberg read before")
        self._met(system, timeline)

    def _held(self) -> Lsn:
        """The furthest position this run holds changes up to: read, applied or committed."""
        return max([self.state.received, self.state.applied, *self.state.committed().values()])

    def same_server_as_lake(self, server: tuple[str, int], slot_exists: bool,
                            recorded: Optional[Mapping[str, Optional[str]]] = None) -> None:
        """At start: the server (system identifier, timeline) judged against the one each
        table's last commit recorded (``walberg.server``; ``recorded``: as the start just read
        it, per table), with the table's LSN at stake: a failover while walberg was down is
        caught as one while it runs."""
        system, timeline = server
        sink = self.tables.sink
        # (tables copied again by walberg resync: what they held does not matter)
        tables = [t for t in self.tables.tables if t not in self.recopy]
        known = recorded or {}
        unread = [t for t in tables if t not in known]
        # Each is a read of the table's history: side by side for hundreds of tables.
        read = dict(zip(unread, jvm_map(
            lambda t: sink.committed_server(self.tables.targets[t]), unread), strict=True))
        servers = [known[t] if t in known else read[t] for t in tables]
        for t, named in zip(tables, servers, strict=True):
            target = self.tables.targets[t]
            if named is None:
                continue
            known_system, _, known_timeline = named.partition("/")
            held = self.state.committed_at(t) or sink.committed_lsn(target) or Lsn(0)
            self._judge((known_system, int(known_timeline or 0)), (system, timeline),
                        slot_exists, held, f"the lake's {target}")
        with self._lock:  # (a reconnect since the start met a server judged already: newer)
            system, timeline = self._server or server
        self._met(system, timeline)

    def moved_without_slot(self) -> Optional[Terminal]:
        """A missing slot on a server other than the one this run met (a standby promoted
        without it, another system): ``_judge``'s word for it, which says so and what to do.
        Asked before the slot is said to be dropped: the DSN may already reach the new primary
        when the lost connection is looked into."""
        with self._lock:
            known = self._server
        if known is None:
            return None
        probe = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication)
        try:
            probe.open()
            now = probe.identify()
        except WalbergError:
            return None
        finally:
            probe.close()
        if now == known:
            return None
        try:
            self._judge(known, now, False, self._held(), "what walberg read before")
        except Terminal as exc:
            return exc
        return None

    def _met(self, system: str, timeline: int) -> None:
        with self._lock:
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
