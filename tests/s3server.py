"""An S3-compatible server for tests: moto's, started on a free loopback port, and what walberg's
pipeline file and PyIceberg need to use it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from conftest import free_port, wait_port

KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


@contextmanager
def moto_server(log: Path, env: Optional[dict[str, str]] = None) -> Iterator[str]:
    """The endpoint URL of a moto server (``env``: added to its environment) that lives as long
    as the context; its log is appended to ``log``."""
    server = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    if not Path(server).exists():
        pytest.skip("moto[server] is not installed")
    port = free_port()
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=open(log, "a"))
    try:
        wait_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def storage_section(endpoint: str) -> dict[str, Any]:
    """The pipeline file's ``storage`` section for the server at ``endpoint``."""
    return {"s3": {"endpoint": endpoint, "region": "us-east-1", "path_style_access": True,
                   "access_key_id": KEYS["aws_access_key_id"],
                   "secret_access_key": KEYS["aws_secret_access_key"]}}


def client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **KEYS)


def keys(s3: Any, bucket: str, prefix: str) -> list[str]:
    """Every object name under ``prefix``."""
    names: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        names += [o["Key"] for o in page.get("Contents", [])]
    return names


def lake_table(s3: Any, endpoint: str, bucket: str, table_prefix: str) -> Any:
    """The current version of the hadoop-catalog Iceberg table at ``s3a://bucket/table_prefix``,
    for PyIceberg, straight from the bucket."""
    from pyiceberg.table import StaticTable

    meta = f"{table_prefix.rstrip('/')}/metadata/"
    hint = s3.get_object(Bucket=bucket, Key=meta + "version-hint.text")["Body"].read()
    lake = StaticTable.from_metadata(
        f"s3a://{bucket}/{meta}v{hint.decode().strip()}.metadata.json",
        properties={"s3.endpoint": endpoint, "s3.access-key-id": KEYS["aws_access_key_id"],
                    "s3.secret-access-key": KEYS["aws_secret_access_key"],
                    "s3.region": "us-east-1"})
    return lake


def lake_rows(s3: Any, endpoint: str, bucket: str, table_prefix: str,
              key: str = "id") -> list[dict[str, Any]]:
    """The rows of that table, sorted by ``key``, without walberg's own columns."""
    lake = lake_table(s3, endpoint, bucket, table_prefix)
    rows = [{k: v for k, v in r.items() if not k.startswith("_walberg_")}
            for r in lake.scan().to_arrow().to_pylist()]
    return sorted(rows, key=lambda r: r[key])
