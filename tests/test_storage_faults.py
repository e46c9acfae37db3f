"""Object-store faults under a jdbc catalog and an s3a:// warehouse (the S3-compatible test
server, moto): an endpoint that goes away mid-run ends `run --once` within
storage.timeout_seconds with one readable paragraph, `run` keeps trying and says so, nothing is
lost once the store is back; a wrong secret is refused at once, before Spark starts.

The outage is a TCP proxy between walberg and moto that the test cuts (new connections
refused, live ones reset) and restores: moto keeps its data in memory, so stopping it would
lose the warehouse."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from conftest import as_file, jdbc_catalog, make_config, walberg_cli, write_pipeline
from lake import postgres_rows
from s3server import KEYS, moto_server, storage_section
from tcp_proxy import Proxy
from walberg.apply.catalog import storage
from walberg.errors import EnvironmentProblem


def test_s3a_deadlines_follow_the_timeout() -> None:
    conf, _ = storage.spark_settings(s3={"jars": ["/j/hadoop-aws-3.3.1.jar",
                                                  "/j/aws-java-sdk-bundle-1.jar"]}, timeout=8)
    h = "spark.hadoop.fs.s3a."
    assert conf[h + "connection.establish.timeout"] == "5000"
    assert conf[h + "connection.timeout"] == "8000"
    assert (conf[h + "attempts.maximum"], conf[h + "retry.limit"]) == ("1", "2")
    assert conf[h + "retry.interval"] == "400ms"
    # Without storage settings, nothing of s3a is set.
    assert not any(k.startswith(h) for k in storage.spark_settings(timeout=8)[0])


@pytest.fixture
def moto(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Starts S3-compatible servers (``moto(env)``: its environment), stopped after the test."""
    try:
        storage.spark_settings(s3={})
    except EnvironmentProblem as exc:
        pytest.skip(str(exc))
    with ExitStack() as servers:
        yield lambda env=None: servers.enter_context(moto_server(tmp_path / "moto.log", env))


def _pipeline(postgres: Any, warehouse: Path, tmp_path: Path, unique: str, endpoint: str,
              bucket: str, table: str, **s3: Any) -> Path:
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["sink"]["catalog"] = jdbc_catalog(postgres, f"s3a://{bucket}/warehouse")
    raw["sink"]["commit_max_backoff_seconds"] = 1
    section = storage_section(endpoint)
    raw["storage"] = {"timeout_seconds": 5, "s3": {**section["s3"], **s3}}
    path = tmp_path / "pipeline.yaml"
    write_pipeline(raw, path)
    return path


def _readable(text: str) -> None:
    """No Java stack trace, no Python traceback: a message for people."""
    for sign in ("\tat ", "Traceback", "Exception in thread", "py4j"):
        assert sign not in text, text[-3000:]


def _lake_rows(postgres: Any, moto: str, namespace: str, table: str) -> list[dict[str, Any]]:
    """The table as PyIceberg reads it, straight from the catalog and the S3 server."""
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("lake", uri=f"postgresql+psycopg2://{postgres.user}@127.0.0.1:"
                                     f"{postgres.port}/{postgres.database}",
                         **{"s3.endpoint": moto, "s3.access-key-id": "testing",
                            "s3.secret-access-key": "testing", "s3.region": "us-east-1"})
    rows = catalog.load_table(f"{namespace}.{table}").scan().to_arrow().to_pylist()
    return sorted(({k: v for k, v in r.items() if not k.startswith("_walberg_")} for r in rows),
                  key=lambda r: r["id"])


