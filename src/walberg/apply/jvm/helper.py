"""walberg's own Java code in the driver's JVM: ``Batch.java`` beside this module, compiled when
first needed by Janino, the Java compiler Spark itself ships for its generated code.

Why: the driver reaches the JVM through py4j, and every call is a round trip (0.1-0.4 ms
here). A batch of a table partitioned by day writes hundreds of files, and describing each to
Iceberg, adding it to the row delta and reading the table's live files took 5-15 calls per
file; ``Batch`` does each of those steps for all files in one call, the values travelling as
one JSON string. No jar to build or ship, no JDK needed: only the JVM Spark runs in.
"""

from __future__ import annotations

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
    return found[1]


def _compile(spark: Any) -> Any:
    started = time.monotonic()
    jvm = spark._jvm
    gateway = spark.sparkContext._gateway
    try:
        compiler = jvm.org.codehaus.janino.SimpleCompiler()
        # The loader that loaded Iceberg sees Iceberg, Hadoop and Jackson.
        compiler.setParentClassLoader(
            jvm.org.apache.iceberg.Table._java_lang_class.getClassLoader())
        compiler.setTargetVersion(8)
        compiler.cook(_SOURCE.read_text(encoding="utf-8"))
        cls = compiler.getClassLoader().loadClass(_CLASS)
        made = cls.getDeclaredConstructor(gateway.new_array(jvm.java.lang.Class, 0)) \
            .newInstance(gateway.new_array(jvm.java.lang.Object, 0))
    except Exception as exc:
        from walberg.apply.jvm.spark import java_message

        raise ApplyError(f"compiling walberg's Java helper ({_SOURCE.name}) in the driver's "
                         f"JVM with Spark's Janino failed: {java_message(exc)}. Is Spark's "
                         "jars folder complete (janino-*.jar, commons-compiler-*.jar)?") from exc
    log.debug("walberg's Java helper compiled in %.2f s", time.monotonic() - started)
    return made


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
