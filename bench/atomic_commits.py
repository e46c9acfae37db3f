"""What multi-table commits cost, and whether a reader ever sees part of a source transaction.

    python bench/atomic_commits.py [--tables 1,10,200] [--batches 8] [--writers 4]
                                   [--seconds 60]

On one embedded PostgreSQL and the test suite's REST catalog server (tests/rest_catalog: the
REST spec over a JDBC catalog, with POST /v1/transactions/commit), in one run:

1. Commit time per batch with 1, 10 and 200 tables: a streaming `walberg run` while one source
   transaction every 2.5 s updates a row in each of the N tables (so each batch holds all N),
   once with `sink.atomic_commits: true` (one catalog transaction a batch) and once with false
   (each table its own commit, side by side); the "committed in" of each batch from walberg's
   log, median over --batches batches, atomic against separate in the same run. (At 1 table
   there is nothing to commit together: the two are the same path.)
2. Orders and their lines (tests/shop.py) written by --writers threads as fast as they go for
   --seconds while walberg streams them, and a reader that takes consistent cuts of the two
   tables meanwhile (PyIceberg through the same REST server): how many cuts it took and how
   many showed an order without its lines (or lines without their order, or a total that is
   not its lines' sum), atomic against separate.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psycopg2
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from backlog import bytecode, walberg_once  # noqa: E402
from run import save_results  # noqa: E402
from sustained import stop_process, wait_until  # noqa: E402

from rest_catalog import RestServer, rest_server  # noqa: E402
from shop import consistent_cut, half_transactions, make_shop, write_shop  # noqa: E402
from walberg.source.embedded_pg import EmbeddedPostgres  # noqa: E402

BATCH = re.compile(r"batch of \d+ segment\(s\), \d+ changes, .*committed in ([0-9.]+) s")


def write_config(dsn: str, work: Path, name: str, tables: list[str], rest: RestServer,
                 atomic: bool) -> Path:
    raw = {
        "source": {"postgres": {"dsn": dsn, "slot": f"slot_{name}", "publication": f"pub_{name}",
                                "tables": tables}},
        "sink": {"catalog": rest.catalog(), "namespace": f"ns_{name}",
                 "atomic_commits": atomic},
        "buffer": {"dir": str(work / "segments"), "max_interval_seconds": 0.5},
        "spark": {"master": "local[2]"},
    }
    path = work / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def streaming(config: Path, log: Path) -> "subprocess.Popen[str]":
    return subprocess.Popen([sys.executable, "-m", "walberg.cli", "run", "-c", str(config)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)


def batch_seconds(log: Path) -> list[float]:
    return [float(m.group(1)) for m in BATCH.finditer(log.read_text())]


def commit_cost(dsn: str, rest: RestServer, work: Path, count: int, batches: int) -> dict[str, Any]:
    """Median commit time of a batch touching ``count`` tables, atomic and separate."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    cur = conn.cursor()
    tables = [f"public.ac{count}_{i}" for i in range(count)]
    for t in tables:
        cur.execute(f"CREATE TABLE {t} (id bigint PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {t} SELECT g, 0 FROM generate_series(1, 100) g")
    out: dict[str, Any] = {}
    for atomic in (True, False):
        mode = "atomic" if atomic else "separate"
        folder = work / f"cost-{count}-{mode}"
        folder.mkdir()
        config = write_config(dsn, folder, f"ac{count}_{mode}", tables, rest, atomic)
        walberg_once(config, "copy")
        proc = streaming(config, folder / "run.log")
        try:
            # One source transaction every 2.5 s, each its own batch; the first batch (the
            # JVM's start is behind it) is not counted.
            deadline = time.monotonic() + 300
            while len(batch_seconds(folder / "run.log")) < batches + 1:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"walberg did not commit {batches + 1} batches: see "
                                     f"{folder / 'run.log'}")
                cur.execute("BEGIN")
                for t in tables:
                    cur.execute(f"UPDATE {t} SET v = v + 1 WHERE id = 1")
                cur.execute("COMMIT")
                time.sleep(2.5)
        finally:
            stop_process(proc)
        seen = batch_seconds(folder / "run.log")[1:]
        together = (folder / "run.log").read_text().count("committed together")
        out[mode] = {"median_s": statistics.median(seen), "batches": len(seen),
                     "committed_together": together}
        print(f"  {count} table(s), {mode}: a batch commits in {statistics.median(seen):.2f} s "
              f"(median of {len(seen)}; {together} committed together)", flush=True)
    out["ratio_atomic_to_separate"] = out["atomic"]["median_s"] / out["separate"]["median_s"]
    conn.close()
    return out


