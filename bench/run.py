"""walberg benchmark: one command, one run, every figure next to its baseline from the same run.

    python bench/run.py [--rows 1000000] [--changes 1000000]

1. Initial copy of a table of --rows rows into Iceberg, next to `COPY ... TO STDOUT` of the
   same table (the fastest Postgres can hand the rows out).
2. CDC: --changes changes (inserts, updates, deletes) committed in Postgres, then the time until
   all of them are visible in Iceberg, next to `pg_recvlogical` draining the same changes from a
   slot of its own (how fast the server can stream them).
3. Memory: the Python process's peak RSS while applying one small and one large transaction.

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

from walberg.apply.spark import build_session, stop_session  # noqa: E402
from walberg.config import parse_config  # noqa: E402
from walberg.embedded_pg import EmbeddedPostgres  # noqa: E402
from walberg.pipeline import Pipeline  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """Samples this process's RSS in the background; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak = rss_mb()
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


def config_for(server: EmbeddedPostgres, work: Path, name: str, table: str,
               namespace: str = "bench", **postgres: Any) -> Any:
    raw = {
        "source": {"postgres": {"dsn": server.dsn, "slot": f"slot_{name}",
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


def run_once(config: Any, session: Any) -> Any:
    pipeline = Pipeline(config, session=session)
    try:
        return pipeline.run(once=True)
    finally:
        pipeline.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--changes", type=int, default=1_000_000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    args = ap.parse_args()

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
        cold_s, report = timed(lambda: run_once(config_for(server, work, "copy1", "public.copy_src",
                                                           "cold"), session))
        assert report.copied["public.copy_src"] == args.rows
        walberg_copy_s, report = timed(lambda: run_once(config_for(server, work, "copy2",
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
        base_rows = max(args.changes // 5, 1000)
        cur.execute("CREATE TABLE cdc (id bigint PRIMARY KEY, v int, note text)")
        cur.execute("INSERT INTO cdc SELECT g, 0, 'row ' || g FROM generate_series(1, %s) g",
                    (base_rows,))
        cfg = config_for(server, work, "cdc", "public.cdc")
        run_once(cfg, session)  # initial copy, creates walberg's slot
        # A running pipeline has merged before: warm the JVM's MERGE path with a small round
        # (its first MERGE costs a few seconds of class loading and JIT compilation).
        cur.execute("UPDATE cdc SET v = v + 1 WHERE id <= 20000")
        cur.execute("DELETE FROM cdc WHERE id <= 1000")
        cur.execute("INSERT INTO cdc SELECT g, 0, 'row ' || g FROM generate_series(1, 1000) g")
        run_once(cfg, session)
        cur.execute("CREATE PUBLICATION recv_pub FOR TABLE cdc")
        cur.execute("SELECT pg_create_logical_replication_slot('recv', 'pgoutput')")
        # The mix: half inserts, three tenths updates, two tenths deletes, in 100 transactions.
        n_ins, n_upd = args.changes // 2, args.changes * 3 // 10
        n_del = args.changes - n_ins - n_upd
        per = max(args.changes // 100, 1)
        for lo in range(0, n_ins, per):
            cur.execute("INSERT INTO cdc SELECT g, 1, 'new ' || g FROM generate_series(%s, %s) g",
                        (base_rows + lo + 1, base_rows + min(lo + per, n_ins)))
        upd_span = base_rows + n_ins
        for lo in range(0, n_upd, per):
            hi = min(lo + per, n_upd)
            cur.execute("UPDATE cdc SET v = v + 1 WHERE id IN (SELECT (g::bigint * 7919) %% %s + 1 "
                        "FROM generate_series(%s, %s) g)", (upd_span, lo, hi - 1))
        cur.execute("SELECT count(*) FROM pg_stat_user_tables")  # (keeps the cursor honest)
        for lo in range(0, n_del, per):
            cur.execute("DELETE FROM cdc WHERE id BETWEEN %s AND %s", (lo + 1, min(lo + per, n_del)))
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        end_lsn = cur.fetchone()[0]
        cur.execute("SELECT count(*) FROM cdc")

        recv = [str(server.bin_dir / "pg_recvlogical"), "-d", server.dsn, "--slot", "recv",
                "--start", "-o", "proto_version=1", "-o", "publication_names=recv_pub",
                "--endpos", end_lsn, "-f", "/dev/null", "--no-loop"]
        recv_s, proc = timed(lambda: subprocess.run(recv, capture_output=True, text=True))
        if proc.returncode != 0:
            raise SystemExit(f"pg_recvlogical failed: {proc.stderr}")
        with PeakRss() as mem:
            walberg_cdc_s, report = timed(lambda: run_once(cfg, session))
        results["cdc"] = {
            "changes_applied": report.changes,
            "pg_recvlogical_changes_per_s": args.changes / recv_s,
            "walberg_changes_per_s": args.changes / walberg_cdc_s,
            "ratio": recv_s / walberg_cdc_s,
            "peak_rss_mb": mem.peak,
        }
        with conn.cursor() as c2:
            c2.execute("SELECT count(*) FROM cdc")
            pg_count = c2.fetchone()[0]
        lake_count = session.sql("SELECT count(*) FROM lake.bench.cdc").collect()[0][0]
        results["cdc"]["lake_equals_source_count"] = pg_count == lake_count

        # ---- 3. memory against transaction size ------------------------------------------------
        # Peak RSS of this process while one transaction of each size is applied. Flat means the
        # peak does not follow the transaction's size (segments and staging live on disk).
        mem_results = {}
        for label, size in (("small", max(args.changes // 10, 1000)), ("large", args.changes)):
            cur.execute("UPDATE cdc SET v = v + 1 WHERE id IN (SELECT id FROM cdc LIMIT %s)", (size,))
            with PeakRss() as mem:
                run_once(cfg, session)
            mem_results[label] = {"txn_changes": size, "peak_rss_mb": mem.peak}
        mem_results["peak_ratio_large_to_small"] = (mem_results["large"]["peak_rss_mb"]
                                                    / mem_results["small"]["peak_rss_mb"])
        results["memory"] = mem_results
    finally:
        stop_session(session)
        server.stop()

    out = save_results(results, args.out)
    c, d, m = results["copy"], results["cdc"], results["memory"]
    print(f"\nwalberg benchmark on {os.cpu_count()} cores ({args.rows:,} rows, {args.changes:,} changes)")
    print(f"  initial copy : walberg {c['walberg_rows_per_s']:>10,.0f} rows/s    "
          f"COPY TO STDOUT {c['pg_copy_to_stdout_rows_per_s']:>10,.0f} rows/s    ratio {c['ratio']:.2f}"
          f"   (first copy in a cold JVM: {c['walberg_cold_jvm_rows_per_s']:,.0f} rows/s)")
    print(f"  CDC          : walberg {d['walberg_changes_per_s']:>10,.0f} changes/s "
          f"pg_recvlogical {d['pg_recvlogical_changes_per_s']:>10,.0f} changes/s ratio {d['ratio']:.2f}")
    print(f"  memory       : peak RSS {m['small']['peak_rss_mb']:.0f} MB for a transaction of "
          f"{m['small']['txn_changes']:,} changes, {m['large']['peak_rss_mb']:.0f} MB for "
          f"{m['large']['txn_changes']:,} (ratio {m['peak_ratio_large_to_small']:.2f})")
    print(f"  lake equals source (row count): {d['lake_equals_source_count']}")
    print(f"  results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
