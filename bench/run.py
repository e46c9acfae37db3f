"""walberg benchmark: one command, one run, every figure next to its baseline from the same run.

    python bench/run.py [--rows 1000000] [--changes 1000000]

1. Initial copy of a table of --rows rows into Iceberg, next to `COPY ... TO STDOUT` of the
   same table (the fastest Postgres can hand the rows out).
2. CDC: --changes changes (inserts, updates, deletes) committed in Postgres, then the time until
   all of them are visible in Iceberg, next to `pg_recvlogical` draining the same changes from a
   slot of its own (how fast the server can stream them). Two such rounds, each on a table of
   its own: the first large MERGE in a JVM runs while the JIT still compiles; the ratio is the
   second round's.
3. Memory: the peak RSS of a Python process of its own while walberg applies one small and one
   large transaction.

These machines are shared and noisy, so the figures that matter are the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psycopg2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from walberg.apply.jvm.spark import build_session, stop_session  # noqa: E402
from walberg.config import parse_config  # noqa: E402
from walberg.pipeline import Pipeline  # noqa: E402
from walberg.source.embedded_pg import EmbeddedPostgres  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """Samples this process's RSS in the background; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.start = self.peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mb())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def config_for(dsn: str, work: Path, name: str, table: str,
               namespace: str = "bench", **postgres: Any) -> Any:
    raw = {
        "source": {"postgres": {"dsn": dsn, "slot": f"slot_{name}",
                                "publication": f"pub_{name}", "tables": [table], **postgres}},
        "sink": {"catalog": {"name": "lake", "type": "hadoop",
                             "warehouse": str(work / "warehouse")}, "namespace": namespace},
        "buffer": {"dir": str(work / f"segments_{name}")},
        "spark": {"master": "local[2]"},
    }
    return parse_config(raw, work, "bench config")


class _Null:
    def write(self, b: bytes) -> int:
        return len(b)


def copy_table_baseline(cur: Any, table: str, rows: int) -> float:
    """Make the copy benchmark's table (bigint key, text, numeric, timestamptz, boolean) of
    ``rows`` rows; return the seconds `COPY ... TO STDOUT` takes to hand it out."""
    cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, name text, amount numeric(12,2), "
                "created timestamptz, flag boolean)")
    cur.execute(f"INSERT INTO {table} SELECT g, 'customer ' || g, (g %% 100000) / 100.0, "
                "timestamptz '2020-01-01 00:00:00+00' + g * interval '1 second', g %% 3 = 0 "
                "FROM generate_series(1, %s) g", (rows,))
    cur.execute(f"VACUUM ANALYZE {table}")
    seconds, _ = timed(lambda: cur.copy_expert(f"COPY (SELECT * FROM {table}) TO STDOUT", _Null()))
    return seconds


