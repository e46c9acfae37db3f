"""The Kafka source end to end against a real broker (Tansu), real Spark and real Iceberg:
Debezium events with and without schema, dead letters, and kill -9 mid-topic."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

import pytest
from prometheus_client import REGISTRY

from conftest import CATALOG, run_once, run_once_within, running, walberg_cli, write_pipeline
from kafka_broker import (
    Producer,
    StoredBroker,
    create_topic,
    envelope,
    kafka_broker,
    row_schema,
    stored_broker,
)
from lake import hadoop_table, iceberg_rows
from tcp_proxy import Proxy
from walberg import faults
from walberg.config import Config, parse_config
from walberg.errors import ApplyError, WalbergError
from walberg.kafka_pipeline import KafkaPipeline
from walberg.lake.changes import changes_sql
from walberg.lake.history import history
from walberg.lake.maintain import maintain
from walberg.lake.query import query
from walberg.lake.services import Lake
from walberg.ops.check import check
from walberg.ops.status import PartitionStatus, status

__all__ = ["kafka_broker", "stored_broker"]  # the session fixtures, used by name


def _raw(servers: str, warehouse: Path, tmp: Path, name: str, topics: list[str],
         **kafka: Any) -> dict[str, Any]:
    return {
        "source": {"kafka": {"bootstrap_servers": servers, "topics": topics,
                             "group_id": f"g_{name}", **kafka}},
        "sink": {"catalog": {"name": CATALOG, "type": "hadoop", "warehouse": str(warehouse)},
                 "namespace": f"ns_{name}"},
        "buffer": {"dir": str(tmp / "segments"), "max_interval_seconds": 0.5},
        "spark": {"master": "local[2]"},
    }


def _config(raw: dict[str, Any], tmp: Path) -> Config:
    return parse_config(raw, tmp, "test config")


def _dead(warehouse: Path, target: str) -> list[dict[str, Any]]:
    """The dead letters of a table: its ``__dlq`` Iceberg table, read by PyIceberg."""
    rows = hadoop_table(warehouse, target + "__dlq").scan().to_arrow().to_pylist()
    return sorted(rows, key=lambda r: (r["partition"], r["offset"]))


def _dec(unscaled: int) -> str:
    return base64.b64encode(unscaled.to_bytes(8, "big", signed=True)).decode()


SCHEMA = row_schema([
    {"field": "id", "type": "int32"},
    {"field": "name", "type": "string", "optional": True},
    {"field": "price", "type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
     "parameters": {"scale": "2", "connect.decimal.precision": "10"}, "optional": True},
    {"field": "born", "type": "int32", "name": "io.debezium.time.Date", "optional": True},
    {"field": "seen", "type": "string", "name": "io.debezium.time.ZonedTimestamp",
     "optional": True},
    {"field": "active", "type": "boolean", "optional": True},
    # A numeric(38,10) past Python's 28 default digits, a time (time.precision.mode connect)
    # and a date[] (a list of dates, not JSON text of day numbers).
    {"field": "wide", "type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
     "parameters": {"scale": "10", "connect.decimal.precision": "38"}, "optional": True},
    {"field": "clock", "type": "int32", "name": "org.apache.kafka.connect.data.Time",
     "optional": True},
    {"field": "days", "type": "array", "optional": True,
     "items": {"type": "int32", "name": "io.debezium.time.Date", "optional": True}},
])
WIDE = -(10**38 - 1)  # -9999999999999999999999999999.9999999999 in numeric(38,10)


def test_debezium_events_with_schema_land_as_the_source_table(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic, partitions=2)
    p = Producer(kafka_broker)

    def row(i: int, name: str, cents: int) -> dict[str, Any]:
        return {"id": i, "name": name, "price": _dec(cents), "born": 19000 + i,
                "seen": f"2024-01-0{i}T10:00:00.5+02:00", "active": i % 2 == 0,
                "wide": base64.b64encode((WIDE + i).to_bytes(16, "big", signed=True)).decode(),
                "clock": 45_296_789, "days": [19000 + i, None]}

    def send(op: str, before: Any, after: Any, key: int) -> None:
        p.send(topic, {"schema": {"type": "struct"}, "payload": {"id": key}},
               envelope(op, before, after, schema=SCHEMA), partition=key % 2)

    for i in (1, 2, 3, 4):
        send("r", None, row(i, f"n{i}", 100 * i), i)
    send("c", None, row(5, "n5", 550), 5)
    send("u", row(2, "n2", 200), row(2, "two", 222), 2)
    send("d", row(3, "n3", 300), None, 3)
    p.send(topic, b'{"id": 3}', None, partition=1)  # the tombstone after a delete
    # A key change, as an update whose before and after keys differ (same partition).
    send("u", row(4, "n4", 400), row(6, "n4", 400), 4)
    report = run_once(_config(_raw(kafka_broker, warehouse, tmp_path, unique, [topic]),
                              tmp_path), spark, KafkaPipeline)
    assert report.dead_letters == 0

    target = f"{CATALOG}.ns_{unique}.{unique}"
    rows = iceberg_rows(warehouse, target)
    assert [(r["id"], r["name"], r["price"]) for r in rows] == [
        (1, "n1", Decimal("1.00")), (2, "two", Decimal("2.22")), (5, "n5", Decimal("5.50")),
        (6, "n4", Decimal("4.00"))]
    assert rows[0]["born"].isoformat() == "2022-01-09"  # day 19001 since 1970
    assert rows[0]["active"] is False and rows[1]["active"] is True
    assert rows[0]["seen"].isoformat() == "2024-01-01T08:00:00.500000+00:00"
    assert [r["wide"] for r in rows] == [Decimal(f"{WIDE + i}E-10") for i in (1, 2, 5, 6)]
    assert rows[0]["clock"] == "12:34:56.789000"
    assert [r["days"] for r in rows[:2]] == [[date(2022, 1, 9), None], [date(2022, 1, 10), None]]
    # Spark reads the same table.
    assert spark.sql(f"SELECT count(*) AS n FROM {target}").collect()[0]["n"] == 4
    # The offsets ride in the snapshot summary: 4 records on partition 0, 6 on partition 1.
    summary = spark.sql(f"SELECT summary FROM {target}.snapshots ORDER BY committed_at DESC"
                        ).collect()[0]["summary"]
    counts = {0: 0, 1: 0}
    for key in (1, 2, 3, 4, 5, 2, 3, 3, 4):
        counts[key % 2] += 1
    assert summary[f"walberg.offset.{topic}.0"] == str(counts[0])
    assert summary[f"walberg.offset.{topic}.1"] == str(counts[1])


def test_a_delete_whose_before_image_holds_a_value_the_lake_cannot_store_deletes(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """A before image under REPLICA IDENTITY FULL carries every column; a value outside the
    key that cannot be stored (a decimal too wide: refused while staging; a date past year
    9999: refused while decoding) must not keep the delete from deleting: a delete needs only
    its key. The updates that brought those values are dead letters, as they were."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)

    def row(i: int, cents: int = 100, born: int = 19000) -> dict[str, Any]:
        return {"id": i, "name": f"n{i}", "price": _dec(cents), "born": born,
                "seen": None, "active": True}

    def send(op: str, before: Any, after: Any, key: int) -> None:
        p.send(topic, {"id": key}, envelope(op, before, after, schema=SCHEMA))

    for i in (1, 2, 3):
        send("c", None, row(i), i)
    config = _config(_raw(kafka_broker, warehouse, tmp_path, unique, [topic]), tmp_path)
    run_once(config, spark, KafkaPipeline)
    wide, future = 10**12, 3_000_000  # 10000000000.00 in a decimal(10,2); a day in year 10183
    send("u", row(1), row(1, cents=wide), 1)
    send("u", row(2), row(2, born=future), 2)
    send("d", row(1, cents=wide), None, 1)
    send("d", row(2, born=future), None, 2)
    report = run_once(config, spark, KafkaPipeline)
    target = f"{CATALOG}.ns_{unique}.{unique}"
    assert [r["id"] for r in iceberg_rows(warehouse, target)] == [3]
    assert [(d["offset"], d["_dlq_reason"].split(":")[0]) for d in _dead(warehouse, target)] \
        == [(3, "column price"), (4, "column born")]
    assert report.dead_letters == 2


