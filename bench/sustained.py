"""The user's situation, warm: a long-running `walberg run` on a large table under a writer.

    python bench/sustained.py [--rows 10000000] [--seconds 300] [--rate 2000]
                              [--steady-seconds 120] [--shape bigint|uuid]

In one run, on one embedded PostgreSQL:

1. A table (id key, a bigint or with --shape uuid a uuid; name text, amount numeric(12,2),
   n int) of --rows rows is copied by
   `walberg run --once`; then `walberg run` starts (its own process, `max_interval_seconds: 1`,
   metrics on a local port) and keeps running.
2. Flat out: a writer commits mixed changes as fast as it can for --seconds (transactions of
   1,000: half inserts of new keys, three tenths updates and two tenths deletes of keys drawn at
   random over every key made so far, so the deletes never exhaust the table). walberg's rate
   is the changes divided by the time from the writer's start until walberg's committed LSN
   (its `walberg_committed_lsn` gauge) passes the writer's last commit. Two baselines, each
   with a slot of its own (pgoutput, protocol 1): `pg_recvlogical` reading live beside walberg
   while the writer writes (the time until its slot's confirmed position passes the last
   commit; it confirms every second), and `pg_recvlogical` draining the same changes
   afterwards, alone. The target is 0.70 or more. While the writer runs, no reader can be
   faster than the writer: the second ratio is capped by the writer's pace on a small machine.
3. Steady: the writer commits --rate changes a second for --steady-seconds (a transaction of
   a tenth of that every 0.1 s). The Postgres-commit-to-Iceberg-visible latency is read from
   walberg's `walberg_end_to_end_seconds` histogram (its counts before and after the phase;
   the age of each commit's oldest transaction), p50 and p99 interpolated within its buckets;
   and, for both phases, from outside walberg: each transaction's COMMIT (the writer's clock,
   and its WAL position) against the Iceberg snapshot that made it visible (the first whose
   `walberg.lsn` is past it, its time from the table's metadata): p50/p95/p99/max. The
   targets: p50 under 3 s, p99 under 10 s.
4. The peak resident memory of walberg's Python process over the run (its JVM is a process
   of its own and is reported beside it).

These machines are shared and noisy: the figures that matter are the ratios within one run.
"""

from __future__ import annotations

import argparse
import bisect
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import timezone
from pathlib import Path
from typing import Any, Callable, Optional

import psycopg2
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from backlog import SHAPES, bytecode, make_table, recvlogical, walberg_once  # noqa: E402
from run import save_results  # noqa: E402

from walberg.apply.catalog.metadata import read_hadoop_history  # noqa: E402
from walberg.source.embedded_pg import EmbeddedPostgres  # noqa: E402

TXN = 1_000  # changes per transaction while writing flat out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one(cur: Any) -> Any:
    """The one value of the one row the cursor's last statement returned."""
    row = cur.fetchone()
    assert row is not None
    return row[0]


def write_config(dsn: str, work: Path, name: str, port: int) -> Path:
    raw = {
        "source": {"postgres": {"dsn": dsn, "slot": f"slot_{name}", "publication": f"pub_{name}",
                                "tables": [f"public.{name}"]}},
        "sink": {"catalog": {"name": "lake", "type": "hadoop",
                             "warehouse": str(work / "warehouse")}, "namespace": "bench"},
        "buffer": {"dir": str(work / f"segments_{name}"), "max_interval_seconds": 1},
        "spark": {"master": "local[2]"},
        "metrics": {"port": port},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The metrics endpoint as {name: [(labels, value)]}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        out.setdefault(name, []).append(({k: v.strip('"') for k, v in labels.items()},
                                         float(value)))
    return out


def committed_lsn(port: int) -> int:
    values = [v for _, v in scrape(port).get("walberg_committed_lsn", [])]
    return int(max(values)) if values else 0


def latency_buckets(port: int) -> dict[float, float]:
    """walberg_end_to_end_seconds as {upper bound: cumulative count}."""
    out: dict[float, float] = {}
    for labels, value in scrape(port).get("walberg_end_to_end_seconds_bucket", []):
        out[float(labels["le"])] = out.get(float(labels["le"]), 0.0) + value
    return out


def quantile(buckets: dict[float, float], q: float) -> Optional[float]:
    """The q-quantile of a cumulative histogram, interpolated linearly within its bucket."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0
    if not total:
        return None
    want, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= want:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (want - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower


def slot_flushed(cur: Any, slot: str) -> int:
    """How far the slot's reader has confirmed (0 before its first confirmation)."""
    cur.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (slot,))
    row = cur.fetchone()
    return lsn_int(row[0]) if row and row[0] else 0


