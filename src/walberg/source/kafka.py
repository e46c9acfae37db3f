"""Reading Kafka topics: the consumer (confluent-kafka, imported only when a Kafka source is
used), and the framing of one consumed record for the segment files.

The consumer is assigned its partitions and told where to start in each; it never joins a
rebalancing group, because where to start comes from the lake (the offsets committed with the
data), not from the broker. It commits offsets to the group only to show lag to the usual
Kafka tools.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from walberg.errors import ConfigError, SourceError, Transient

log = logging.getLogger("walberg")

# topic length, partition, offset, timestamp (ms), key length, value length (-1: null)
_HEAD = struct.Struct(">HiqqII")
_NULL = 0xFFFFFFFF
# The earliest offset, Kafka's special value for "from the start of the partition".
BEGINNING = -2


class Record(NamedTuple):
    """One consumed record (a named tuple: made for every record read, and quick to make)."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: Optional[bytes]
    value: Optional[bytes]


def encode(record: Record) -> bytes:
    """One record as a segment frame's payload."""
    topic = record.topic.encode()
    key, value = record.key, record.value
    return b"".join((
        _HEAD.pack(len(topic), record.partition, record.offset, record.timestamp,
                   _NULL if key is None else len(key), _NULL if value is None else len(value)),
        topic, key or b"", value or b""))


_TOPICS: dict[bytes, str] = {}  # a frame's topic name as text (a few topics, many records)
_new_record = tuple.__new__  # (a Record made without the named tuple's Python-level __new__)


def decode(payload: bytes) -> Record:
    """The inverse of ``encode``."""
    tlen, partition, offset, ts, klen, vlen = _HEAD.unpack_from(payload, 0)
    at = _HEAD.size + tlen
    name = payload[_HEAD.size:at]
    topic = _TOPICS.get(name)
    if topic is None:
        if len(_TOPICS) > 10_000:
            _TOPICS.clear()
        topic = _TOPICS[name] = name.decode()
    key = None
    if klen != _NULL:
        key = payload[at:at + klen]
        at += klen
    value = None if vlen == _NULL else payload[at:at + vlen]
    return _new_record(Record, (topic, partition, offset, ts, key, value))


# A run of records in one frame (``encode_run``): the count and the number of topic names,
# then the names (length and UTF-8), then per record in columns: the topic's index, partition,
# offset, timestamp (ms), key length and value length (-1: null); then the keys and the values.
_RUN_HEAD = struct.Struct(">IH")
_NAME = struct.Struct(">H")
_RUN_COLUMNS = (">u2", ">i4", ">i8", ">i8", ">i4", ">i4")
RUN_BYTES = 1 << 20  # a run frame's keys and values, about at most (a record larger goes alone)


def runs(records: Sequence[Record], limit: int = RUN_BYTES) -> Iterator[tuple[int, bytes]]:
    """The records as frames of runs (``encode_run``) of about ``limit`` bytes of keys and
    values at most, with the largest offset each holds (the frame's position in its segment)."""
    start = size = 0
    for i, r in enumerate(records):
        took = len(r.value or b"") + len(r.key or b"")
        if size and size + took > limit:
            run = records[start:i]
            yield max(x.offset for x in run), encode_run(run)
            start, size = i, 0
        size += took
    if start < len(records):
        run = records[start:]
        yield max(x.offset for x in run), encode_run(run)


def encode_run(records: Sequence[Record]) -> bytes:
    """Records as one frame's payload: columns of numbers, then the keys and the values (a
    poll's records are framed once, not each on its own)."""
    names: dict[str, int] = {}
    for r in records:
        if r.topic not in names:
            names[r.topic] = len(names)
    keys = [r.key for r in records]
    values = [r.value for r in records]
    columns = ([names[r.topic] for r in records], [r.partition for r in records],
               [r.offset for r in records], [r.timestamp for r in records],
               [-1 if k is None else len(k) for k in keys],
               [-1 if v is None else len(v) for v in values])
    encoded = [name.encode() for name in names]
    return b"".join((
        _RUN_HEAD.pack(len(records), len(names)),
        *(_NAME.pack(len(e)) + e for e in encoded),
        *(np.asarray(c, dtype=t).tobytes() for c, t in zip(columns, _RUN_COLUMNS, strict=True)),
        b"".join(k for k in keys if k), b"".join(v for v in values if v)))


