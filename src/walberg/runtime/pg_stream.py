"""The Postgres reader's stream: the replication stream written to segment files (each segment
starting with the relations' descriptions; transactions streamed in progress written once they
commit), reconnecting when the connection is lost. With a slot that exists, the stream starts
in a thread of its own while the lake is checked (``start_early``) and goes on from there."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from walberg import metrics
from walberg.buffer import spill
from walberg.buffer.spill import TxnSpill
from walberg.buffer.store import SegmentStore
from walberg.config import Config
from walberg.errors import SourceError, Terminal, Transient, WalbergError
from walberg.faults import crash_point
from walberg.model import Lsn
from walberg.runtime.pg_gauges import ReaderGauges
from walberg.runtime.pg_server import ServerCheck
from walberg.runtime.pg_stager import FRAME_PGOUTPUT, FRAME_PREAMBLE
from walberg.runtime.state import RunState, SegmentMeta
from walberg.source import postgres as pg
from walberg.source import slots
from walberg.source.framing import (
    CHANGE_TAGS,
    Committed,
    StreamedTransactions,
    begin_final_lsn,
    commit_end_lsn,
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


class PgStream:
    """Streams a Postgres source into segment files."""

    def __init__(self, config: Config, store: SegmentStore, state: RunState,
                 relations: Relations, server: ServerCheck,
                 streaming_early: Callable[[bool], None]) -> None:
        self.config = config
        self.pg = config.postgres
        self.store = store
        self.state = state
        self.relations = relations
        self.server = server
        self.gauges = ReaderGauges(config, store, state)
        self._active_commit: Optional[Lsn] = None  # end of the last transaction in the active seg
        self._streamed_since_start = False
        # Streaming that starts while the lake is still being checked (see start_early).
        self._early: Optional[threading.Thread] = None
        self._early_error: Optional[BaseException] = None
        self._lake_ready = threading.Event()  # the lake is read: the slot may follow WAL's end
        self._halt_early = threading.Event()
        self._streaming_early = streaming_early

    def close(self) -> None:
        self.stop_early()  # (a run that failed before ``stream``)
        self.gauges.close()

    def start_early(self, stream: ReplicationStream, target: Optional[Lsn]) -> None:
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

    def stop_early(self) -> None:
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
                        self.server.same_server(stream, self._slot_exists())
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
            return slots.slot_state(conn, self.pg.slot) is not None
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
            if slots.slot_state(conn, self.pg.slot) is None:
                moved = self.server.moved_without_slot()
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

    def _await_slot_confirmation(self, timeout: float = 10.0) -> None:
        """The server takes our last status update asynchronously; wait (briefly) until the slot
        shows it, so that a finished run leaves the slot exactly where the lake is."""
        conn = pg.connect(self.pg.dsn)
        try:
            deadline = time.monotonic() + timeout
            while True:
                state = slots.slot_state(conn, self.pg.slot)
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
                self._wait_for_spark(stream)
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
            self.gauges.note_pending()
            if time.monotonic() - last_gauges >= self.pg.status_interval_seconds:
                self.gauges.update_slot_gauges()
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

    def _wait_for_spark(self, stream: ReplicationStream) -> None:
        """Spark is behind: stop reading for a moment (status updates keep flowing). Only
        between transactions, with what was read sealed: a batch ends at a commit, so a reader
        paused inside a transaction larger than the backlog limit (sent whole, not streamed in
        progress), or with the commit that ends one in the active segment, would wait for a
        batch that cannot come."""
        if self.store.active_bytes():
            self.seal(clean=True)
        stream.confirm(self.state.confirmable())
        stream.keepalive()
        self._await_progress()

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
            self.gauges.received_commit(end, payload)
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
                self.gauges.received_commit(done.end, frame)
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

    def seal(self, clean: bool) -> None:
        info = self.store.seal()
        if info is not None:
            crash_point("seal")
            metrics.SEGMENTS_SEALED.inc()
            self.state.sealed(info.seq, SegmentMeta(self._active_commit, clean))
            self._active_commit = None
            self.state.wake.set()
