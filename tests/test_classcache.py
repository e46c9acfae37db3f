"""The driver JVM's class-data archive (walberg.apply.jvm.classcache): made by a process of its own,
checked, used by the next session, and never in the way: a damaged one is dropped and made
again while the session starts without it. Each session here runs in a process of its own,
since this test session's Spark is running already."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from walberg.apply.jvm import classcache
from walberg.apply.jvm.java import check_java, find_java, iceberg_jar
from walberg.apply.jvm.spark import _settings, session_archive

pytestmark = pytest.mark.slow

# A session in a process of its own: it says which archive it expected, whether its JVM was
# given it, and that the JVM answers SQL.
SESSION = """
import sys
from walberg.apply.jvm.spark import build_session, session_archive, stop_session
archive = session_archive()
# With a second argument: a session for a `--once` run, with those options of the user's own.
short = len(sys.argv) > 2
own = {"spark.driver.extraJavaOptions": sys.argv[2]} if short else {}
session = build_session("local[1]", "lake", sys.argv[1], {}, own, short_lived=short)
options = session.sparkContext.getConf().get("spark.driver.extraJavaOptions")
print("ARCHIVE", archive)
print("GIVEN", f"SharedArchiveFile={archive}" in options)
jvm = session._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
print("JIT_GC", " ".join(sorted(a for a in jvm.getInputArguments()
                                if a.startswith("-XX:") and ("Tiered" in a or "GC" in a))))
print("ANSWER", session.sql("SELECT 6 * 7").collect()[0][0])
stop_session(session)
# The JVM ends on its own once this process has (its output passes through pipes of this
# one): wait for it here, before the test damages the archive it has mapped.
from pyspark import SparkContext
SparkContext._gateway.proc.stdin.close()
SparkContext._gateway.proc.wait()
"""


def _session(tmp_path: Path, env: dict[str, str], *own_options: str) -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", SESSION, str(tmp_path / "warehouse"),
                           *own_options],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Nothing from the JVM about the archive reaches the terminal.
    assert "SharedArchiveFile" not in proc.stderr and "fatal error" not in proc.stderr
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)


def _stop_builds(folder: Path) -> None:
    """End the background build a test started (it would only cost CPU)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(folder).encode() in part for part in cmdline) and \
                classcache.BUILDER.encode() in cmdline:
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except OSError:
                pass


def test_java_versions_are_read() -> None:
    assert classcache.java_major('openjdk version "17.0.15" 2025-04-15') == 17
    assert classcache.java_major('openjdk version "11.0.2" 2019-01-15') == 11
    assert classcache.java_major('java version "1.8.0_381"') == 8
    assert classcache.java_major("no version here") is None