def decode_run(payload: bytes) -> list[Record]:
    """The inverse of ``encode_run``."""
    n, count = _RUN_HEAD.unpack_from(payload, 0)
    at = _RUN_HEAD.size
    names = []
    for _ in range(count):
        (size,) = _NAME.unpack_from(payload, at)
        names.append(payload[at + 2:at + 2 + size].decode())
        at += 2 + size
    columns = []
    for t in _RUN_COLUMNS:
        column = np.frombuffer(payload, dtype=t, count=n, offset=at)
        columns.append(column)
        at += column.nbytes
    topic, partition, offset, ts, klen, vlen = columns

    def pieces(lengths: "np.ndarray[Any, Any]", start: int) -> tuple[list[Optional[bytes]], int]:
        ends = start + np.cumsum(np.maximum(lengths, 0))
        starts = (ends - np.maximum(lengths, 0)).tolist()
        out = [payload[a:b] if size >= 0 else None
               for a, b, size in zip(starts, ends.tolist(), lengths.tolist(), strict=True)]
        return out, int(ends[-1]) if n else start

    keys, at = pieces(klen, at)
    values, at = pieces(vlen, at)
    topics = [names[i] for i in topic.tolist()]
    return [_new_record(Record, fields) for fields in zip(
        topics, partition.tolist(), offset.tolist(), ts.tolist(), keys, values, strict=True)]


# Offsets that hold no record (``encode_past``): the count, then per partition the topic's
# length and name (UTF-8), the partition and the offset up to which none is a record.
_PAST = struct.Struct(">iq")


def encode_past(past: Mapping[tuple[str, int], int]) -> bytes:
    """Where the consumer reached partitions' ends past offsets that hold no record (a
    transaction's commit marker takes an offset, aborted records are not read): the lake's
    offsets may move there, so a gap the markers leave is never taken for records lost."""
    parts = [struct.pack(">I", len(past))]
    for (topic, partition), offset in sorted(past.items()):
        name = topic.encode()
        parts += [_NAME.pack(len(name)), name, _PAST.pack(partition, offset)]
    return b"".join(parts)


def decode_past(payload: bytes) -> dict[tuple[str, int], int]:
    """The inverse of ``encode_past``."""
    (n,) = struct.unpack_from(">I", payload, 0)
    at, out = 4, {}
    for _ in range(n):
        (size,) = _NAME.unpack_from(payload, at)
        topic = payload[at + 2:at + 2 + size].decode()
        partition, offset = _PAST.unpack_from(payload, at + 2 + size)
        out[(topic, partition)] = offset
        at += 2 + size + _PAST.size
    return out


def _module() -> Any:
    try:
        import confluent_kafka
    except ImportError:
        raise ConfigError("the Kafka source needs the confluent-kafka package: "
                          "pip install 'walberg[kafka]' (or pip install confluent-kafka)") from None
    return confluent_kafka


POLL_LIMIT = 500  # records a poll asks for at most