def reader_phase(dsn: str, rest: RestServer, work: Path, writers: int, seconds: float,
                 atomic: bool) -> dict[str, Any]:
    """Orders and lines written as fast as ``writers`` threads go while walberg streams them;
    consistent cuts taken meanwhile, and how many showed part of a source transaction."""
    mode = "atomic" if atomic else "separate"
    folder = work / f"shop-{mode}"
    folder.mkdir()
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    orders, lines = make_shop(conn, f"b{mode}")
    config = write_config(dsn, folder, f"shop_{mode}", [orders, lines], rest, atomic)
    walberg_once(config, "copy")
    names = (f"ns_shop_{mode}.{orders.split('.')[1]}", f"ns_shop_{mode}.{lines.split('.')[1]}")
    catalog = rest.pyiceberg()
    proc = streaming(config, folder / "run.log")
    stop = threading.Event()
    counts = [{"transactions": 0} for _ in range(writers)]
    threads = [threading.Thread(target=write_shop, args=(dsn, orders, lines, stop, counts[i]),
                                kwargs={"pause": 0, "seed": i, "first_id": 10_000_000 * (i + 1)})
               for i in range(writers)]
    cuts = half = 0
    snapshots = set()
    try:
        # Warm-up: a first source transaction, applied once walberg streams.
        with conn.cursor() as cur:
            cur.execute(f"UPDATE {orders} SET customer = 'warm' WHERE id = 1")
        wait_until(lambda: len(batch_seconds(folder / "run.log")) > 0, 300, "walberg to stream")
        for t in threads:
            t.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            first, second = consistent_cut(catalog, *names)
            if half_transactions(first.scan().to_arrow(), second.scan().to_arrow()):
                half += 1
            cuts += 1
            snapshots.add(first.metadata.current_snapshot_id)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        stop_process(proc)
    made = sum(c["transactions"] for c in counts) / seconds
    print(f"  {mode}: writers made {made:,.0f} transactions/s; the reader took {cuts} "
          f"consistent cuts ({len(snapshots)} snapshots of orders), {half} showed part of a "
          "source transaction", flush=True)
    conn.close()
    return {"transactions_per_s": made, "cuts": cuts, "half_transaction_cuts": half,
            "order_snapshots_seen": len(snapshots)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", default="1,10,200", help="table counts for the commit cost")
    ap.add_argument("--batches", type=int, default=8, help="batches measured per setting")
    ap.add_argument("--writers", type=int, default=4, help="writer threads of the shop phase")
    ap.add_argument("--seconds", type=float, default=60, help="the shop phase's length")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "atomic-commits.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="walberg-atomic-"))
    bytecode()
    server = EmbeddedPostgres().start()
    results: dict[str, Any] = {"cores": os.cpu_count(), "cost": {}, "reader": {}}
    proc: Optional[subprocess.Popen[str]] = None
    try:
        with rest_server(server, work / "warehouse", work / "rest.log") as rest:
            print("commit time per batch:", flush=True)
            for count in (int(x) for x in args.tables.split(",")):
                results["cost"][str(count)] = commit_cost(server.dsn, rest, work, count,
                                                          args.batches)
            print("a reader of orders and their lines:", flush=True)
            for atomic in (True, False):
                results["reader"]["atomic" if atomic else "separate"] = reader_phase(
                    server.dsn, rest, work, args.writers, args.seconds, atomic)
    finally:
        stop_process(proc)
        server.stop()
    out = save_results(results, args.out)
    print(f"results in {out} (logs in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
