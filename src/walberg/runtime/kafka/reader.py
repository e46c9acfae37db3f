"""The Kafka reader: the configured topics read from the offsets the lake holds (never from
the consumer group's committed offsets) into segment files, a frame per run of records. It runs in
the pipeline's main thread, beside the applier."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from walberg import metrics
from walberg.buffer.store import SegmentStore
from walberg.config import Config
from walberg.errors import SourceError, Terminal, Transient
from walberg.runtime.applier import Partition
from walberg.runtime.kafka.frames import FRAME_KAFKA_PAST, FRAME_KAFKA_RUN
from walberg.runtime.kafka.marks import offsets_text
from walberg.runtime.state import RunState
from walberg.source import kafka

log = logging.getLogger("walberg")

_TELL_GROUP_SECONDS = 5.0  # how often the lake's offsets are committed to the consumer group
_LOOK_SECONDS = 5.0  # how often a streaming run asks for partitions added to its topics
# How long past buffer.max_interval_seconds a segment waits at most for the ends of the
# partitions it read (see _awaiting_end); librdkafka's fetch waits 0.5 s at most.
_END_WAIT_SECONDS = 1.0


class KafkaReader:
    """Reads Kafka topics into segment files."""

    def __init__(self, config: Config, store: SegmentStore, state: RunState,
                 consumer: kafka.Consumer) -> None:
        assert config.source.kafka is not None
        self.config = config
        self.topics = list(config.source.kafka.topics)
        self.store = store
        self.state = state
        self.consumer = consumer
        self._read: dict[Partition, int] = {}  # next offset read from the broker
        self._assigned: dict[Partition, int] = {}  # the partitions read, and where they began
        self._looked_at = time.monotonic()
        # Per partition, the offset up to which the segments say no record lies (see _passed)
        self._past: dict[Partition, int] = {}
        self._open: dict[Partition, int] = {}  # ... and the next offset read into the active one
        self._told: dict[Partition, int] = {}  # the offsets last committed to the group
        self._told_at = 0.0
        self._source = config.source_name or "kafka"  # the gauges' label

    def read(self, once: bool, coming: Callable[[], None] = lambda: None) -> None:
        """Read until stopped; with ``once``, until every partition is read up to its end as
        it was at the start. ``coming``: called when there are records to read (at once when
        streaming), so the first batch's commit can be readied meanwhile. Until the ends as
        they were at the start are read and sealed, ``state.catching_up`` is set: the run's
        first batch grows meanwhile."""
        consumer, store, state = self.consumer, self.store, self.state
        applied = state.applied_offsets()
        marks = self._ends()
        if marks is None:
            return  # stopped while the broker could not be reached
        start = {tp: applied.get(tp, kafka.BEGINNING) for tp in marks}
        ends = {tp: high for tp, (_, high) in marks.items()}
        self._check_offsets(applied, marks)
        behind = any(end > max(start[tp], 0) for tp, end in ends.items())
        if not once or behind:
            coming()
        if behind:
            state.catching_up.set()
        consumer.assign(start)
        self._assigned = dict(start)
        log.info("reading %d topic(s) from the lake's offsets: %s", len(self.topics),
                 offsets_text(start))
        interval = self.config.buffer.max_interval_seconds
        backlog_limit = 4 * self.config.buffer.max_batch_bytes
        # (a run frame of a poll's records, no more than a quarter segment: segments stay about
        # the size asked for)
        run_bytes = min(kafka.RUN_BYTES, self.config.buffer.max_segment_bytes // 4)
        try:
            while not state.stop.is_set() and state.error is None:
                limit = kafka.POLL_LIMIT
                if state.catching_up.is_set() or once:
                    left = self._left(ends, applied)
                    if not left:
                        if once:
                            break
                        self._caught_up()
                    else:
                        # (no more than is left: the consumer waits out its timeout for a
                        # fuller batch)
                        limit = min(limit, left)
                if store.pending_bytes() > backlog_limit:
                    # Spark is behind: stop reading for a moment, what was read sealed (a batch
                    # takes sealed segments only: one larger than this would wait for good).
                    if store.active_bytes():
                        self.seal()
                    state.progress.wait(0.2)
                    state.progress.clear()
                    continue
                records = consumer.poll(min(interval, 0.5), limit)
                for last, frame in kafka.runs(records, run_bytes):
                    if store.should_seal():
                        self.seal()
                    store.append(last, FRAME_KAFKA_RUN, frame)
                # (a partition's offsets grow: its last record is its furthest)
                read = {(r.topic, r.partition): r.offset + 1 for r in records}
                self._read.update(read)
                self._open.update(read)
                past = self._passed()
                if past:
                    # (in the segment of the records before them: their batch's commits carry
                    # the offsets past the markers)
                    store.append(max(past.values()), FRAME_KAFKA_PAST, kafka.encode_past(past))
                if store.should_seal() or (store.active_age_seconds() >= interval
                                           and not self._awaiting_end(interval)):
                    self.seal()
                self._tell_group()
                if not once:
                    self._look_for_partitions()
            self.seal()
        finally:
            state.catching_up.clear()

    def _ends(self) -> Optional[dict[Partition, tuple[int, int]]]:
        """Every partition of the topics and its ends now (its first offset kept and the
        offset after its last record). A broker that cannot be reached (restarting, or the
        network not up yet) is asked again, 1 s, 2 s, 4 s ... (at most 30 s) apart, for
        ``source.kafka.reconnect_max_seconds``; None if the run is stopped meanwhile."""
        assert self.config.source.kafka is not None
        limit = self.config.source.kafka.reconnect_max_seconds
        deadline, delay = time.monotonic() + limit, 1.0
        while True:
            # (each ask waits at most 10 s, and no longer than the time left)
            wait = max(1.0, min(10.0, deadline - time.monotonic()))
            try:
                partitions = self.consumer.partitions(self.topics, wait)
                return {tp: self.consumer.watermarks(*tp, wait) for tp in partitions}
            except Transient as exc:
                if time.monotonic() + delay > deadline:
                    raise Transient(f"{exc}; tried for {limit:.0f} s "
                                    "(source.kafka.reconnect_max_seconds): start the broker or "
                                    "mend the address, then run walberg again") from None
                log.warning("%s; asking again in %.0f s", exc, delay)
            if self.state.stop.wait(delay):
                return None
            delay = min(delay * 2, 30.0)

    def _passed(self) -> dict[Partition, int]:
        """The partitions whose end the consumer reached past the offset after the last record
        read, and that end: the offsets between hold no record (a transaction's commit marker
        takes one, aborted records are not read), so the lake's offsets may pass them. Else a
        topic written in transactions (Debezium's exactly-once delivery) leaves the lake's
        offset at its last marker, and once retention deleted the marker the next start took
        the gap for records lost."""
        past: dict[Partition, int] = {}
        for tp, end in self.consumer.reached.items():
            at = self._read.get(tp, self._assigned.get(tp, 0))
            if end > max(at, 0) and end > self._past.get(tp, 0):
                past[tp] = end
        self._past.update(past)
        return past

    def _awaiting_end(self, interval: float) -> bool:
        """Whether the active segment waits a moment for the end of a partition it read: the
        offsets after a transaction's last record (its commit marker) are known once the
        consumer reaches the partition's end, a fetch later. In the segment of the records,
        they ride in the same commits; in a segment of their own they would make no commit,
        and the lake's offset would stay at the marker. At most ``_END_WAIT_SECONDS`` past
        ``interval``: a partition read without pause never reaches its end."""
        if self.store.active_age_seconds() >= interval + _END_WAIT_SECONDS:
            return False
        reached = self.consumer.reached
        return any(reached.get(tp, -1) < at for tp, at in self._open.items())

    def _look_for_partitions(self) -> None:
        """Partitions added to the topics while walberg runs (kafka-topics --alter
        --partitions), a few seconds apart: read from their first offset (or from the lake's,
        should it hold some), as a start would. The broker asked in vain is asked again later
        (the consumer says why it reads nothing)."""
        if time.monotonic() - self._looked_at < _LOOK_SECONDS:
            return
        self._looked_at = time.monotonic()
        try:
            found = self.consumer.partitions(self.topics, 2.0)
        except (Transient, SourceError):
            return
        new = [tp for tp in found if tp not in self._assigned]
        if not new:
            return
        held = self.state.applied_offsets()
        start = {tp: held.get(tp, kafka.BEGINNING) for tp in new}
        self.consumer.add(start)
        self._assigned.update(start)
        log.info("partition(s) added while running, read from: %s", offsets_text(start))

    def _tell_group(self, wait: bool = False) -> None:
        """Commit what the lake holds to the consumer group, at most every few seconds, so the
        usual Kafka lag tools see where walberg is (walberg itself starts from the lake's
        offsets, never the group's). From the reader's thread, the consumer's only user."""
        if not wait and time.monotonic() - self._told_at < _TELL_GROUP_SECONDS:
            return
        self._told_at = time.monotonic()
        held = self.state.applied_offsets()
        if held != self._told:
            self.consumer.commit(held, wait=wait)
            self._told = held

    @staticmethod
    def _check_offsets(applied: dict[Partition, int],
                       marks: dict[Partition, tuple[int, int]]) -> None:
        """The lake's offsets against what each partition holds now: past its end (the topic
        was deleted and made again, or its log cut back), the records that come next would be
        taken for ones the lake holds and skipped; before its first record kept (retention
        deleted records walberg had not read), the lake misses changes. Either way the table
        no longer follows the topic: say so and stop, rather than go on wrong."""
        for (topic, partition), (low, high) in sorted(marks.items()):
            held = applied.get((topic, partition))
            if held is None:
                continue
            if held > high:
                raise Terminal(
                    f"the lake holds {topic} partition {partition} up to offset {held}, but the "
                    f"partition ends at {high} now: the topic was deleted and created again, or "
                    "its log was cut back (an unclean leader election), so its offsets no longer "
                    "match the lake's. Drop the topic's Iceberg table (or point the pipeline at "
                    "a new one) and have the connector send a snapshot again.")
            if held < low:
                raise Terminal(
                    f"the lake holds {topic} partition {partition} up to offset {held}, but the "
                    f"partition keeps records from offset {low} only: retention deleted "
                    f"{low - held} record(s) walberg had not read, and the table misses their "
                    "changes. Raise the topic's retention.ms to cover walberg's downtime; to "
                    "repair the table, drop it and have the connector send a snapshot again.")

    def _left(self, ends: dict[Partition, int], applied: dict[Partition, int]) -> int:
        """Offsets still to read up to ``ends``, the partitions' ends as they were at the start;
        none in a partition whose end the consumer reached where reading stands: what lies
        between is no record (a transaction's commit marker takes an offset, aborted records
        are not read) or not yet readable (a transaction still open)."""
        left = 0
        for tp, end in ends.items():
            at = self._read.get(tp, applied.get(tp, 0))
            reached = self.consumer.reached.get(tp)
            if reached is None or reached < at:
                left += max(end - at, 0)
        return left

    def _caught_up(self) -> None:
        """Reading has caught up with the topics' ends as they were at the start: what was
        read is sealed before the run's first batch is told to stop growing, so it takes it."""
        self.seal()
        self.state.catching_up.clear()

    def seal(self) -> None:
        self._open.clear()
        if self.store.seal() is not None:
            metrics.SEGMENTS_SEALED.inc()
            self.state.wake.set()
        metrics.PENDING_BYTES.labels(self._source).set(self.store.pending_bytes())

    def drain(self) -> None:
        """Wait until the applier has applied every sealed segment (or failed, or was
        stopped), then tell the group where the lake is."""
        while self.store.sealed() and self.state.error is None and not self.state.stop.is_set():
            self.state.wake.set()
            self.state.progress.wait(0.2)
            self.state.progress.clear()
        self._tell_group(wait=True)
