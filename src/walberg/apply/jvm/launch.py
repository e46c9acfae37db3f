"""The driver's JVM started from the command Spark's launcher gave last time for the same
settings, instead of through ``spark-submit``.

PySpark starts its JVM by running ``bin/spark-submit``: two shell scripts, then a first JVM
(``org.apache.spark.launcher.Main``) whose only work is to print the java command line of the
second, then that second JVM, whose readiness PySpark polls every 0.1 s. The first JVM and the
polling are a quarter of a second of every ``walberg run --once`` here. The launcher's answer
depends only on what it is given: the settings, Spark's home and its configuration folder, and
the environment it reads (``SPARK_*``, ``HADOOP_*``, ``YARN_*``, ``JAVA_*``, ``PYSPARK_*``). So
it is asked once per distinct set of those, its answer is remembered in walberg's temp folder,
and the driver's JVM is started from it directly, its readiness polled every 10 ms. The JVM
then tells its gateway's port and secret the way it tells PySpark: a file named by
``_PYSPARK_DRIVER_CONN_INFO_PATH`` (a big-endian int, then a length-prefixed UTF-8 string).

Where the launcher's answer could depend on more (a ``spark-env.sh``, which may run anything;
PySpark's own overrides such as ``PYSPARK_SUBMIT_ARGS``), or where the launcher fails, walberg
leaves the start to PySpark.

With the command known, ``walberg run`` starts the JVM early (``spawn_early``), so that its
start (a second or more) overlaps the import of the rest of walberg (pyarrow, numpy, the apply
code): the command last started for the same pipeline file before the file is even read
(``spawn_for_file``), else the one its settings give as soon as it is read. The session
connects to that JVM if its command is the one the session's own settings give
(``take_early``); otherwise it is stopped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

# Environment variables that change what the launcher prints, by prefix.
_READ_BY_LAUNCHER = ("SPARK_", "HADOOP_", "YARN_", "JAVA_", "PYSPARK_")
# Set, they mean PySpark's own way to start (or reach) the JVM: walberg leaves it to PySpark.
_PYSPARK_OWN = ("PYSPARK_GATEWAY_PORT", "PYSPARK_SUBMIT_ARGS", "SPARK_TESTING",
                "SPARK_PREPEND_CLASSES")
_LAUNCHER_MAIN = "org.apache.spark.launcher.Main"
_SUBMIT = "org.apache.spark.deploy.SparkSubmit"
# What PySpark's own start makes visible in the gateway's JVM view, for PySpark's code to find.
_PYSPARK_IMPORTS = ("org.apache.spark.SparkConf", "org.apache.spark.api.java.*",
                    "org.apache.spark.api.python.*", "org.apache.spark.ml.python.*",
                    "org.apache.spark.mllib.api.python.*", "org.apache.spark.resource.*",
                    "org.apache.spark.sql.*", "org.apache.spark.sql.api.python.*",
                    "org.apache.spark.sql.hive.*", "scala.Tuple2")
_KEEP = 16  # remembered answers kept (the newest)


class NotReady(Exception):
    """The driver's JVM exited before its gateway was ready."""


def spark_home() -> Path:
    """Where PySpark's Spark is (its ``jars``, ``bin``...): ``SPARK_HOME``, else the pip
    package's own folder, found without importing PySpark (a third of a second), else as
    PySpark finds it."""
    if os.environ.get("SPARK_HOME"):
        return Path(os.environ["SPARK_HOME"])
    spec = importlib.util.find_spec("pyspark")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / "jars").is_dir() and (Path(folder) / "bin").is_dir():
            return Path(folder)
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home())  # type: ignore[no-untyped-call]


def spark_env(home: Path) -> dict[str, str]:
    """The variables Spark's scripts set for the JVM they start (``load-spark-env.sh``,
    ``spark-submit``), over this process's own."""
    env = dict(os.environ)
    env["SPARK_HOME"] = str(home)
    env.setdefault("SPARK_CONF_DIR", str(home / "conf"))
    env["SPARK_ENV_LOADED"] = "1"
    if "SPARK_SCALA_VERSION" not in env:
        both = home / "assembly" / "target"
        env["SPARK_SCALA_VERSION"] = "2.13" if (both / "scala-2.13").is_dir() else "2.12"
    env["PYTHONHASHSEED"] = "0"
    return env


