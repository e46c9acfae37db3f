"""A real multi-process Spark whose executors cannot see the driver's disk: a standalone master
and worker started on loopback with pyspark's spark-class, the worker in a mount namespace of
its own with an empty tmpfs over ``buffer.dir``, the warehouse on an S3-compatible server
(moto). walberg copies, streams, is killed with -9 in the middle of a batch, restarts, and the
lake equals Postgres; the staged objects it sent the executors through the bucket are gone.
A second source of the same pipeline is copied by the executors over JDBC."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from conftest import as_file, free_port, make_config, wait_port, walberg_cli, walberg_ok, write_pipeline
from lake import postgres_rows
from s3server import client, keys, lake_rows, lake_table, moto_server, storage_section
from walberg.apply.catalog import storage
from walberg.apply.jvm.java import find_java
from walberg.config import load_config
from walberg.errors import EnvironmentProblem


def _hidden(path: Path) -> list[str]:
    """A command prefix that runs the command in a mount namespace of its own, where an empty
    tmpfs covers ``path`` (the driver's files there do not exist for it)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding buffer.dir from the worker needs root and unshare(1)")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs walberg-hidden "$0" && exec "$@"', str(path)]


@contextmanager
def spark_cluster(tmp_path: Path, hide: Optional[Path] = None) -> Iterator[str]:
    """A standalone master and one worker on loopback (the worker blind to ``hide``)."""
    import pyspark

    spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
    java = find_java()
    env = dict(os.environ, JAVA_HOME=str(java.resolve().parent.parent),
               SPARK_LOCAL_IP="127.0.0.1", SPARK_LOCAL_DIRS=str(tmp_path / "spark-local"),
               SPARK_WORKER_DIR=str(tmp_path / "spark-work"))
    port, ui, worker_ui = free_port(), free_port(), free_port()
    procs = [subprocess.Popen(
        [str(spark_class), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
         "--port", str(port), "--webui-port", str(ui)],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "master.log", "w"))]
    try:
        wait_port(port, 60)
        prefix = _hidden(hide) if hide is not None else []
        procs.append(subprocess.Popen(
            [*prefix, str(spark_class), "org.apache.spark.deploy.worker.Worker",
             f"spark://127.0.0.1:{port}", "--host", "127.0.0.1", "--cores", "2", "--memory",
             "2g", "--webui-port", str(worker_ui)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "w")))
        deadline = time.monotonic() + 60
        while "Successfully registered with master" not in (tmp_path / "worker.log").read_text():
            assert procs[-1].poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
            time.sleep(0.3)
        yield f"spark://127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def s3_endpoint(tmp_path: Path) -> Iterator[str]:
    try:
        storage.spark_settings(s3={})
    except EnvironmentProblem as exc:
        pytest.skip(str(exc))
    with moto_server(tmp_path / "moto.log") as endpoint:
        yield endpoint


def test_a_cluster_that_cannot_see_buffer_dir(
        pg_conn: Any, postgres: Any, tmp_path: Path, unique: str, s3_endpoint: str) -> None:
    buffers = tmp_path / "buffers"  # every pipeline's buffer.dir is under it
    buffers.mkdir()
    (buffers / "driver-only").write_text("the worker must not see this file")
    with spark_cluster(tmp_path, hide=buffers) as master:
        _copy_stream_crash_and_restart(pg_conn, postgres, tmp_path, unique, s3_endpoint,
                                       buffers, master)


