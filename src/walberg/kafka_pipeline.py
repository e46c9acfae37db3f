"""The Kafka pipeline: Debezium change events from Kafka topics into Iceberg, through the same
segment files and the same applier as the Postgres pipeline.

    Kafka (source.kafka) -> segment files (a frame per run of records) -> staged batch -> Iceberg

Delivery contract. Kafka delivers at least once from wherever a consumer starts; walberg makes
it exactly once in the lake:
- each table's commit carries, in its snapshot summary and in the same atomic commit as the
  data, the next offset of every partition of its topic that the batch read
  (``walberg.offset.<topic>.<partition>``);
- on start, walberg first applies what is left in the segment files, skipping every record
  below the offsets its table holds, then reads each partition from the offset stored in the
  lake (the earliest offset for a partition the lake has never seen), never from the
  consumer group's committed offsets, which walberg writes only for lag monitoring;
- records that cannot be applied are written to the dead-letter files before the table's
  commit, and a replay never writes a record there twice (see ``DeadLetters.write``);
- segments are removed only once what they hold is in Iceberg.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from walberg import metrics
from walberg.apply import staging
from walberg.apply.iceberg import IcebergSink
from walberg.apply.types import TypeMap
from walberg.buffer.store import SegmentStore
from walberg.config import Config
from walberg.errors import ConfigError
from walberg.lake.maintain import maintain_on_schedule, written_beside
from walberg.runtime.applier import Applier
from walberg.runtime.kafka.reader import KafkaReader
from walberg.runtime.kafka.stager import KafkaReport, KafkaStager
from walberg.runtime.lakeside import open_session, ready_storage, release, stage_root
from walberg.runtime.state import RunState
from walberg.runtime.tables import Tables
from walberg.source import kafka

log = logging.getLogger("walberg")


class KafkaPipeline:
    """Keeps one Iceberg table per configured topic equal to what its Debezium events say."""

    def __init__(self, config: Config, session: Any = None) -> None:
        if config.source.kafka is None:
            raise ConfigError("KafkaPipeline needs source.kafka in the pipeline file")
        self.config = config
        self.kafka = config.source.kafka
        self.topics = list(self.kafka.topics)
        self.names = {t: self.kafka.table_for(t) for t in self.topics}
        self.targets = {t: config.target_for_topic(t) for t in self.topics}
        self.types = TypeMap(config.sink.numeric_default, frozenset(config.sink.text_types))
        self.report = KafkaReport()
        self._session: Any = session
        self._owns_session = session is None
        self._sink: Optional[IcebergSink] = None
        self._store: Optional[SegmentStore] = None
        self._consumer: Optional[kafka.Consumer] = None
        self._state = RunState()

    # ---- wiring ------------------------------------------------------------------------------

    @property
    def sink(self) -> IcebergSink:
        if self._session is None:
            self._session = open_session(self.config)
        if self._sink is None:
            self._sink = IcebergSink(self._session, self.types, None,
                                     stage_root(self.config, self._session),
                                     self.config.index_dir,
                                     self.config.sink.key_index_in_warehouse,
                                     self.config.sink.index_in_metadata)
        return self._sink

    def stop(self) -> None:
        """Ask a running ``run`` to stop after the current step (safe from signal handlers)."""
        self._state.request_stop()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._sink is not None:
            self._sink.close()
        release(self._store, self._session if self._owns_session else None)
        self._store = None
        if self._owns_session:
            self._session = self._sink = None

    def _new_consumer(self) -> kafka.Consumer:
        return kafka.Consumer(self.kafka.bootstrap_servers, self.kafka.group_id,
                              self.kafka.properties)

    # ---- running -------------------------------------------------------------------------------

    def run(self, once: bool = False) -> KafkaReport:
        """Apply what the segment files still hold, then read the topics from the offsets in
        the lake while the applier commits batch after batch. With ``once``, return when every
        partition is applied up to its end as it was at the start."""
        if self.config.metrics.port:
            metrics.serve(self.config.metrics.port, self.config.metrics.host)
        state = self._state
        ready_storage(self.config, once, state.stop)
        store = SegmentStore(self.config.segment_dir, self.config.buffer.max_segment_bytes)
        self._store = store
        log.info("segments: %s", store.recover().summary())
        staging.remove_local_leftovers(self.config.segment_dir)
        for topic in self.topics:
            held = self.sink.committed_offsets(self.targets[topic])
            state.advance_offsets({tp: o for tp, o in held.items() if tp[0] == topic},
                                  lake=True)
        stager = KafkaStager(self.config, store, state, self.types, self.targets,
                             lambda: self.sink, self.report)
        # In append mode a topic's table is its changelog (every event, one row each); in
        # mode both the changelog is a table of its own beside it, with offsets of its own.
        tables = Tables({self.names[t]: self.targets[t] for t in self.topics},
                        {self.names[t]: self.config.changelog_for_topic(t) for t in self.topics
                         if self.config.layout_for(self.names[t]).mode != "upsert"})
        for t in self.topics:
            if self.config.layout_for(self.names[t]).mode == "both":
                stager.marks.read_changelog(self.sink, self.names[t],
                                            self.config.changelog_for_topic(t))
        applier = Applier(self.config, store, state, stager, tables, lambda: self.sink,
                          lambda: maintain_on_schedule(
                              self.sink, self.config.maintenance,
                              written_beside(self.config, {self.names[t]: self.targets[t]
                                                           for t in self.topics}),
                              state.stop))
        # Whatever survived in sealed segments from an earlier run goes first.
        applier.apply_ready(drain=True)

        consumer = self._consumer = self._new_consumer()
        reader = KafkaReader(self.config, store, state, consumer)
        thread = threading.Thread(target=applier.loop, name="walberg-apply", daemon=True)
        thread.start()
        try:
            reader.read(once, coming=self.sink.warm)
            if once or not state.stop.is_set():
                reader.drain()
        finally:
            state.request_stop()
            thread.join()
        if state.error is not None:
            raise state.error
        self.report.offsets = state.applied_offsets()
        return self.report
