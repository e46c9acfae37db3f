"""The driver's JVM started from the command Spark's launcher gave before for the same
settings (walberg.apply.jvm.launch): the same JVM, with the same arguments and environment,
as PySpark's own start through ``spark-submit``; a remembered command that no longer starts
is forgotten and PySpark starts the JVM. Each session runs in a process of its own, since
this test session's Spark is running already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SESSION = """
import json, sys
from walberg.apply.jvm.spark import build_session, stop_session
session = build_session("local[1]", "lake", sys.argv[1], {}, {}, short_lived=True)
jvm = session._jvm
names = ["SPARK_HOME", "SPARK_CONF_DIR", "SPARK_ENV_LOADED", "SPARK_SCALA_VERSION",
         "PYTHONHASHSEED", "JAVA_HOME"]
print(json.dumps({
    "args": list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
                 .getInputArguments()),
    "command": jvm.System.getProperty("sun.java.command"),
    "env": {n: jvm.System.getenv(n) for n in names},
    "answer": session.sql("SELECT 6 * 7").collect()[0][0],
}))
stop_session(session)
from pyspark import SparkContext
SparkContext._gateway.proc.stdin.close()
SparkContext._gateway.proc.wait()
"""


def _session(tmp_path: Path, **env: str) -> dict[str, object]:
    run_env = {**os.environ, "TMPDIR": str(tmp_path), **env}
    proc = subprocess.run([sys.executable, "-c", SESSION, str(tmp_path / "warehouse")],
                          capture_output=True, text=True, env=run_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def _memos(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / f"walberg-{os.getuid()}" / "launch").glob("launch-*"))


def test_the_remembered_command_starts_the_jvm_spark_submit_would(tmp_path: Path) -> None:
    by_pyspark = _session(tmp_path, PYSPARK_SUBMIT_ARGS="pyspark-shell")
    assert not _memos(tmp_path), "PYSPARK_SUBMIT_ARGS set: PySpark's own start"
    first = _session(tmp_path)  # asks the launcher, remembers, starts from its answer
    [memo] = _memos(tmp_path)
    words = json.loads(memo.read_text())
    assert words[0].endswith("/bin/java") and "org.apache.spark.deploy.SparkSubmit" in words
    again = _session(tmp_path)  # starts from what it remembered
    assert _memos(tmp_path) == [memo]
    for started in (first, again):
        assert started["answer"] == 42
        # The same JVM options, main class and arguments, and the environment Spark's
        # scripts give it.
        assert started["args"] == by_pyspark["args"]
        assert started["command"] == by_pyspark["command"]
        assert started["env"] == by_pyspark["env"]
    assert by_pyspark["env"]["PYTHONHASHSEED"] == "0"  # type: ignore[index]


def test_a_command_others_may_write_is_never_run_and_one_that_fails_is_forgotten(
        tmp_path: Path) -> None:
    """The temp dir is every user's: a remembered command that another user could have
    written is not run (the launcher is asked again, its answer replaces it); one that no
    longer starts is forgotten, and PySpark starts the JVM."""
    _session(tmp_path)
    [memo] = _memos(tmp_path)
    words = json.loads(memo.read_text())
    memo.write_text(json.dumps([str(tmp_path / "planted"), *words[1:]]))
    memo.chmod(0o666)
    assert _session(tmp_path)["answer"] == 42
    assert json.loads(memo.read_text()) == words
    assert not memo.stat().st_mode & 0o022
    memo.write_text(json.dumps([str(tmp_path / "no-java"), *words[1:]]))
    assert _session(tmp_path)["answer"] == 42  # PySpark's start
    assert not _memos(tmp_path)


EARLY = """
import json, sys
from walberg.apply.jvm import launch
from walberg.apply.jvm.spark import build_session, start_jvm_early, stop_session
from pyspark import SparkContext
warehouse, early_short, build_short = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
start_jvm_early("local[1]", "lake", warehouse, {}, {}, short_lived=early_short)
early = launch._early
session = build_session("local[1]", "lake", warehouse, {}, {}, short_lived=build_short)
proc = SparkContext._gateway.proc
print(json.dumps({
    "early": early is not None,
    "used": early is not None and proc is early.proc,
    "early_ended": early is not None and early.proc.poll() is not None,
    "answer": session.sql("SELECT 6 * 7").collect()[0][0],
}))
stop_session(session)
proc.stdin.close()
proc.wait()
"""


def _early(tmp_path: Path, early_short: bool, build_short: bool) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", EARLY, str(tmp_path / "warehouse"),
                           str(int(early_short)), str(int(build_short))],
                          capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def test_a_jvm_started_early_is_the_sessions_when_its_settings_are(tmp_path: Path) -> None:
    """The CLI starts the driver's JVM as soon as it has read the pipeline file; the session
    built later connects to it if it was started with the session's settings, and stops it and
    starts its own if not. Nothing is started early before the command is remembered (nor
    before the class-data archive is known to start)."""
    first = _early(tmp_path, True, True)
    assert not first["early"] and first["answer"] == 42
    same = _early(tmp_path, True, True)
    assert same["early"] and same["used"] and same["answer"] == 42
    other = _early(tmp_path, True, False)  # (started for `--once`, built for `walberg run`)
    assert other["early"] and not other["used"] and other["early_ended"]
    assert other["answer"] == 42



BY_FILE = """
import json, sys
from pathlib import Path
from walberg.apply.jvm import launch
from walberg.apply.jvm.spark import build_session, start_jvm_early, start_jvm_for_file, stop_session
from pyspark import SparkContext
warehouse, pipeline_file = sys.argv[1], Path(sys.argv[2])
memo = start_jvm_for_file(pipeline_file, True)
before_reading = launch._early
start_jvm_early("local[1]", "lake", warehouse, {}, {}, short_lived=True, file_memo=memo)
session = build_session("local[1]", "lake", warehouse, {}, {}, short_lived=True)
proc = SparkContext._gateway.proc
print(json.dumps({
    "before_reading": before_reading is not None,
    "used": before_reading is not None and proc is before_reading.proc,
    "answer": session.sql("SELECT 6 * 7").collect()[0][0],
}))
stop_session(session)
proc.stdin.close()
proc.wait()
"""


def test_the_jvm_last_started_for_a_pipeline_file_starts_before_it_is_read(
        tmp_path: Path) -> None:
    """``walberg run`` starts the JVM it last started for the same pipeline file before it
    even reads the file (parsing it and its imports take half a second); a changed file starts
    nothing until its settings are known."""
    pipeline_file = tmp_path / "pipeline.yaml"
    pipeline_file.write_text("# the settings are the script's own\\n")

    def run() -> dict[str, object]:
        proc = subprocess.run([sys.executable, "-c", BY_FILE, str(tmp_path / "warehouse"),
                               str(pipeline_file)], capture_output=True, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
        return found

    run()  # (the launcher asked; nothing remembered for the file: nothing started early)
    second = run()  # started once the settings were known; remembered for the file
    assert not second["before_reading"] and second["answer"] == 42
    third = run()
    assert third["before_reading"] and third["used"] and third["answer"] == 42
    pipeline_file.write_text("# changed\\n")
    fourth = run()
    assert not fourth["before_reading"] and fourth["answer"] == 42
