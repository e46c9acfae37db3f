"""The Postgres reader's gauges: segment bytes waiting for the lake, the age of the oldest
transaction received but not applied (also written to a file for `walberg status`), and the
slot's lag and retained WAL as the server sees them."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from walberg import metrics
from walberg.buffer.files import write_freshness
from walberg.buffer.store import SegmentStore
from walberg.config import Config
from walberg.model import Lsn, pg_epoch
from walberg.runtime.state import RunState
from walberg.source import postgres as pg
from walberg.source import slots
from walberg.source.framing import commit_time

log = logging.getLogger("walberg")


class ReaderGauges:
    """What a Postgres reader tells the metrics about how far behind the lake is."""

    def __init__(self, config: Config, store: SegmentStore, state: RunState) -> None:
        self.config = config
        self.pg = config.postgres
        self.store = store
        self.state = state
        self._gauge_conn: Any = None
        # (end LSN, commit time) of received transactions not yet in the lake: the first
        # commit of each tenth of a second, so a backlog of many keeps this short.
        self._unapplied: deque[tuple[int, int]] = deque()
        self._told_freshness = 0.0
        self._source = config.source_name or "postgres"  # the gauges' label

    def close(self) -> None:
        if self._gauge_conn is not None:
            self._gauge_conn.close()
            self._gauge_conn = None

    def note_pending(self) -> None:
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

    def received_commit(self, end: Lsn, payload: bytes) -> None:
        """A transaction is in the segments: remember when it committed (see _unapplied)."""
        ts = commit_time(payload)
        if not self._unapplied or ts - self._unapplied[-1][1] >= 100_000:
            self._unapplied.append((int(end), ts))

    def update_slot_gauges(self) -> None:
        """Lag and retained WAL as the server sees them; a failed look is tried next time."""
        try:
            if self._gauge_conn is None or self._gauge_conn.closed:
                self._gauge_conn = pg.connect(self.pg.dsn)
            slot = slots.slot_state(self._gauge_conn, self.pg.slot)
            now = pg.current_wal_lsn(self._gauge_conn)
        except Exception as exc:  # metrics must never stop the stream
            log.debug("slot metrics not updated: %s", exc)
            self._gauge_conn = None
            return
        if slot is not None:
            metrics.LAG_BYTES.labels(self._source).set(max(int(now) - int(slot.confirmed_flush), 0))
            metrics.RETAINED_WAL_BYTES.labels(self._source).set(
                max(int(now) - int(slot.restart_lsn), 0))