def test_no_archive_when_turned_off_or_for_an_old_java(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    java = find_java()
    monkeypatch.setenv("WALBERG_CLASS_CACHE", "off")
    assert classcache.archive_for(java, check_java(java), {}) is None
    monkeypatch.setenv("WALBERG_CLASS_CACHE", str(tmp_path))
    assert classcache.archive_for(java, 'openjdk version "11.0.2"', {}) is None
    here = classcache.archive_for(java, check_java(java), {})
    assert here is not None and here.parent == tmp_path
    # Another driver class path, another archive.
    assert classcache.archive_for(java, check_java(java),
                                  {"spark.driver.extraClassPath": "/x.jar"}) != here


def test_walberg_s_jars_are_on_the_driver_s_class_path_and_the_archive_follows(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """walberg's jars (the Iceberg runtime's first, then those a catalog or storage needs) are
    on the driver's class path, so the executor of local mode fetches none of them; on a
    cluster they are shipped on spark.jars too. Another set of jars is another class path,
    so another archive (made with those jars)."""
    monkeypatch.setenv("WALBERG_CLASS_CACHE", str(tmp_path))
    jar = str(iceberg_jar())

    def settings(master: str, jars: list[str], own: dict[str, str]) -> tuple[dict[str, str], Any]:
        _, conf, _, archive = _settings(master, "lake", "/w", {}, own, jars, class_cache=True,
                                        short_lived=False)
        return conf, archive

    plain, archive = settings("local[2]", [], {})
    assert plain["spark.driver.extraClassPath"] == jar and "spark.jars" not in plain
    assert archive == session_archive() is not None
    s3, other = settings("local[*]", ["/j/hadoop-aws.jar", "/j/bundle.jar"],
                         {"spark.jars": "/mine.jar", "spark.driver.extraClassPath": "/cp.jar"})
    assert s3["spark.driver.extraClassPath"] == os.pathsep.join(
        [jar, "/j/hadoop-aws.jar", "/j/bundle.jar", "/cp.jar"])
    assert s3["spark.jars"] == "/mine.jar" and other not in (archive, None)
    cluster, _ = settings("local-cluster[2,1,1024]", ["/j/hadoop-aws.jar"], {})
    assert cluster["spark.driver.extraClassPath"] == os.pathsep.join([jar, "/j/hadoop-aws.jar"])
    assert cluster["spark.jars"] == f"{jar},/j/hadoop-aws.jar"


def test_only_the_archives_used_last_are_kept(tmp_path: Path) -> None:
    # Every new virtualenv (a CI run's, say) makes an archive of its own; old ones go.
    now = time.time()
    for age in range(5):
        made = tmp_path / f"driver-{age}.jsa"
        made.write_bytes(b"x")
        made.with_suffix(".log").write_text("log")
        os.utime(made, (now - age * 3600, now - age * 3600))
    classcache.prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "driver-0.jsa", "driver-0.log", "driver-1.jsa", "driver-1.log", "driver-2.jsa",
        "driver-2.log"]


def test_made_checked_used_and_a_damaged_one_replaced(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("WALBERG_CLASS_CACHE", str(cache))
    env = dict(os.environ)
    java = find_java()
    archive = session_archive()
    assert archive is not None

    # Made in the foreground, as the benchmarks do: in place, and a JVM starts with it.
    made = subprocess.run([sys.executable, "-m", classcache.BUILDER, str(archive)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert archive.is_file() and archive.stat().st_size > 10_000_000
    assert classcache.starts_with(java, archive, tmp_path / "reports")
    assert not list(cache.glob("*.partial")) and not list(cache.glob("*.building"))
    # A session that started before it was made asks for it on stopping: nothing starts.
    classcache.build_later(archive)
    assert not archive.with_suffix(".building").exists()

    # The next session's JVM is given it, and works.
    seen = _session(tmp_path, env)
    assert seen == {"ARCHIVE": str(archive), "GIVEN": "True", "ANSWER": "42",
                    "JIT_GC": ""}  # the JVM's own defaults: no JIT or collector chosen
    # A `--once` run's JVM starts on C1 alone and the serial collector, from the same archive.
    # Options of the user's own decide what they name: their collector (two would keep the JVM
    # from starting), with walberg's JIT setting still added.
    seen = _session(tmp_path, env, "-Dwalberg.test=1")
    assert seen["GIVEN"] == "True" and seen["ANSWER"] == "42"
    assert seen["JIT_GC"] == "-XX:+UseSerialGC -XX:TieredStopAtLevel=1", seen
    seen = _session(tmp_path, env, "-XX:+UseG1GC")
    assert seen["GIVEN"] == "True" and seen["ANSWER"] == "42"
    assert seen["JIT_GC"] == "-XX:+UseG1GC -XX:TieredStopAtLevel=1", seen

    # A damaged archive (cut short, as a full disk would leave it) makes a JVM abort. The
    # session starts without it, drops it, and has it made again in the background.
    size = archive.stat().st_size
    archive.chmod(0o644)
    with open(archive, "r+b") as f:
        f.truncate(size // 3)
    reports = len(list(Path.cwd().glob("hs_err_pid*.log")))
    assert not classcache.starts_with(java, archive, tmp_path / "reports")
    # The aborted JVM's crash report is in the folder given, not in the working directory.
    assert len(list(Path.cwd().glob("hs_err_pid*.log"))) == reports
    assert list((tmp_path / "reports").glob("hs_err_check_*.log"))
    try:
        seen = _session(tmp_path, env)
        assert seen["GIVEN"] == "False" and seen["ANSWER"] == "42"
        deadline = time.monotonic() + 30
        while not archive.with_suffix(".building").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        # The damaged file is gone; a build is under way (its lock and log are there).
        assert archive.with_suffix(".building").exists()
        assert archive.with_suffix(".log").exists()
        assert not (archive.is_file() and archive.stat().st_size == size // 3)
    finally:
        _stop_builds(cache)
