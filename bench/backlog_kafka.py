"""The kafka shape of bench/backlog.py: the same table and backlog as Debezium change events in
a Kafka topic (a Tansu broker, in memory, on loopback), applied by `walberg run --once` with
the Kafka source.

The table's N rows are Debezium snapshot events (op "r") in one topic of one partition, keyed
by a string (`customer-<n>`, as Debezium keys often are), without the envelope's schema (the
pipeline file gives the columns: id text, name text, amount numeric(12,2), n integer). A first
`walberg run --once` applies them (the lake's initial load from Kafka: there is no COPY); its
baseline is a plain consumer (confluent-kafka, in this process) draining the same records from
the topic. The backlog is the one of the Postgres shapes: half inserts of new keys, three
tenths updates and two tenths deletes of distinct keys drawn at random, as "c", "u" (before and
after) and "d" events; its baseline is the same consumer draining them, as pg_recvlogical is
for the Postgres shapes: how fast the broker hands them out.

Tansu's high watermark counts the last batch, not its records, so the records are produced in
batches (fast) and each burst's last record alone, which makes the watermark right: a
`--once` run reads up to it.
"""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kafka_broker import create_topic, start_tansu  # noqa: E402

COLUMNS = {"id": "text", "name": "text", "amount": "numeric(12,2)", "n": "integer"}