def _copy_stream_crash_and_restart(pg_conn: Any, postgres: Any, tmp_path: Path, unique: str,
                                   endpoint: str, buffers: Path, master: str) -> None:
    s3 = client(endpoint)
    bucket = unique.replace("_", "-")
    s3.create_bucket(Bucket=bucket)
    table, other = f"public.{unique}", f"public.{unique}_jdbc"
    with pg_conn.cursor() as cur:
        # A partition the driver does not compute (a bucket of a decimal): that table's copy
        # and new rows are staged for the executors (through the bucket). The other's new rows
        # are written by the driver straight into the bucket (apply.position.datafiles).
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text, n numeric(9,2), "
                    "a int[])")
        cur.execute(f"CREATE TABLE {other} (id int PRIMARY KEY, v text, n numeric(9,2))")
        for name in (table, other):
            cur.execute(f"INSERT INTO {name} SELECT g, 'v' || g, g / 8.0 "
                        "FROM generate_series(1, 3000) g")
        cur.execute(f"UPDATE {table} SET a = ARRAY[id, -id]")
        cur.execute(f"ANALYZE {other}")

    # Two sources in one process and one Spark application: one copied by COPY and staged as
    # Parquet (which reaches the executors through the bucket), one copied by the executors
    # over JDBC, chunk by chunk (the driver jar shipped to them through spark.jars).
    config = make_config(postgres, tmp_path / "unused", buffers / "pipeline", unique, [table])
    jdbc = make_config(postgres, tmp_path / "unused", buffers / "pipeline", f"{unique}_jdbc",
                       [other])
    raw = as_file(config)
    del raw["source"]
    raw["sources"] = {"copied": config.source.model_dump(mode="json"),
                      "chunked": jdbc.source.model_dump(mode="json")}
    raw["sources"]["chunked"]["postgres"]["initial_copy"] = {"method": "jdbc", "chunk_rows": 1000}
    raw["sink"]["catalog"]["warehouse"] = f"s3a://{bucket}/warehouse"
    raw["storage"] = storage_section(endpoint)
    raw["spark"] = {"master": master, "conf": {"spark.executor.memory": "1g",
                                               "spark.cores.max": "2"}}
    # Each source's table its own (no fan-in): the tables are applied by position, so the key
    # index is built and followed through the cluster's executors too (see apply.position.keyed).
    raw["sink"]["fan_in"] = False
    raw["sink"]["tables"] = {table: {"partition_by": ["bucket(4, n)"]}}
    path = tmp_path / "pipeline.yaml"
    write_pipeline(raw, path)
    loaded = load_config(path)
    prefixes = {name: "warehouse/" + loaded.for_source(source).target_for(name)
                .split(".", 1)[1].replace(".", "/")
                for name, source in ((table, "copied"), (other, "chunked"))}
    staged_prefix = "warehouse/_walberg_staging/"

    def equal() -> None:
        for name, prefix in prefixes.items():
            assert lake_rows(s3, endpoint, bucket, prefix) == postgres_rows(pg_conn, name), name

    walberg_ok("run", "--once", "-c", str(path))
    equal()
    chunks = [s for s in lake_table(s3, endpoint, bucket, prefixes[other]).snapshots()
              if any(k.startswith("walberg.copy.span") for k in s.summary.additional_properties)]
    assert len(chunks) >= 3

    # Changes, then a run killed -9 in the middle of a batch, its staged file uploaded for the
    # executors and the commit that reads it not yet made.
    with pg_conn.cursor() as cur:
        for name in (table, other):
            cur.execute(f"UPDATE {name} SET v = 'changed' WHERE id % 10 = 0")
            cur.execute(f"DELETE FROM {name} WHERE id > 2900")
            cur.execute(f"INSERT INTO {name} VALUES (30000, 'new', 1.5)")
    crashed = walberg_cli("-q", "run", "--once", "-c", str(path),
                          env=dict(os.environ, WALBERG_CRASH_AT="staged:1"))
    assert crashed.returncode == -9, crashed.stdout[-2000:] + crashed.stderr[-2000:]
    orphans = [k for k in keys(s3, bucket, staged_prefix) if k.endswith(".parquet")]
    assert orphans, keys(s3, bucket, "warehouse/")

    # More changes while it is down; the restart removes the orphans and applies everything.
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET n = n + 1 WHERE id <= 100")
        cur.execute(f"INSERT INTO {table} VALUES (30001, 'newer', 2.5)")
    walberg_ok("run", "--once", "-c", str(path))
    equal()
    assert [k for k in keys(s3, bucket, staged_prefix) if k.endswith(".parquet")] == []
    assert not list(buffers.glob("pipeline/*/batch-*"))  # nor the killed run's local files
    # The key indexes describe the tables as they are now: the last batch went by position.
    manifests = {m.parent.name: json.loads(m.read_text())
                 for m in buffers.glob("pipeline/**/keyindex/*/manifest.json")}
    for name, source in ((table, "copied"), (other, "chunked")):
        target = loaded.for_source(source).target_for(name)
        current = lake_table(s3, endpoint, bucket, prefixes[name]).current_snapshot()
        assert manifests[target]["snapshot"] == current.snapshot_id, (target, manifests)
    # The work ran on the cluster's executor, not in the driver.
    assert list((tmp_path / "spark-work").glob("app-*")), "no application ran on the worker"
