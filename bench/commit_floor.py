"""What one Iceberg commit costs by itself on this machine: the floor under a batch that touches
many tables, since each table of a batch is an Iceberg commit of its own (bench/many_tables.py).

    python bench/commit_floor.py [--tables 200] [--rounds 8] [--side-by-side 4]

On a Hadoop catalog in a temporary folder, with the Spark session walberg starts (local[2]) and
the settings its commits use (manifests scanned in the calling thread, file permissions set in
the JVM), --tables empty tables (id bigint, v string) are committed to --rounds times each,
through py4j as walberg's commits are, with files that are never read (a commit only writes
metadata: manifests, a manifest list, the table's metadata file):

1. an append of one data file, one table after another;
2. a row delta of one data file and one position-delete file (what walberg's apply by position
   commits), one table after another;
3. the same row delta, --side-by-side tables at once (sink.commit_parallelism).

Before any of them, --warmup rounds of both kinds to every table (the JIT's, not timed); then for
each: wall milliseconds a commit and the JVM's CPU milliseconds a commit (the median of the
rounds), and the ratio of the row delta to the append. What it means for a
batch: the JVM alone needs (tables x CPU a commit / cores) seconds a batch, before any row is
read or written; that bounds how often every table of a database can be committed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from run import save_results  # noqa: E402

from walberg.apply.jvm.helper import batch_helper  # noqa: E402
from walberg.apply.jvm.spark import build_session, stop_session  # noqa: E402
from walberg.apply.session import java_table  # noqa: E402


def jvm_cpu_seconds() -> float:
    """The CPU seconds the session's JVM (the SparkSubmit child of this process) has used."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and b"SparkSubmit" in cmdline:
            return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    raise RuntimeError("the session's JVM was not found among this process's children")


class Tables:
    """--tables empty Iceberg tables and commits of files that exist in their metadata only."""

    def __init__(self, spark: Any, count: int) -> None:
        self.spark = spark
        jvm = spark._jvm
        batch_helper(spark)  # (as a walberg run: file permissions set in the JVM)
        self.direct = (jvm.org.apache.iceberg.relocated.com.google.common.util.concurrent
                       .MoreExecutors.newDirectExecutorService())
        self.iceberg = jvm.org.apache.iceberg
        spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.floor")
        self.tables = []
        for i in range(count):
            name = f"lake.floor.t_{i:04d}"
            spark.sql(f"CREATE TABLE {name} (id bigint, v string) USING iceberg "
                      "TBLPROPERTIES ('format-version'='2', 'write.delete.mode'='merge-on-read',"
                      " 'write.update.mode'='merge-on-read')")
            self.tables.append(java_table(spark, name))
        self._n = 0
        self._lock = threading.Lock()

    def _path(self, table: Any, kind: str) -> str:
        with self._lock:
            self._n += 1
            return f"{table.location()}/data/{kind}-{self._n:08d}.parquet"

    def _data_file(self, table: Any) -> Any:
        return (self.iceberg.DataFiles.builder(table.spec()).withPath(self._path(table, "rows"))
                .withFormat("PARQUET").withFileSizeInBytes(1000).withRecordCount(10).build())

    def _delete_file(self, table: Any) -> Any:
        return (self.iceberg.FileMetadata.deleteFileBuilder(table.spec()).ofPositionDeletes()
                .withPath(self._path(table, "deletes")).withFormat("PARQUET")
                .withFileSizeInBytes(500).withRecordCount(5).build())

    def append(self, table: Any) -> None:
        table.newAppend().appendFile(self._data_file(table)).scanManifestsWith(self.direct) \
            .commit()

    def row_delta(self, table: Any) -> None:
        current = table.currentSnapshot()
        delta = table.newRowDelta().addRows(self._data_file(table)) \
            .addDeletes(self._delete_file(table)).scanManifestsWith(self.direct)
        if current is not None:
            delta = delta.validateFromSnapshot(current.snapshotId())
        delta.commit()


def rounds(tables: Tables, commit: Callable[[Any], None], count: int, side_by_side: int
           ) -> dict[str, Any]:
    """``count`` rounds of one commit to every table, ``side_by_side`` tables at once; wall and
    JVM CPU milliseconds a commit, the median of the rounds."""
    wall: list[float] = []
    cpu: list[float] = []
    n = len(tables.tables)
    for r in range(count):
        cpu0, started = jvm_cpu_seconds(), time.monotonic()
        if side_by_side <= 1:
            for table in tables.tables:
                commit(table)
        else:
            parts = [tables.tables[i::side_by_side] for i in range(side_by_side)]
            def each(part: list[Any]) -> None:
                for table in part:
                    commit(table)

            threads = [threading.Thread(target=each, args=(part,)) for part in parts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        elapsed, used = time.monotonic() - started, jvm_cpu_seconds() - cpu0
        wall.append(1000 * elapsed / n)
        cpu.append(1000 * used / n)
        print(f"  round {r + 1}: {wall[-1]:.1f} ms a commit (wall), JVM CPU {cpu[-1]:.1f} ms "
              "a commit", flush=True)
    return {"wall_ms": statistics.median(wall), "jvm_cpu_ms": statistics.median(cpu),
            "rounds": count}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each kind")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds of both kinds first")
    ap.add_argument("--side-by-side", type=int, default=4)
    ap.add_argument("--out", default=None, help="default: bench/results/commit-floor-N.json")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    results: dict[str, Any] = {"tables": args.tables, "cores": cores}
    with tempfile.TemporaryDirectory(prefix="walberg-floor-") as work:
        spark = build_session("local[2]", "lake", str(Path(work) / "warehouse"), {}, {},
                              app_name="walberg-bench-commit-floor")
        try:
            tables = Tables(spark, args.tables)
            for _ in range(args.warmup):  # (the JIT's: not timed)
                for table in tables.tables:
                    tables.append(table)
                    tables.row_delta(table)
            for name, commit, side in (("append", tables.append, 1),
                                       ("row_delta", tables.row_delta, 1),
                                       ("row_delta_side_by_side", tables.row_delta,
                                        args.side_by_side)):
                print(f"{name} ({side} at once), {args.tables} tables:", flush=True)
                results[name] = rounds(tables, commit, args.rounds, side)
        finally:
            stop_session(spark)
    append, delta = results["append"], results["row_delta"]
    side = results["row_delta_side_by_side"]
    results["row_delta_to_append"] = delta["jvm_cpu_ms"] / append["jvm_cpu_ms"]
    results["batch_floor_s"] = args.tables * side["jvm_cpu_ms"] / 1000 / cores
    print(f"\n{args.tables} tables, {cores} cores, Hadoop catalog on local disk; median of "
          f"{args.rounds} rounds after {args.warmup} to warm up:")
    for name in ("append", "row_delta", "row_delta_side_by_side"):
        r = results[name]
        print(f"  {name:<24} {r['wall_ms']:6.1f} ms a commit (wall), JVM CPU "
              f"{r['jvm_cpu_ms']:5.1f} ms a commit")
    print(f"  a row delta costs the JVM {results['row_delta_to_append']:.2f}x an append; a batch "
          f"that commits every table needs at least {results['batch_floor_s']:.2f} s of the "
          f"machine's {cores} cores in the JVM alone")
    path = save_results(results, args.out or str(ROOT / "bench" / "results" /
                                                 f"commit-floor-{args.tables}.json"))
    print(f"  results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