def save_results(results: dict[str, Any], out: str) -> Path:
    """Write a benchmark's figures as JSON to ``out`` (its folder made if missing)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    return path


def copied_table(cur: Any, dsn: str, work: Path, session: Any, table: str, rows: int) -> Any:
    """Make ``table`` (id bigint key, v int, note text) of ``rows`` rows and copy it into
    Iceberg with a pipeline of its own (which creates its slot); returns that pipeline's
    configuration."""
    cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, v int, note text)")
    cur.execute(f"INSERT INTO {table} SELECT g, 0, 'row ' || g FROM generate_series(1, %s) g",
                (rows,))
    cfg = config_for(dsn, work, table, f"public.{table}")
    run_once(cfg, session)
    return cfg


def cdc_round(cur: Any, server: EmbeddedPostgres, work: Path, session: Any, table: str,
              changes: int) -> dict[str, Any]:
    """Make ``table`` (changes/5 rows) and copy it into Iceberg, then commit ``changes``
    changes to it (half inserts of new ids, three tenths updates spread over the table, two
    tenths deletes; in 100 transactions) and time `pg_recvlogical` draining them from a slot
    of its own, then walberg applying them."""
    base_rows = max(changes // 5, 1000)
    cfg = copied_table(cur, server.dsn, work, session, table, base_rows)
    # A small round first: a pipeline that has merged before does not pay for loading the
    # MERGE path's classes again.
    cur.execute(f"UPDATE {table} SET v = v + 1 WHERE id <= 20000")
    cur.execute(f"DELETE FROM {table} WHERE id <= 1000")
    cur.execute(f"INSERT INTO {table} SELECT g, 0, 'row ' || g FROM generate_series(1, 1000) g")
    run_once(cfg, session)

    cur.execute(f"CREATE PUBLICATION recv_{table} FOR TABLE {table}")
    cur.execute(f"SELECT pg_create_logical_replication_slot('recv_{table}', 'pgoutput')")
    n_ins, n_upd = changes // 2, changes * 3 // 10
    n_del = changes - n_ins - n_upd
    per = max(changes // 100, 1)
    for lo in range(0, n_ins, per):
        cur.execute(f"INSERT INTO {table} SELECT g, 1, 'new ' || g FROM generate_series(%s, %s) g",
                    (base_rows + lo + 1, base_rows + min(lo + per, n_ins)))
    span = base_rows + n_ins
    for lo in range(0, n_upd, per):
        cur.execute(f"UPDATE {table} SET v = v + 1 WHERE id IN (SELECT (g::bigint * 7919) %% %s "
                    "+ 1 FROM generate_series(%s, %s) g)", (span, lo, min(lo + per, n_upd) - 1))
    for lo in range(0, n_del, per):
        cur.execute(f"DELETE FROM {table} WHERE id BETWEEN %s AND %s",
                    (lo + 1, min(lo + per, n_del)))
    cur.execute("SELECT pg_current_wal_insert_lsn()::text")
    end_lsn = cur.fetchone()[0]

    recv = [str(server.bin_dir / "pg_recvlogical"), "-d", server.dsn, "--slot", f"recv_{table}",
            "--start", "-o", "proto_version=1", "-o", f"publication_names=recv_{table}",
            "--endpos", end_lsn, "-f", "/dev/null", "--no-loop"]
    recv_s, proc = timed(lambda: subprocess.run(recv, capture_output=True, text=True))
    if proc.returncode != 0:
        raise SystemExit(f"pg_recvlogical failed: {proc.stderr}")
    cur.execute(f"SELECT pg_drop_replication_slot('recv_{table}')")
    with PeakRss() as mem:
        walberg_s, report = timed(lambda: run_once(cfg, session))
    cur.execute(f"SELECT count(*) FROM {table}")
    pg_count = cur.fetchone()[0]
    lake_count = session.sql(f"SELECT count(*) FROM lake.bench.{table}").collect()[0][0]
    return {
        "changes_applied": report.changes,
        "pg_recvlogical_changes_per_s": changes / recv_s,
        "walberg_changes_per_s": changes / walberg_s,
        "ratio": recv_s / walberg_s,
        "peak_rss_mb": mem.peak,
        "lake_equals_source_count": pg_count == lake_count,
    }


def run_once(config: Any, session: Any) -> Any:
    pipeline = Pipeline(config, session=session)
    try:
        return pipeline.run(once=True)
    finally:
        pipeline.close()


def memory_phase(dsn: str, work: Path, changes: int) -> dict[str, Any]:
    """Peak RSS of this process while walberg applies one transaction of changes/10 changes and
    one of ``changes`` (UPDATEs of a table of ``changes`` rows). Flat means the peak does not
    follow the transaction's size (segments and staging live on disk)."""
    work.mkdir(parents=True, exist_ok=True)
    session = build_session("local[2]", "lake", str(work / "warehouse"), {}, {},
                            app_name="walberg-bench-memory")
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cfg = copied_table(cur, dsn, work, session, "mem", changes)
            out: dict[str, Any] = {}
            for label, size in (("small", max(changes // 10, 1000)), ("large", changes)):
                cur.execute("UPDATE mem SET v = v + 1 WHERE id <= %s", (size,))
                with PeakRss() as mem:
                    report = run_once(cfg, session)
                out[label] = {"txn_changes": report.changes, "rss_before_mb": mem.start,
                              "peak_rss_mb": mem.peak}
        out["peak_ratio_large_to_small"] = out["large"]["peak_rss_mb"] / out["small"]["peak_rss_mb"]
        return out
    finally:
        conn.close()
        stop_session(session)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    ap.add_argument("--memory-phase", nargs=2, metavar=("DSN", "WORKDIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_phase:  # (run by the benchmark itself, in a process of its own)
        print(json.dumps(memory_phase(args.memory_phase[0], Path(args.memory_phase[1]),
                                      args.changes)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="walberg-bench-"))
    server = EmbeddedPostgres().start()
    session = build_session("local[2]", "lake", str(work / "warehouse"), {}, {},
                            app_name="walberg-bench")
    results: dict[str, Any] = {"rows": args.rows, "changes": args.changes}
    try:
        conn = psycopg2.connect(server.dsn)
        conn.autocommit = True
        cur = conn.cursor()

        # ---- 1. initial copy ------------------------------------------------------------------
        copy_s = copy_table_baseline(cur, "copy_src", args.rows)
        # The first copy in a fresh JVM pays for class loading and JIT compilation; a pipeline
        # that copies many tables pays it once. Both are reported; the ratio uses the second.
        cold_s, report = timed(lambda: run_once(config_for(server.dsn, work, "copy1", "public.copy_src",
                                                           "cold"), session))
        assert report.copied["public.copy_src"] == args.rows
        walberg_copy_s, report = timed(lambda: run_once(config_for(server.dsn, work, "copy2",
                                                                   "public.copy_src", "warm"),
                                                        session))
        assert report.copied["public.copy_src"] == args.rows
        results["copy"] = {
            "pg_copy_to_stdout_rows_per_s": args.rows / copy_s,
            "walberg_rows_per_s": args.rows / walberg_copy_s,
            "walberg_cold_jvm_rows_per_s": args.rows / cold_s,
            "ratio": copy_s / walberg_copy_s,
        }

        # ---- 2. CDC ---------------------------------------------------------------------------
        # Two rounds of the same workload, each on a table of its own made the same way. The
        # first large MERGE in a JVM runs while the JIT still compiles its hot paths, which a
        # long-running `walberg run` pays once: the ratio is the second round's, and the first
        # is reported next to it (like the copy's cold run).
        first = cdc_round(cur, server, work, session, "cdc1", args.changes)
        results["cdc"] = cdc_round(cur, server, work, session, "cdc2", args.changes)
        results["cdc"]["first_round_in_this_jvm"] = first

        # ---- 3. memory against transaction size ------------------------------------------------
        # In a process of its own, so that what the phases above left in this one does not
        # raise the baseline and hide growth.
        proc = subprocess.run([sys.executable, __file__, "--memory-phase", server.dsn,
                               str(work / "memory"), "--changes", str(args.changes)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"memory phase failed: {proc.stderr[-2000:]}")
        results["memory"] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        stop_session(session)
        server.stop()

    out = save_results(results, args.out)
    c, d, m = results["copy"], results["cdc"], results["memory"]
    print(f"\nwalberg benchmark on {os.cpu_count()} cores ({args.rows:,} rows, {args.changes:,} changes)")
    print(f"  initial copy : walberg {c['walberg_rows_per_s']:>10,.0f} rows/s    "
          f"COPY TO STDOUT {c['pg_copy_to_stdout_rows_per_s']:>10,.0f} rows/s    ratio {c['ratio']:.2f}"
          f"   (first copy in a cold JVM: {c['walberg_cold_jvm_rows_per_s']:,.0f} rows/s)")
    f1 = d["first_round_in_this_jvm"]
    print(f"  CDC          : walberg {d['walberg_changes_per_s']:>10,.0f} changes/s "
          f"pg_recvlogical {d['pg_recvlogical_changes_per_s']:>10,.0f} changes/s ratio {d['ratio']:.2f}"
          f"   (first round in this JVM: {f1['walberg_changes_per_s']:,.0f} vs "
          f"{f1['pg_recvlogical_changes_per_s']:,.0f}, ratio {f1['ratio']:.2f})")
    print(f"  memory       : peak RSS {m['small']['peak_rss_mb']:.0f} MB for a transaction of "
          f"{m['small']['txn_changes']:,} changes, {m['large']['peak_rss_mb']:.0f} MB for "
          f"{m['large']['txn_changes']:,} (ratio {m['peak_ratio_large_to_small']:.2f}; "
          f"{m['small']['rss_before_mb']:.0f} MB before the first)")
    print(f"  lake equals source (row count): "
          f"{d['lake_equals_source_count'] and f1['lake_equals_source_count']}")
    print(f"  results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
