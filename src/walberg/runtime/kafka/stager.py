"""A Kafka batch: the Debezium records of sealed segments staged as changes per table, and
what a table needs before its commit (created from the records' shape). Commits of a Kafka
batch are marked with the next offset of every partition of the table's topic that the batch
read (``walberg.offset.<topic>.<partition>``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from walberg import metrics
from walberg.apply import evolution
from walberg.apply.batch import BatchBuilder, StagedTable
from walberg.apply.iceberg import OFFSET_PROPERTY, IcebergSink
from walberg.apply.types import TypeMap, pg_type_for
from walberg.buffer.store import SegmentInfo, SegmentStore
from walberg.config import Config, KafkaTopic
from walberg.errors import ConfigError
from walberg.faults import failure_point
from walberg.lakeside import commit_with_retries
from walberg.model import Column, Layout, Lsn
from walberg.runtime.applier import Batch, Partition, grow_batch
from walberg.runtime.kafka.frames import read_segment
from walberg.runtime.state import RunState
from walberg.source import debezium as dbz
from walberg.source import kafka
from walberg.source.debezium_columns import Columns, Decoded, is_envelope, split_envelope

log = logging.getLogger("walberg")

_RUN = 50_000  # records decoded in columns at once, at most
# A topic's table's key columns (a JSON list), for a run whose first record names none: a
# Debezium truncate has no message key.
KEY_PROPERTY = "walberg.key"
_SCHEMAS = 64  # schema texts remembered per table, at most

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
    images: dbz.Images = field(init=False)  # (records without a schema of their own)

    decoder: Columns = field(init=False)  # the same, a run of records at a time
    # Records with a schema of their own: a decoder per schema text seen (and checked).
    schemas: dict[bytes, Columns] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.images = dbz.Images(self.columns, self.types)
        self.decoder = Columns(self.images)


def offsets_text(offsets: Mapping[Partition, int]) -> str:
    return ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(offsets.items())) or "-"


class OffsetMarks:
    """A Kafka commit records the next offset of each partition of the table's topic."""

    def __init__(self, state: RunState, topics: dict[str, str]) -> None:
        self.state = state
        self.topics = topics  # table name -> topic
        # The changelog beside a table in mode both: the next offset of each partition it
        # holds (it commits before its table, so it may hold more than the table).
        self.changelog: dict[str, dict[Partition, int]] = {}

    def _of(self, table: str, batch: Batch) -> dict[Partition, int]:
        topic = self.topics.get(table)
        return {tp: o for tp, o in batch.offsets.items() if topic is None or tp[0] == topic}

    def marks(self, table: str, batch: Batch) -> Optional[dict[str, str]]:
        return {f"{OFFSET_PROPERTY}.{t}.{p}": str(o) for (t, p), o in self._of(table, batch).items()}

    def landed(self, sink: IcebergSink, table: str, target: str, batch: Batch) -> bool:
        held = sink.committed_offsets(target)
        return all(held.get(tp, -1) >= o for tp, o in self._of(table, batch).items())

    def upto(self, table: str, batch: Batch) -> str:
        return f"offsets {offsets_text(self._of(table, batch) if table else batch.offsets)}"

    def held(self, table: str) -> str:
        topic = self.topics.get(table)
        held = {tp: o for tp, o in self.state.lake_offsets().items() if tp[0] == topic}
        return f"offsets {offsets_text(held)}"

    def record(self, table: str, batch: Batch) -> None:
        self.state.advance_offsets(self._of(table, batch), lake=True)

    def in_changelog(self, table: str, batch: Batch) -> tuple[Optional[Lsn], list[tuple[int, int]]]:
        """The seq ranges of the batch's records below the offsets the changelog holds: a
        replay after its commit landed and the table's did not (they are a run of records at
        the batch's start, so mostly one range)."""
        held = self.changelog.get(table)
        if not held:
            return None, []
        topic = self.topics.get(table)
        skip: list[tuple[int, int]] = []
        before = False  # whether the record before (of this topic) is skipped too
        for seq, t, p, o in batch.records:
            if t != topic:
                continue
            if o >= held.get((t, p), 0):
                before = False
            elif before:
                skip[-1] = (skip[-1][0], seq)
            else:
                skip.append((seq - 1, seq))  # a record's changes take seq - 1 and seq
                before = True
        return None, skip

    def changelog_holds(self, table: str, batch: Batch) -> None:
        held = self.changelog.setdefault(table, {})
        for tp, o in self._of(table, batch).items():
            held[tp] = max(held.get(tp, 0), o)

    def read_changelog(self, sink: IcebergSink, table: str, changelog: str) -> None:
        topic = self.topics.get(table)
        self.changelog[table] = {tp: o for tp, o in sink.committed_offsets(changelog).items()
                                 if tp[0] == topic}


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
        self._sink = sink
        self.report = report
        self.marks = OffsetMarks(state, {n: t for t, n in self.names.items()})
        self._shapes: dict[str, _Shape] = {}

    @property
    def sink(self) -> IcebergSink:
        return self._sink()

    def _topic_of(self, name: str) -> str:
        return next(t for t, n in self.names.items() if n == name)

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
            columns, self.targets[self._topic_of(name)]))
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
                if self._stage_records(into, records):
                    cut = True  # the record that adds columns starts the next batch
                    break
                for tp, o in past.items():  # (offsets without records: the lake may pass them)
                    into.upto[tp] = max(into.upto.get(tp, 0), o)
                if info is segments[-1]:
                    more, waited_now = self._grow(read, committed)
                    segments += more
                    waited += waited_now
            staged = builder.finish()
            into.dead += _refused(staged, into.by_seq)
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
            shape = self._shapes.get(topic) if topic in self.names else None
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
                        if self._shapes.get(topic) is not shape:  # the record's schema added columns
                            return self._stage_records(into, run[k + 1:] + records[j:])
            i = j
        return False

    @staticmethod
    def _form(shape: Optional[_Shape], record: kafka.Record) -> tuple[Optional[Columns], bytes]:
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
        except _NewColumns:
            return True
        into.upto[tp] = max(into.upto.get(tp, 0), record.offset + 1)
        return False

    def _stage_decoded(self, into: _Staging, topic: str, shape: _Shape,
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
        shape = self._shape(record.topic, event, key)
        name, target = self.names[record.topic], self.targets[record.topic]
        if event.fields is not None:
            shape = self._widened(record.topic, shape, event.fields, builder)
        images = shape.images
        if event.fields is not None:
            table = {c.name: (c, t) for c, t in zip(shape.columns, shape.types, strict=True)}
            fields = tuple((n, dbz.as_column(t, *table[n]) if n in table else t)
                           for n, t in event.fields)
            dbz.check_fields(fields, shape.columns, lambda t, c: self._same_type(t, c, target))
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
            self._learn(shape, record.value, images)
        return True

    @staticmethod
    def _learn(shape: _Shape, value: bytes, images: dbz.Images) -> None:
        """Remember a schema text whose record was staged, so that later records carrying the
        same text (byte for byte) are decoded in columns with the same types."""
        parts = split_envelope(value)
        if parts is None or parts[0] in shape.schemas or len(shape.schemas) >= _SCHEMAS:
            return
        if is_envelope(parts):
            shape.schemas[parts[0]] = Columns(images)

    def _widened(self, topic: str, shape: _Shape, fields: tuple[tuple[str, dbz.FieldType], ...],
                 builder: BatchBuilder) -> _Shape:
        """Schema evolution a record's schema asks for: fields the table lacks become new
        (nullable) columns at its end, and a field whose type Iceberg can widen the column to
        in place (int32 to int64, float32 to float64, a decimal of more digits at the same
        scale: what Debezium sends after the source column's type was widened) widens it;
        unless the pipeline file gives the columns or ``sink.schema_evolution`` is strict (or,
        for a widening, add_columns).
        Raises _NewColumns when this batch already has rows of the table with the old
        columns."""
        target = self.targets[topic]
        names = {c.name: i for i, c in enumerate(shape.columns)}
        new = [(n, t) for n, t in fields if n not in names]
        wider: dict[int, dbz.FieldType] = {}
        for n, t in fields:
            if n in names:
                col = shape.columns[names[n]]
                mine = self._spark_type(Column(n, t.oid, t.modifier), target)
                theirs = self._spark_type(col, target)
                if mine != theirs and evolution.widens(theirs, mine):
                    wider[names[n]] = t
        chosen = self.kafka.tables.get(topic)
        table = self.names[topic]
        mode = self.config.layout_for(table).schema_evolution
        if mode != "full":
            wider = {}  # (add_columns: additions only)
        if not (new or wider) or (chosen is not None and chosen.columns) or mode == "strict":
            return shape  # (a field the table lacks, or of another type, is then a dead letter)
        if builder.columns_of(table) is not None:
            raise _NewColumns(topic)
        kept = tuple(Column(c.name, wider[i].oid, wider[i].modifier, c.is_key) if i in wider
                     else c for i, c in enumerate(shape.columns))
        columns = kept + tuple(Column(n, t.oid, t.modifier, False) for n, t in new)
        for c in columns:
            self.types.spark_type(c, target)
        types = tuple(wider.get(i, t) for i, t in enumerate(shape.types))
        widened = self._shapes[topic] = _Shape(columns, types + tuple(t for _, t in new))
        log.info("%s: the records' schema %s; %s follows", topic, "; ".join(
            [f"adds {n}" for n, _ in new] +
            [f"widens {shape.columns[i].name} to {self._spark_type(kept[i], target)}"
             for i in sorted(wider)]), target)
        return widened

    def _spark_type(self, col: Column, target: str) -> str:
        return str(self.types.spark_type(col, target).describe())

    def _same_type(self, t: dbz.FieldType, col: Column, target: str) -> bool:
        """Whether a record's field lands in ``col`` as it is: the same Iceberg type, or a
        narrower one the column was widened from (records written before the widening)."""
        mine = self._spark_type(Column(col.name, t.oid, t.modifier), target)
        theirs = self._spark_type(col, target)
        return mine == theirs or evolution.widens(mine, theirs)

    def _fields(self, topic: str, event: dbz.Event) -> list[tuple[str, dbz.FieldType]]:
        """The table's columns: from the pipeline file, else the existing Iceberg table, else
        the record's schema, else its JSON values."""
        chosen = self.kafka.tables.get(topic) or KafkaTopic.model_validate({})
        target = self.targets[topic]
        if chosen.columns:
            try:
                return [(n, dbz.type_from_name(t)) for n, t in chosen.columns.items()]
            except ValueError as exc:
                raise ConfigError(f"source.kafka.tables.{topic}.columns: {exc}") from None
        if self.sink.table_exists(target):
            return [(n, dbz.FieldType(*pg_type_for(t, f"{target}.{n}")))
                    for n, t in self.sink.schema(target)]
        if event.fields is not None:
            return list(event.fields)
        image = event.after if event.after is not None else event.before
        if image is None:
            raise dbz.BadRecord("no columns to learn the table from: the table does not "
                                "exist yet and this first record has no row and no schema")
        return [(n, dbz.infer_type(v)) for n, v in image.items()]

    def _shape(self, topic: str, event: dbz.Event, key: Optional[Mapping[str, Any]]) -> _Shape:
        """The table's columns and key, settled by the first record of a run."""
        shape = self._shapes.get(topic)
        if shape is not None:
            return shape
        chosen = self.kafka.tables.get(topic) or KafkaTopic.model_validate({})
        target = self.targets[topic]
        where = f"source.kafka.tables.{topic}"
        fields = self._fields(topic, event)
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
        elif self.sink.table_exists(target):
            keys = [k for k in self._recorded_key(target) if k in names]
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

    # ---- before and after the commits --------------------------------------------------------

    def follow(self, table: str, staged: StagedTable, batch: Batch) -> None:
        """The topic's table (and in mode both its changelog) exists and takes the staged
        columns."""
        topic = self._topic_of(table)
        layout = self.config.layout_for(table)
        if layout.mode == "append":
            self._follow(topic, self.targets[topic], staged, self.sink.ensure_changelog)
            return
        if layout.mode == "both":
            self._follow(topic, self.config.changelog_for_topic(topic), staged,
                         self.sink.ensure_changelog)
        self._follow(topic, self.targets[topic], staged, self.sink.ensure_table)

    def _recorded_key(self, target: str) -> list[str]:
        value = self.sink.properties(target, KEY_PROPERTY).get(KEY_PROPERTY)
        try:
            return [str(k) for k in json.loads(value)] if value else []
        except (ValueError, TypeError):
            return []  # (not walberg's)

    def _follow(self, topic: str, target: str, staged: StagedTable,
                ensure: Callable[[str, tuple[Column, ...], Layout], bool]) -> None:
        keys = [c.name for c in staged.columns if c.is_key]
        layout = self.config.layout_for(self.names[topic])
        made = dataclasses.replace(layout, properties={**layout.properties,
                                                       KEY_PROPERTY: json.dumps(keys)})
        if ensure(target, staged.columns, made):
            log.info("created %s", target)
        elif not self.sink.columns_match(target, staged.columns):
            current = self.sink.schema(target)
            wanted = [(c.name, self.types.spark_type(c, target).describe())
                      for c in staged.columns]
            try:
                steps = evolution.plan(current, wanted)
            except evolution.NotEvolvable:
                steps = []
            if not steps or any(s.kind not in ("add", "widen") for s in steps):
                raise ConfigError(f"{target} has columns {current}, not those walberg staged "
                                  f"for topic {topic}; give the table's columns in "
                                  f"source.kafka.tables.{topic}.columns")
            after = {n: (wanted[i - 1][0] if i else "") for i, (n, _) in enumerate(wanted)}
            self.sink.evolve(target, steps, after)
            log.info("evolved the schema of %s to follow topic %s: %s", target, topic,
                     "; ".join(s.describe() for s in steps))
        if keys and self._recorded_key(target) != keys:  # (a table made before it was kept)
            self.sink.set_property(target, KEY_PROPERTY, json.dumps(keys))

    def replays_inserts(self, table: str) -> bool:
        # A connector that crashed sends its last events again, creates included: a `c`
        # whose key the table holds already must not add a second row.
        return True

    def dead_letters(self, table: str, staged: StagedTable, batch: Batch) -> None:
        pass  # gathered with the batch's records: written by before_commit

    def before_commit(self, batch: Batch) -> None:
        """The batch's dead letters, before any table's commit: into ``<table>__dlq``, an
        Iceberg table like a Postgres source's dead-letter table (one place to look), in one
        commit per table carrying the next offset of each partition they come from. A replay
        after a crash leaves out the records that table holds already, so none is written
        twice."""
        by_target: dict[str, list[tuple[kafka.Record, str]]] = {}
        for record, reason in batch.dead:
            by_target.setdefault(self.targets[record.topic], []).append((record, reason))
        for target, items in sorted(by_target.items()):
            items.sort(key=lambda item: (item[0].partition, item[0].offset))
            upto = {(r.topic, r.partition): r.offset + 1 for r, _ in items}
            table = pa.Table.from_pylist([
                {"topic": r.topic, "partition": r.partition, "offset": r.offset,
                 "timestamp_ms": r.timestamp, "key": r.key, "value": r.value,
                 "table": target, "_dlq_reason": why} for r, why in items],
                schema=DEAD_LETTER_SCHEMA)
            topic = items[0][0].topic
            with tempfile.TemporaryDirectory(prefix="walberg-dlq-",
                                             dir=self.config.segment_dir) as work:
                staged = Path(work) / "dead.parquet"
                pq.write_table(table, staged)
                written = self._write_dead(target, staged, upto, self.names.get(topic, topic))
            if written < len(items):
                # Written by a run that stopped before its tables' commits, perhaps before it
                # could say so: said again, not written again.
                log.warning("%d record(s) of topic %s could not be applied and are in %s with "
                            "the reason in _dlq_reason (written there before a restart)",
                            len(items) - written, topic, self.sink.dead_letter_target(target))
            if not written:
                continue
            first = items[0]
            metrics.DEAD_LETTERS.labels(self.names.get(topic, topic)).inc(written)
            self.report.dead_letters += written
            log.warning("%d record(s) of topic %s could not be applied and went to %s with the "
                        "reason in _dlq_reason; the first: partition %d offset %d: %s", written,
                        topic, self.sink.dead_letter_target(target), first[0].partition,
                        first[0].offset, first[1])

    def _write_dead(self, target: str, staged: Path, upto: dict[Partition, int],
                    table: str) -> int:
        """``write_record_dead_letters`` (its commit marked with the next offset of each
        partition, ``upto``), tried again on storage or catalog failures like a table's commit;
        a retry leaves out what an attempt whose outcome was unknown wrote."""
        marks = {f"{OFFSET_PROPERTY}.{t}.{p}": str(o) for (t, p), o in upto.items()}
        written = 0

        def write() -> None:
            nonlocal written
            written += self.sink.write_record_dead_letters(target, staged, marks)
            failure_point("dead-letters")

        commit_with_retries(self.config.sink, self.state.stop, self.sink, table,
                            self.sink.dead_letter_target(target), write, lambda: False,
                            f"offsets {offsets_text(upto)}",
                            self.marks.held(table))
        return written

    def applied(self, batch: Batch) -> None:
        self.state.advance_offsets(batch.offsets, lake=False)
        self.report.batches += 1
        self.report.records += batch.changes

    def done_with(self, batch: Batch) -> list[SegmentInfo]:
        # A batch cut before new columns leaves its last segment to the next one.
        return batch.segments[:-1] if batch.cut else batch.segments


@dataclass
class _Staging:
    """What staging a batch's records gathers."""

    builder: BatchBuilder
    seq: int = 0  # of the last change staged (a record takes two: see _stage_one)
    upto: dict[Partition, int] = field(default_factory=dict)  # next offset read, per partition
    dead: list[tuple[kafka.Record, str]] = field(default_factory=list)
    # Each record staged, by the last seq of its changes (for Batch.records and _refused)
    by_seq: dict[int, kafka.Record] = field(default_factory=dict)


class _NewColumns(Exception):
    """A record adds columns to a table the batch has rows of: the batch ends before it."""


def _refused(staged: Mapping[str, StagedTable],
             by_seq: Mapping[int, kafka.Record]) -> list[tuple[kafka.Record, str]]:
    """Rows the staging refused (a value the Iceberg type cannot hold exactly), back to the
    records they came from."""
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