class Consumer:
    """A consumer of the configured topics, started at given offsets."""

    def __init__(self, bootstrap_servers: str, group_id: str,
                 properties: Mapping[str, str]) -> None:
        ck = _module()
        self._ck = ck
        self.servers = bootstrap_servers
        settings = {"bootstrap.servers": bootstrap_servers, "group.id": group_id,
                    "enable.auto.commit": False, "enable.auto.offset.store": False,
                    # Joins and heartbeats of the group are short, so a committing consumer
                    # never waits long on a broker that rebalances slowly.
                    "session.timeout.ms": 6000, "heartbeat.interval.ms": 300,
                    **properties,
                    # Where each partition's end was reached (see ``reached``).
                    "enable.partition.eof": True,
                    # Reading starts at the lake's offsets (or the beginning): one the
                    # partition no longer has (retention deleted records not yet read while
                    # walberg ran, or the topic was made again) is an error, never a jump.
                    "auto.offset.reset": "error"}
        self._consumer = ck.Consumer(settings)
        # Per partition, the offset at which reading last reached its end: past a transaction's
        # commit marker, which takes an offset and is never a record, and past aborted records.
        self.reached: dict[tuple[str, int], int] = {}
        self._errors_said: dict[tuple[Any, Optional[str], Optional[int]], float] = {}

    def partitions(self, topics: Sequence[str], timeout: float = 10.0) -> list[tuple[str, int]]:
        """Every (topic, partition) of the topics; a missing topic is an error that says so."""
        try:
            meta = self._consumer.list_topics(timeout=timeout)
        except self._ck.KafkaException as exc:
            raise Transient(f"cannot reach the Kafka broker at {self.servers} "
                            f"(source.kafka.bootstrap_servers): {exc.args[0]}") from None
        found: list[tuple[str, int]] = []
        for topic in topics:
            info = meta.topics.get(topic)
            if info is None or info.error is not None or not info.partitions:
                raise SourceError(f"topic {topic} (source.kafka.topics) does not exist on "
                                  f"{self.servers}; create it, or let the Debezium connector "
                                  "create it, then run walberg again")
            found.extend((topic, p) for p in sorted(info.partitions))
        return found

    def high_watermark(self, topic: str, partition: int, timeout: float = 10.0) -> int:
        """The offset after the last record of the partition now."""
        return self.watermarks(topic, partition, timeout)[1]

    def watermarks(self, topic: str, partition: int, timeout: float = 10.0) -> tuple[int, int]:
        """The partition's first offset still kept (retention deletes below it) and the
        offset after its last record, now."""
        try:
            low, high = self._consumer.get_watermark_offsets(
                self._ck.TopicPartition(topic, partition), timeout=timeout, cached=False)
        except self._ck.KafkaException as exc:
            raise Transient(f"cannot read the ends of {topic} partition {partition} from "
                            f"{self.servers}: {exc.args[0]}") from None
        return int(low), int(high)

    def assign(self, start: Mapping[tuple[str, int], int]) -> None:
        """Read these partitions from these offsets (``BEGINNING``: the earliest there is)."""
        self._consumer.assign([self._ck.TopicPartition(t, p, o) for (t, p), o in start.items()])

    def add(self, start: Mapping[tuple[str, int], int]) -> None:
        """Read these partitions too (added to a topic while running), from these offsets."""
        self._consumer.incremental_assign(
            [self._ck.TopicPartition(t, p, o) for (t, p), o in start.items()])

    def poll(self, timeout: float, limit: int = POLL_LIMIT) -> list[Record]:
        """Up to ``limit`` records, within ``timeout`` seconds: librdkafka returns as soon as
        it has ``limit`` of them, else at the timeout with what came."""
        out: list[Record] = []
        for m in self._consumer.consume(limit, timeout):
            error = m.error()
            if error is not None:
                if error.code() == self._ck.KafkaError._PARTITION_EOF:
                    self.reached[(m.topic(), m.partition())] = m.offset()
                    continue
                if error.code() == self._ck.KafkaError._AUTO_OFFSET_RESET:
                    raise SourceError(
                        f"{m.topic()} partition {m.partition()} no longer has the records "
                        f"walberg reads next ({error.str()}): retention deleted records "
                        "walberg had not read, or the topic was deleted and made again, and "
                        "the table misses their changes. Raise the topic's retention.ms to "
                        "cover walberg's lag; to repair the table, drop it and have the "
                        "connector send a snapshot again.")
                if error.fatal():
                    raise SourceError(f"Kafka consumer failed on {m.topic()} partition "
                                      f"{m.partition()}: {error.str()}")
                self._said(m.topic(), m.partition(), error)
                continue  # librdkafka retries transient errors itself
            _, ts = m.timestamp()
            out.append(Record(m.topic(), m.partition(), m.offset(), ts, m.key(), m.value()))
        return out

    def _said(self, topic: Optional[str], partition: Optional[int], error: Any) -> None:
        """Log an error the consumer goes on after (a topic gone, no leader, no rights), once
        a minute for each: a run that reads nothing says why."""
        what = (error.code(), topic, partition)
        now = time.monotonic()
        if now - self._errors_said.get(what, -60.0) < 60.0:
            return
        self._errors_said[what] = now
        where = f"{topic} partition {partition}" if topic else self.servers
        log.warning("Kafka consumer, %s: %s (librdkafka tries again; said once a minute)",
                    where, error.str())

    def commit(self, offsets: Mapping[tuple[str, int], int], wait: bool = False) -> None:
        """Tell the group where walberg is (for lag monitoring; walberg never reads it back);
        ``wait``: until the broker has it (before the consumer closes)."""
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=[self._ck.TopicPartition(t, p, o)
                                           for (t, p), o in offsets.items()],
                                  asynchronous=not wait)
        except self._ck.KafkaException:
            pass  # only monitoring: the lake holds the offsets that count

    def close(self) -> None:
        self._consumer.close()
