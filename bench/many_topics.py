"""Many tables from Kafka: a topic per table of Debezium events, under an application-like
producer, as a user meets it (the Kafka side of bench/many_tables.py).

    python bench/many_topics.py [--topics 200] [--rows 1000] [--rate 2000] [--seconds 60]
                                [--settle-seconds 30] [--commit-parallelism N]

In one run, on one Tansu broker (in memory, loopback):

1. --topics topics of one partition, each the Debezium change events of one table (a text key,
   the columns of bench/backlog_kafka.py), --rows snapshot events ("r") each. The lake's
   initial load is one `walberg run --once` (seconds per table), then a no-op one.
2. `walberg run` starts (its own process, `max_interval_seconds: 1`) and a producer sends
   --rate events a second for --seconds, in "transactions" of ten events over 1 to 3 topics
   drawn at random (inserts of new keys, updates and deletes of keys drawn at random).
3. Freshness from outside walberg: for each (transaction, topic it touched), the time from the
   producer's delivery of the transaction's last event to that table's first snapshot whose
   `walberg.offset.<topic>.0` is past it (read from the table's metadata). A pair not visible
   --settle-seconds after the producer stopped counts as not visible. Targets as for
   bench/many_tables.py at 200 tables: p50 < 2 s, p99 < 5 s.
4. How many Iceberg commits the phase made, and the peak resident memory of walberg's Python
   process and of its JVM.

Every event is sent as a batch of its own: Tansu's high watermark counts batches, not records
(tests/kafka_broker.py), and a consumer that trusts it would wait for the next event.
"""

from __future__ import annotations

import argparse
import bisect
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import timezone
from pathlib import Path
from typing import Any, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from backlog import bytecode, walberg_once  # noqa: E402
from backlog_kafka import COLUMNS, _event, _row, broker, produce  # noqa: E402
from many_tables import commits_since, lake_sections  # noqa: E402
from run import save_results  # noqa: E402
from sustained import (  # noqa: E402
    Sampler,
    _up,
    free_port,
    paced,
    percentiles,
    stop_process,
    wait_until,
)

from kafka_broker import create_topic  # noqa: E402
from walberg.apply.catalog.metadata import read_hadoop_history  # noqa: E402
from walberg.apply.iceberg import OFFSET_PROPERTY  # noqa: E402


def topic_name(i: int) -> str:
    return f"app.public.t_{i:04d}"


def table_name(i: int) -> str:
    return f"t_{i:04d}"


def write_config(servers: str, work: Path, count: int, port: int,
                 parallelism: Optional[int] = None) -> Path:
    raw: dict[str, Any] = {
        "source": {"kafka": {
            "bootstrap_servers": servers, "group_id": "walberg_many",
            "topics": [topic_name(i) for i in range(count)],
            "tables": {topic_name(i): {"table": f"bench.{table_name(i)}", "key": ["id"],
                                       "columns": COLUMNS} for i in range(count)}}},
        **lake_sections(work, port, parallelism),
    }
    path = work / "many_topics.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Writer:
    """Transactions of ten events over 1-3 random topics, each event a batch of its own."""

    def __init__(self, servers: str, count: int, rows: int, seed: int = 7) -> None:
        from confluent_kafka import Producer

        self.producer = Producer({"bootstrap.servers": servers, "linger.ms": 0,
                                  "batch.num.messages": 1, "acks": "all"})
        self.count = count
        self.next_key = [rows + 1] * count
        self.rng = random.Random(seed)
        self.changes = 0
        # (topic number, the offset of its last event in the transaction, delivered at)
        self.sent: list[tuple[int, int, float]] = []

    def transaction(self, size: int = 10) -> None:
        touched = self.rng.sample(range(self.count), self.rng.randint(1, 3))
        last: dict[int, int] = {}

        def delivered(i: int) -> Any:
            def note(err: Any, msg: Any) -> None:
                if err is None:
                    last[i] = max(last.get(i, -1), int(msg.offset()))
            return note

        for n in range(size):
            i = touched[n % len(touched)]
            roll = self.rng.random()
            if roll < 0.4:
                g = self.next_key[i]
                self.next_key[i] += 1
                key, value = _event("c", None, _row(g, f"new {g}", "1.00", 1))
            else:
                g = self.rng.randint(1, self.next_key[i] - 1)
                old = _row(g, f"customer {g}", "0.00", 0)
                key, value = (_event("u", old, dict(old, n=self.rng.randint(1, 99)))
                              if roll < 0.8 else _event("d", old, None))
            self.producer.produce(topic_name(i), key=key, value=value, partition=0,
                                  on_delivery=delivered(i))
        self.producer.flush(30)
        at = time.time()
        self.sent += [(i, offset, at) for i, offset in last.items()]
        self.changes += size

    def steady(self, rate: int, seconds: float, size: int = 10) -> None:
        paced(lambda: self.transaction(size), size / rate, seconds)


def mark(i: int) -> str:
    """The property of walberg's mark in the topic's table: the next offset it holds."""
    return f"{OFFSET_PROPERTY}.{topic_name(i)}.0"


def marks(warehouse: Path, i: int) -> tuple[list[float], list[int]]:
    """When each snapshot of the topic's table was made current, and the next offset of the
    topic it holds by then (its highest mark so far)."""
    times, held, highest = [], [], -1
    for row in read_hadoop_history(warehouse, "bench", table_name(i), mark(i)) or []:
        if row["lsn"]:
            highest = max(highest, int(row["lsn"]))
            times.append(row["made_current_at"].replace(tzinfo=timezone.utc).timestamp())
            held.append(highest)
    return times, held


