"""A class-data archive for the driver's JVM, so that a cold start costs a fraction of what it
would.

Before its first query a Spark driver loads, verifies and links some 20,000 classes; on two
cores that is most of a `walberg run --once` that has little to do. Java 13 and later can write
the classes a run loaded into an archive as the JVM exits (application class-data sharing:
``-XX:ArchiveClassesAtExit``) and map that archive at the next start
(``-XX:SharedArchiveFile``). Measured on this project's two-core machines: the session starts in
3.4 s instead of 5.8 s, the first SQL statement takes 1.7 s instead of 3.9 s and the first write
1.8 s instead of 4.8 s (bench/backlog.py reports what it does to whole runs).

One archive per Java, pyspark and driver class path, in a per-user cache folder
(``$XDG_CACHE_HOME/walberg/jvm``, else ``~/.cache/walberg/jvm``; ``WALBERG_CLASS_CACHE`` names
another folder, or ``off``). About 180 MB each; the three used last are kept. The first
session that finds none has one made after it stops, by a process of its own in the
background (``python -m walberg.apply.classcache``):
that process starts a session whose JVM writes the archive to a temporary file, runs a small
workload on a scratch Iceberg table, waits for its JVM to exit, checks that a JVM starts with
the archive, and only then renames it into place. A JVM given a damaged archive refuses to
start, so an archive is checked before it is put in place and before each session uses it
(a ``java -version`` with it, about 0.2 s); one that fails is removed, made again, and the
session starts without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

log = logging.getLogger("walberg")

# The JVM's own messages about the archive (classes it skips, say) are not for walberg's output.
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
# A build that has not finished after this long is taken to be dead.
_STALE_SECONDS = 900.0
# Archives kept in the folder (the ones used last).
KEEP = 3


def java_major(version_output: str) -> Optional[int]:
    """The major version from ``java -version``'s output ("17.0.15" -> 17, "1.8.0" -> 8)."""
    found = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if not found:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def cache_folder() -> Optional[Path]:
    chosen = os.environ.get("WALBERG_CLASS_CACHE", "")
    if chosen.lower() in ("off", "0", "false", "no"):
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "walberg" / "jvm"


def archive_for(java: Path, version_output: str, conf: Mapping[str, str]) -> Optional[Path]:
    """Where the archive for this JVM and driver class path lives (None: not for this Java, or
    turned off). The name changes with anything that changes which classes the JVM loads from
    where, since an archive only serves the class path it was made with."""
    folder = cache_folder()
    major = java_major(version_output)
    if folder is None or major is None or major < 13:
        return None
    try:
        import pyspark
        spark_home = Path(pyspark.__file__).parent
        jars = sorted(p.name for p in (spark_home / "jars").glob("*.jar"))
    except ImportError:
        return None
    what = "\n".join([str(java.resolve()), version_output.strip(), str(spark_home),
                      *jars, conf.get("spark.driver.extraClassPath", ""),
                      os.environ.get("SPARK_HOME", "")])
    return folder / f"driver-{hashlib.sha256(what.encode()).hexdigest()[:16]}.jsa"


def usable(archive: Optional[Path]) -> bool:
    return archive is not None and archive.is_file()


def starts_with(java: Path, archive: Path) -> bool:
    """Whether a JVM starts with the archive (a damaged one makes it abort; about 0.2 s). A
    good one is marked used (its modification time), for ``prune``."""
    try:
        ok = subprocess.run([str(java), f"-XX:SharedArchiveFile={archive}", "-Xshare:auto",
                             "-Xlog:disable", "-version"], capture_output=True,
                            timeout=120).returncode == 0
        if ok:
            os.utime(archive)
        return ok
    except (OSError, subprocess.TimeoutExpired):
        return False


def prune(folder: Path, keep: int = KEEP) -> None:
    """Remove all but the ``keep`` archives used last: every new virtualenv or Java makes
    another, and each is large."""
    found = sorted(folder.glob("driver-*.jsa"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in found[keep:]:
        discard(old)
        discard(old.with_suffix(".log"))


def java_options(archive: Path) -> str:
    return f"-XX:SharedArchiveFile={archive} -Xshare:auto {_QUIET}"


def dump_options(path: Path) -> str:
    return f"-XX:ArchiveClassesAtExit={path} {_QUIET}"


def discard(archive: Path) -> None:
    try:
        archive.unlink()
    except OSError:
        pass


def build_later(archive: Path) -> None:
    """Have the archive made by a background process of its own, unless one is at it."""
    lock = archive.with_suffix(".building")
    try:
        archive.parent.mkdir(parents=True, exist_ok=True)
        try:
            if time.time() - lock.stat().st_mtime > _STALE_SECONDS:
                lock.unlink()
        except FileNotFoundError:
            pass
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return  # being built, or the folder cannot be written: start-ups stay as they are
    os.close(fd)
    logfile = archive.with_suffix(".log")
    try:
        with open(logfile, "w") as out:
            subprocess.Popen([sys.executable, "-m", "walberg.apply.classcache", str(archive)],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, close_fds=True)
    except OSError:
        lock.unlink(missing_ok=True)
        return
    log.info("making a class-data archive for faster Spark start-ups, in the background: %s "
             "(its log: %s)", archive, logfile)


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


def _make(archive: Path) -> int:
    """The background build (see the module docstring); 0 when the archive is in place."""
    from walberg.apply.spark import build_session, find_java

    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f"{archive.stem}.{os.getpid()}.partial")
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="walberg-warm-") as scratch:
            session = build_session("local[2]", "lake", str(Path(scratch) / "warehouse"), {},
                                    {"spark.driver.extraJavaOptions": dump_options(partial)},
                                    app_name="walberg-class-archive", class_cache=False)
            for statement in _WORKLOAD:
                session.sql(statement).collect()
            df = session.read.parquet(*_parquet(session, Path(scratch)))
            df.where("op <> 'D'").selectExpr("CAST(id AS BIGINT) AS id", "name").collect()
            _stop_and_wait(session)
        if not partial.is_file() or not starts_with(find_java(), partial):
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


def _parquet(session: Any, scratch: Path) -> Sequence[str]:
    """A staged-looking Parquet file, written by Spark, for the workload to read back."""
    path = str(scratch / "staged")
    session.range(5000).selectExpr("id", "CAST(id AS STRING) AS name",
                                   "IF(id % 3 = 0, 'D', 'U') AS op").write.parquet(path)
    return [path]


def _stop_and_wait(session: Any) -> None:
    """Stop the session and its JVM, and wait for the JVM to exit: it writes the archive as it
    exits. (The JVM leaves when its standard input closes.)"""
    proc = session.sparkContext._gateway.proc
    session.stop()
    if proc.stdin is not None:
        proc.stdin.close()
    proc.wait(timeout=600)


def make_now(archive: Path, timeout: float = 900.0) -> bool:
    """Make the archive in the foreground (the benchmarks do, so that no build runs beside what
    they time). True when it is in place."""
    if usable(archive):
        return True
    archive.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "walberg.apply.classcache", str(archive)],
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode == 0 and usable(archive)


if __name__ == "__main__":
    sys.exit(_make(Path(sys.argv[1])))