def lsn_int(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


class Writer:
    """Commits mixed changes to ``name``: flat out, or at a steady rate."""

    def __init__(self, dsn: str, name: str, rows: int, shape: str = "bigint") -> None:
        # The key of new rows and of rows drawn at random, as the shape spells it from a
        # number (backlog.SHAPES): a bigint is the number, a uuid an md5 of it.
        self.key = SHAPES[shape][1]
        self.conn = psycopg2.connect(dsn)
        self.conn.autocommit = True
        self.cur = self.conn.cursor()
        self.name, self.rows, self.next_key = name, rows, rows + 1
        self.changes, self.last = 0, 0
        # Each transaction: (the WAL insert position just before its COMMIT, the wall time
        # its COMMIT returned), for latency measured from outside walberg.
        self.commits: list[tuple[int, float]] = []

    def transaction(self, size: int) -> None:
        inserts, updates = size // 2, size * 3 // 10
        deletes = size - inserts - updates
        cur, name = self.cur, self.name
        cur.execute("BEGIN")
        drawn = self.key.format(g="1 + (random() * %s)::bigint")
        cur.execute(f"INSERT INTO {name} SELECT {self.key.format(g='g')}, 'new ' || g, 1.00, 1 "
                    "FROM generate_series(%s, %s) g", (self.next_key, self.next_key + inserts - 1))
        made = cur.rowcount
        self.next_key += inserts
        cur.execute(f"UPDATE {name} SET amount = amount + 1, n = n + 1 WHERE id IN (SELECT "
                    f"{drawn} FROM generate_series(1, %s))", (self.next_key - 2, updates))
        made += cur.rowcount
        cur.execute(f"DELETE FROM {name} WHERE id IN (SELECT {drawn} "
                    "FROM generate_series(1, %s))", (self.next_key - 2, deletes))
        made += cur.rowcount
        # Just before the commit record: the LSN walberg reports for this transaction is at
        # least this.
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        self.last = lsn_int(_one(cur))
        cur.execute("COMMIT")
        self.commits.append((self.last, time.time()))
        self.changes += made

    def flat_out(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.transaction(TXN)

    def steady(self, rate: int, seconds: float) -> None:
        size = max(rate // 10, 10)
        paced(lambda: self.transaction(size), 0.1, seconds)


def paced(step: Callable[[], None], tick: float, seconds: float) -> None:
    """``step`` once every ``tick`` seconds for ``seconds`` (at once again when one ran late)."""
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        step()
        n += 1
        delay = start + n * tick - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def visible_after(commits: list[tuple[int, float]], warehouse: Path,
                  name: str) -> list[float]:
    """Per transaction, seconds from its COMMIT returning to the Iceberg snapshot that made it
    visible: the first snapshot made current whose ``walberg.lsn`` is past the transaction's
    commit record (read from the table's metadata, not from walberg's metrics)."""
    history = read_hadoop_history(warehouse, "bench", name) or []
    times, marks, highest = [], [], 0
    for row in history:  # in the order they were made current
        if row["lsn"]:
            highest = max(highest, lsn_int(row["lsn"]))
            times.append(row["made_current_at"].replace(tzinfo=timezone.utc).timestamp())
            marks.append(highest)
    out = []
    for lsn, committed in commits:
        i = bisect.bisect_right(marks, lsn)  # the first snapshot whose mark is past it
        if i < len(marks):
            out.append(max(times[i] - committed, 0.0))
    return out


def percentiles(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"p50_s": None, "p95_s": None, "p99_s": None, "max_s": None, "n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

    return {"p50_s": at(0.50), "p95_s": at(0.95), "p99_s": at(0.99), "max_s": ordered[-1],
            "n": len(ordered)}


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)
    return time.monotonic()


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of ``pid`` in MB (0 once it is gone); ``field``: VmRSS (all of it),
    RssAnon (the process's own memory) or RssFile (pages of mapped files, such as the key
    index's, which the kernel may drop and read again)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Sampler(threading.Thread):
    """Peak RSS of walberg's process and of its JVM (a child process), sampled every second."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.python_mb, self.jvm_mb = pid, 0.0, 0.0
        self.python_anon_mb = self.python_file_mb = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.python_mb = max(self.python_mb, rss_mb(self.pid))
            self.python_anon_mb = max(self.python_anon_mb, rss_mb(self.pid, "RssAnon"))
            self.python_file_mb = max(self.python_file_mb, rss_mb(self.pid, "RssFile"))
            self.jvm_mb = max(self.jvm_mb, sum(rss_mb(c) for c in children(self.pid)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--seconds", type=float, default=300, help="flat-out writing phase")
    ap.add_argument("--rate", type=int, default=2000, help="changes/s in the steady phase")
    ap.add_argument("--steady-seconds", type=float, default=120)
    ap.add_argument("--shape", choices=["bigint", "uuid"], default="bigint",
                    help="the table's key: a bigint, or a uuid")
    ap.add_argument("--out", default=None,
                    help="default: bench/results/sustained.json (sustained-uuid.json for uuid)")
    args = ap.parse_args()
    if args.out is None:
        suffix = "" if args.shape == "bigint" else f"-{args.shape}"
        args.out = str(ROOT / "bench" / "results" / f"sustained{suffix}.json")
    work = Path(tempfile.mkdtemp(prefix="walberg-sustained-"))
    bytecode()  # (as an installed walberg has it)
    server = EmbeddedPostgres().start()
    name, port = "sustained", free_port()
    results: dict[str, Any] = {"rows": args.rows, "cores": os.cpu_count(), "shape": args.shape}
    proc: Optional[subprocess.Popen[str]] = None
    try:
        conn = psycopg2.connect(server.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        make_table(cur, name, args.rows, args.shape)
        config = write_config(server.dsn, work, name, port)
        results["copy_run_once_s"] = walberg_once(config, "copy")
        log = open(work / "run.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "walberg.cli", "run", "-c", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
        sampler = Sampler(proc.pid)
        sampler.start()
        wait_until(lambda: _up(port), 300, "walberg's metrics endpoint")
        cur.execute(f"CREATE PUBLICATION recv_{name} FOR TABLE {name}")
        cur.execute(f"SELECT pg_create_logical_replication_slot('recv_{name}', 'pgoutput')")
        cur.execute(f"SELECT pg_create_logical_replication_slot('live_{name}', 'pgoutput')")
        # The live baseline: pg_recvlogical reading beside walberg while the writer writes.
        live = subprocess.Popen(
            [str(server.bin_dir / "pg_recvlogical"), "-d", server.dsn, "--slot", f"live_{name}",
             "--start", "-o", "proto_version=1", "-o", f"publication_names=recv_{name}",
             "-f", "/dev/null", "-s", "1", "-F", "1", "--no-loop"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        writer = Writer(server.dsn, name, args.rows, args.shape)
        start = time.monotonic()
        writer.flat_out(args.seconds)
        written_s = time.monotonic() - start
        end_lsn = writer.last
        # Both watched in one loop: each one's time is when it first passed the last commit.
        done: dict[str, float] = {}

        def both() -> bool:
            if "walberg" not in done and committed_lsn(port) >= end_lsn:
                done["walberg"] = time.monotonic() - start
            if "live" not in done and slot_flushed(cur, f"live_{name}") >= end_lsn:
                done["live"] = time.monotonic() - start
            return len(done) == 2

        wait_until(both, 1800, "walberg and pg_recvlogical to read the flat-out phase")
        walberg_s, live_s = done["walberg"], done["live"]
        live.terminate()
        live.wait(30)
        cur.execute(f"SELECT pg_drop_replication_slot('live_{name}')")
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        recv_s = recvlogical(server, {server.dsn: f"recv_{name}"}, f"recv_{name}", _one(cur))
        cur.execute(f"SELECT pg_drop_replication_slot('recv_{name}')")
        flat = writer.changes
        flat_commits, writer.commits = writer.commits, []
        results["flat_out"] = {
            "changes": flat, "writer_s": written_s, "writer_changes_per_s": flat / written_s,
            "walberg_caught_up_s": walberg_s, "walberg_changes_per_s": flat / walberg_s,
            "lag_after_writer_s": walberg_s - written_s,
            "pg_recvlogical_s": recv_s, "pg_recvlogical_changes_per_s": flat / recv_s,
            "ratio": recv_s / walberg_s,
            "pg_recvlogical_live_s": live_s, "live_ratio": live_s / walberg_s,
        }
        print(f"flat out: {flat:,} changes written in {written_s:.0f} s, in Iceberg after "
              f"{walberg_s:.0f} s, read live by pg_recvlogical after {live_s:.0f} s; "
              f"pg_recvlogical drains them afterwards in {recv_s:.1f} s", flush=True)

        results["flat_out"]["outside"] = percentiles(
            visible_after(flat_commits, work / "warehouse", name))
        before = latency_buckets(port)
        writer.changes = 0
        writer.steady(args.rate, args.steady_seconds)
        end_lsn = writer.last
        wait_until(lambda: committed_lsn(port) >= end_lsn, 600, "the steady phase")
        after = latency_buckets(port)
        phase = {b: after[b] - before.get(b, 0.0) for b in after}
        results["steady"] = {
            "rate_asked": args.rate, "rate_made": writer.changes / args.steady_seconds,
            "batches": phase.get(float("inf"), 0.0),
            "p50_s": quantile(phase, 0.50), "p99_s": quantile(phase, 0.99),
            "buckets": {str(k): v for k, v in sorted(phase.items())},
            "outside": percentiles(visible_after(writer.commits, work / "warehouse", name)),
        }
        sampler.stop.set()
        results["peak_rss_mb"] = {"python": sampler.python_mb, "jvm": sampler.jvm_mb,
                                  "python_anon": sampler.python_anon_mb,
                                  "python_file": sampler.python_file_mb}
    finally:
        stop_process(proc)
        server.stop()
    out = save_results(results, args.out)
    f, s = results["flat_out"], results["steady"]
    print(f"\nsustained `walberg run` on a {args.rows:,}-row table, {results['cores']} cores "
          f"(logs in {work})")
    print(f"  flat out {args.seconds:.0f} s: writer {f['writer_changes_per_s']:,.0f} changes/s, "
          f"walberg {f['walberg_changes_per_s']:,.0f}/s (caught up {f['lag_after_writer_s']:.1f} s "
          f"after the writer), pg_recvlogical {f['pg_recvlogical_changes_per_s']:,.0f}/s: "
          f"ratio {f['ratio']:.2f} (target >= 0.70); pg_recvlogical reading live beside it "
          f"had them after {f['pg_recvlogical_live_s']:.1f} s: ratio {f['live_ratio']:.2f}")
    p50, p99 = s["p50_s"], s["p99_s"]
    print(f"  steady {s['rate_made']:,.0f} changes/s: end-to-end p50 "
          f"{'n/a' if p50 is None else f'{p50:.1f}'} s (target < 3), p99 "
          f"{'n/a' if p99 is None else f'{p99:.1f}'} s (target < 10), "
          f"{s['batches']:.0f} batches")
    for phase_name, figures in (("flat out", f["outside"]), ("steady", s["outside"])):
        if figures["n"]:
            print(f"  {phase_name}, measured from outside (each transaction's COMMIT to the "
                  f"snapshot that made it visible, {figures['n']} transactions): p50 "
                  f"{figures['p50_s']:.2f} s, p95 {figures['p95_s']:.2f} s, p99 "
                  f"{figures['p99_s']:.2f} s, max {figures['max_s']:.2f} s")
    rss = results["peak_rss_mb"]
    print(f"  peak RSS: walberg's Python process {rss['python']:.0f} MB (its own memory "
          f"{rss['python_anon']:.0f} MB, mapped files {rss['python_file']:.0f} MB, each at its "
          f"own peak), its JVM {rss['jvm']:.0f} MB")
    print(f"  results in {out}")
    return 0


def stop_process(proc: "Optional[subprocess.Popen[str]]") -> None:
    """End a `walberg run` the benchmark started (SIGTERM, then SIGKILL after a minute)."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _up(port: int) -> bool:
    try:
        scrape(port)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