def test_events_without_schema_and_dead_letters(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    p.send(topic, {"id": 1}, envelope("c", None, {"id": 1, "v": "a", "n": 1}))
    p.send(topic, {"id": 2}, b"{this is not json")
    p.send(topic, {"id": 2}, {"before": None, "after": {"id": 2, "v": "b", "n": 2}})  # no op
    p.send(topic, {"id": 3}, envelope("c", None, {"id": 3, "v": "c", "n": 3, "surprise": 1}))
    p.send(topic, {"id": 4}, envelope("c", None, {"id": 4, "v": "d", "n": "four"}))
    p.send(topic, None, envelope("c", None, {"id": 5, "v": "e", "n": 5}))  # key from config
    p.send(topic, {"id": 1}, envelope("u", None, {"id": 1, "v": "A", "n": 10}))
    p.send(topic, {"id": 6}, {"schema": {"fields": [{"field": "after", "fields": [
        {"type": "int32"}]}]}, "payload": {"op": "c", "before": None, "after": {"id": 6}}})
    p.send(topic, {"id": 9}, b"[]")  # last: the lake's offsets never cover it
    before = REGISTRY.get_sample_value("walberg_dead_letters_total",
                                       {"table": f"public.{unique}"}) or 0.0
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic],
               tables={topic: {"key": ["id"]}})
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)

    target = f"{CATALOG}.ns_{unique}.{unique}"
    assert iceberg_rows(warehouse, target) == [{"id": 1, "v": "A", "n": 10},
                                               {"id": 5, "v": "e", "n": 5}]
    dead = _dead(warehouse, target)
    assert [(d["offset"], d["_dlq_reason"].split(":")[0]) for d in dead] == [
        (1, "the value is not JSON"), (2, "the envelope has no op"),
        (3, "schema mismatch"), (4, "column n"),
        (7, "the envelope's schema is malformed (KeyError"),
        (8, "the value is not a Debezium envelope (a JSON object with op, before, after)")]
    assert dead[0]["value"] == b"{this is not json" and dead[0]["key"] == b'{"id": 2}'
    assert report.dead_letters == 6
    after = REGISTRY.get_sample_value("walberg_dead_letters_total", {"table": f"public.{unique}"})
    assert after == before + 6
    # Run again: the last record is read again (no table commit covers it), and it does not
    # become a dead letter twice.
    again = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert (again.records, again.dead_letters, len(_dead(warehouse, target))) == (0, 0, 6)
    assert {d["table"] for d in dead} == {target}


def test_dead_letters_whose_commit_outcome_is_unknown_are_retried_not_doubled(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The dead letters' commit answers with an error after it landed (a catalog that timed
    out): like a table's commit it is tried again, the run goes on, and the retry leaves out
    what the dead-letter table holds already."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    p.send(topic, {"id": 1}, b"{not json")
    p.send(topic, {"id": 2}, envelope("c", None, {"id": 2, "v": "b"}))
    monkeypatch.setattr(faults, "_FAIL", ("dead-letters", 1))
    monkeypatch.setattr(faults, "_fails", {})
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic],
               tables={topic: {"key": ["id"]}})
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert faults._FAIL is None  # the failure point was passed
    target = f"{CATALOG}.ns_{unique}.{unique}"
    assert iceberg_rows(warehouse, target) == [{"id": 2, "v": "b"}]
    assert [d["offset"] for d in _dead(warehouse, target)] == [0]
    assert report.dead_letters == 1