def command(memo_folder: Path, args: Sequence[str],
            ask: bool = True) -> Optional[tuple[list[str], Path]]:
    """The java command line that ``spark-submit args`` would run, and where it is remembered
    (in ``memo_folder``; asked of Spark's launcher the first time, unless not to ``ask``);
    None: leave the start to PySpark."""
    if not _ours():
        return None
    import pyspark

    home = spark_home()
    env = spark_env(home)
    java = Path(env.get("JAVA_HOME", "")) / "bin" / "java"
    conf_dir = Path(env["SPARK_CONF_DIR"])
    jars = home / "jars"
    if not java.is_file() or not jars.is_dir() or (conf_dir / "spark-env.sh").exists():
        return None
    if not (private(memo_folder.parent) and private(memo_folder)):
        return None
    memo = memo_folder / f"launch-{_key(home, java, conf_dir, args, env, pyspark.__version__)}"
    found = read_memo(memo)
    if isinstance(found, list) and found:
        try:
            os.utime(memo)  # (the newest are kept)
        except OSError:
            pass
        return [str(x) for x in found], memo
    asked = _ask_launcher(java, jars, args, env) if ask else None
    if asked is None:
        return None
    write_memo(memo, asked)
    return asked, memo


def _ours() -> bool:
    """Whether walberg may start the JVM itself: not where PySpark is told to start (or to
    reach) it its own way."""
    return os.name == "posix" and not any(os.environ.get(name) for name in _PYSPARK_OWN) \
        and os.environ.get("PYSPARK_PIN_THREAD", "true").lower() == "true"


def read_memo(memo: Path) -> Any:
    """What ``memo`` holds (None: nothing, or nothing this user may trust: the memo, its
    folder and the folder above must be this user's own, written by nobody else)."""
    if not all(private(p) for p in (memo.parent.parent, memo.parent, memo)):
        return None
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        return None


def write_memo(memo: Path, value: Any) -> None:
    """Put ``value`` in ``memo`` whole (written aside, then renamed), keeping the newest few;
    a memo that cannot be written is asked for again next time."""
    try:
        memo.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = memo.with_suffix(f".{os.getpid()}")
        partial.write_text(json.dumps(value))
        os.replace(partial, memo)
        _prune(memo.parent)
    except OSError:
        pass


def private(path: Path) -> bool:
    """Whether ``path`` (a command walberg will run, or the folder it is in) is this user's and
    nobody else may write it (the temp dir is shared by every user of the machine); one that
    does not exist yet is made so."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _key(home: Path, java: Path, conf_dir: Path, args: Sequence[str], env: dict[str, str],
         version: str) -> str:
    st = java.resolve().stat()
    try:
        conf = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                      for p in conf_dir.iterdir() if p.is_file())
    except OSError:
        conf = []
    read = sorted((k, v) for k, v in env.items() if k.startswith(_READ_BY_LAUNCHER))
    text = json.dumps([version, str(home), str(java.resolve()), st.st_ino, st.st_mtime_ns,
                       str(conf_dir), conf, read, list(args)])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _ask_launcher(java: Path, jars: Path, args: Sequence[str],
                  env: dict[str, str]) -> Optional[list[str]]:
    """What Spark's launcher prints for ``spark-submit args`` (as ``bin/spark-class`` runs
    it): the command's words, each ended by a NUL."""
    launcher = [str(java), "-Xmx128m", *shlex.split(env.get("SPARK_LAUNCHER_OPTS", "")),
                "-cp", f"{jars}/*", _LAUNCHER_MAIN, _SUBMIT, *args]
    try:
        done = subprocess.run(launcher, env=env, capture_output=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = done.stdout.decode("utf-8", "replace")
    # (a NUL line ends any messages before the command; the command's words end in NULs)
    marker = out.find("\0\n")
    words = out[marker + 2:].split("\0") if marker >= 0 else out.split("\0")
    if done.returncode != 0 or len(words) < 2 or words[-1] != "" or _SUBMIT not in words:
        return None
    return words[:-1]


def _prune(memo_folder: Path) -> None:
    for kind in ("launch-*", "file-*", "helper-*"):
        found = sorted(memo_folder.glob(kind), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in found[_KEEP:]:
            old.unlink(missing_ok=True)


@dataclass
class Spawned:
    """A driver's JVM started, its gateway perhaps not yet ready."""

    command: list[str]
    proc: subprocess.Popen[bytes]
    folder: Path  # where the JVM tells its gateway's port and secret


# The JVM ``spawn_early`` started, until ``take_early``.
_early: Optional[Spawned] = None
_early_lock = threading.Lock()


def spawn(cmd: Sequence[str], output: Callable[[], ContextManager[tuple[int, int]]],
          java_home: Optional[str] = None) -> Spawned:
    """Start the driver's JVM from ``cmd``, its stdout and stderr the write ends ``output``
    gives, as PySpark's own start does (Ctrl-C is this process's to handle, not the JVM's; the
    JVM ends when this process's end closes its stdin). ``java_home``: the JAVA_HOME it is
    given if this process has none yet."""
    folder = Path(tempfile.mkdtemp(prefix="walberg-gateway-"))
    env = spark_env(spark_home())
    if java_home is not None:
        env.setdefault("JAVA_HOME", java_home)
    env["_PYSPARK_DRIVER_CONN_INFO_PATH"] = str(folder / "info")
    try:
        with output() as (out, err):
            proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    env=env, preexec_fn=_ignore_sigint)
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise NotReady(f"the driver's JVM did not start: {exc}") from None
    return Spawned(list(cmd), proc, folder)


def spawn_early(cmd: Sequence[str], output: Callable[[], ContextManager[tuple[int, int]]],
                java_home: Optional[str] = None) -> None:
    """``spawn``, for ``take_early`` to find when the session is built (a JVM that cannot even
    be started is left to that moment to report). One started early already from another
    command is stopped first."""
    global _early
    kept = take_early(cmd)  # (one started from this command already; another is stopped)
    with _early_lock:
        if kept is not None:
            _early = kept
        elif _early is None:
            try:
                _early = spawn(cmd, output, java_home)
            except NotReady:
                pass


def file_memo(memo_folder: Path, path: Path, once: bool) -> Optional[Path]:
    """Where the java command last started for the pipeline file ``path`` (as it is now: its
    inode, size and modification time) is remembered, with this process's SPARK_/HADOOP_/
    YARN_/JAVA_/PYSPARK_ environment; None if it cannot be."""
    try:
        st = path.resolve().stat()
    except OSError:
        return None
    read = sorted((k, v) for k, v in os.environ.items() if k.startswith(_READ_BY_LAUNCHER))
    text = json.dumps([str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, once, read])
    return memo_folder / f"file-{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def spawn_for_file(memo: Optional[Path],
                   output: Callable[[], ContextManager[tuple[int, int]]]) -> None:
    """Start early the JVM last started for this pipeline file (``file_memo``), before the
    file is even read: whether it is the one the session wants is settled when the session is
    built (``take_early``)."""
    found: Any = read_memo(memo) if memo is not None and _ours() else None
    try:
        words, java_home = [str(w) for w in found["command"]], str(found["java_home"])
    except (KeyError, TypeError):
        return
    spawn_early(words, output, java_home)


