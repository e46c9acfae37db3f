"""What staging a batch through object storage costs against reading it from local disk.

    python bench/staging.py [--batches 8] [--rows 50000]

On a cluster the driver uploads each staged batch to ``buffer.stage_uri`` and the executors
read it there (see walberg.apply.staging); in local mode Spark reads the staged files where they
are. This runs both in one Spark session (local[2]) on the same staged batches: each batch
(--rows changes of a 3-column table, half updates of rows the table holds and half inserts) is
staged once as walberg stages it, then applied to two tables of their own, once read from local
disk and once uploaded to an S3-compatible server on loopback (moto) and read from there, the
two in alternating order. A first batch of inserts warms the JVM and is not counted. Prints the
seconds per batch of each and the ratio (object storage / local); the machines are shared and
noisy, so the ratio is the figure to compare. Needs the s3a jars (WALBERG_S3A_JARS or
sagemaker-pyspark, see walberg.apply.catalog.storage).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import ROOT, save_results  # noqa: E402

from walberg.apply.batch import BatchBuilder  # noqa: E402
from walberg.apply.catalog import storage  # noqa: E402
from walberg.apply.iceberg import IcebergSink  # noqa: E402
from walberg.apply.jvm.spark import build_session, stop_session  # noqa: E402
from walberg.apply.types import TypeMap  # noqa: E402
from walberg.model import Column, Lsn  # noqa: E402

COLUMNS = (Column("id", 20, is_key=True), Column("v", 25), Column("x", 701))
SOURCE = "public.bench"


def moto(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    server = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=open(work / "moto.log", "w"))
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("moto_server did not start")
        time.sleep(0.2)


def stage(work: Path, types: TypeMap, n: int, rows: int, seq0: int) -> tuple[BatchBuilder, Any]:
    """One batch as walberg stages it: rows/2 updates of ids the table holds (none on the
    first batch: all inserts), the rest inserts of new ids."""
    rng = np.random.default_rng(n)
    if n == 0:
        ids, ops = np.arange(rows, dtype=np.int64), np.full(rows, "I")
    else:
        half = rows // 2
        updates = rng.choice(rows * n, size=half, replace=False).astype(np.int64)
        inserts = np.arange(rows * n, rows * n + rows - half, dtype=np.int64)
        ids = np.concatenate([updates, inserts])
        ops = np.concatenate([np.full(half, "U"), np.full(rows - half, "I")])
    seq = np.arange(seq0, seq0 + len(ids), dtype=np.int64)
    values = [pa.array(ids.astype(str)), pa.array([f"value {n} {i}" for i in ids]),
              pa.array((rng.random(len(ids)) * 1000).round(3).astype(str))]
    builder = BatchBuilder(work / f"batch-{n}", prep=lambda s, c: types.prep(c, None))
    builder.add_columns(SOURCE, COLUMNS, ops, seq, np.full(len(ids), seq0 + len(ids)), values,
                        [None] * len(COLUMNS))
    staged = builder.finish((int(seq[-1]), []), frozenset({SOURCE}))
    return builder, staged[SOURCE]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "staging.json"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="walberg-bench-staging-"))
    proc, endpoint = moto(work)
    session = None
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="stage")
        conf, jars = storage.spark_settings(s3={
            "endpoint": endpoint, "region": "us-east-1", "path_style_access": True,
            "access_key_id": "testing", "secret_access_key": "testing"})
        session = build_session("local[2]", "lake", str(work / "warehouse"), {}, conf,
                                app_name="walberg-bench-staging", jars=jars)
        types = TypeMap()
        sinks = {"local": IcebergSink(session, types),
                 "object storage": IcebergSink(session, types,
                                               stage_root="s3a://stage/walberg/bench")}
        targets = {"local": "lake.bench.staged_local", "object storage": "lake.bench.staged_s3"}
        for name, sink in sinks.items():
            sink.ensure_table(targets[name], COLUMNS)
        seconds: dict[str, list[float]] = {name: [] for name in sinks}
        seq = 1
        for n in range(args.batches + 1):
            builder, staged = stage(work, types, n, args.rows, seq)
            seq += args.rows
            order = list(sinks) if n % 2 == 0 else list(reversed(sinks))
            for name in order:
                started = time.perf_counter()
                sinks[name].apply(targets[name], staged, Lsn(seq), seq)
                sinks[name].release_staged(builder.directory)
                if n:  # the first batch warms the JVM
                    seconds[name].append(time.perf_counter() - started)
            builder.discard()
        for name in sinks:
            assert sinks[name].count(targets[name]) == sinks["local"].count(targets["local"])
        local = sum(seconds["local"]) / args.batches
        remote = sum(seconds["object storage"]) / args.batches
        print(f"{args.batches} batches of {args.rows:,} changes (half updates, half inserts), "
              f"Spark local[2], {os.cpu_count()} cores")
        print(f"  staged files read from local disk:             {local:.3f} s per batch")
        print(f"  uploaded to object storage (moto), read there: {remote:.3f} s per batch")
        print(f"  ratio object storage / local: {remote / local:.2f}")
        saved = save_results({"batches": args.batches, "rows": args.rows,
                              "local_s_per_batch": local, "object_storage_s_per_batch": remote,
                              "ratio": remote / local, "seconds": seconds}, args.out)
        print(f"results in {saved}")
    finally:
        stop_session(session)
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
