"""The frames of a Kafka pipeline's segment files: the kinds it writes, and a sealed segment
read back as its records and the offsets it found to hold no record."""

from __future__ import annotations

from walberg.buffer.kinds import FrameKind, refuse_foreign
from walberg.buffer.store import SegmentInfo, SegmentStore
from walberg.runtime.applier import Partition
from walberg.source import kafka

FRAME_KAFKA = int(FrameKind.KAFKA_RECORD)  # one record (kafka.encode; before run frames)
FRAME_KAFKA_RUN = int(FrameKind.KAFKA_RUN)  # a run of records (kafka.encode_run)
FRAME_KAFKA_PAST = int(FrameKind.KAFKA_PAST)  # offsets that hold no record (kafka.encode_past)


def read_segment(store: SegmentStore, info: SegmentInfo, below: dict[Partition, int]
                 ) -> tuple[list[kafka.Record], dict[Partition, int]]:
    """The segment's records from ``below`` on (per partition: those before are held already),
    and per partition the offset up to which the consumer found no more record (past a
    transaction's commit marker). A frame of a Postgres pipeline's kind is refused: this
    directory is not the Kafka pipeline's."""
    records: list[kafka.Record] = []
    past: dict[Partition, int] = {}
    for _, kind, payload in store.read(info):
        if kind == FRAME_KAFKA_RUN:
            run = kafka.decode_run(payload)
        elif kind == FRAME_KAFKA:
            run = [kafka.decode(payload)]
        elif kind == FRAME_KAFKA_PAST:
            for tp, offset in kafka.decode_past(payload).items():
                if offset > below.get(tp, 0):
                    past[tp] = max(past.get(tp, 0), offset)
            continue
        else:
            raise refuse_foreign(info.path, kind, "Kafka")
        records += [r for r in run if r.offset >= below.get((r.topic, r.partition), 0)]
    return records, past