def freshness(writer: Writer, warehouse: Path) -> tuple[list[float], int]:
    """Seconds from each (transaction, topic) pair's delivery to the table's snapshot that
    holds it (a mark past its offset); and how many pairs were not visible."""
    per_topic: dict[int, list[tuple[int, float]]] = {}
    for i, offset, at in writer.sent:
        per_topic.setdefault(i, []).append((offset, at))
    seen: list[float] = []
    for i, sent in per_topic.items():
        times, held = marks(warehouse, i)
        for offset, at in sent:
            k = bisect.bisect_right(held, offset)  # the first snapshot holding offset + 1
            if k < len(held):
                seen.append(max(times[k] - at, 0.0))
    return seen, len(writer.sent) - len(seen)


def caught_up(writer: Writer, warehouse: Path) -> bool:
    wanted: dict[int, int] = {}
    for i, offset, _ in writer.sent:
        wanted[i] = max(wanted.get(i, -1), offset)
    return all((marks(warehouse, i)[1] or [-1])[-1] > offset for i, offset in wanted.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topics", type=int, default=200)
    ap.add_argument("--rows", type=int, default=1000, help="snapshot events of each topic")
    ap.add_argument("--rate", type=int, default=2000, help="events a second")
    ap.add_argument("--seconds", type=float, default=60, help="the producer's phase")
    ap.add_argument("--settle-seconds", type=float, default=30,
                    help="how long after the producer a pair may still become visible")
    ap.add_argument("--commit-parallelism", type=int, default=None,
                    help="sink.commit_parallelism (default: walberg's)")
    ap.add_argument("--out", default=None, help="default: bench/results/many-topics-N.json")
    args = ap.parse_args()
    out_path = args.out or str(ROOT / "bench" / "results" / f"many-topics-{args.topics}.json")
    work = Path(tempfile.mkdtemp(prefix="walberg-topics-"))
    bytecode()
    tansu, servers = broker(work)
    port = free_port()
    results: dict[str, Any] = {"topics": args.topics, "rows": args.rows, "rate": args.rate,
                               "cores": os.cpu_count(),
                               "commit_parallelism": args.commit_parallelism}
    proc: Optional[subprocess.Popen[str]] = None
    try:
        for i in range(args.topics):
            create_topic(servers, topic_name(i))
            produce(servers, topic_name(i),
                    (_event("r", None, _row(g, f"customer {g}", "0.00", 0))
                     for g in range(1, args.rows + 1)))
        config = write_config(servers, work, args.topics, port, args.commit_parallelism)
        copy_s = walberg_once(config, "copy")
        noop_s = walberg_once(config, "noop")
        results.update(copy_s=copy_s, copy_per_table_s=copy_s / args.topics, noop_once_s=noop_s)
        print(f"initial load of {args.topics} topics: {copy_s:.1f} s "
              f"({copy_s / args.topics:.3f} s a table); no-op run --once {noop_s:.1f} s",
              flush=True)

        log = open(work / "run.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "walberg.cli", "run", "-c", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
        sampler = Sampler(proc.pid)
        sampler.start()
        wait_until(lambda: _up(port), 300, "walberg's metrics endpoint")
        writer = Writer(servers, args.topics, args.rows)
        warehouse = work / "warehouse"
        # Warm-up, not measured: walberg's start is behind it once the warm-up is in the lake.
        writer.steady(args.rate, 5)
        wait_until(lambda: caught_up(writer, warehouse), 600, "walberg to apply the warm-up")
        writer.sent, writer.changes = [], 0
        started = time.time()
        writer.steady(args.rate, args.seconds)
        made = writer.changes / args.seconds
        try:
            wait_until(lambda: caught_up(writer, warehouse), args.settle_seconds,
                       "every touched table")
        except SystemExit:
            pass  # (what is not visible by then is counted so)
        sampler.stop.set()
        seen, missing = freshness(writer, warehouse)
        results["steady"] = {
            "rate_made": made, "transactions_pairs": len(writer.sent),
            "pairs_not_visible": missing,
            "iceberg_commits": commits_since(
                warehouse, [(table_name(i), mark(i)) for i in range(args.topics)], started),
            **percentiles(seen),
        }
        results["peak_rss_mb"] = {"python": sampler.python_mb, "jvm": sampler.jvm_mb}
    finally:
        stop_process(proc)
        tansu.kill()
    out = save_results(results, out_path)
    s = results["steady"]
    p50, p99 = s["p50_s"], s["p99_s"]
    print(f"\n{args.topics} topics of {args.rows:,} events, producer {s['rate_made']:,.0f} "
          f"events/s in transactions of 1-3 topics, {results['cores']} cores (logs in {work})")
    print(f"  commit-to-visible, measured from outside ({s['n']} (transaction, topic) pairs "
          f"visible, {s['pairs_not_visible']} not visible {args.settle_seconds:.0f} s after "
          f"the producer): p50 {p50 if p50 is None else round(p50, 2)} s (target < 2), "
          f"p99 {p99 if p99 is None else round(p99, 2)} s (target < 5); "
          f"{s['iceberg_commits']} Iceberg commits")
    print(f"  peak RSS: walberg's Python process {results['peak_rss_mb']['python']} MB, "
          f"its JVM {results['peak_rss_mb']['jvm']} MB")
    print(f"  results in {out}")


if __name__ == "__main__":
    main()
