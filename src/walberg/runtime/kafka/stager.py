"""A Kafka batch: the Debezium records of sealed segments staged as changes per table (runs of
a topic's records decoded in columns, the others one at a time), the next offset of every
partition read, and the records that cannot be applied. The stager the applier drives: what a
topic's table is lives in ``tables``, the offsets a commit carries in ``marks``, the writing of
dead letters in ``dead_letters``."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from walberg.apply.batch import BatchBuilder, StagedTable
from walberg.apply.iceberg import IcebergSink
from walberg.apply.types import TypeMap
from walberg.buffer.store import SegmentInfo, SegmentStore
from walberg.config import Config
from walberg.runtime.applier import Batch, Partition, grow_batch
from walberg.runtime.kafka.dead_letters import DeadLetters, refused
from walberg.runtime.kafka.frames import read_segment
from walberg.runtime.kafka.marks import OffsetMarks, offsets_text
from walberg.runtime.kafka.tables import NewColumns, Shape, TopicTables
from walberg.runtime.state import RunState
from walberg.source import debezium as dbz
from walberg.source import kafka
from walberg.source.debezium_columns import Columns, Decoded, split_envelope

log = logging.getLogger("walberg")

_RUN = 50_000  # records decoded in columns at once, at most


@dataclass
class KafkaReport:
    batches: int = 0
    records: int = 0  # changes staged for Iceberg
    dead_letters: int = 0
    offsets: dict[Partition, int] = field(default_factory=dict)  # next offset applied


class KafkaStager:
    """Stages the Debezium records of sealed segments for the applier."""

    def __init__(self, config: Config, store: SegmentStore, state: RunState, types: TypeMap,
                 targets: dict[str, str], sink: Callable[[], IcebergSink],
                 report: KafkaReport) -> None:
        assert config.source.kafka is not None
        self.config = config
        self.kafka = config.source.kafka
        self.store = store
        self.state = state
        self.types = types
        self.topics = list(self.kafka.topics)
        self.names = {t: self.kafka.table_for(t) for t in self.topics}  # topic -> table name
        self.targets = targets  # topic -> Iceberg table
        self.report = report
        self.sink = sink
        self.marks = OffsetMarks(state, {n: t for t, n in self.names.items()})
        self.tables = TopicTables(config, types, self.names, targets, sink)
        # The tables a batch is netted for: not those with a changelog (every mode but
        # upsert), which records every change.
        self._nettable = frozenset(n for n in self.names.values()
                                   if config.layout_for(n).mode == "upsert")
        self.dead = DeadLetters(config, state, self.names, targets, sink, self.marks)

    def prepare_next(self, after: Optional[Batch]) -> Optional[Batch]:
        """The sealed segments after ``after``'s, ``buffer.max_batch_bytes`` at a time,
        staged."""
        first = 0
        floor = self.state.applied_offsets()
        if after is not None:
            first = after.segments[-1].seq + (0 if after.cut else 1)
            for tp, o in after.offsets.items():
                floor[tp] = max(floor.get(tp, 0), o)
        batch = self._sealed_from(first, 0)
        committed = after.committed if after is not None else None
        return self._stage(batch, floor, committed) if batch else None

    def _sealed_from(self, first: int, size: int) -> list[SegmentInfo]:
        """The sealed segments from ``first`` on, no more than reach ``buffer.max_batch_bytes``
        with ``size`` (at least one)."""
        batch: list[SegmentInfo] = []
        for info in self.store.sealed():
            if info.seq < first:
                continue
            if (batch or size) and size + info.size_bytes > self.config.buffer.max_batch_bytes:
                break
            batch.append(info)
            size += info.size_bytes
        return batch

    def _grow(self, read: list[SegmentInfo], committed: Optional[threading.Event]
              ) -> tuple[list[SegmentInfo], float]:
        """More sealed segments for a batch that has staged ``read``, and the seconds waited
        for them: while the batch before it commits (``committed`` not set), or, for a run's
        first batch (no batch before), while the reader catches up with the topics' ends as
        they were when it began; then one more look. When the topics outpace the commits,
        batches grow and the lake gets fewer, larger commits; a backlog that fits one batch is
        one commit."""
        started = time.monotonic()
        last = read[-1].seq

        def wait() -> bool:
            if any(info.seq > last for info in self.store.sealed()):
                # Sealed, and not taken: no room for it, the batch is full. (Waiting on would
                # wait for ever once the reader pauses for the backlog it leaves pending.)
                return False
            more_to_come = (not committed.is_set() if committed is not None
                            else self.state.catching_up.is_set())
            if more_to_come:
                (committed or self.state.stop).wait(0.05)
            return more_to_come

        more = grow_batch(sum(info.size_bytes for info in read), self.config.buffer.max_batch_bytes,
                          self.state.stop, lambda size: self._sealed_from(last + 1, size), wait)
        return more or [], time.monotonic() - started

    def _stage(self, segments: list[SegmentInfo], floor: dict[Partition, int],
               committed: Optional[threading.Event] = None) -> Batch:
        """Turn the segments' records into staged changes per table, the next offset of each
        partition read, and the records that cannot be applied (dead letters). Records below
        ``floor`` (the batch before, not yet committed) are left out. A record that adds
        columns to a table this batch has rows of ends the batch before it. The batch grows
        by the segments sealed while the batch before commits (``committed``), or, the first
        of a run, while the reader catches up (see ``_grow``)."""
        started = time.monotonic()
        workdir = Path(tempfile.mkdtemp(prefix="batch-", dir=self.config.segment_dir))
        builder = BatchBuilder(workdir, prep=lambda name, columns: self.types.prep(
            columns, self.targets[self.tables.topic_of(name)]))
        into = _Staging(builder)
        read: list[SegmentInfo] = []
        cut = False
        # Records below these are held already (a replay after a crash) or in the batch before.
        below = self.state.lake_offsets()
        for tp, o in floor.items():
            below[tp] = max(below.get(tp, 0), o)
        segments = list(segments)
        waited = 0.0  # (for more segments: not staging)
        try:
            for info in segments:  # (grows while read)
                read.append(info)
                records, past = read_segment(self.store, info, below)
                if self._stage_records(into, by_topic(records)):
                    cut = True  # the record that adds columns starts the next batch
                    break
                for tp, o in past.items():  # (offsets without records: the lake may pass them)
                    into.upto[tp] = max(into.upto.get(tp, 0), o)
                if info is segments[-1]:
                    more, waited_now = self._grow(read, committed)
                    segments += more
                    waited += waited_now
            # Netted per key here (each key's last change), as a Postgres batch is: their new
            # rows are then written on the driver, not by a Spark job per table.
            staged = builder.finish((into.seq, []), self._nettable)
            into.dead += refused(staged, into.by_seq)
            # (not the records themselves: the batch lives on through its commit, beside the
            # next one's staging)
            both = {t for t in self.topics if self.config.layout_for(self.names[t]).mode == "both"}
            positions = [(seq, r.topic, r.partition, r.offset) for seq, r in into.by_seq.items()
                         if r.topic in both] if both else []
        except BaseException:
            builder.discard()
            raise
        tables = [self.names[t] for t in self.topics
                  if (st := staged.get(self.names[t])) is not None and (st.rows or st.truncates)]
        return Batch(read, builder, staged, tables, into.seq,
                     sum(st.rows for st in staged.values()),
                     time.monotonic() - started - waited,
                     offsets=into.upto, dead=into.dead, cut=cut, records=positions)

    def _stage_records(self, into: _Staging, records: list[kafka.Record]) -> bool:
        """Stage the records in order: runs of a topic's records in columns where the decoder
        vouches for them, the others one by one. True when a record ends the batch before it
        (new columns)."""
        i = 0
        while i < len(records):
            topic = records[i].topic
            shape = self.tables.shapes.get(topic) if topic in self.names else None
            decoder, text = self._form(shape, records[i])
            if shape is None or decoder is None:
                if self._stage_one(into, records[i]):
                    return True
                i += 1
                continue
            texts = [text]
            j = i + 1
            while j < len(records) and j - i < _RUN and records[j].topic == topic:
                form, text = self._form(shape, records[j])
                if form is not decoder:
                    break
                texts.append(text)
                j += 1
            run = records[i:j]
            for lo, hi, decoded in decoder.decode(texts, [r.key for r in run]):
                fast = decoded.fast if decoded is not None else np.zeros(hi - lo, np.bool_)
                edges = [0, *(np.flatnonzero(fast[1:] != fast[:-1]) + 1).tolist(), hi - lo]
                for a, b in zip(edges, edges[1:], strict=False):
                    if fast[a]:
                        assert decoded is not None
                        self._stage_decoded(into, topic, shape, run[lo + a:lo + b], decoded, a, b)
                        continue
                    for k in range(lo + a, lo + b):
                        if self._stage_one(into, run[k]):
                            return True
                        if self.tables.shapes.get(topic) is not shape:  # the record's schema added columns
                            return self._stage_records(into, run[k + 1:] + records[j:])
            i = j
        return False

    @staticmethod
    def _form(shape: Optional[Shape], record: kafka.Record) -> tuple[Optional[Columns], bytes]:
        """The decoder that takes the record in columns, and the text it reads (the value, or
        the payload of a value whose schema text was seen before); None: one at a time."""
        value = record.value
        if shape is None or value is None:
            return None, b""
        parts = split_envelope(value)
        if parts is not None:
            known = shape.schemas.get(parts[0])
            return (known, parts[1]) if known is not None and known.usable else (None, b"")
        return (shape.decoder, value) if shape.decoder.usable else (None, b"")

    def _stage_one(self, into: _Staging, record: kafka.Record) -> bool:
        """Stage one record by itself; True when it adds columns to a table this batch has
        rows of (it starts the next batch)."""
        tp = (record.topic, record.partition)
        try:
            if self._stage_record(into.builder, record, into.seq + 2):
                into.seq += 2  # room for the delete half of a key change
                into.by_seq[into.seq] = record
        except dbz.BadRecord as exc:
            into.dead.append((record, str(exc)))
        except NewColumns:
            return True
        into.upto[tp] = max(into.upto.get(tp, 0), record.offset + 1)
        return False

    def _stage_decoded(self, into: _Staging, topic: str, shape: Shape,
                       records: list[kafka.Record], decoded: Decoded, lo: int, hi: int) -> None:
        """Stage records decoded in columns (rows lo..hi of ``decoded``): one change each."""
        seqs = into.seq + 2 * np.arange(1, len(records) + 1, dtype=np.int64)
        ops, lsn, values, unchanged = decoded.slice(lo, hi)
        into.builder.add_columns(self.names[topic], shape.columns, ops, seqs, lsn, values,
                                 unchanged)
        into.seq = int(seqs[-1])
        numbers = seqs.tolist()
        into.by_seq.update(zip(numbers, records, strict=True))
        # (a partition's offsets grow: its last record is its furthest)
        into.upto.update({(r.topic, r.partition): r.offset + 1 for r in records})

    def _stage_record(self, builder: BatchBuilder, record: kafka.Record, seq: int) -> bool:
        """Stage one record's change(s) at ``seq``; False if it holds none (a tombstone, or a
        topic no longer in the pipeline file)."""
        if record.topic not in self.names:
            return False  # a topic taken out of the pipeline file since it was read
        if record.value is None:
            return False  # a tombstone: Kafka's compaction marker, not a change
        event = dbz.parse_event(record.value)
        key = dbz.parse_key(record.key)
        shape = self.tables.shape(record.topic, event, key)
        name, target = self.names[record.topic], self.targets[record.topic]
        if event.fields is not None:
            shape = self.tables.widened(record.topic, shape, event.fields, builder)
        images = shape.images
        if event.fields is not None:
            table = {c.name: (c, t) for c, t in zip(shape.columns, shape.types, strict=True)}
            fields = tuple((n, dbz.as_column(t, *table[n]) if n in table else t)
                           for n, t in event.fields)
            dbz.check_fields(fields, shape.columns, lambda t, c: self.tables.same_type(t, c, target))
            # The record's own encoding (e.g. microseconds or milliseconds) reads its values.
            given = dict(fields)
            images = dbz.Images(shape.columns, tuple(
                given.get(c.name, t) for c, t in zip(shape.columns, shape.types, strict=True)))
        lsn = event.lsn or 0
        if event.truncates:
            builder.truncate(name, shape.columns, seq, lsn)
            return True
        staged = images.changes(event, key)
        for i, (op, row) in enumerate(staged):
            builder.add(name, shape.columns, op, seq - len(staged) + 1 + i, lsn, row)
        if event.fields is not None:
            self.tables.learn(shape, record.value, images)
        return True

    # ---- before and after the commits --------------------------------------------------------

    def follow(self, table: str, staged: StagedTable, batch: Batch) -> None:
        """See ``TopicTables.follow``."""
        self.tables.follow(table, staged, batch)

    def replays_inserts(self, table: str) -> bool:
        # A connector that crashed sends its last events again, creates included: a `c`
        # whose key the table holds already must not add a second row.
        return True

    def dead_letters(self, table: str, staged: StagedTable, batch: Batch) -> None:
        pass  # gathered with the batch's records: written by before_commit

    def before_commit(self, batch: Batch) -> None:
        """The batch's dead letters, before any table's commit (see ``DeadLetters.write``)."""
        self.report.dead_letters += self.dead.write(batch)

    def applied(self, batch: Batch) -> None:
        self._pass(batch)
        self.state.advance_offsets(batch.offsets, lake=False)
        self.report.batches += 1
        self.report.records += batch.changes

    def _pass(self, batch: Batch) -> None:
        """The offsets the batch read past what a table's commits hold, with nothing to commit
        (its topic's records were a transaction's commit marker, tombstones or dead letters):
        recorded with the table, so a start after retention deleted them goes on."""
        lake = self.state.lake_offsets()
        passed: dict[str, dict[Partition, int]] = {}
        for tp, o in batch.offsets.items():
            if tp in lake and o > lake[tp] and tp[0] in self.names \
                    and not self.state.is_halted(self.names[tp[0]]):
                passed.setdefault(tp[0], {})[tp] = o
        for topic, offsets in passed.items():
            self.sink().pass_offsets(self.targets[topic], offsets)
            self.state.advance_offsets(offsets, lake=True)
            log.info("%s: offsets %s hold nothing to commit; the table passes them",
                     self.names[topic], offsets_text(offsets))

    def done_with(self, batch: Batch) -> list[SegmentInfo]:
        # A batch cut before new columns leaves its last segment to the next one.
        return batch.segments[:-1] if batch.cut else batch.segments


def by_topic(records: list[kafka.Record]) -> list[kafka.Record]:
    """The records of a segment a topic at a time (topics in the order they first come), each
    topic's in their order: the columnar decoder takes a topic's records in runs, and the
    topics of an application's transactions interleave (200 topics: runs of a record or two,
    most of the staging's time spent per run). Only each partition's order matters: a table is
    applied by itself, and what a batch holds of a partition is still a prefix of it if a
    record that adds columns cuts the batch (the topics after it in this order are left whole
    to the next batch, from the offsets staged)."""
    groups: dict[str, list[kafka.Record]] = {}
    for record in records:
        groups.setdefault(record.topic, []).append(record)
    return records if len(groups) < 2 else [r for group in groups.values() for r in group]


@dataclass
class _Staging:
    """What staging a batch's records gathers."""

    builder: BatchBuilder
    seq: int = 0  # of the last change staged (a record takes two: see _stage_one)
    upto: dict[Partition, int] = field(default_factory=dict)  # next offset read, per partition
    dead: list[tuple[kafka.Record, str]] = field(default_factory=list)
    # Each record staged, by the last seq of its changes (for Batch.records and refused)
    by_seq: dict[int, kafka.Record] = field(default_factory=dict)