def _wait_rows(postgres: Any, pg_conn: Any, moto: str, namespace: str, name: str,
               table: str, proc: subprocess.Popen[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while _lake_rows(postgres, moto, namespace, name) != postgres_rows(pg_conn, table):
        assert proc.poll() is None, "walberg run stopped"
        assert time.monotonic() < deadline, "the lake did not catch up"
        time.sleep(1)


def test_s3_outage_mid_run(pg_conn: Any, postgres: Any, warehouse: Path, tmp_path: Path,
                           unique: str, moto: Callable[..., str]) -> None:
    endpoint = moto()
    import boto3

    bucket = unique.replace("_", "-")
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **KEYS).create_bucket(
        Bucket=bucket)
    proxy = Proxy(int(endpoint.rsplit(":", 1)[1]))
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 200) g")
    path = _pipeline(postgres, warehouse, tmp_path, unique, proxy.endpoint, bucket, table)
    namespace = f"ns_{unique}"

    # The store goes away while the initial copy's data files are written.
    proxy.arm(rb"^PUT [^ ]*\.parquet")
    started = time.monotonic()
    done = walberg_cli("run", "--once", "-c", str(path), timeout=240)
    took = time.monotonic() - started
    after_cut = time.monotonic() - proxy.cut_at
    assert proxy.cuts == 1, done.stderr[-2000:]
    assert done.returncode != 0
    _readable(done.stderr + done.stdout)
    said = " ".join(done.stderr.split())  # the message is wrapped at 100 columns
    assert proxy.endpoint in said and "storage.timeout_seconds is 5 s" in said, said[-2000:]
    assert "Check that the S3 server is running" in said
    print(f"run --once with the store cut mid-run: {took:.1f} s in all, {after_cut:.1f} s after "
          "the cut")
    assert after_cut < 60

    # `walberg run` with the store back: it copies the table; cut again, it keeps trying (and
    # says so), and catches up once the store is back.
    proxy.restore()
    log = open(tmp_path / "run.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "walberg.cli", "run", "-c", str(path)],
                            stdout=log, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        _wait_rows(postgres, pg_conn, endpoint, namespace, unique, table, proc)
        with pg_conn.cursor() as cur:
            cur.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 20")
            cur.execute(f"DELETE FROM {table} WHERE id > 190")
        proxy.arm(rb"^(PUT|POST) ")
        deadline = time.monotonic() + 120
        while "trying again" not in Path(log.name).read_text():
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            assert time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(0.5)
        proxy.restore()
        restored = time.monotonic()
        _wait_rows(postgres, pg_conn, endpoint, namespace, unique, table, proc)
        print(f"run caught up {time.monotonic() - restored:.1f} s after the store came back")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    text = Path(log.name).read_text()
    assert re.search(r"trying again in [\d.]+ s \(attempt 2 of 8\)", text), text[-3000:]
    assert proxy.endpoint in text
    _readable(text)


def test_wrong_secret_is_refused_before_spark(pg_conn: Any, postgres: Any, warehouse: Path,
                                              tmp_path: Path, unique: str,
                                              moto: Callable[..., str]) -> None:
    # A server that checks signatures: the first three calls (no auth) make a user, its key
    # and a policy; every call after needs a valid signature.
    endpoint = moto({"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", **KEYS)
    iam.create_user(UserName="walberg")
    key = iam.create_access_key(UserName="walberg")["AccessKey"]
    iam.put_user_policy(UserName="walberg", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17",
         "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    bucket = unique.replace("_", "-")
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id=key["AccessKeyId"],
                 aws_secret_access_key=key["SecretAccessKey"]).create_bucket(Bucket=bucket)
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    path = _pipeline(postgres, warehouse, tmp_path, unique, endpoint, bucket, table,
                     access_key_id=key["AccessKeyId"], secret_access_key="not-the-secret")
    started = time.monotonic()
    done = walberg_cli("run", "--once", "-c", str(path), timeout=120)
    took = time.monotonic() - started
    assert done.returncode != 0
    _readable(done.stderr + done.stdout)
    said = " ".join(done.stderr.split())
    assert f"s3a://{bucket}/warehouse on S3 at {endpoint} refused walberg's credentials" in \
        said, said[-2000:]
    assert "storage.s3.secret_access_key" in said
    print(f"a wrong secret was refused in {took:.1f} s")
    assert took < 30
    checked = walberg_cli("check", "-c", str(path), timeout=120)
    said = " ".join(checked.stdout.split())
    assert checked.returncode != 0 and "refused walberg's credentials" in said, said[-2000:]
