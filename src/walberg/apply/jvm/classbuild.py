"""Making the driver JVM's class-data archive (see apply.jvm.classcache), in a process of its own:
``python -m walberg.apply.jvm.classbuild <archive> [jar ...]`` (the jars its sessions have on the
class path beside the Iceberg jar: an archive serves only the class path it was made with). It
starts a session whose JVM writes the archive to a temporary file as it exits, runs a small
workload on a scratch Iceberg table, waits for the JVM to exit, checks that a JVM starts with
the archive, and only then renames it into place. Exit status 0 when the archive is in place."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from walberg.apply.jvm.classcache import dump_options, prune, starts_with
from walberg.apply.jvm.java import find_java, temp_folder
from walberg.apply.jvm.spark import build_session

# Statements that load what a batch, a copy and a start-up use: catalog lookups, DDL, reading
# Parquet, netting by window, writes, a MERGE and a delete by position.
_WORKLOAD = (
    "CREATE TABLE lake.warm.t (id BIGINT, name STRING, amount DECIMAL(12,2), at TIMESTAMP, "
    "n INT, _walberg_lsn BIGINT) USING iceberg TBLPROPERTIES ('format-version'='2', "
    "'write.delete.mode'='merge-on-read', 'write.update.mode'='merge-on-read', "
    "'write.merge.mode'='merge-on-read')",
    "INSERT INTO lake.warm.t SELECT id, CAST(id AS STRING), CAST(id / 7 AS DECIMAL(12,2)), "
    "TIMESTAMP '2024-01-01 00:00:00' + make_interval(0, 0, 0, 0, 0, 0, id), "
    "CAST(id % 100 AS INT), id FROM range(20000)",
    "DESCRIBE TABLE EXTENDED lake.warm.t",
    "SHOW TBLPROPERTIES lake.warm.t",
    "CREATE OR REPLACE TEMPORARY VIEW changes AS SELECT * FROM (SELECT id, name, amount, at, n, "
    "op, row_number() OVER (PARTITION BY id ORDER BY seq DESC) AS r FROM (SELECT id * 3 AS id, "
    "CAST(id AS STRING) AS name, CAST(id AS DECIMAL(12,2)) AS amount, current_timestamp() AS at, "
    "CAST(id AS INT) AS n, IF(id % 5 = 0, 'D', 'U') AS op, id AS seq FROM range(10000))) "
    "WHERE r = 1",
    "MERGE INTO lake.warm.t t USING changes c ON t.id = c.id WHEN MATCHED AND c.op = 'D' THEN "
    "DELETE WHEN MATCHED THEN UPDATE SET name = c.name, amount = c.amount, at = c.at, n = c.n "
    "WHEN NOT MATCHED AND c.op <> 'D' THEN INSERT (id, name, amount, at, n, _walberg_lsn) "
    "VALUES (c.id, c.name, c.amount, c.at, c.n, 1)",
    "SELECT id, _file, _pos FROM lake.warm.t ORDER BY id",
    "SELECT count(*), sum(amount) FROM lake.warm.t",
)


def make(archive: Path, jars: Sequence[str] = ()) -> int:
    """The background build (see the module docstring); 0 when the archive is in place."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f"{archive.stem}.{os.getpid()}.partial")
    started = time.monotonic()
    try:
        if archive.is_file() and starts_with(find_java(), archive, temp_folder()):
            print(f"class-data archive there already: {archive}", flush=True)
            return 0
        with tempfile.TemporaryDirectory(prefix="walberg-warm-") as scratch:
            session = build_session("local[2]", "lake", str(Path(scratch) / "warehouse"), {},
                                    {"spark.driver.extraJavaOptions": dump_options(partial)},
                                    app_name="walberg-class-archive", jars=jars,
                                    class_cache=False)
            for statement in _WORKLOAD:
                session.sql(statement).collect()
            df = session.read.parquet(_parquet(session, Path(scratch)))
            df.where("op <> 'D'").selectExpr("CAST(id AS BIGINT) AS id", "name").collect()
            _stop_and_wait(session)
        if not partial.is_file() or not starts_with(find_java(), partial, temp_folder()):
            print("the archive was not written, or a JVM does not start with it: not using it",
                  flush=True)
            return 1
        os.replace(partial, archive)
        prune(archive.parent)
        print(f"class-data archive ready: {archive} ({archive.stat().st_size / 1e6:.0f} MB, "
              f"made in {time.monotonic() - started:.0f} s)", flush=True)
        return 0
    finally:
        partial.unlink(missing_ok=True)
        archive.with_suffix(".building").unlink(missing_ok=True)


def _parquet(session: Any, scratch: Path) -> str:
    """A staged-looking Parquet file, written by Spark, for the workload to read back."""
    path = str(scratch / "staged")
    session.range(5000).selectExpr("id", "CAST(id AS STRING) AS name",
                                   "IF(id % 3 = 0, 'D', 'U') AS op").write.parquet(path)
    return path


def _stop_and_wait(session: Any) -> None:
    """Stop the session and its JVM, and wait for the JVM to exit: it writes the archive as it
    exits. (The JVM leaves when its standard input closes.)"""
    proc = session.sparkContext._gateway.proc
    session.stop()
    if proc.stdin is not None:
        proc.stdin.close()
    proc.wait(timeout=600)


if __name__ == "__main__":
    sys.exit(make(Path(sys.argv[1]), sys.argv[2:]))
