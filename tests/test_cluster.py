"""A real multi-process Spark: a standalone master and worker started on loopback with pyspark's
spark-class; walberg copies and streams through it, and verify finds the lake equal."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from conftest import make_config, walberg_ok
from lake import hadoop_table, iceberg_rows, postgres_rows
from walberg.apply.spark import find_java


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


@pytest.fixture
def spark_cluster(tmp_path: Path) -> Iterator[str]:
    import pyspark

    spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
    java = find_java()
    env = dict(os.environ, JAVA_HOME=str(java.resolve().parent.parent),
               SPARK_LOCAL_IP="127.0.0.1", SPARK_LOCAL_DIRS=str(tmp_path / "spark-local"),
               SPARK_WORKER_DIR=str(tmp_path / "spark-work"))
    port, ui, worker_ui = _free_port(), _free_port(), _free_port()
    procs = [subprocess.Popen(
        [str(spark_class), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
         "--port", str(port), "--webui-port", str(ui)],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "master.log", "w"))]
    try:
        _wait_port(port)
        procs.append(subprocess.Popen(
            [str(spark_class), "org.apache.spark.deploy.worker.Worker",
             f"spark://127.0.0.1:{port}", "--host", "127.0.0.1", "--cores", "2", "--memory",
             "2g", "--webui-port", str(worker_ui)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "w")))
        deadline = time.monotonic() + 60
        while "Successfully registered with master" not in (tmp_path / "worker.log").read_text():
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


def test_copy_and_stream_through_a_standalone_cluster(
        pg_conn: Any, postgres: Any, warehouse: Path, tmp_path: Path, unique: str,
        spark_cluster: str) -> None:
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text, n numeric(9,2))")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g, g / 8.0 "
                    "FROM generate_series(1, 20000) g")
    raw = make_config(postgres, warehouse, tmp_path / "segments", unique, [table]).model_dump(
        mode="json", exclude={"base_dir"})
    raw["spark"] = {"master": spark_cluster, "conf": {"spark.executor.memory": "1g",
                                                      "spark.cores.max": "2"}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))

    def walberg(*args: str) -> str:
        return walberg_ok(*args, "-c", str(path))

    walberg("run", "--once")
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'changed' WHERE id %% 10 = 0".replace("%%", "%"))
        cur.execute(f"DELETE FROM {table} WHERE id > 19000")
        cur.execute(f"INSERT INTO {table} VALUES (30000, 'new', 1.5)")
    walberg("run", "--once")
    assert "[ok  ]" in walberg("verify")
    target = make_config(postgres, warehouse, tmp_path / "segments", unique,
                         [table]).target_for(table)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    # The work ran on the cluster's executor, not in the driver.
    apps = list((tmp_path / "spark-work").glob("app-*"))
    assert apps, "no application ran on the worker"

    # The parallel copy: the cluster's executors read the table over JDBC (the driver jar
    # shipped to them through spark.jars), inside the slot's snapshot, chunk by chunk.
    other = f"{table}_jdbc"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {other} AS SELECT * FROM {table}")
        cur.execute(f"ALTER TABLE {other} ADD PRIMARY KEY (id)")
        cur.execute(f"ANALYZE {other}")
    raw_jdbc = make_config(postgres, warehouse, tmp_path / "segments_jdbc", f"{unique}_jdbc",
                           [other]).model_dump(mode="json", exclude={"base_dir"})
    raw_jdbc["spark"] = raw["spark"]
    raw_jdbc["source"]["postgres"]["initial_copy"] = {"method": "jdbc", "chunk_rows": 5000}
    jdbc_path = tmp_path / "pipeline_jdbc.yaml"
    jdbc_path.write_text(yaml.safe_dump(raw_jdbc))
    out = walberg_ok("run", "--once", "-c", str(jdbc_path))
    jdbc_target = make_config(postgres, warehouse, tmp_path / "segments_jdbc", f"{unique}_jdbc",
                              [other]).target_for(other)
    assert iceberg_rows(warehouse, jdbc_target) == postgres_rows(pg_conn, other), out
    chunks = [s for s in hadoop_table(warehouse, jdbc_target).snapshots()
              if "walberg.copy.span" in s.summary.additional_properties]
    assert len(chunks) >= 3