def test_dead_letters_written_by_a_run_that_stopped_are_said_by_the_next(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A run stops right after writing a batch's dead letters, before saying so and before any
    table's commit: the next run applies the batch again, does not write them twice, and says
    they are there."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    p.send(topic, {"id": 1}, b"{not json")
    p.send(topic, {"id": 2}, envelope("c", None, {"id": 2, "v": "b"}))
    monkeypatch.setattr(faults, "_FAIL", ("dead-letters", 1))
    monkeypatch.setattr(faults, "_fails", {})
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic],
               tables={topic: {"key": ["id"]}})
    failing = dict(raw, sink=dict(raw["sink"], commit_max_attempts=1))
    with pytest.raises(ApplyError):
        run_once(_config(failing, tmp_path), spark, KafkaPipeline)
    target = f"{CATALOG}.ns_{unique}.{unique}"
    said = f"record(s) of topic {topic} could not be applied and "
    assert said not in caplog.text
    with caplog.at_level(logging.WARNING, logger="walberg"):
        report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert caplog.text.count(said) == 1, caplog.text[-2000:]
    assert f"1 {said}are in {target}__dlq" in caplog.text
    assert iceberg_rows(warehouse, target) == [{"id": 2, "v": "b"}]
    assert [d["offset"] for d in _dead(warehouse, target)] == [0]
    assert report.dead_letters == 0  # (written by the run before)


def test_kill_9_mid_topic_then_a_restart_from_the_lakes_offsets(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: Any) -> None:
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic, partitions=2)
    p = Producer(kafka_broker)
    expected: dict[int, int] = {}
    for i in range(1, 121):
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": i}), partition=i % 2)
        expected[i] = i
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    # Small segments: several batches, so the crash comes with some of the topic committed.
    raw["buffer"]["max_segment_bytes"] = 65536
    path = write_pipeline(raw, tmp_path / "pipeline.yaml")
    target = f"{CATALOG}.ns_{unique}.{unique}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")

    # First: a first batch commits (in this process), then updates arrive and the next run is
    # killed after its lookup, before its row delta commits (a process of its own: only the
    # crash needs one). Not "commit" (a timer half a second into the commit): a warm row delta
    # can commit within that, and then the lake is not behind.
    run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    for i in range(1, 121):
        if i % 3 == 0:
            p.send(topic, {"id": i}, envelope("d", {"id": i, "v": expected.pop(i)}, None),
                   partition=i % 2)
        else:
            p.send(topic, {"id": i}, envelope("u", None, {"id": i, "v": -i}), partition=i % 2)
            expected[i] = -i
    for i in range(121, 141):
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": i}), partition=i % 2)
        expected[i] = i
    crashed = subprocess.run([sys.executable, "-m", "walberg.cli", "run", "-c", str(path),
                              "--once"], env=dict(env, WALBERG_CRASH_AT="row-delta:1"),
                             capture_output=True, text=True, timeout=600)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    half = {r["id"]: r["v"] for r in iceberg_rows(warehouse, target)}
    assert half != expected  # the crash left the lake behind

    # A new consumer group: the broker knows no offsets for it, so only the lake's count.
    raw["source"]["kafka"]["group_id"] = f"other_{unique}"
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    reading = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reading ")]
    assert reading and "@earliest" not in reading[0], reading
    rows = iceberg_rows(warehouse, target)
    assert len(rows) == len({r["id"] for r in rows})  # no duplicates
    assert {r["id"]: r["v"] for r in rows} == expected  # nothing lost