def broker(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A Tansu broker for the run: its process and bootstrap servers."""
    proc, servers = start_tansu(work / "tansu.log")
    return proc, str(servers)


def _row(g: int, name: str, amount: str, n: int) -> dict[str, Any]:
    return {"id": f"customer-{g}", "name": name, "amount": amount, "n": n}


# --shape kafka-schema: the records as Kafka Connect's JSON converter writes them by default
# (schemas.enable), the numeric as Debezium's default Connect decimal (base64, scale 2).
_FIELDS = [{"field": "id", "type": "string", "optional": False},
           {"field": "name", "type": "string", "optional": True},
           {"field": "amount", "type": "bytes", "optional": True, "version": 1,
            "name": "org.apache.kafka.connect.data.Decimal",
            "parameters": {"scale": "2", "connect.decimal.precision": "12"}},
           {"field": "n", "type": "int32", "optional": True}]
_ROW = {"type": "struct", "optional": True, "name": "bench.public.t.Value", "fields": _FIELDS}
_SOURCE = {"type": "struct", "optional": False, "name": "io.debezium.connector.postgresql.Source",
           "field": "source", "fields": [
               *({"type": "string", "optional": False, "field": f} for f in
                 ("version", "connector", "name", "db", "schema", "table")),
               {"type": "int64", "optional": False, "field": "ts_ms"},
               {"type": "int64", "optional": True, "field": "lsn"}]}
VALUE_SCHEMA = json.dumps({"type": "struct", "optional": False, "name": "bench.public.t.Envelope",
                           "fields": [{**_ROW, "field": "before"}, {**_ROW, "field": "after"},
                                      _SOURCE, {"type": "string", "optional": False, "field": "op"},
                                      {"type": "int64", "optional": True, "field": "ts_ms"}]},
                          separators=(",", ":"))
KEY_SCHEMA = json.dumps({"type": "struct", "optional": False, "name": "bench.public.t.Key",
                         "fields": [_FIELDS[0]]}, separators=(",", ":"))


def _connect_decimal(row: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if row is None:
        return None
    cents = round(float(row["amount"]) * 100)
    size = max(1, (cents.bit_length() + 8) // 8)
    return {**row, "amount": base64.b64encode(cents.to_bytes(size, "big", signed=True)).decode()}


def _event(op: str, before: Optional[dict[str, Any]], after: Optional[dict[str, Any]],
           schema: bool = False) -> tuple[bytes, bytes]:
    key = (after or before or {})["id"]
    if schema:
        before, after = _connect_decimal(before), _connect_decimal(after)
    source: dict[str, Any] = {"connector": "postgresql"}
    if schema:  # (every field its schema declares)
        source = {"version": "2.7.0.Final", "connector": "postgresql", "name": "bench",
                  "db": "bench", "schema": "public", "table": "t", "ts_ms": 1_700_000_000_000,
                  "lsn": None}
    value = {"op": op, "before": before, "after": after, "ts_ms": 1_700_000_000_000,
             "source": source}
    if not schema:
        return json.dumps({"id": key}).encode(), json.dumps(value).encode()
    return (f'{{"schema":{KEY_SCHEMA},"payload":{json.dumps({"id": key})}}}'.encode(),
            f'{{"schema":{VALUE_SCHEMA},"payload":{json.dumps(value)}}}'.encode())


def produce(servers: str, topic: str, events: Iterator[tuple[bytes, bytes]]) -> int:
    """Sends ``events`` (key, value) to partition 0 of ``topic``: all but the last in
    batches, the last alone (see the module's note); returns how many."""
    from confluent_kafka import Producer

    batched = Producer({"bootstrap.servers": servers, "acks": "all", "linger.ms": 5})
    sent = 0
    last: Optional[tuple[bytes, bytes]] = None
    for event in events:
        if last is not None:
            while True:
                try:
                    batched.produce(topic, key=last[0], value=last[1], partition=0)
                    break
                except BufferError:
                    batched.poll(0.05)
            sent += 1
            if sent % 10_000 == 0:
                batched.poll(0)
        last = event
    if batched.flush(300):
        raise SystemExit(f"Kafka did not take every record of {topic}")
    if last is not None:
        alone = Producer({"bootstrap.servers": servers, "acks": "all", "linger.ms": 0,
                          "batch.num.messages": 1})
        alone.produce(topic, key=last[0], value=last[1], partition=0)
        if alone.flush(60):
            raise SystemExit(f"Kafka did not take the last record of {topic}")
        sent += 1
    return sent


def drain(servers: str, topic: str, start: int, end: int) -> float:
    """Seconds a plain consumer takes to read offsets ``start``..``end`` - 1 of the topic,
    from its creation to the last record: the baseline, as pg_recvlogical's for Postgres."""
    from confluent_kafka import Consumer, TopicPartition

    began = time.perf_counter()
    consumer = Consumer({"bootstrap.servers": servers, "group.id": f"drain_{topic}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, start)])
        at = start
        while at < end:
            # (no more than is left: librdkafka waits out the timeout for a batch it cannot fill)
            for m in consumer.consume(min(10_000, end - at), timeout=10):
                offset = m.offset()
                if m.error() is None and offset is not None:
                    at = offset + 1
        return time.perf_counter() - began
    finally:
        consumer.close()


def write_config(servers: str, work: Path, name: str, topic: str) -> Path:
    raw: dict[str, Any] = {
        "source": {"kafka": {"bootstrap_servers": servers, "topics": [topic],
                             "group_id": f"walberg_{name}",
                             "tables": {topic: {"table": f"bench.{name}", "key": ["id"],
                                                "columns": COLUMNS}}}},
        "sink": {"catalog": {"name": "lake", "type": "hadoop",
                             "warehouse": str(work / "warehouse")}, "namespace": "bench"},
        "buffer": {"dir": str(work / f"segments_{name}")},
        "spark": {"master": "local[2]"},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def one_size(servers: str, work: Path, rows: int, changes: int,
             walberg_once: Callable[..., float], noop: Callable[[Path], dict[str, Any]],
             batch_seconds: Callable[[Path, str], float], schema: bool = False
             ) -> dict[str, Any]:
    """One table size: the same record of figures as the Postgres shapes' (its baselines a
    consumer's drain instead of COPY TO STDOUT and pg_recvlogical). ``schema``: the records
    carry the envelope's schema part (--shape kafka-schema)."""
    name = f"backlog_kafka{'_schema' if schema else ''}_{rows}"
    topic = f"bench.public.{name}"
    create_topic(servers, topic)
    produce(servers, topic, (_event("r", None, _row(g, f"customer {g}",
                                                    f"{(g % 100_000) / 100:.2f}", g % 1000),
                                    schema)
                             for g in range(1, rows + 1)))
    drain_table_s = drain(servers, topic, 0, rows)
    config = write_config(servers, work, name, topic)
    copy_s = walberg_once(config, "copy")
    fixed = noop(config)
    inserts, updates = changes // 2, changes * 3 // 10
    deletes = changes - inserts - updates
    drawn = random.Random(rows).sample(range(1, rows + 1), updates + deletes)

    def backlog() -> Iterator[tuple[bytes, bytes]]:
        for g in range(rows + 1, rows + inserts + 1):
            yield _event("c", None, _row(g, f"new {g}", "1.00", 1), schema)
        for g in drawn[:updates]:
            old = _row(g, f"customer {g}", f"{(g % 100_000) / 100:.2f}", g % 1000)
            new = dict(old, amount=f"{(g % 100_000) / 100 + 1:.2f}", n=g % 1000 + 1)
            yield _event("u", old, new, schema)
        for g in drawn[updates:]:
            yield _event("d", _row(g, f"customer {g}", f"{(g % 100_000) / 100:.2f}", g % 1000),
                         None, schema)

    made = produce(servers, topic, backlog())
    drain_s = drain(servers, topic, rows, rows + made)
    apply_s = walberg_once(config, "apply")
    net_s = max(apply_s - fixed["noop_run_once_s"], 1e-3)
    return {
        "rows": rows, "changes": made, "sources": 1,
        "copy": {"walberg_run_once_s": copy_s, "kafka_drain_s": drain_table_s,
                 "walberg_rows_per_s": rows / copy_s, "ratio": drain_table_s / copy_s},
        **fixed,
        "apply_run_once_s": apply_s, "apply_net_s": net_s,
        "apply_batch_s": batch_seconds(config, "apply"),
        "kafka_drain_s": drain_s, "baseline_s": drain_s,
        "walberg_changes_per_s": made / net_s, "baseline_changes_per_s": made / drain_s,
        "ratio": drain_s / net_s,
    }
