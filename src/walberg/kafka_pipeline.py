"""The Kafka pipeline: Debezium change events from Kafka topics into Iceberg, through the same
segment files and the same Spark apply as the Postgres pipeline.

    Kafka (source.kafka) -> segment files (one frame per record) -> staged batch -> Iceberg

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
  commit, and a replay never writes a record there twice (see ``_write_dead_letters``);
- segments are removed only once what they hold is in Iceberg.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from walberg import metrics
from walberg.apply.batch import BatchBuilder, StagedTable
from walberg.apply.iceberg import OFFSET_PROPERTY, IcebergSink
from walberg.apply.types import TypeMap, pg_type_for
from walberg.buffer.store import SegmentInfo, SegmentStore
from walberg.config import Config, KafkaTopic
from walberg.errors import ConfigError
from walberg.faults import crash_point
from walberg.lakeside import commit_with_retries, count_files, open_session, release
from walberg.model import Column, Lsn, Op
from walberg.source import debezium as dbz
from walberg.source import kafka

log = logging.getLogger("walberg")

FRAME_KAFKA = 2  # one consumed Kafka record (source.kafka.encode)
Partition = tuple[str, int]

DEAD_LETTER_SCHEMA = pa.schema([
    pa.field("topic", pa.string()), pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()), pa.field("timestamp_ms", pa.int64()),
    pa.field("key", pa.binary()), pa.field("value", pa.binary()),
    pa.field("table", pa.string()), pa.field("_dlq_reason", pa.string())])


@dataclass
class KafkaReport:
    batches: int = 0
    records: int = 0  # changes staged for Iceberg
    dead_letters: int = 0
    offsets: dict[Partition, int] = field(default_factory=dict)  # next offset applied


@dataclass
class _Shape:
    """A topic's table as walberg stages it: columns (with keys) and their value types."""

    columns: tuple[Column, ...]
    types: tuple[dbz.FieldType, ...]


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
        self._shapes: dict[str, _Shape] = {}
        self._lake: dict[Partition, int] = {}  # next offset each partition's table holds
        self._position: dict[Partition, int] = {}  # next offset read and applied (or skipped)
        self._read: dict[Partition, int] = {}  # next offset read from the broker
        self._stop = threading.Event()

    # ---- wiring ------------------------------------------------------------------------------

    @property
    def sink(self) -> IcebergSink:
        if self._session is None:
            self._session = open_session(self.config)
        if self._sink is None:
            self._sink = IcebergSink(self._session, self.types)
        return self._sink

    def stop(self) -> None:
        """Ask a running ``run`` to stop after the current step (safe from signal handlers)."""
        self._stop.set()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
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
        the lake and apply batch after batch. With ``once``, return when every partition is
        applied up to its end as it was at the start."""
        if self.config.metrics.port:
            metrics.serve(self.config.metrics.port, self.config.metrics.host)
        store = SegmentStore(self.config.segment_dir, self.config.buffer.max_segment_bytes)
        self._store = store
        log.info("segments: %s", store.recover().summary())
        for topic in self.topics:
            held = self.sink.committed_offsets(self.targets[topic])
            self._lake.update({tp: o for tp, o in held.items() if tp[0] == topic})
        self._position.update(self._lake)
        # Whatever survived in sealed segments from an earlier run goes first.
        self._apply_sealed(drain=True)

        consumer = self._consumer = self._new_consumer()
        partitions = consumer.partitions(self.topics)
        start = {tp: self._position.get(tp, kafka.BEGINNING) for tp in partitions}
        ends = {tp: consumer.high_watermark(*tp) for tp in partitions} if once else {}
        consumer.assign(start)
        log.info("reading %s from the lake's offsets: %s", ", ".join(self.topics),
                 ", ".join(f"{t}[{p}]@{'earliest' if o < 0 else o}"
                           for (t, p), o in sorted(start.items())) or "-")
        interval = self.config.buffer.max_interval_seconds
        while not self._stop.is_set():
            if once and all(self._read.get(tp, self._position.get(tp, 0)) >= end
                            for tp, end in ends.items()):
                break
            for record in consumer.poll(min(interval, 0.5)):
                store.append(record.offset, FRAME_KAFKA, kafka.encode(record))
                self._read[(record.topic, record.partition)] = record.offset + 1
                if store.should_seal():
                    self._seal()
            if store.active_age_seconds() >= interval:
                self._seal()
            self._apply_sealed(drain=False)
        self._seal()
        if once or not self._stop.is_set():
            self._apply_sealed(drain=True)
        self.report.offsets = dict(self._position)
        return self.report

    def _seal(self) -> None:
        assert self._store is not None
        if self._store.seal() is not None:
            metrics.SEGMENTS_SEALED.inc()
        metrics.PENDING_BYTES.set(self._store.pending_bytes())

    def _apply_sealed(self, drain: bool) -> None:
        """Apply the sealed segments, ``buffer.max_batch_bytes`` at a time (all with ``drain``,
        else one batch)."""
        assert self._store is not None
        while True:
            batch: list[SegmentInfo] = []
            size = 0
            for info in self._store.sealed():
                if batch and size + info.size_bytes > self.config.buffer.max_batch_bytes:
                    break
                batch.append(info)
                size += info.size_bytes
            if not batch:
                return
            self._apply(batch)
            if not drain:
                return

    # ---- one batch -------------------------------------------------------------------------

    def _apply(self, segments: list[SegmentInfo]) -> None:
        """Stage the records of these segments, write their dead letters, commit each table
        with its offsets, then let go of the segments."""
        assert self._store is not None
        started = time.monotonic()
        workdir = Path(tempfile.mkdtemp(prefix="batch-", dir=self.config.segment_dir))
        builder = BatchBuilder(workdir, prep=lambda name, columns: self.types.prep(
            columns, self.targets[self._topic_of(name)]))
        try:
            staged, upto, dead, by_seq, seq = self._stage(segments, builder)
            dead += self._prep_dead_letters(staged, by_seq)
            self._write_dead_letters(dead)
            for topic in self.topics:
                st = staged.get(self.names[topic])
                if st is not None and (st.rows or st.truncates):
                    self._commit(topic, st, seq, {tp: o for tp, o in upto.items()
                                                  if tp[0] == topic})
        finally:
            builder.discard()
        crash_point("committed")
        for tp, o in upto.items():
            self._position[tp] = max(self._position.get(tp, 0), o)
        self._store.remove(segments)
        metrics.SEGMENTS_APPLIED.inc(len(segments))
        metrics.PENDING_BYTES.set(self._store.pending_bytes())
        metrics.BATCHES.inc()
        changes = sum(st.rows for st in staged.values())
        metrics.BATCH_CHANGES.observe(changes)
        metrics.BATCH_SECONDS.observe(time.monotonic() - started)
        self.report.batches += 1
        self.report.records += changes
        log.info("batch of %d segment(s): %d change(s), %d dead letter(s), offsets %s, in "
                 "%.2f s", len(segments), changes, len(dead),
                 ", ".join(f"{t}[{p}]->{o}" for (t, p), o in sorted(upto.items())) or "-",
                 time.monotonic() - started)

    def _topic_of(self, name: str) -> str:
        return next(t for t, n in self.names.items() if n == name)

    def _stage(self, segments: list[SegmentInfo], builder: BatchBuilder
               ) -> tuple[dict[str, StagedTable], dict[Partition, int],
                          list[tuple[kafka.Record, str]], dict[int, kafka.Record], int]:
        """Turn the segments' records into staged changes per table. Returns the staged
        tables, the next offset of each partition read, the dead letters, the record behind
        each sequence number, and the last sequence number."""
        assert self._store is not None
        seq = 0
        upto: dict[Partition, int] = {}
        dead: list[tuple[kafka.Record, str]] = []
        by_seq: dict[int, kafka.Record] = {}
        for info in segments:
            for _, kind, payload in self._store.read(info):
                if kind != FRAME_KAFKA:
                    continue
                record = kafka.decode(payload)
                tp = (record.topic, record.partition)
                if record.offset < self._lake.get(tp, 0):
                    continue  # its table holds it already: a replay after a crash
                upto[tp] = max(upto.get(tp, 0), record.offset + 1)
                if record.topic not in self.names:
                    continue  # a topic taken out of the pipeline file since it was read
                if record.value is None:
                    continue  # a tombstone: Kafka's compaction marker, not a change
                try:
                    self._stage_record(builder, record, seq + 2)
                except dbz.BadRecord as exc:
                    dead.append((record, str(exc)))
                    continue
                seq += 2  # room for the delete half of a key change
                by_seq[seq] = record
        return builder.finish(), upto, dead, by_seq, seq

    def _stage_record(self, builder: BatchBuilder, record: kafka.Record, seq: int) -> None:
        assert record.value is not None
        event = dbz.parse_event(record.value)
        key = dbz.parse_key(record.key)
        shape = self._shape(record.topic, event, key)
        name, target = self.names[record.topic], self.targets[record.topic]
        types = shape.types
        if event.fields is not None:
            dbz.check_fields(event.fields, shape.columns, lambda t, c: self._same_type(t, c, target))
            # The record's own encoding (e.g. microseconds or milliseconds) reads its values.
            given = dict(event.fields)
            types = tuple(given.get(c.name, t) for c, t in zip(shape.columns, types, strict=True))
        lsn = event.lsn or 0
        if event.op == "t":
            builder.truncate(name, shape.columns, seq, lsn)
            return
        staged = dbz.changes(event, key, shape.columns, types)
        for i, (op, row) in enumerate(staged):
            builder.add(name, shape.columns, Op(op), seq - len(staged) + 1 + i, lsn, row)

    def _same_type(self, t: dbz.FieldType, col: Column, target: str) -> bool:
        mine = self.types.spark_type(Column(col.name, t.oid, t.modifier), target).describe()
        return mine == self.types.spark_type(col, target).describe()

    def _shape(self, topic: str, event: dbz.Event, key: Optional[Mapping[str, Any]]) -> _Shape:
        """The table's columns, settled by the first record of a run: from the pipeline file,
        else the existing Iceberg table, else the record's schema, else its JSON values."""
        shape = self._shapes.get(topic)
        if shape is not None:
            return shape
        chosen = self.kafka.tables.get(topic) or KafkaTopic.model_validate({})
        target = self.targets[topic]
        where = f"source.kafka.tables.{topic}"
        fields: list[tuple[str, dbz.FieldType]]
        if chosen.columns:
            try:
                fields = [(n, dbz.type_from_name(t)) for n, t in chosen.columns.items()]
            except ValueError as exc:
                raise ConfigError(f"{where}.columns: {exc}") from None
        elif self.sink.table_exists(target):
            fields = [(n, dbz.FieldType(*pg_type_for(t, f"{target}.{n}")))
                      for n, t in self.sink.schema(target)]
        elif event.fields is not None:
            fields = list(event.fields)
        else:
            image = event.after if event.after is not None else event.before
            if image is None:
                raise dbz.BadRecord("no columns to learn the table from: the table does not "
                                    "exist yet and this first record has no row and no schema")
            fields = [(n, dbz.infer_type(v)) for n, v in image.items()]
        names = [n for n, _ in fields]
        keys = list(chosen.key)
        if keys:
            missing = [k for k in keys if k not in names]
            if missing:
                raise ConfigError(f"{where}.key names {', '.join(missing)}, which the table "
                                  f"{target} does not have ({', '.join(names)})")
        elif key:
            keys = [k for k in key if k in names]
            if len(keys) != len(key):
                raise dbz.BadRecord(f"missing key: the message key's fields {', '.join(key)} "
                                    f"are not all columns of {target}")
        if not keys:
            raise dbz.BadRecord(f"missing key: the record has no message key and {where}.key "
                                "is not set")
        columns = tuple(Column(n, t.oid, t.modifier, n in keys) for n, t in fields)
        for c in columns:
            self.types.spark_type(c, target)
        shape = self._shapes[topic] = _Shape(columns, tuple(t for _, t in fields))
        log.info("%s -> %s: columns %s, key %s", topic, target,
                 ", ".join(f"{c.name} {self.types.spark_type(c, target).describe()}"
                           for c in columns), ", ".join(keys))
        return shape

    def _commit(self, topic: str, st: StagedTable, max_seq: int,
                offsets: Mapping[Partition, int]) -> None:
        """One table's share of a batch, in one commit that carries its offsets."""
        name, target = self.names[topic], self.targets[topic]
        sink = self.sink
        if sink.ensure_table(target, st.columns, self.config.layout_for(name)):
            log.info("created %s", target)
        elif not sink.columns_match(target, st.columns):
            raise ConfigError(f"{target} has columns {sink.schema(target)}, not those walberg "
                              f"staged for topic {topic}; give the table's columns in "
                              f"source.kafka.tables.{topic}.columns")
        marks = {f"{OFFSET_PROPERTY}.{t}.{p}": str(o) for (t, p), o in offsets.items()}

        def commit() -> None:
            crash_point("commit", delay=0.5)
            sink.apply(target, st, Lsn(0), max_seq, (), marks)

        def landed() -> bool:
            held = sink.committed_offsets(target)
            return all(held.get(tp, -1) >= o for tp, o in offsets.items())

        started = time.monotonic()
        log.info("applying %d change(s) to %s up to %s", st.rows, target, _offsets(offsets))
        try:
            commit_with_retries(self.config.sink, self._stop, sink, name, target, commit, landed,
                                f"offsets {_offsets(offsets)}",
                                f"offsets {_offsets({tp: self._lake.get(tp, 0) for tp in offsets})}")
        except BaseException:
            metrics.COMMITS.labels(name, "failure").inc()
            raise
        self._lake.update(offsets)
        metrics.COMMITS.labels(name, "success").inc()
        metrics.COMMIT_SECONDS.labels(name).observe(time.monotonic() - started)
        for op, label in (("I", "insert"), ("U", "update"), ("D", "delete")):
            metrics.RECORDS_WRITTEN.labels(name, label).inc(st.ops[op])
        count_files(sink, name, target)

    # ---- dead letters ------------------------------------------------------------------------

    def _prep_dead_letters(self, staged: Mapping[str, StagedTable],
                           by_seq: Mapping[int, kafka.Record]) -> list[tuple[kafka.Record, str]]:
        """Rows the staging refused (a value the Iceberg type cannot hold exactly), back to
        the records they came from."""
        out: list[tuple[kafka.Record, str]] = []
        for st in staged.values():
            if st.dead_letters is None:
                continue
            rows = pq.read_table(st.dead_letters, columns=["_wb_seq", "_dlq_reason"]).to_pylist()
            seen: set[int] = set()
            for r in rows:
                seq = r["_wb_seq"]
                record = by_seq.get(seq) or by_seq.get(seq + 1)
                if record is not None and id(record) not in seen:
                    seen.add(id(record))
                    out.append((record, r["_dlq_reason"]))
        return out

    def _write_dead_letters(self, dead: list[tuple[kafka.Record, str]]) -> None:
        """One Parquet file per partition and batch, ``<dir>/<topic>/<partition>/<first>-
        <last>.parquet`` (offsets). A file holds every dead letter of its partition between its
        two offsets, so a replay skips the records an earlier file covers: a crash between
        these files and the table's commit never writes a record twice."""
        root = self.config.dead_letter_dir
        by_partition: dict[Partition, list[tuple[kafka.Record, str]]] = {}
        for record, reason in dead:
            by_partition.setdefault((record.topic, record.partition), []).append((record, reason))
        for (topic, partition), items in sorted(by_partition.items()):
            directory = root / topic / str(partition)
            covered = _covered(directory)
            fresh = [(r, why) for r, why in items
                     if not any(lo <= r.offset <= hi for lo, hi in covered)]
            if not fresh:
                continue
            fresh.sort(key=lambda item: item[0].offset)
            first, last = fresh[0][0].offset, fresh[-1][0].offset
            table = pa.Table.from_pylist([
                {"topic": r.topic, "partition": r.partition, "offset": r.offset,
                 "timestamp_ms": r.timestamp, "key": r.key, "value": r.value,
                 "table": self.targets.get(r.topic), "_dlq_reason": why} for r, why in fresh],
                schema=DEAD_LETTER_SCHEMA)
            _write_atomically(table, directory / f"{first:020d}-{last:020d}.parquet")
            name = self.names.get(topic, topic)
            metrics.DEAD_LETTERS.labels(name).inc(len(fresh))
            self.report.dead_letters += len(fresh)
            log.warning("%d record(s) of %s partition %d (offsets %d..%d) could not be applied "
                        "and went to %s with the reason in _dlq_reason; the first: offset %d: %s",
                        len(fresh), topic, partition, first, last, directory, first, fresh[0][1])


def _offsets(offsets: Mapping[Partition, int]) -> str:
    return ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(offsets.items())) or "-"


def _covered(directory: Path) -> list[tuple[int, int]]:
    """The offset ranges of the dead-letter files already in a partition's directory."""
    out = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        stem, _, ext = name.partition(".")
        lo, _, hi = stem.partition("-")
        if ext == "parquet" and lo.isdigit() and hi.isdigit():
            out.append((int(lo), int(hi)))
    return out


def _write_atomically(table: pa.Table, path: Path) -> None:
    """Write, fsync, rename, fsync the directory: the file is there whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    pq.write_table(table, temp)
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["KafkaPipeline", "KafkaReport", "FRAME_KAFKA"]
