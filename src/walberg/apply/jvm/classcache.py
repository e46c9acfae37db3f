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
background (``python -m walberg.apply.jvm.classbuild``):
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
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

log = logging.getLogger("walberg")

# The JVM's own messages about the archive (classes it skips, say) are not for walberg's output.
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
# A build that has not finished after this long is taken to be dead.
_STALE_SECONDS = 900.0
# Archives kept in the folder (the ones used last).
KEEP = 3
# The module that makes an archive, run as a process of its own.
BUILDER = "walberg.apply.jvm.classbuild"


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


def starts_with(java: Path, archive: Path, reports: Path) -> bool:
    """Whether a JVM starts with the archive (a damaged one makes it abort; about 0.2 s). A
    good one is marked used (its modification time), for ``prune``. An aborting JVM writes a
    crash report: into the folder ``reports``, not the user's working directory."""
    try:
        reports.mkdir(mode=0o700, parents=True, exist_ok=True)
        ok = subprocess.run([str(java), f"-XX:SharedArchiveFile={archive}", "-Xshare:auto",
                             "-Xlog:disable", f"-XX:ErrorFile={reports}/hs_err_check_%p.log",
                             "-version"], capture_output=True, timeout=120).returncode == 0
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


def build_later(archive: Path, jars: Sequence[str] = ()) -> None:
    """Have the archive made by a background process of its own, unless it is there already
    (another process made it meanwhile) or one is at it. ``jars``: those the sessions it
    serves have on their class path beside the Iceberg jar (it is made with them)."""
    if usable(archive):
        return
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
            subprocess.Popen([sys.executable, "-m", BUILDER, str(archive), *jars],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, close_fds=True)
    except OSError:
        lock.unlink(missing_ok=True)
        return
    log.info("making a class-data archive for faster Spark start-ups, in the background: %s "
             "(its log: %s)", archive, logfile)


def make_now(archive: Path, jars: Sequence[str] = (), timeout: float = 900.0) -> bool:
    """Make the archive in the foreground (the benchmarks do, so that no build runs beside what
    they time). True when it is in place."""
    if usable(archive):
        return True
    archive.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", BUILDER, str(archive), *jars],
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode == 0 and usable(archive)
