"""Where a batch's staged files reach Spark's executors from (apply.staging): the rules that pick
the stage area from spark.master, buffer.stage_uri and the warehouse, each pipeline's folder in
it, and what `walberg check` tells a user of a cluster. The upload itself, the cleanup after a
commit and after a crash run in tests/test_cluster.py against a worker that cannot see
buffer.dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from walberg.apply.staging import pipeline_folder, remove_local_leftovers, stage_uri
from walberg.config import parse_config
from walberg.errors import ConfigError, Terminal
from walberg.lake.services import Lake
from walberg.ops.check import Probe, executor_staging


def test_where_staged_files_go() -> None:
    wh = "s3a://lake/warehouse"
    # Local mode reads buffer.dir, whatever the warehouse.
    assert stage_uri("local[*]", None, wh) is None
    assert stage_uri("local-cluster[2,1,1024]", None, wh) is None
    # A cluster stages under a remote warehouse by default.
    assert stage_uri("spark://m:7077", None, wh) == "s3a://lake/warehouse/_walberg_staging"
    assert stage_uri("k8s://https://api:6443", None, "hdfs://nn/wh/") == \
        "hdfs://nn/wh/_walberg_staging"
    # ... and reads buffer.dir when the warehouse is a local path (a shared mount, then).
    assert stage_uri("yarn", None, "/mnt/shared/warehouse") is None
    assert stage_uri("yarn", None, "file:/mnt/shared/warehouse") is None
    # buffer.stage_uri wins, in local mode too; `local` means buffer.dir.
    assert stage_uri("local[2]", "gs://b/stage/", wh) == "gs://b/stage"
    assert stage_uri("spark://m:7077", "local", wh) is None
    # Each pipeline has its own folder: readable, and distinct for distinct pipelines.
    one = pipeline_folder("walberg", "postgres|host=a dbname=x|walberg|/var/walberg/segments")
    assert one == pipeline_folder("walberg",
                                  "postgres|host=a dbname=x|walberg|/var/walberg/segments")
    assert one.startswith("walberg-") and one != pipeline_folder(
        "walberg", "postgres|host=b dbname=x|walberg|/var/walberg/segments")
    assert "/" not in pipeline_folder("a/b c", "x")


def _config(tmp_path: Path, master: str, warehouse: str, **buffer: Any) -> Any:
    return parse_config({
        "source": {"postgres": {"dsn": "postgresql://walberg@db.example.com/app",
                                "tables": ["public.t"]}},
        "sink": {"catalog": {"name": "lake", "type": "hadoop", "warehouse": warehouse}},
        "buffer": {"dir": str(tmp_path / "segments"), **buffer},
        "spark": {"master": master},
    }, tmp_path, "test config")


def _staging_check(config: Any) -> str:
    with Lake(config) as lake:
        return executor_staging(Probe(lake, lake.sources[0]))


def test_check_tells_a_cluster_user_where_batches_go(tmp_path: Path) -> None:
    segments = str(tmp_path / "segments")
    local = _staging_check(_config(tmp_path, "local[2]", str(tmp_path / "wh")))
    assert "local mode" in local and segments in local
    remote = _staging_check(_config(tmp_path, "spark://m:7077", "s3a://lake/wh"))
    assert "uploads" in remote and "s3a://lake/wh/_walberg_staging" in remote
    chosen = _staging_check(_config(tmp_path, "spark://m:7077", str(tmp_path / "wh"),
                                    stage_uri="hdfs://nn/walberg-stage"))
    assert "hdfs://nn/walberg-stage" in chosen and "buffer.stage_uri" in chosen
    shared = _staging_check(_config(tmp_path, "spark://m:7077", str(tmp_path / "wh"),
                                    stage_uri="local"))
    assert "every executor must mount it" in shared
    # A cluster, a local warehouse and nothing set: executors would look for the driver's files.
    with pytest.raises(Terminal) as failed:
        _staging_check(_config(tmp_path, "spark://m:7077", str(tmp_path / "wh")))
    assert "buffer.stage_uri" in str(failed.value) and segments in str(failed.value)
    with pytest.raises(ConfigError, match="stage_uri"):
        _config(tmp_path, "spark://m:7077", "s3a://lake/wh", stage_uri="bucket/stage")


def test_a_restart_removes_the_folders_a_killed_run_staged_in(tmp_path: Path) -> None:
    for name in ("batch-a1b2c3", "walberg-copy-x9", "walberg-dlq-k3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "00000-public.t.parquet").write_bytes(b"PAR1")
    (tmp_path / "0000000000000001.sealed").write_bytes(b"segment")
    (tmp_path / "spill").mkdir()
    gone = remove_local_leftovers(tmp_path)
    assert sorted(p.name for p in gone) == ["batch-a1b2c3", "walberg-copy-x9", "walberg-dlq-k3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000000000001.sealed", "spill"]
    assert remove_local_leftovers(tmp_path / "missing") == []
