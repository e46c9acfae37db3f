"""The Spark session walberg builds: its settings (catalog, jars, the driver's JVM options),
the driver's JVM started early or from a remembered command, the class-data archive it starts
from (made after a session that started without it), and stopping it. pyspark lives only in
apply/."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from walberg.apply.jvm import classcache, launch
from walberg.apply.jvm.calls import java_message, watch_storage
from walberg.apply.jvm.java import check_java, find_java, iceberg_jar, remembered, temp_folder
from walberg.apply.jvm.jvmlog import log_config
from walberg.errors import EnvironmentProblem

log = logging.getLogger("walberg")


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
    log_conf = log_config()
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
                                          worker_pool_option(own_options),
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


# Iceberg writes each commit's manifests in its JVM-wide worker pool (as many threads as cores
# by default) and polls for them every 10 ms; with a batch's tables committing side by side,
# each commit's manifests queued behind the others' and waited 10 ms at a time: measured at 200
# tables on two cores, about 15 such waits a commit. With threads to spare each waits once.
WORKER_THREADS = 16


def worker_pool_option(own_options: str) -> str:
    """The size of Iceberg's worker pool, unless the user's own options set it."""
    return "" if "iceberg.worker.num-threads" in own_options else \
        f"-Diceberg.worker.num-threads={WORKER_THREADS}"


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
    _no_local_checksums(session)
    return session


def _no_local_checksums(session: Any) -> None:
    """Hadoop's file system for this machine's disk (the one instance every user of ``file:``
    shares, Iceberg's too) stops writing a checksum file beside each file it writes. Without
    its native library (pip's pyspark has none) Hadoop sets each new file's permissions by
    running `chmod`, about 8 ms a run: a commit writes five metadata files, ten runs with
    their checksums, which at 200 tables was half a commit's time. Nothing needs them:
    Parquet, Avro and Iceberg's metadata check their own contents, and checksums already
    written are still checked when read."""
    jvm = session._jvm
    try:
        jvm.org.apache.hadoop.fs.FileSystem.getLocal(
            session._jsc.hadoopConfiguration()).setWriteChecksum(False)
    except Exception as exc:  # (a file system of the user's own for file:)
        log.debug("local checksums: left as they are (%s)", exc)


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
