"""A Kafka batch's dead letters, the records that cannot be applied: the rows the staging
refused traced back to their records, and all of them written, before any table's commit, into
``<table>__dlq`` with the next offset of each partition they come from."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Callable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from walberg import metrics
from walberg.apply.batch import StagedTable
from walberg.apply.iceberg import OFFSET_PROPERTY, IcebergSink
from walberg.config import Config
from walberg.faults import failure_point
from walberg.runtime.applier import Batch, Partition
from walberg.runtime.kafka.marks import OffsetMarks, offsets_text
from walberg.runtime.lakeside import commit_with_retries
from walberg.runtime.state import RunState
from walberg.source import kafka

log = logging.getLogger("walberg")

DEAD_LETTER_SCHEMA = pa.schema([
    pa.field("topic", pa.string()), pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()), pa.field("timestamp_ms", pa.int64()),
    pa.field("key", pa.binary()), pa.field("value", pa.binary()),
    pa.field("table", pa.string()), pa.field("_dlq_reason", pa.string())])


class DeadLetters:
    """Writes a batch's dead letters into the dead-letter tables of their topics' tables."""

    def __init__(self, config: Config, state: RunState, names: dict[str, str],
                 targets: dict[str, str], sink: Callable[[], IcebergSink],
                 marks: OffsetMarks) -> None:
        self.config = config
        self.state = state
        self.names = names  # topic -> table name
        self.targets = targets  # topic -> Iceberg table
        self._sink = sink
        self.marks = marks

    @property
    def sink(self) -> IcebergSink:
        return self._sink()

    def write(self, batch: Batch) -> int:
        """The batch's dead letters, before any table's commit: into ``<table>__dlq``, an
        Iceberg table like a Postgres source's dead-letter table (one place to look), in one
        commit per table carrying the next offset of each partition they come from. A replay
        after a crash leaves out the records that table holds already, so none is written
        twice. Returns how many this call wrote."""
        by_target: dict[str, list[tuple[kafka.Record, str]]] = {}
        total = 0
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
            total += written
            log.warning("%d record(s) of topic %s could not be applied and went to %s with the "
                        "reason in _dlq_reason; the first: partition %d offset %d: %s", written,
                        topic, self.sink.dead_letter_target(target), first[0].partition,
                        first[0].offset, first[1])
        return total

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


def refused(staged: Mapping[str, StagedTable],
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
