"""What the reader thread and the applier thread share while a pipeline runs, in one object
with one lock. Every field both threads touch is read and written through its methods; the
events are thread-safe by themselves."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

from walberg.model import Lsn


@dataclass(frozen=True)
class SegmentMeta:
    """What the pipeline knows about a sealed segment without reading it again."""

    last_commit_end: Optional[Lsn]  # end LSN of the last transaction that commits in it
    clean_end: bool  # its last frame is a Commit (no transaction continues in the next one)


class RunState:
    """Progress and stop signals shared by a pipeline's reader and applier."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._applied = Lsn(0)  # every table holds everything up to here
        self._received = Lsn(0)  # end of the last transaction written to a segment
        self._committed: dict[str, Lsn] = {}  # what each table holds in the lake
        # Tables stopped by a change Iceberg cannot follow, with why: the others go on.
        self._halted: dict[str, str] = {}
        # Tables whose resumed copy the stream has not yet caught up with: the LSN to pass.
        self._catchup: dict[str, Lsn] = {}
        self._segments: dict[int, SegmentMeta] = {}  # sealed segments not yet applied
        self._lake_offsets: dict[tuple[str, int], int] = {}  # Kafka: what the tables hold
        self._applied_offsets: dict[tuple[str, int], int] = {}  # ... and what was applied
        self._error: Optional[BaseException] = None  # the applier's failure
        self.wake = threading.Event()  # reader -> applier: a segment was sealed
        self.progress = threading.Event()  # applier -> reader: a batch was applied
        self.stop = threading.Event()
        # stager -> pipeline: a batch is being staged before the lake is read.
        self.staging_early = threading.Event()
        # reader -> stager: a --once run has sealed every change up to where it stops.
        self.read_to_target = threading.Event()
        # reader -> stager: the stream that started before the lake was read runs (a --once
        # run's early batch grows only while it does).
        self.reading_early = threading.Event()
        # reader -> stager (Kafka): the topics are being read up to their ends as they were
        # when reading began; a run's first batch grows until then (one commit for a backlog
        # that fits a batch, not one for each segment sealed before the first was staged).
        self.catching_up = threading.Event()
        # applier -> reader: another connection to the source could not be made (a server
        # shutting down refuses them, and waits for the replication connection to confirm
        # what it sent, which the blocked applier cannot): let the stream go and reconnect.
        self.release_source = threading.Event()

    # ---- positions ---------------------------------------------------------------------------

    @property
    def applied(self) -> Lsn:
        with self._lock:
            return self._applied

    def advance_applied(self, lsn: Lsn) -> None:
        with self._lock:
            self._applied = max(self._applied, lsn)

    @property
    def received(self) -> Lsn:
        with self._lock:
            return self._received

    def set_received(self, lsn: Lsn) -> None:
        with self._lock:
            self._received = lsn

    def confirmable(self) -> Lsn:
        """What the slot may be told: everything applied, but not past a stopped table's last
        commit (its changes must be read again once it is fixed)."""
        with self._lock:
            if not self._halted:
                return self._applied
            return Lsn(min([self._applied,
                            *(self._committed.get(t, Lsn(0)) for t in self._halted)]))

    # ---- tables ------------------------------------------------------------------------------

    def committed(self) -> dict[str, Lsn]:
        """A copy: what each table holds in the lake."""
        with self._lock:
            return dict(self._committed)

    def committed_at(self, table: str) -> Optional[Lsn]:
        with self._lock:
            return self._committed.get(table)

    def set_committed(self, table: str, lsn: Lsn) -> None:
        with self._lock:
            self._committed[table] = lsn

    def forget_committed(self, table: str) -> None:
        with self._lock:
            self._committed.pop(table, None)

    def halted(self) -> dict[str, str]:
        """A copy: the stopped tables, with why."""
        with self._lock:
            return dict(self._halted)

    def is_halted(self, table: str) -> bool:
        with self._lock:
            return table in self._halted

    def halt(self, table: str, why: str) -> None:
        with self._lock:
            self._halted[table] = why

    def unhalt(self, table: str) -> None:
        with self._lock:
            self._halted.pop(table, None)

    def catchup(self, table: str) -> Optional[Lsn]:
        with self._lock:
            return self._catchup.get(table)

    def set_catchup(self, table: str, lsn: Lsn) -> None:
        with self._lock:
            self._catchup[table] = lsn

    def caught_up(self, table: str, lsn: Lsn) -> None:
        """The table's commit reached ``lsn``: past its catch-up mark, it is done."""
        with self._lock:
            mark = self._catchup.get(table)
            if mark is not None and lsn >= mark:
                del self._catchup[table]

    # ---- sealed segments ---------------------------------------------------------------------

    def sealed(self, seq: int, meta: SegmentMeta) -> None:
        with self._lock:
            self._segments[seq] = meta

    def segment(self, seq: int) -> Optional[SegmentMeta]:
        with self._lock:
            return self._segments.get(seq)

    def forget_segments(self, seqs: list[int]) -> None:
        with self._lock:
            for seq in seqs:
                self._segments.pop(seq, None)

    def last_received(self) -> Lsn:
        """The end of the last transaction the sealed segments hold (or the applied position)."""
        with self._lock:
            return max([m.last_commit_end or Lsn(0) for m in self._segments.values()]
                       + [self._applied])

    # ---- Kafka offsets -----------------------------------------------------------------------

    def lake_offset(self, partition: tuple[str, int]) -> int:
        """The next offset of a partition that its table holds (0: none)."""
        with self._lock:
            return self._lake_offsets.get(partition, 0)

    def lake_offsets(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._lake_offsets)

    def applied_offsets(self) -> dict[tuple[str, int], int]:
        """The next offset of each partition read and applied (or skipped)."""
        with self._lock:
            return dict(self._applied_offsets)

    def advance_offsets(self, offsets: dict[tuple[str, int], int], *, lake: bool) -> None:
        """Offsets applied; with ``lake``, also held by their table's commit."""
        with self._lock:
            for held in ([self._applied_offsets, self._lake_offsets] if lake
                         else [self._applied_offsets]):
                for tp, o in offsets.items():
                    held[tp] = max(held.get(tp, 0), o)

    # ---- failure -----------------------------------------------------------------------------

    @property
    def error(self) -> Optional[BaseException]:
        with self._lock:
            return self._error

    def fail(self, exc: BaseException) -> None:
        """The applier failed: the reader stops and ``run`` raises ``exc``."""
        with self._lock:
            self._error = exc
        self.stop.set()
        self.wake.set()
        self.progress.set()

    def request_stop(self) -> None:
        self.stop.set()
        self.wake.set()
        self.progress.set()
