"""walberg's own Java code in the driver's JVM: ``Batch.java`` beside this module, compiled when
first needed by Janino, the Java compiler Spark itself ships for its generated code.

Why: the driver reaches the JVM through py4j, and every call is a round trip (0.1-0.4 ms
here). A batch of a table partitioned by day writes hundreds of files, and describing each to
Iceberg, adding it to the row delta and reading the table's live files took 5-15 calls per
file; ``Batch`` does each of those steps for all files in one call, the values travelling as
one JSON string. No jar to build or ship, no JDK needed: only the JVM Spark runs in.

Compiling takes 0.3-0.5 s of a cold JVM's time (and a core, beside the first batch's or copy's
work), so the class files are remembered beside the launch memos (``apply.jvm.launch``, the
same checks that nobody else could have written them), per text of ``Batch.java`` and versions
of Spark and Iceberg, and later sessions define the classes from them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from walberg.errors import ApplyError

log = logging.getLogger("walberg")

_SOURCE = Path(__file__).with_name("Batch.java")
_CLASS = "walberg.Batch"
_lock = threading.Lock()
# The helper of each gateway (a JVM), by the gateway's id (py4j's gateway object answers any
# attribute lookup with a JVM member, so nothing can be kept on it).
_compiled: dict[int, tuple[Any, Any]] = {}


def batch_helper(spark: Any) -> Any:
    """The ``walberg.Batch`` object of this session's JVM, compiled on first use."""
    gateway = spark.sparkContext._gateway
    found = _compiled.get(id(gateway))
    if found is not None and found[0] is gateway:
        return found[1]
    with _lock:
        found = _compiled.get(id(gateway))
        if found is None or found[0] is not gateway:
            found = _compiled[id(gateway)] = (gateway, _compile(spark))
            _local_permissions(spark, found[1])
    return found[1]


def _local_permissions(spark: Any, helper: Any) -> None:
    """New local files get their permissions from the JVM, not from a `chmod` process each
    (``Batch.LocalPermissions``: Hadoop without its native library starts one per file it
    makes, 8-17 ms; five an Iceberg commit, which at 200 tables was a fifth of a commit)."""
    try:
        done = helper.localPermissions(spark._jsc.hadoopConfiguration())
        log.debug("local file permissions set %s", "in the JVM" if done else "by Hadoop")
    except Exception as exc:  # (a JVM that refuses the reflection): Hadoop's way stays
        log.debug("local file permissions: left to Hadoop (%s)", exc)


def _compile(spark: Any) -> Any:
    started = time.monotonic()
    jvm = spark._jvm
    source = _SOURCE.read_text(encoding="utf-8")
    try:
        # The loader that loaded Iceberg sees Iceberg, Hadoop and Jackson.
        parent = jvm.org.apache.iceberg.Table._java_lang_class.getClassLoader()
        memo = _memo(spark, source)
        made = _remembered(spark, memo, parent)
        if made is not None:
            log.debug("walberg's Java helper defined from %s in %.2f s", memo,
                      time.monotonic() - started)
            return made
        compiler = jvm.org.codehaus.janino.SimpleCompiler()
        compiler.setParentClassLoader(parent)
        compiler.setTargetVersion(8)
        compiler.cook(source)
        made = _instance(spark, compiler.getClassLoader())
    except Exception as exc:
        from walberg.apply.jvm.calls import java_message

        raise ApplyError(f"compiling walberg's Java helper ({_SOURCE.name}) in the driver's "
                         f"JVM with Spark's Janino failed: {java_message(exc)}. Is Spark's "
                         "jars folder complete (janino-*.jar, commons-compiler-*.jar)?") from exc
    log.debug("walberg's Java helper compiled in %.2f s", time.monotonic() - started)
    if memo is not None:
        from walberg.apply.jvm import launch

        codes = compiler.getBytecodes()
        launch.write_memo(memo, {str(name): base64.b64encode(bytes(codes.get(name))).decode()
                                 for name in list(codes.keySet())})
    return made