def remember_for_file(memo: Optional[Path], cmd: Sequence[str], java_home: str) -> None:
    """Remember ``cmd`` (and the JAVA_HOME it ran with) for the pipeline file of ``memo``."""
    if memo is not None:
        write_memo(memo, {"command": list(cmd), "java_home": java_home})


def take_early(cmd: Optional[Sequence[str]]) -> Optional[Spawned]:
    """The JVM ``spawn_early`` started, if it was started from ``cmd``; one started from
    another command is stopped."""
    global _early
    with _early_lock:
        found, _early = _early, None
    if found is None or (cmd is not None and found.command == list(cmd)):
        return found
    _stop(found)
    return None


def _stop(spawned: Spawned) -> None:
    if spawned.proc.stdin is not None:
        spawned.proc.stdin.close()  # (the JVM ends when its stdin does)
    spawned.proc.kill()
    spawned.proc.wait()
    shutil.rmtree(spawned.folder, ignore_errors=True)


def connect(spawned: Spawned) -> Any:
    """PySpark's gateway to a spawned JVM, once it is ready."""
    from py4j.clientserver import ClientServer, JavaParameters, PythonParameters
    from py4j.java_gateway import java_import

    info = spawned.folder / "info"
    try:
        while spawned.proc.poll() is None and not info.exists():
            time.sleep(0.01)
        if not info.exists():
            raise NotReady(f"the driver's JVM exited with status {spawned.proc.returncode} "
                           "before it was ready")
        data = info.read_bytes()
    finally:
        shutil.rmtree(spawned.folder, ignore_errors=True)
    port, length = struct.unpack(">ii", data[:8])
    secret = data[8:8 + length].decode("utf-8")
    gateway = ClientServer(
        java_parameters=JavaParameters(port=port, auth_token=secret, auto_convert=True),
        python_parameters=PythonParameters(port=0, eager_load=False))
    gateway.proc = spawned.proc  # (its stdin open for as long as this process lives)
    for name in _PYSPARK_IMPORTS:
        java_import(gateway.jvm, name)
    return gateway


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
