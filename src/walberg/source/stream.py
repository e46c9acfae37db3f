"""The logical replication connection: slot creation with an exported snapshot, START_REPLICATION
with pgoutput, reading raw messages, and standby status updates (also when idle)."""

from __future__ import annotations

import select
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import psycopg2
import psycopg2.extras

from walberg.errors import SourceError, Transient
from walberg.model import Lsn
from walberg.source.postgres import connect, redact
from walberg.source.slots import report_slot_wait

# What a read or a status update raises when the replication connection is gone. A server
# that crashed or restarted under the stream surfaces as a bare DatabaseError from libpq
# ("no COPY in progress", "server closed the connection unexpectedly"), not only as an
# OperationalError.
_CONNECTION_LOST = (psycopg2.DatabaseError, psycopg2.InterfaceError)


@dataclass(frozen=True)
class CreatedSlot:
    name: str
    consistent_point: Lsn
    snapshot_name: str


class ReplicationStream:
    """One replication connection. Not thread-safe: one thread reads and confirms."""

    def __init__(self, dsn: str, slot: str, publication: str, status_interval: float = 10.0) -> None:
        self.dsn = dsn
        self.slot = slot
        self.publication = publication
        self.status_interval = status_interval
        self._conn: Any = None
        self._cur: Any = None
        self._last_feedback = 0.0
        self._flushed = Lsn(0)
        self._written = Lsn(0)

    @property
    def is_open(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def open(self) -> None:
        self._conn = connect(self.dsn, replication=True)
        self._cur = self._conn.cursor()

    def create_slot(self, name: Optional[str] = None, temporary: bool = False,
                    failover: bool = False) -> CreatedSlot:
        """Create a pgoutput slot and export its snapshot. The snapshot stays valid only while this
        connection runs no other command, so copy the tables before calling ``start``.
        ``failover``: a failover slot, synchronised to standbys (PostgreSQL 17+)."""
        name = name or self.slot
        kind = "TEMPORARY " if temporary else ""
        options = "SNAPSHOT 'export'" + (", FAILOVER true" if failover else "")
        done = threading.Event()  # (the server waits for running transactions: say which)
        threading.Thread(target=report_slot_wait, name="walberg-slot-wait", daemon=True,
                         args=(self.dsn, name, self._conn.get_backend_pid(), done)).start()
        try:
            self._cur.execute(
                f"CREATE_REPLICATION_SLOT \"{name}\" {kind}LOGICAL pgoutput ({options})"
            )
            row = self._cur.fetchone()
        except psycopg2.Error as exc:
            if self._cur.connection.closed:
                raise Transient(f"lost the connection to the source while creating replication "
                                f"slot {name}: {' '.join(str(exc).split())}") from None
            raise SourceError(
                f"could not create replication slot {name} on {redact(self.dsn)}: "
                f"{str(exc).strip()}. The role needs the REPLICATION attribute "
                "(ALTER ROLE ... REPLICATION) and max_replication_slots must have room."
            ) from None
        finally:
            done.set()
        return CreatedSlot(row[0], Lsn.parse(row[1]), row[2])

    def make_failover(self) -> None:
        """Turn the (existing, inactive) slot into a failover slot (PostgreSQL 17+)."""
        try:
            self._cur.execute(f"ALTER_REPLICATION_SLOT \"{self.slot}\" (FAILOVER true)")
        except psycopg2.Error as exc:
            if self._cur.connection.closed:
                raise Transient(f"lost the connection to the source while altering replication "
                                f"slot {self.slot}: {' '.join(str(exc).split())}") from None
            raise SourceError(
                f"could not make replication slot {self.slot} a failover slot on "
                f"{redact(self.dsn)}: {str(exc).strip()}. Set source.postgres.failover_slot: "
                "false to keep it as it is.") from None

    def identify(self) -> tuple[str, int]:
        """The server's system identifier and timeline (IDENTIFY_SYSTEM): a promoted standby
        has the same system, on a new timeline; another server, another system."""
        try:
            self._cur.execute("IDENTIFY_SYSTEM")
            row = self._cur.fetchone()
        except _CONNECTION_LOST as exc:
            raise self._lost(exc) from None
        return str(row[0]), int(row[1])

    def timeline_switch(self, timeline: int) -> Optional[Lsn]:
        """Where the server's history left ``timeline`` for the next one (None: it did not, as
        far as this server knows), from the current timeline's history file."""
        _, current = self.identify()
        if current <= 1 or timeline >= current:
            return None
        try:
            self._cur.execute(f"TIMELINE_HISTORY {current}")
            row = self._cur.fetchone()
        except _CONNECTION_LOST as exc:
            raise self._lost(exc) from None
        content = row[1].tobytes().decode() if isinstance(row[1], memoryview) else str(row[1])
        for line in content.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) == timeline:
                return Lsn.parse(parts[1])
        return None

    def start(self, start_lsn: Optional[Lsn] = None, in_progress: bool = False) -> None:
        """Start streaming. The server resumes from the slot's confirmed position or ``start_lsn``,
        whichever is later. ``in_progress``: protocol 2, with large transactions streamed
        before they commit (PostgreSQL 14 and later)."""
        options = {"proto_version": "1", "publication_names": self.publication,
                   "messages": "true"}
        if in_progress:
            options.update(proto_version="2", streaming="on")
        try:
            self._cur.start_replication(
                slot_name=self.slot,
                slot_type=psycopg2.extras.REPLICATION_LOGICAL,
                start_lsn=int(start_lsn or 0),
                options=options,
                decode=False,
                status_interval=self.status_interval,
            )
        except psycopg2.OperationalError as exc:
            if "is active for PID" in str(exc):
                # After a lost connection the server may not have noticed yet; after a while it
                # does. A second walberg on the same slot is refused at start, see pipeline.
                raise Transient(f"replication slot {self.slot} is still in use: "
                                f"{str(exc).strip()}") from None
            if "does not exist" not in str(exc) and self._cur.connection.closed:
                # The server went away (restarting, say): reconnecting is the cure.
                raise Transient(f"lost the connection to the source while starting "
                                f"replication: {' '.join(str(exc).split())}") from None
            raise self._cannot_start(exc) from None
        except psycopg2.Error as exc:
            raise self._cannot_start(exc) from None
        self._last_feedback = time.monotonic()

    def server_version(self) -> int:
        return int(self._conn.server_version)

    def _cannot_start(self, exc: Exception) -> SourceError:
        reason = str(exc).strip()
        advice = ""
        if "does not exist" in reason and "slot" in reason:
            advice = (" The slot was dropped while walberg streamed from it; the changes since "
                      "the lake's last commit cannot be read any more. Run `walberg resync -c "
                      "<pipeline.yaml>` to copy the tables again.")
        return SourceError(f"could not start replication from slot {self.slot} with publication "
                           f"{self.publication}: {reason}{advice}")

    def messages(self, timeout: float) -> Iterator[tuple[int, bytes]]:
        """Yield ``(wal_start, payload)`` for every message available now; wait up to ``timeout``
        seconds for the first one. Returns when the socket has nothing more to give."""
        cur = self._cur
        try:
            msg = cur.read_message()
            if msg is None:
                self.keepalive()
                ready = select.select([cur], [], [], timeout)[0]
                if not ready:
                    return
                msg = cur.read_message()
            while msg is not None:
                yield msg.data_start, msg.payload
                msg = cur.read_message()
        except _CONNECTION_LOST as exc:
            raise self._lost(exc) from None
        self.keepalive()

    @property
    def wal_end(self) -> Lsn:
        """The server's WAL position as of its last message or keepalive."""
        return Lsn(self._cur.wal_end if self._cur is not None else 0)

    def confirm(self, flushed: Lsn, written: Optional[Lsn] = None) -> None:
        """Remember the positions to report; the next status update sends them."""
        self._flushed = max(self._flushed, flushed)
        self._written = max(self._written, written or flushed, self._flushed)

    def keepalive(self, force: bool = False, reply: bool = False) -> None:
        """Send a standby status update when due (or now with ``force``)."""
        now = time.monotonic()
        if not force and now - self._last_feedback < self.status_interval:
            return
        try:
            self._cur.send_feedback(write_lsn=int(self._written), flush_lsn=int(self._flushed),
                                    reply=reply, force=True)
        except _CONNECTION_LOST as exc:
            raise self._lost(exc) from None
        self._last_feedback = now

    def _lost(self, exc: BaseException) -> Transient:
        """A read or a status update that found the replication connection gone: walberg
        reconnects."""
        return Transient(f"the replication connection to {redact(self.dsn)} was lost: "
                         f"{' '.join(str(exc).split())}")

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg2.Error:
                pass
            self._conn = self._cur = None