def _instance(spark: Any, loader: Any) -> Any:
    gateway = spark.sparkContext._gateway
    cls = loader.loadClass(_CLASS)
    return cls.getDeclaredConstructor(gateway.new_array(spark._jvm.java.lang.Class, 0)) \
        .newInstance(gateway.new_array(spark._jvm.java.lang.Object, 0))


def _memo(spark: Any, source: str) -> Optional[Path]:
    """Where the class files of this ``source``, compiled against this JVM's Spark and
    Iceberg, are remembered (None: not here, the folder could be another user's)."""
    from walberg.apply.jvm import launch
    from walberg.apply.jvm.java import temp_folder

    folder = temp_folder() / "launch"
    if not launch.private(folder.parent) or not launch.private(folder):
        return None
    try:
        versions = [spark.version,
                    str(spark._jvm.org.apache.iceberg.IcebergBuild.fullVersion())]
    except Exception:  # (an Iceberg without it): compiled every time
        return None
    key = hashlib.sha256(json.dumps([source, *versions]).encode()).hexdigest()[:24]
    return folder / f"helper-{key}"


def _remembered(spark: Any, memo: Optional[Path], parent: Any) -> Any:
    """The helper defined from the remembered class files, if there are any and they load."""
    from walberg.apply.jvm import launch

    found = launch.read_memo(memo) if memo is not None else None
    if not isinstance(found, dict) or _CLASS not in found:
        return None
    try:
        codes = spark._jvm.java.util.HashMap()
        for name, text in found.items():
            codes.put(str(name), base64.b64decode(text))
        loader = spark._jvm.org.codehaus.commons.compiler.util.reflect.ByteArrayClassLoader(
            codes, parent)
        return _instance(spark, loader)
    except Exception as exc:  # (damaged, or made for another JVM): compiled anew
        log.debug("walberg's remembered Java helper %s does not load: %s", memo, exc)
        return None


@dataclass(frozen=True)
class FileInfo:
    """What the driver needs of one Iceberg content file (data file or delete file)."""

    location: str
    spec_id: int
    partition: str  # the partition's values as text: files of a partition share it
    records: int
    referenced: Optional[str] = None  # a deletion vector's data file
    offset: Optional[int] = None  # a deletion vector's blob, in its Puffin file
    length: Optional[int] = None
    format: str = "PARQUET"

    @property
    def group(self) -> tuple[int, str]:
        """Files that share a delete file: the same spec and partition."""
        return self.spec_id, self.partition


def info_of(row: Sequence[Any]) -> FileInfo:
    """A ``FileInfo`` from a row of ``Batch.describe``."""
    return FileInfo(row[0], int(row[1]), row[2], int(row[3]), row[4], row[5], row[6], row[7])


@dataclass(frozen=True)
class JavaFiles:
    """Iceberg content files held in the JVM as one Java list, with what the driver needs of
    each, read in one round trip."""

    java: Any  # a java.util.List of ContentFiles
    info: tuple[FileInfo, ...]

    @staticmethod
    def of(spark: Any, files: Any) -> "JavaFiles":
        """``files``: a Java list, array or Iterable of content files, or a Python list of
        them (converted one round trip each: for a few files only)."""
        helper = batch_helper(spark)
        java = helper.list(files)
        return JavaFiles(java, tuple(info_of(r) for r in json.loads(helper.describe(java))))

    @staticmethod
    def empty(spark: Any) -> "JavaFiles":
        return JavaFiles(spark._jvm.java.util.ArrayList(), ())

    def __len__(self) -> int:
        return len(self.info)

    def plus(self, spark: Any, other: "JavaFiles") -> "JavaFiles":
        """These files and then ``other``'s."""
        if not len(other):
            return self
        if not len(self):
            return other
        joined = spark._jvm.java.util.ArrayList(self.java)
        joined.addAll(other.java)
        return JavaFiles(joined, self.info + other.info)

    @property
    def locations(self) -> list[str]:
        return [f.location for f in self.info]

    @property
    def records(self) -> int:
        return sum(f.records for f in self.info)
