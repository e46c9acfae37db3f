"""Benchmark of the parallel initial copy (source.postgres.initial_copy.method: jdbc).

    python bench/parallel_copy.py [--rows 10000000] [--master local[2]]

One table of --rows rows is read three ways in one run: `COPY ... TO STDOUT` (the fastest
Postgres hands rows to one client: the baseline), walberg's default copy (one COPY stream staged
locally), and walberg's jdbc copy (Spark executors reading spans of the table in parallel inside
the slot's snapshot, one Iceberg commit per chunk). Figures are rows/s and ratios to the
baseline; the machines are shared and noisy, so the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg2

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import ROOT, config_for, copy_table_baseline, run_once, save_results, timed  # noqa: E402

from walberg.apply.initial.jdbc import driver_jar  # noqa: E402
from walberg.apply.jvm.spark import build_session, stop_session  # noqa: E402
from walberg.source.embedded_pg import EmbeddedPostgres  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "parallel_copy.json"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="walberg-bench-"))
    server = EmbeddedPostgres().start()
    session = build_session(args.master, "lake", str(work / "warehouse"), {}, {},
                            app_name="walberg-bench", jars=[driver_jar()])
    results: dict[str, Any] = {"rows": args.rows, "master": args.master,
                               "cores": os.cpu_count()}
    try:
        conn = psycopg2.connect(server.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        copy_s = copy_table_baseline(cur, "big", args.rows)
        # Warm the JVM first (class loading, JIT) on a small table, as a running pipeline has.
        cur.execute("CREATE TABLE warm AS SELECT * FROM big WHERE id <= 200000")
        cur.execute("ALTER TABLE warm ADD PRIMARY KEY (id)")
        for method in ("copy", "jdbc"):
            run_once(config_for(server.dsn, work, f"warm_{method}", "public.warm", f"warm_{method}",
                                initial_copy={"method": method, "chunk_rows": 100_000}),
                     session)
        figures = {}
        for method in ("copy", "jdbc"):
            cfg = config_for(server.dsn, work, method, "public.big", method,
                             initial_copy={"method": method})
            seconds, report = timed(lambda c=cfg: run_once(c, session))  # type: ignore[misc]
            assert report.copied["public.big"] == args.rows, report.copied
            lake = session.sql(f"SELECT count(*) FROM lake.{method}.big").collect()[0][0]
            assert lake == args.rows, (method, lake)
            figures[method] = args.rows / seconds
        results.update({
            "pg_copy_to_stdout_rows_per_s": args.rows / copy_s,
            "walberg_copy_rows_per_s": figures["copy"],
            "walberg_jdbc_rows_per_s": figures["jdbc"],
            "copy_ratio": figures["copy"] / (args.rows / copy_s),
            "jdbc_ratio": figures["jdbc"] / (args.rows / copy_s),
            "jdbc_to_copy": figures["jdbc"] / figures["copy"],
        })
    finally:
        stop_session(session)
        server.stop()

    out = save_results(results, args.out)
    r = results
    print(f"\nparallel initial copy, {args.rows:,} rows, Spark {args.master}, {os.cpu_count()} cores")
    print(f"  COPY TO STDOUT       {r['pg_copy_to_stdout_rows_per_s']:>12,.0f} rows/s  (baseline)")
    print(f"  walberg, method copy {r['walberg_copy_rows_per_s']:>12,.0f} rows/s  "
          f"ratio {r['copy_ratio']:.2f}")
    print(f"  walberg, method jdbc {r['walberg_jdbc_rows_per_s']:>12,.0f} rows/s  "
          f"ratio {r['jdbc_ratio']:.2f}  ({r['jdbc_to_copy']:.2f}x method copy)")
    print(f"  results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
