"""The Kafka reader: the configured topics read from the offsets the lake holds (never from
the consumer group's committed offsets) into segment files, one frame per record. It runs in
the pipeline's main thread, beside the applier."""

from __future__ import annotations

import logging
from typing import Callable

from walberg import metrics
from walberg.buffer.store import SegmentStore
from walberg.config import Config
from walberg.runtime.applier import Partition
from walberg.runtime.kafka_stager import FRAME_KAFKA
from walberg.runtime.state import RunState
from walberg.source import kafka

log = logging.getLogger("walberg")


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
        self._source = config.source_name or "kafka"  # the gauges' label

    def read(self, once: bool, coming: Callable[[], None] = lambda: None) -> None:
        """Read until stopped; with ``once``, until every partition is read up to its end as
        it was at the start. ``coming``: called when there are records to read (at once when
        streaming), so the first batch's commit can be readied meanwhile. Until the ends as
        they were at the start are read and sealed, ``state.catching_up`` is set: the run's
        first batch grows meanwhile."""
        consumer, store, state = self.consumer, self.store, self.state
        applied = state.applied_offsets()
        partitions = consumer.partitions(self.topics)
        start = {tp: applied.get(tp, kafka.BEGINNING) for tp in partitions}
        ends = {tp: consumer.high_watermark(*tp) for tp in partitions}
        behind = any(end > max(start[tp], 0) for tp, end in ends.items())
        if not once or behind:
            coming()
        if behind:
            state.catching_up.set()
        consumer.assign(start)
        log.info("reading %s from the lake's offsets: %s", ", ".join(self.topics),
                 ", ".join(f"{t}[{p}]@{'earliest' if o < 0 else o}"
                           for (t, p), o in sorted(start.items())) or "-")
        interval = self.config.buffer.max_interval_seconds
        backlog_limit = 4 * self.config.buffer.max_batch_bytes
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
                for record in records:
                    store.append(record.offset, FRAME_KAFKA, kafka.encode(record))
                    self._read[(record.topic, record.partition)] = record.offset + 1
                    if store.should_seal():
                        self.seal()
                if store.active_age_seconds() >= interval:
                    self.seal()
            self.seal()
        finally:
            state.catching_up.clear()

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
        if self.store.seal() is not None:
            metrics.SEGMENTS_SEALED.inc()
            self.state.wake.set()
        metrics.PENDING_BYTES.labels(self._source).set(self.store.pending_bytes())

    def drain(self) -> None:
        """Wait until the applier has applied every sealed segment (or failed, or was
        stopped)."""
        while self.store.sealed() and self.state.error is None and not self.state.stop.is_set():
            self.state.wake.set()
            self.state.progress.wait(0.2)
            self.state.progress.clear()
