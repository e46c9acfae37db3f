"""A warehouse on S3: an S3-compatible server (moto) started by the test, the s3a connector's
jars from the sagemaker-pyspark package; initial copy, stream and verify. And what the storage
settings become for Spark, with a clear error when a connector's jars are missing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import as_file, make_config, walberg_cli, walberg_ok, write_pipeline
from lake import postgres_rows
from s3server import client, keys, lake_rows, moto_server, storage_section
from walberg.apply.catalog import storage
from walberg.errors import EnvironmentProblem


def test_storage_settings_and_missing_jars() -> None:
    conf, jars = storage.spark_settings(s3={
        "endpoint": "http://127.0.0.1:9000", "region": "eu-west-1", "path_style_access": True,
        "access_key_id": "AK", "secret_access_key": "SK", "jars": ["/j/hadoop-aws-3.3.1.jar",
                                                                   "/j/aws-java-sdk-bundle-1.jar"]})
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"
    assert conf["spark.hadoop.fs.s3a.access.key"] == "AK"
    assert conf["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert len(jars) == 2
    with pytest.raises(EnvironmentProblem, match=r"hadoop-aws-\*\.jar.*sagemaker-pyspark"):
        storage.spark_settings(s3={"jars": ["/j/other.jar"]})
    with pytest.raises(EnvironmentProblem, match="gcs-connector"):
        storage.spark_settings(gcs={"project_id": "p"})
    conf, _ = storage.spark_settings(azure={"account_name": "acct", "account_key": "k",
                                            "jars": ["/j/hadoop-azure-3.3.4.jar"]})
    assert conf["spark.hadoop.fs.azure.account.key.acct.dfs.core.windows.net"] == "k"


@pytest.fixture
def s3_server(tmp_path: Path) -> Iterator[str]:
    with moto_server(tmp_path / "moto.log") as endpoint:
        yield endpoint


def test_warehouse_on_s3(pg_conn: Any, postgres: Any, warehouse: Path, tmp_path: Path,
                         unique: str, s3_server: str) -> None:
    try:
        storage.spark_settings(s3={})
    except EnvironmentProblem as exc:
        pytest.skip(str(exc))
    s3 = client(s3_server)
    bucket = unique.replace("_", "-")
    s3.create_bucket(Bucket=bucket)
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text, ts timestamptz)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g, now() "
                    "FROM generate_series(1, 500) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["sink"]["catalog"]["warehouse"] = f"s3a://{bucket}/warehouse"
    raw["storage"] = storage_section(s3_server)
    path = tmp_path / "pipeline.yaml"
    write_pipeline(raw, path)

    def walberg(*args: str) -> str:
        return walberg_ok(*args, "-c", str(path))

    walberg("run", "--once")
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 50")
        cur.execute(f"DELETE FROM {table} WHERE id > 450")
    at = f"warehouse/{raw['sink']['namespace']}/{unique}"

    def lake_equals_source() -> bool:
        """An independent reader, PyIceberg, straight from the bucket (`verify`, a JVM of its
        own, runs once, after the last path)."""
        return lake_rows(s3, s3_server, bucket, at) == postgres_rows(pg_conn, table)

    walberg("run", "--once")
    assert lake_equals_source()
    # The key index was kept in the bucket beside the table, versioned by its snapshot.
    prefix = f"warehouse/{raw['sink']['namespace']}/{unique}/_walberg_keys/_one/"
    kept = keys(s3, bucket, prefix)
    assert any(re.fullmatch(r"snapshot-\d+\.json", n[len(prefix):]) for n in kept) and \
        any("/base-" in n for n in kept), "\n".join(kept)
    # The driver moves to a fresh machine (no key index here): it fetches the index from the
    # bucket instead of reading the table's keys.
    shutil.rmtree(tmp_path / "segments" / "keyindex")
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'moved' WHERE id BETWEEN 40 AND 60")
    done = walberg_cli("run", "--once", "-c", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    logged = done.stdout + done.stderr
    assert "fetched from the warehouse" in logged and "rebuilt" not in logged, logged[-3000:]
    assert lake_equals_source()
    # With no copy in the bucket either, the index is made anew from the bucket on the
    # driver, the key column and the delete files read through Arrow's S3.
    shutil.rmtree(tmp_path / "segments" / "keyindex")
    for name in keys(s3, bucket, prefix):
        s3.delete_object(Bucket=bucket, Key=name)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'moved again' WHERE id BETWEEN 50 AND 70")
    done = walberg_cli("run", "--once", "-c", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"rebuilt from the lake \(\d+ data file\(s\) and [1-9]\d* delete file\(s\) "
                     r"read on the driver\)", done.stdout + done.stderr), done.stderr[-3000:]
    assert "[ok  ]" in walberg("verify")
    # status reads the metadata straight from the bucket, no JVM
    held = json.loads(walberg("status", "--json"))["tables"][table]
    assert held["rows"] == 450 and held["last_lsn"] is not None
    names = keys(s3, bucket, "warehouse/")
    assert any(n.endswith(".parquet") for n in names) and \
        any(n.endswith(".metadata.json") for n in names)
    assert not (warehouse / raw["sink"]["namespace"]).exists()  # nothing landed locally

    assert lake_equals_source()


def test_s3a_jars_from_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("hadoop-aws-3.3.1.jar", "aws-java-sdk-bundle-1.11.901.jar", "other.jar"):
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setenv("WALBERG_S3A_JARS", str(tmp_path))
    _, jars = storage.spark_settings(s3={})
    assert sorted(Path(j).name for j in jars) == ["aws-java-sdk-bundle-1.11.901.jar",
                                                  "hadoop-aws-3.3.1.jar"]