def test_lake_commands_on_a_kafka_pipeline_file(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """status, check, query (time travel too), history, changes and maintain read a Kafka
    pipeline's tables as they read a Postgres pipeline's."""
    topic = f"srv.public.{unique}"
    table = f"public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    for i in (1, 2, 3):
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": f"v{i}"}, lsn=100 + i))
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic],
               tables={topic: {"key": ["id"]}})
    config = _config(raw, tmp_path)
    run_once(config, spark, KafkaPipeline)
    p.send(topic, {"id": 2}, envelope("u", {"id": 2, "v": "v2"}, {"id": 2, "v": "two"}, lsn=200))
    p.send(topic, {"id": 3}, envelope("d", {"id": 3, "v": "v3"}, None, lsn=201))
    run_once(config, spark, KafkaPipeline)
    target = f"{CATALOG}.ns_{unique}.{unique}"

    with Lake(config, session=spark) as lake:
        [where] = status(lake)
        assert where.tables[table].iceberg_table == target and where.tables[table].rows == 2
        assert where.tables[table].last_commit_at is not None
        assert where.partitions == [PartitionStatus(topic, 0, 5, 5, 0)]
        [checks] = check(lake)
        assert all(c.ok for c in checks.results), checks
        assert f"topic {topic}" in [c.name for c in checks.results]

        count = f"SELECT count(*) FROM {target}"
        assert query(lake, count)[0] == [(2,)]
        snapshots = history(lake, table)
        assert history(lake, topic) == snapshots  # a table is named by its topic too
        assert len(snapshots) >= 2
        first = snapshots[0].snapshot_id
        assert query(lake, count, snapshot=first)[0] == [(3,)]
        rows, names = query(lake, changes_sql(lake, table, str(first)))
        assert {(r[names.index("_change")], r[names.index("id")], r[names.index("v")])
                for r in rows} == {("update", 2, "two"), ("delete", 3, "v3")}

        (maintained,) = maintain(lake)
        assert maintained.table == target and maintained.after.delete_files == 0
        # The compaction's commit carries the offsets: a restart reads nothing again.
        assert lake.sink().committed_offsets(target) == {(topic, 0): 5}
    assert run_once(config, spark, KafkaPipeline).records == 0
    assert iceberg_rows(warehouse, target) == [{"id": 1, "v": "v1"}, {"id": 2, "v": "two"}]

    # The same through the command line, which opens the lake for a Kafka pipeline file as for
    # a Postgres one (status needs no Spark; `query` through the command line is
    # test_reading's: one JVM fewer to start here).
    path = write_pipeline(raw, tmp_path / "pipeline.yaml")
    done = walberg_cli("status", "-c", str(path), "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["tables"][table]["rows"] == 2
    assert said["partitions"] == [{"topic": topic, "partition": 0, "lake_offset": 5,
                                   "end_offset": 5, "lag": 0}]


def test_a_truncate_that_opens_a_run_finds_the_tables_key(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """Debezium sends a TRUNCATE with no message key. As a run's first record, with no key in
    the pipeline file, nothing said the table's key and the truncate went to the dead letters:
    the table kept the rows the source had truncated. The key is kept with the table
    (``walberg.key``), for tables made before it too."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    for i in (1, 2, 3):
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": f"v{i}"}))
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    target = f"{CATALOG}.ns_{unique}.{unique}"
    run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert [r["id"] for r in iceberg_rows(warehouse, target)] == [1, 2, 3]
    assert hadoop_table(warehouse, target).properties["walberg.key"] == '["id"]'
    # A table made before the key was kept: the next run records it.
    spark.sql(f"ALTER TABLE {target} UNSET TBLPROPERTIES ('walberg.key')")
    p.send(topic, {"id": 4}, envelope("c", None, {"id": 4, "v": "v4"}))
    run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert hadoop_table(warehouse, target).properties["walberg.key"] == '["id"]'

    p.send(topic, None, envelope("t", None, None))
    p.send(topic, {"id": 9}, envelope("c", None, {"id": 9, "v": "after"}))
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.dead_letters == 0
    assert [(r["id"], r["v"]) for r in iceberg_rows(warehouse, target)] == [(9, "after")]


def _wide_records(p: Producer, topic: str, ids: range, v: str) -> None:
    for i in ids:
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": v * 400}))


def test_the_next_batch_is_staged_while_one_commits(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: Any) -> None:
    """The Kafka source goes through the shared applier: batch N+1 is staged in the staging
    thread while Spark commits batch N."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    _wide_records(Producer(kafka_broker), topic, range(1, 601), "x")  # ~250 KB: several batches
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    raw["buffer"].update(max_segment_bytes=65536, max_batch_bytes=65536)
    with caplog.at_level(logging.DEBUG, logger="walberg"):
        report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.batches >= 3 and report.records == 600
    staged_aside = [r for r in caplog.records
                    if r.getMessage().startswith("staged ") and r.threadName.startswith(
                        "walberg-stage")]
    assert staged_aside, "no batch was staged beside a commit"
    rows = iceberg_rows(warehouse, f"{CATALOG}.ns_{unique}.{unique}")
    assert [r["id"] for r in rows] == list(range(1, 601))


def test_a_topic_written_in_transactions_is_read_to_its_end_and_once_ends(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """Debezium with exactly-once delivery writes in Kafka transactions: each commit leaves a
    marker in the partition that takes an offset and is never a record, so the topic's end
    lies one past its last record. `--once` stops at the end all the same (it waited for the
    marker's offset for good), and so does the next run, with nothing new to read."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker, transactional_id=f"tx_{unique}")
    with p.transaction():
        for i in (1, 2, 3):
            p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": f"v{i}"}))
    with p.transaction():
        p.send(topic, {"id": 2}, envelope("u", None, {"id": 2, "v": "w"}))
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    report = run_once_within(120, _config(raw, tmp_path), spark, KafkaPipeline)
    assert (report.records, report.batches) == (4, 1)
    target = f"{CATALOG}.ns_{unique}.{unique}"
    assert iceberg_rows(warehouse, target) == [{"id": 1, "v": "v1"}, {"id": 2, "v": "w"},
                                               {"id": 3, "v": "v3"}]
    again = run_once_within(120, _config(raw, tmp_path), spark, KafkaPipeline)
    assert (again.records, again.batches) == (0, 0)


def test_a_transactions_marker_deleted_by_retention_is_no_record_lost(
        stored_broker: StoredBroker, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Debezium with exactly-once delivery: each transaction ends in a commit marker that
    takes an offset. The lake's offset stopped at the marker (the offset after the last
    record), so once retention deleted the first transaction, marker included, the next start
    found the lake's offset below the partition's first one and stopped: "retention deleted
    1 record(s)", which was a marker. The lake's offsets now pass the markers.
    (Streaming first: this broker's stored topics report a partition's end as that of its
    first batch, which would end a --once run early.)"""
    servers = stored_broker.servers
    topic = f"srv.public.{unique}"
    create_topic(servers, topic)
    p = Producer(servers, transactional_id=f"tx_{unique}")
    with p.transaction():  # offsets 0-2, its commit marker 3
        for i in (1, 2, 3):
            p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": f"v{i}"}))
    raw = _raw(servers, warehouse, tmp_path, unique, [topic])
    target = f"{CATALOG}.ns_{unique}.{unique}"
    version = warehouse / f"ns_{unique}" / unique / "metadata" / "version-hint.text"
    with running(KafkaPipeline(_config(raw, tmp_path), session=spark)) as failures:
        deadline = time.monotonic() + 120
        while not version.exists() or len(iceberg_rows(warehouse, target)) < 3:
            assert time.monotonic() < deadline and not failures, failures
            time.sleep(0.5)
    assert not failures, failures
    with p.transaction():  # offset 4, its commit marker 5
        p.send(topic, {"id": 4}, envelope("c", None, {"id": 4, "v": "v4"}))
    stored_broker.delete_before(topic, 0, 4)
    report = run_once_within(120, _config(raw, tmp_path), spark, KafkaPipeline)
    assert report.records == 1
    assert [r["id"] for r in iceberg_rows(warehouse, target)] == [1, 2, 3, 4]


def test_offsets_that_hold_nothing_to_commit_are_passed_without_a_snapshot(
        stored_broker: StoredBroker, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """A topic's last records before a pause may hold nothing to commit: a tombstone (what
    Debezium sends after a delete, for compaction) and a transaction's commit marker. Read
    after the commit that covers the records before them, they made no commit, so the lake's
    offset stayed before them, and once retention deleted them the next start stopped
    ("retention deleted 2 record(s)") although nothing was lost. The table now records them
    passed in a property (no snapshot without rows), which `walberg status` reads too."""
    from walberg.apply.catalog.metadata import read_hadoop_table

    servers = stored_broker.servers
    topic = f"srv.public.{unique}"
    create_topic(servers, topic)
    p = Producer(servers, transactional_id=f"tx_{unique}")
    with p.transaction():  # offsets 0-1, its commit marker 2
        for i in (1, 2):
            p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": f"v{i}"}))
    raw = _raw(servers, warehouse, tmp_path, unique, [topic])
    namespace, target = f"ns_{unique}", f"{CATALOG}.ns_{unique}.{unique}"

    def held() -> dict[tuple[str, int], int]:
        summary = read_hadoop_table(warehouse, namespace, unique)
        return {} if summary is None else summary.offsets

    with running(KafkaPipeline(_config(raw, tmp_path), session=spark)) as failures:
        deadline = time.monotonic() + 120
        while held() != {(topic, 0): 3}:
            assert time.monotonic() < deadline and not failures, (held(), failures)
            time.sleep(0.5)
        snapshots = read_hadoop_table(warehouse, namespace, unique).snapshots  # type: ignore[union-attr]
        with p.transaction():  # a tombstone at 3, its commit marker 4: nothing to commit
            p.send(topic, {"id": 1}, None)
        while held() != {(topic, 0): 5}:
            assert time.monotonic() < deadline and not failures, (held(), failures)
            time.sleep(0.5)
    assert not failures, failures
    assert read_hadoop_table(warehouse, namespace, unique).snapshots == snapshots  # type: ignore[union-attr]
    stored_broker.delete_before(topic, 0, 5)
    with p.transaction():  # offset 5, its commit marker 6
        p.send(topic, {"id": 3}, envelope("c", None, {"id": 3, "v": "v3"}))
    with running(KafkaPipeline(_config(raw, tmp_path), session=spark)) as failures:
        while held() != {(topic, 0): 7}:  # (past the marker too, with or without the row)
            assert time.monotonic() < deadline and not failures, (held(), failures)
            time.sleep(0.5)
    assert not failures, failures
    assert [r["id"] for r in iceberg_rows(warehouse, target)] == [1, 2, 3]


def test_partitions_added_while_running_are_read_from_their_first_offset_once(
        stored_broker: StoredBroker, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Partitions added to a topic while walberg streams it are read from their first offset,
    each record once (an append table: a row per event), without a restart. (Tansu 0.6 has
    no CreatePartitions: the partitions are added where it keeps the topic, and its metadata
    says so to every client, as Kafka's does after kafka-topics --alter.)"""
    servers = stored_broker.servers
    topic = f"srv.public.{unique}"
    create_topic(servers, topic)
    Producer(servers).send(topic, {"id": 1}, envelope("c", None, {"id": 1, "v": "a"}))
    raw = _raw(servers, warehouse, tmp_path, unique, [topic])
    raw["sink"]["mode"] = "append"
    target = f"{CATALOG}.ns_{unique}.{unique}"

    def rows() -> list[tuple[int, str]]:
        if not (warehouse / f"ns_{unique}" / unique / "metadata" / "version-hint.text").exists():
            return []
        return sorted((r["id"], r["v"]) for r in iceberg_rows(warehouse, target))

    pipeline = KafkaPipeline(_config(raw, tmp_path), session=spark)
    with running(pipeline) as failures:
        deadline = time.monotonic() + 120
        while rows() != [(1, "a")]:
            assert time.monotonic() < deadline and not failures, failures
            time.sleep(0.5)
        stored_broker.add_partitions(topic, 3)
        p = Producer(servers)  # (one that learns the partitions now)
        p.send(topic, {"id": 2}, envelope("c", None, {"id": 2, "v": "b"}), partition=1)
        p.send(topic, {"id": 3}, envelope("c", None, {"id": 3, "v": "c"}), partition=2)
        p.send(topic, {"id": 4}, envelope("c", None, {"id": 4, "v": "d"}), partition=2)
        p.send(topic, {"id": 5}, envelope("c", None, {"id": 5, "v": "e"}), partition=0)
        while len(rows()) < 5:
            assert time.monotonic() < deadline and not failures, (rows(), failures)
            time.sleep(0.5)
    assert not failures, failures
    assert rows() == [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e")]
    offsets = {}
    for r in spark.sql(f"SELECT summary FROM {target}.snapshots").collect():
        offsets.update({k: v for k, v in r["summary"].items() if k.startswith("walberg.offset")})
    assert {k.rpartition(".")[2]: int(v) for k, v in offsets.items()} == \
        {"0": 2, "1": 1, "2": 2}


def test_a_topic_made_again_behind_the_lakes_offsets_stops_the_run_with_the_way_out(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """A topic deleted and created again starts its offsets at 0: the lake's offsets lie past
    its end, and its new records would be taken for ones the lake holds and skipped, silently.
    The run stops instead, saying why and what to do."""
    from confluent_kafka.admin import AdminClient

    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    for i in range(1, 6):
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": "a"}))
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    assert run_once(_config(raw, tmp_path), spark, KafkaPipeline).records == 5
    admin = AdminClient({"bootstrap.servers": kafka_broker})
    for future in admin.delete_topics([topic]).values():
        future.result(timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            create_topic(kafka_broker, topic)
            break
        except Exception:
            assert time.monotonic() < deadline, "the topic could not be made again"
            time.sleep(0.5)
    for i in (6, 7):
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": "b"}))
    with pytest.raises(WalbergError, match="deleted and created again"):
        run_once(_config(raw, tmp_path), spark, KafkaPipeline)


def test_a_broker_not_yet_reachable_at_start_is_waited_for(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The broker cannot be reached when the run starts (restarting, the network not up
    yet): the run asks again, saying so, and reads the topic once it answers; it fails only
    after source.kafka.reconnect_max_seconds."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    Producer(kafka_broker).send(topic, {"id": 1}, envelope("c", None, {"id": 1, "v": "a"}))
    proxy = Proxy(int(kafka_broker.rpartition(":")[2]))
    proxy.cut()  # refused until restored: past the first ask's 10 s
    threading.Timer(12, proxy.restore).start()
    raw = _raw(f"127.0.0.1:{proxy.port}", warehouse, tmp_path, unique, [topic])
    with caplog.at_level(logging.WARNING, logger="walberg"):
        report = run_once_within(120, _config(raw, tmp_path), spark, KafkaPipeline)
    assert report.records == 1
    assert iceberg_rows(warehouse, f"{CATALOG}.ns_{unique}.{unique}") == [{"id": 1, "v": "a"}]
    assert any("cannot reach the Kafka broker" in r.getMessage() and "asking again" in
               r.getMessage() for r in caplog.records)
    proxy.cut()

    # A broker that never answers fails the run after reconnect_max_seconds, saying so.
    raw["source"]["kafka"]["reconnect_max_seconds"] = 1
    with pytest.raises(WalbergError, match="reconnect_max_seconds"):
        run_once_within(60, _config(raw, tmp_path), spark, KafkaPipeline)


def test_a_segment_larger_than_the_reader_holds_back_for_is_sealed_and_applied(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """The reader stops reading while four batches' worth of segments wait; a batch takes
    sealed segments only. With segments larger than that (1 MiB segments, 64 kB batches), the
    active segment alone passed it, and nothing sealed it: the run waited for good."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    _wide_records(Producer(kafka_broker), topic, range(1, 2001), "z")  # ~850 kB
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    raw["buffer"].update(max_segment_bytes=1024 * 1024, max_batch_bytes=64 * 1024)
    report = run_once_within(120, _config(raw, tmp_path), spark, KafkaPipeline)
    assert report.records == 2000
    assert [r["id"] for r in iceberg_rows(warehouse, f"{CATALOG}.ns_{unique}.{unique}")] == list(
        range(1, 2001))
    # The consumer group is told where the lake is, for the usual lag tools.
    from confluent_kafka import Consumer, TopicPartition

    group = Consumer({"bootstrap.servers": kafka_broker, "group.id": f"g_{unique}"})
    try:
        [committed] = group.committed([TopicPartition(topic, 0)], timeout=30)
    finally:
        group.close()
    assert committed.offset == 2000


def test_a_backlog_that_fits_a_batch_is_one_commit_once_and_streaming(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: Any) -> None:
    """A run's first batch grows while the reader catches up with the topic's end as it was
    when reading began: a backlog of several segments that fits one batch is one commit (a
    commit costs the same whether it holds one segment or many), in a --once run and in a
    streaming run alike."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    _wide_records(p, topic, range(1, 601), "x")  # ~250 KB: four or more segments
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    raw["buffer"]["max_segment_bytes"] = 65536
    target = f"{CATALOG}.ns_{unique}.{unique}"
    with caplog.at_level(logging.INFO, logger="walberg"):
        report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert (report.batches, report.records) == (1, 600)
    segments = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("batch of ")]
    assert len(segments) == 1 and int(segments[0].split()[2]) >= 4, segments
    assert [r["id"] for r in iceberg_rows(warehouse, target)] == list(range(1, 601))

    # Streaming, from the lake's offsets: the next 600 records are one batch too.
    _wide_records(p, topic, range(601, 1201), "y")
    caplog.clear()
    pipeline = KafkaPipeline(_config(raw, tmp_path), session=spark)
    with caplog.at_level(logging.INFO, logger="walberg"), running(pipeline) as failures:
        deadline = time.monotonic() + 120
        while len(iceberg_rows(warehouse, target)) < 1200 and not failures:
            assert time.monotonic() < deadline, "the backlog did not land"
            time.sleep(0.5)
    assert not failures, failures
    applied = [r.getMessage() for r in caplog.records if r.getMessage().startswith("applied ")]
    assert applied and "600 changes" in applied[0], applied
    rows = iceberg_rows(warehouse, target)
    assert [r["id"] for r in rows] == list(range(1, 1201))


def test_maintenance_runs_on_schedule_between_kafka_batches(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    raw["maintenance"] = {"every": "2s", "snapshot_retention": "0s", "retain_last": 2}
    pipeline = KafkaPipeline(_config(raw, tmp_path), session=spark)
    target = f"{CATALOG}.ns_{unique}.{unique}"
    with running(pipeline) as failures:
        for i in range(1, 4):  # batches before and after the first maintenance
            p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": "x"}))
            p.send(topic, {"id": i}, envelope("u", None, {"id": i, "v": "y"}))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not failures:
                if spark.catalog.tableExists(target) and spark.sql(
                        f"SELECT count(*) AS n FROM {target} WHERE id = {i} AND v = 'y'"
                ).collect()[0]["n"]:
                    break
                time.sleep(0.3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not failures:
            if "replace" in [h["operation"] for h in pipeline.sink.history(target)]:
                break
            time.sleep(0.5)
        assert "replace" in [h["operation"] for h in pipeline.sink.history(target)]
    assert not failures, failures
    rows = iceberg_rows(warehouse, target)
    assert [(r["id"], r["v"]) for r in rows] == [(i, "y") for i in range(1, 4)]


def test_a_replayed_create_is_not_a_duplicate_in_an_upsert_table(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """A connector that replays after its own crash sends a `c` again: the key already holds
    the same row, so the table keeps one row for it, whether the replay lands in the same
    batch or in a later run."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    for i in (1, 2, 1):  # the second `c` of 1: a replay within one batch
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": f"v{i}"}))
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    target = f"{CATALOG}.ns_{unique}.{unique}"
    assert [(r["id"], r["v"]) for r in iceberg_rows(warehouse, target)] == [(1, "v1"), (2, "v2")]
    for i in (2, 3):  # a replay of 2 in a later run, then a new row
        p.send(topic, {"id": i}, envelope("c", None, {"id": i, "v": f"v{i}"}))
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.records == 2
    assert [(r["id"], r["v"]) for r in iceberg_rows(warehouse, target)] == [
        (1, "v1"), (2, "v2"), (3, "v3")]


def test_append_mode_keeps_every_event_once_with_its_offsets(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """``sink.mode: append`` on a Kafka source: the table is a changelog, one row per event,
    and its commits carry the offsets, so a run that reads the topic again adds nothing twice."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    p.send(topic, {"id": 1}, envelope("c", None, {"id": 1, "v": "a"}))
    p.send(topic, {"id": 1}, envelope("u", {"id": 1, "v": "a"}, {"id": 1, "v": "b"}))
    p.send(topic, {"id": 2}, envelope("c", None, {"id": 2, "v": "c"}))
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    raw["sink"]["mode"] = "append"
    run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    p.send(topic, {"id": 2}, envelope("d", {"id": 2, "v": "c"}, None))
    run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    run_once(_config(raw, tmp_path), spark, KafkaPipeline)  # nothing new: nothing added
    target = f"{CATALOG}.ns_{unique}.{unique}"
    rows = spark.sql(f"SELECT id, v, _walberg_op FROM {target}").collect()
    assert sorted((r["id"], r["v"], r["_walberg_op"]) for r in rows) == [
        (1, "a", "insert"), (1, "b", "update"), (2, "c", "delete"), (2, "c", "insert")]
    summary = spark.sql(f"SELECT summary FROM {target}.snapshots ORDER BY committed_at DESC"
                        ).collect()[0]["summary"]
    assert summary[f"walberg.offset.{topic}.0"] == "4"


def test_mode_both_keeps_table_and_changelog_exact_through_replays(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        immutable: Any) -> None:
    """``sink.mode: both`` on a Kafka source: the upsert table and ``<table>_changelog``
    beside it, as a Postgres source lands them (see test_changelog). The changelog's commit
    carries the offsets too, so a run that reads again what the changelog holds (its table's
    commit failed after it) adds no row to it twice, and a replay of segments both tables hold
    adds nothing to either."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic, partitions=2)
    p = Producer(kafka_broker)
    p.send(topic, {"id": 1}, envelope("c", None, {"id": 1, "v": "a"}, lsn=10), partition=1)
    p.send(topic, {"id": 1}, envelope("u", {"id": 1, "v": "a"}, {"id": 1, "v": "b"}, lsn=20),
           partition=1)
    p.send(topic, {"id": 2}, envelope("c", None, {"id": 2, "v": "c"}, lsn=30), partition=0)
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    raw["sink"]["mode"] = "both"
    run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    target = f"{CATALOG}.ns_{unique}.{unique}"
    changelog = target + "_changelog"

    def changes() -> list[tuple[Any, ...]]:
        rows = iceberg_rows(warehouse, changelog, keep_own=True)
        return sorted((r["_walberg_lsn"], r["_walberg_op"], r["id"], r["v"]) for r in rows)

    assert changes() == [(10, "insert", 1, "a"), (20, "update", 1, "b"), (30, "insert", 2, "c")]
    assert [(r["id"], r["v"]) for r in iceberg_rows(warehouse, target)] == [(1, "b"), (2, "c")]

    # The table's commit fails after the changelog's: the changelog has the batch, the table
    # and its offsets do not.
    p.send(topic, {"id": 2}, envelope("d", {"id": 2, "v": "c"}, None, lsn=40), partition=0)
    p.send(topic, {"id": 3}, envelope("c", None, {"id": 3, "v": "d"}, lsn=50), partition=1)
    p.send(topic, {"id": 1}, envelope("u", {"id": 1, "v": "b"}, {"id": 1, "v": "e"}, lsn=60),
           partition=1)
    failing = dict(raw, sink=dict(raw["sink"], commit_max_attempts=1))
    immutable(warehouse / f"ns_{unique}" / unique / "metadata")
    with pytest.raises(ApplyError, match="could not commit"):
        run_once(_config(failing, tmp_path), spark, KafkaPipeline)
    expected = [(10, "insert", 1, "a"), (20, "update", 1, "b"), (30, "insert", 2, "c"),
                (40, "delete", 2, "c"), (50, "insert", 3, "d"), (60, "update", 1, "e")]
    assert changes() == expected
    immutable.release()
    segments = tmp_path / "segments"
    kept = tmp_path / "kept"
    shutil.copytree(segments, kept)  # the batch the table does not hold yet

    # The next run reads it again: into the table, not a second time into the changelog.
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.records == 3
    assert changes() == expected
    assert [(r["id"], r["v"]) for r in iceberg_rows(warehouse, target)] == [(1, "e"), (3, "d")]
    summary = spark.sql(f"SELECT summary FROM {changelog}.snapshots ORDER BY committed_at DESC"
                        ).collect()[0]["summary"]
    assert (summary[f"walberg.offset.{topic}.0"], summary[f"walberg.offset.{topic}.1"]) == \
        ("2", "4")

    # Segments both tables hold, left as a kill -9 after the commits leaves them: nothing new.
    shutil.rmtree(segments)
    shutil.copytree(kept, segments)
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.records == 0
    assert changes() == expected
    assert [(r["id"], r["v"]) for r in iceberg_rows(warehouse, target)] == [(1, "e"), (3, "d")]


def test_a_new_optional_field_in_the_schema_adds_a_column(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """Additive schema evolution from the Debezium ``schema`` part: the connector's table
    gained a column, so its records carry a new optional field; the Iceberg table gets the
    column (older rows NULL) instead of every record going to the dead letters."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    old = row_schema([{"field": "id", "type": "int32"},
                      {"field": "name", "type": "string", "optional": True}])
    new = row_schema([{"field": "id", "type": "int32"},
                      {"field": "name", "type": "string", "optional": True},
                      {"field": "email", "type": "string", "optional": True}])
    p.send(topic, {"id": 1}, envelope("c", None, {"id": 1, "name": "a"}, schema=old))
    p.send(topic, {"id": 2}, envelope("c", None, {"id": 2, "name": "b"}, schema=old))
    # In the same batch as the rows before it: the batch ends there, the next has the column.
    p.send(topic, {"id": 3}, envelope("c", None, {"id": 3, "name": "c", "email": "c@x"},
                                      schema=new))
    p.send(topic, {"id": 1}, envelope("u", None, {"id": 1, "name": "a", "email": "a@x"},
                                      schema=new))
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.dead_letters == 0 and report.records == 4
    target = f"{CATALOG}.ns_{unique}.{unique}"
    assert iceberg_rows(warehouse, target) == [
        {"id": 1, "name": "a", "email": "a@x"}, {"id": 2, "name": "b", "email": None},
        {"id": 3, "name": "c", "email": "c@x"}]
    # A later run reads the columns from the table and takes records of either schema.
    p.send(topic, {"id": 4}, envelope("c", None, {"id": 4, "name": "d"}, schema=old))
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.dead_letters == 0 and report.records == 1
    assert iceberg_rows(warehouse, target)[-1] == {"id": 4, "name": "d", "email": None}


def test_a_field_widened_in_the_schema_widens_the_column(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """The source's columns were widened (``ALTER ... TYPE bigint``, ``double precision``), so
    Debezium's records carry int64 and float64 where they carried int32 and float32: the
    Iceberg columns are widened in place (Iceberg's type promotion), key included, instead of
    every later record going to the dead letters; records of the old schema still apply."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic)
    p = Producer(kafka_broker)
    old = row_schema([{"field": "id", "type": "int32"},
                      {"field": "n", "type": "int32", "optional": True},
                      {"field": "f", "type": "float32", "optional": True}])
    new = row_schema([{"field": "id", "type": "int64"},
                      {"field": "n", "type": "int64", "optional": True},
                      {"field": "f", "type": "float64", "optional": True}])
    big = 3_000_000_000
    p.send(topic, {"id": 1}, envelope("c", None, {"id": 1, "n": 1, "f": 0.5}, schema=old))
    p.send(topic, {"id": 2}, envelope("c", None, {"id": 2, "n": 2, "f": 1.5}, schema=old))
    p.send(topic, {"id": big}, envelope("c", None, {"id": big, "n": 2 * big, "f": 0.1},
                                        schema=new))
    p.send(topic, {"id": 1}, envelope("u", None, {"id": 1, "n": 2**40, "f": 0.5}, schema=new))
    p.send(topic, {"id": 2}, envelope("d", {"id": 2, "n": 2, "f": 1.5}, None, schema=old))
    raw = _raw(kafka_broker, warehouse, tmp_path, unique, [topic])
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.dead_letters == 0 and report.records == 5
    target = f"{CATALOG}.ns_{unique}.{unique}"
    table = hadoop_table(warehouse, target)
    assert [(f.name, str(f.field_type)) for f in table.schema().fields][:3] == [
        ("id", "long"), ("n", "long"), ("f", "double")]
    assert iceberg_rows(warehouse, target) == [
        {"id": 1, "n": 2**40, "f": 0.5}, {"id": big, "n": 2 * big, "f": 0.1}]
    # A later run reads the wider columns from the table and takes records of either schema.
    p.send(topic, {"id": 4}, envelope("c", None, {"id": 4, "n": 4, "f": 0.25}, schema=old))
    p.send(topic, {"id": big}, envelope("d", {"id": big}, None, schema=new))
    report = run_once(_config(raw, tmp_path), spark, KafkaPipeline)
    assert report.dead_letters == 0 and report.records == 2
    assert iceberg_rows(warehouse, target) == [
        {"id": 1, "n": 2**40, "f": 0.5}, {"id": 4, "n": 4, "f": 0.25}]


def test_string_and_composite_keys_apply_by_position(
        kafka_broker: str, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Debezium keys of several string fields: the second batch's updates and deletes go by
    position through the key index (apply.position), not by MERGE."""
    topic = f"srv.public.{unique}"
    create_topic(kafka_broker, topic, partitions=1)
    p = Producer(kafka_broker)
    schema = row_schema([{"field": "tenant", "type": "string"},
                         {"field": "code", "type": "string"},
                         {"field": "qty", "type": "int32", "optional": True}])

    def send(op: str, tenant: str, code: str, qty: Optional[int], before: Optional[int] = None
             ) -> None:
        after = None if op == "d" else {"tenant": tenant, "code": code, "qty": qty}
        old = None if op in ("c", "r") else {"tenant": tenant, "code": code, "qty": before}
        p.send(topic, {"schema": {"type": "struct"}, "payload": {"tenant": tenant, "code": code}},
               envelope(op, old, after, schema=schema), partition=0)

    for t in ("acme", "globex"):
        for c in range(50):
            send("c", t, f"item-{c}", c)
    config = _config(_raw(kafka_broker, warehouse, tmp_path, unique, [topic]), tmp_path)
    run_once(config, spark, KafkaPipeline)
    for c in range(0, 50, 3):
        send("u", "acme", f"item-{c}", -c, before=c)
    for c in range(0, 50, 7):
        send("d", "globex", f"item-{c}", None, before=c)
    send("c", "initech", "item-1", 1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark, KafkaPipeline)
    target = f"{CATALOG}.ns_{unique}.{unique}"
    assert f"{target} by position: " in caplog.text, caplog.text[-3000:]
    expected = {("acme", f"item-{c}"): (-c if c % 3 == 0 else c) for c in range(50)}
    expected.update({("globex", f"item-{c}"): c for c in range(50) if c % 7})
    expected[("initech", "item-1")] = 1
    rows = hadoop_table(warehouse, target).scan().to_arrow().to_pylist()
    assert {(r["tenant"], r["code"]): r["qty"] for r in rows} == expected
    assert len(rows) == len(expected)


def test_a_log_line_names_a_few_partitions_then_how_many_more() -> None:
    """At hundreds of topics the start, batch and stop lines named every partition (a 200-topic
    pipeline wrote 10 KB lines); they name the first few, then say how many more."""
    from walberg.runtime.kafka.marks import SHOWN, offsets_text

    few = {("orders", 0): 12, ("orders", 1): -2}
    assert offsets_text(few) == "orders[0]@12, orders[1]@earliest"
    assert offsets_text({}) == "-"
    many = {(f"app.public.t_{i:04d}", 0): 200 for i in range(200)}
    text = offsets_text(many)
    assert text.startswith("app.public.t_0000[0]@200, app.public.t_0001[0]@200")
    assert text.endswith(f"and {200 - SHOWN} more partition(s)")
    assert text.count("@") == SHOWN and len(text) < 300
