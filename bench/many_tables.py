"""A database of many small tables under an application-like writer, as a user meets it.

    python bench/many_tables.py [--tables 200] [--rows 5000] [--rate 2000] [--seconds 60]
                                [--settle-seconds 30] [--commit-parallelism N]

In one run, on one embedded PostgreSQL:

1. --tables tables in one publication and one pipeline file, their keys in turn a bigint, a
   uuid and a composite (int, bigint), --rows rows each. The initial copy is one
   `walberg run --once` (seconds per table; target at 1,000 tables: at most 0.1 s a table);
   then a no-op `walberg run --once` (target: at most 4 s at 1,000 tables).
2. `walberg run` starts (its own process, `max_interval_seconds: 1`, metrics on a local port)
   and a writer commits --rate changes a second for --seconds, in transactions that each
   touch 1 to 3 tables drawn at random (inserts of new keys, updates and deletes of keys drawn
   at random), as an application does.
3. Freshness from outside walberg: for each (transaction, table it touched), the time from the
   transaction's COMMIT (the writer's clock; its WAL position just before) to the first
   snapshot of that table whose `walberg.lsn` is past it (read from the table's metadata). A
   pair not visible --settle-seconds after the writer stopped counts as not visible.
   Targets: p50 < 2 s and p99 < 5 s at 200 tables; p99 < 10 s at 1,000.
4. How many Iceberg commits the phase made, and the peak resident memory of walberg's Python
   process and of its JVM.

These machines are shared and noisy; the freshness targets are absolute (as a user meets
them), and the single-table figures to hold beside them are bench/sustained.py's.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import timezone
from pathlib import Path
from typing import Any, Optional

import psycopg2
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from backlog import SHAPES, bytecode, walberg_once  # noqa: E402
from run import save_results  # noqa: E402
from sustained import (  # noqa: E402
    Sampler,
    _up,
    free_port,
    lsn_int,
    paced,
    percentiles,
    scrape,
    stop_process,
    visible_after,
    wait_until,
)

from walberg.apply.catalog.metadata import read_hadoop_history  # noqa: E402
from walberg.apply.iceberg import LSN_PROPERTY  # noqa: E402
from walberg.source.embedded_pg import EmbeddedPostgres  # noqa: E402

KEYS = ("bigint", "uuid", "composite")


def table_name(i: int) -> str:
    return f"app_{i:04d}"


def make_tables(cur: Any, count: int, rows: int) -> None:
    for i in range(count):
        key, key_sql, key_names, _, _, _ = SHAPES[KEYS[i % len(KEYS)]]
        name = table_name(i)
        cur.execute(f"CREATE TABLE {name} ({key}, name text, amount numeric(12,2), n int, "
                    f"PRIMARY KEY ({key_names}))")
        key_sql = key_sql.replace("%", "%%")  # (a statement with parameters)
        cur.execute(f"INSERT INTO {name} SELECT {key_sql.format(g='g')}, 'row ' || g, "
                    "(g %% 1000) / 10.0, g %% 100 FROM generate_series(1, %s) g", (rows,))
    cur.execute("VACUUM ANALYZE")
    cur.execute("CHECKPOINT")


def lake_sections(work: Path, port: int, parallelism: Optional[int] = None) -> dict[str, Any]:
    """The pipeline file's sections but the source: a hadoop warehouse in ``work``, 1 s
    batches, metrics on ``port``."""
    return {
        "sink": {"catalog": {"name": "lake", "type": "hadoop",
                             "warehouse": str(work / "warehouse")}, "namespace": "bench",
                 **({"commit_parallelism": parallelism} if parallelism else {})},
        "buffer": {"dir": str(work / "segments"), "max_interval_seconds": 1},
        "spark": {"master": "local[2]"},
        "metrics": {"port": port},
    }


def write_config(dsn: str, work: Path, count: int, port: int,
                 parallelism: Optional[int] = None) -> Path:
    raw = {
        "source": {"postgres": {"dsn": dsn, "slot": "slot_many", "publication": "pub_many",
                                "tables": [f"public.{table_name(i)}" for i in range(count)]}},
        **lake_sections(work, port, parallelism),
    }
    path = work / "many.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Writer:
    """Transactions of 1-3 random tables, about ``rate`` changes a second."""

    def __init__(self, dsn: str, count: int, rows: int, seed: int = 7) -> None:
        self.conn = psycopg2.connect(dsn)
        self.conn.autocommit = True
        self.cur = self.conn.cursor()
        self.count, self.rows = count, rows
        self.next_key = [rows + 1] * count
        self.rng = random.Random(seed)
        self.changes = 0
        # (the WAL insert position just before COMMIT, the wall time COMMIT returned, tables)
        self.commits: list[tuple[int, float, list[int]]] = []

    def _key(self, i: int, g: int) -> str:
        return SHAPES[KEYS[i % len(KEYS)]][1].format(g=str(g))

    def _where(self, i: int, g: int) -> str:
        names = SHAPES[KEYS[i % len(KEYS)]][2]
        return f"({names}) = ({self._key(i, g)})"

    def transaction(self, size: int) -> None:
        touched = self.rng.sample(range(self.count), self.rng.randint(1, 3))
        cur = self.cur
        cur.execute("BEGIN")
        for n in range(size):
            i = touched[n % len(touched)]
            name, roll = table_name(i), self.rng.random()
            if roll < 0.4:
                g = self.next_key[i]
                self.next_key[i] += 1
                cur.execute(f"INSERT INTO {name} VALUES ({self._key(i, g)}, 'new', 1.0, 1)")
            elif roll < 0.8:
                g = self.rng.randint(1, self.next_key[i] - 1)
                cur.execute(f"UPDATE {name} SET n = n + 1 WHERE {self._where(i, g)}")
            else:
                g = self.rng.randint(1, self.next_key[i] - 1)
                cur.execute(f"DELETE FROM {name} WHERE {self._where(i, g)}")
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        row = cur.fetchone()
        assert row is not None
        lsn = lsn_int(row[0])
        cur.execute("COMMIT")
        self.commits.append((lsn, time.time(), touched))
        self.changes += size

    def steady(self, rate: int, seconds: float, size: int = 10) -> None:
        paced(lambda: self.transaction(size), size / rate, seconds)


def committed(port: int) -> dict[str, int]:
    """walberg_committed_lsn per table."""
    return {labels.get("table", ""): int(v)
            for labels, v in scrape(port).get("walberg_committed_lsn", [])}


def freshness(writer: Writer, warehouse: Path) -> tuple[list[float], int]:
    """Seconds from each (transaction, table) pair's COMMIT to the table's snapshot that made
    it visible; and how many pairs were not visible."""
    per_table: dict[int, list[tuple[int, float]]] = {}
    for lsn, at, touched in writer.commits:
        for i in touched:
            per_table.setdefault(i, []).append((lsn, at))
    seen: list[float] = []
    pairs = 0
    for i, commits in per_table.items():
        pairs += len(commits)
        seen += visible_after(commits, warehouse, table_name(i))
    return seen, pairs - len(seen)


def commits_since(warehouse: Path, tables: list[tuple[str, str]], since: float) -> int:
    """walberg's commits made current since ``since`` in ``tables`` (name, the property
    of walberg's mark in it)."""
    made = 0
    for name, mark in tables:
        for row in read_hadoop_history(warehouse, "bench", name, mark) or []:
            at = row["made_current_at"].replace(tzinfo=timezone.utc).timestamp()
            if at >= since and row["lsn"]:
                made += 1
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=200)
    ap.add_argument("--rows", type=int, default=5000, help="rows of each table")
    ap.add_argument("--rate", type=int, default=2000, help="changes a second")
    ap.add_argument("--seconds", type=float, default=60, help="the writer's phase")
    ap.add_argument("--settle-seconds", type=float, default=30,
                    help="after the writer: how long a change may still become visible")
    ap.add_argument("--commit-parallelism", type=int, default=None,
                    help="sink.commit_parallelism (default: walberg's)")
    ap.add_argument("--out", default=None, help="default: bench/results/many-tables-N.json")
    args = ap.parse_args()
    out_path = args.out or str(ROOT / "bench" / "results" / f"many-tables-{args.tables}.json")
    work = Path(tempfile.mkdtemp(prefix="walberg-many-"))
    bytecode()
    server = EmbeddedPostgres().start()
    port = free_port()
    results: dict[str, Any] = {"tables": args.tables, "rows": args.rows, "rate": args.rate,
                               "cores": os.cpu_count(),
                               "commit_parallelism": args.commit_parallelism}
    proc: Optional[subprocess.Popen[str]] = None
    try:
        conn = psycopg2.connect(server.dsn)
        conn.autocommit = True
        make_tables(conn.cursor(), args.tables, args.rows)
        config = write_config(server.dsn, work, args.tables, port, args.commit_parallelism)
        copy_s = walberg_once(config, "copy")
        noop_s = walberg_once(config, "noop")
        results.update(copy_s=copy_s, copy_per_table_s=copy_s / args.tables, noop_once_s=noop_s)
        print(f"initial copy of {args.tables} tables: {copy_s:.1f} s "
              f"({copy_s / args.tables:.3f} s a table; target at 1,000 tables <= 0.1); "
              f"no-op run --once {noop_s:.1f} s (target at 1,000 tables <= 4)", flush=True)

        log = open(work / "run.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "walberg.cli", "run", "-c", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
        sampler = Sampler(proc.pid)
        sampler.start()
        wait_until(lambda: _up(port), 300, "walberg's metrics endpoint")
        writer = Writer(server.dsn, args.tables, args.rows)

        def caught_up() -> bool:
            # Each table against the last transaction that touched it: a table's mark moves
            # only with a commit of its own, so one a later batch did not touch keeps the
            # earlier batch's end though nothing of it is missing.
            last: dict[str, int] = {}
            for lsn, _, tables in writer.commits:
                for i in tables:
                    last[table_name(i)] = lsn
            marks = committed(port)
            return all(marks.get(f"public.{t}", 0) >= lsn for t, lsn in last.items())

        # Warm-up, not measured: walberg's start (Spark, the lake's check) is behind it once
        # what the writer wrote meanwhile is in the lake.
        writer.steady(args.rate, 5)
        wait_until(caught_up, 600, "walberg to apply the warm-up")
        writer.commits, writer.changes = [], 0
        started = time.time()
        writer.steady(args.rate, args.seconds)
        made = writer.changes / args.seconds
        try:
            wait_until(caught_up, args.settle_seconds, "every touched table")
        except SystemExit:
            pass  # (what is not visible by then is counted so)
        sampler.stop.set()
        seen, missing = freshness(writer, work / "warehouse")
        figures = percentiles(seen)
        results["steady"] = {
            "rate_made": made, "transactions": len(writer.commits), "pairs_not_visible": missing,
            "iceberg_commits": commits_since(
                work / "warehouse", [(table_name(i), LSN_PROPERTY) for i in range(args.tables)],
                started),
            **figures,
        }
        results["peak_rss_mb"] = {"python": sampler.python_mb, "jvm": sampler.jvm_mb}
    finally:
        stop_process(proc)
        server.stop()
    out = save_results(results, out_path)
    s = results["steady"]
    p50, p99 = s["p50_s"], s["p99_s"]
    print(f"\n{args.tables} tables of {args.rows:,} rows, writer {s['rate_made']:,.0f} "
          f"changes/s in transactions of 1-3 tables, {results['cores']} cores (logs in {work})")
    print(f"  commit-to-visible, measured from outside ({s['n']} (transaction, table) pairs "
          f"visible, {s['pairs_not_visible']} not visible {args.settle_seconds:.0f} s after "
          f"the writer): p50 {'n/a' if p50 is None else f'{p50:.2f}'} s (target < 2 at 200 "
          f"tables), p99 {'n/a' if p99 is None else f'{p99:.2f}'} s (target < 5 at 200, < 10 "
          f"at 1,000); {s['iceberg_commits']} Iceberg commits")
    rss = results["peak_rss_mb"]
    print(f"  peak RSS: walberg's Python process {rss['python']:.0f} MB, its JVM "
          f"{rss['jvm']:.0f} MB")
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
