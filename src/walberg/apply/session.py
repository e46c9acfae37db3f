"""What every part of the Iceberg sink shares: the Spark session, the source's name when several
sources fan in to one table, the columns walberg reserves in a table, the snapshot-summary keys
that say what a commit covers, and the writer that puts those keys on every commit.

Exactly once rests on one rule kept here: every commit walberg makes carries ``walberg.lsn`` (the
end LSN of the last source transaction it contains) in its snapshot summary, in the same atomic
commit as the data. What a table holds is therefore always known from the table itself.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Container, Mapping, Optional, Sequence, TypeVar

from walberg.apply.batch import value_column
from walberg.apply.jvm.calls import spark_call
from walberg.apply.staging import StageArea
from walberg.apply.types import TypeMap, quote
from walberg.model import Column, Lsn

T = TypeVar("T")
R = TypeVar("R")

LSN_PROPERTY = "walberg.lsn"
# The source server a commit's LSN belongs to: "<system identifier>/<timeline>" (a promoted
# standby shares the system, on a later timeline).
SERVER_PROPERTY = "walberg.server"
# The commit LSN of the first source transaction whose changes a streamed commit holds: all it
# holds ended after this position, so the table's snapshot before it holds the table as the
# source was at every position from that snapshot's LSN up to this one (lake.query's
# consistent cut reads it; a commit without it is known only at its own LSN).
FROM_PROPERTY = "walberg.from-lsn"
# Marks of a chunked initial copy (see source.chunks): first, xmin, point, span (and
# catchup, in a copy an older walberg resumed).
COPY_PREFIX = "walberg.copy."
# A table property: the table is owed a copy from at least this LSN (a slot made anew, or
# `walberg resync`), said in the lake before the copy starts; held until a commit's LSN
# reaches it, so a copy cut short is made again, not forgotten.
COPY_OWED_PROPERTY = "walberg.copy-owed"
# walberg.offset.<topic>.<partition> = the next offset to read: what a Kafka source's commit
# covers, in the same snapshot as its data.
OFFSET_PROPERTY = "walberg.offset"
# walberg.offsets-past (a table property, JSON: {"snapshot": id, "offsets": [[topic, partition,
# offset], ...]}): Kafka offsets the table's commits need not cover, read after the commit
# that covers the records before them and holding nothing to commit (a transaction's commit
# marker, a tombstone, records sent to the dead letters). Valid while that snapshot is the
# table's current one or an ancestor of it; no snapshot is made for them (no rows).
OFFSETS_PAST_PROPERTY = "walberg.offsets-past"
LSN_COLUMN = "_walberg_lsn"
SOURCE_COLUMN = "_walberg_source"  # with several sources fanning in to one table
OP_COLUMN = "_walberg_op"
DLQ_SUFFIX = "__dlq"


def offsets_past(value: Optional[str], ancestry: Container[int]) -> dict[tuple[str, int], int]:
    """The offsets a ``walberg.offsets-past`` value passes, if the snapshot it was written at
    is among ``ancestry`` (the table's current snapshot and its ancestors), else none (the
    table was rolled back past it)."""
    if not value:
        return {}
    past = json.loads(value)
    if past.get("snapshot") not in ancestry:
        return {}
    return {(str(t), int(p)): int(o) for t, p, o in past.get("offsets", [])}


def offsets_past_value(snapshot: int, offsets: dict[tuple[str, int], int]) -> str:
    """The ``walberg.offsets-past`` value for ``offsets`` at ``snapshot``."""
    return json.dumps({"snapshot": snapshot,
                       "offsets": [[t, p, o] for (t, p), o in sorted(offsets.items())]})


def quote_target(target: str) -> str:
    """``catalog.namespace.table`` with each part quoted for Spark SQL."""
    return ".".join(quote(p) for p in target.split("."))


def java_table(spark: Any, target: str) -> Any:
    """``target`` as an Iceberg Java table, refreshed: its metadata, read on the driver, with
    no Spark job and none of Spark SQL's parsing and planning (one round trip)."""
    from walberg.apply.jvm.helper import batch_helper

    return batch_helper(spark).table(spark._jsparkSession, target, False)


def java_properties(spark: Any, table: Any) -> dict[str, str]:
    """An Iceberg Java table's properties, as Python strings (in one round trip)."""
    from walberg.apply.jvm.helper import batch_helper

    return {str(k): str(v) for k, v in json.loads(batch_helper(spark).properties(table)).items()}


def java_items(items: Any) -> list[Any]:
    """The elements of a Java list. Not by Python's iteration of it: py4j ends that with a
    Java exception, which PySpark converts at the cost of a dozen more round trips."""
    return [items.get(i) for i in range(int(items.size()))]


def jvm_map(call: Callable[[T], R], items: Sequence[T], threads: int = 4) -> list[R]:
    """``call`` over ``items``, in order; in ``threads`` Python threads when there are many.
    For many small JVM calls per item (describing hundreds of files): each call is a round
    trip to the JVM, and each Python thread has a JVM thread of its own (PySpark's pinned
    threads), so the round trips and the JVM's work overlap."""
    if len(items) < threads:
        return [call(item) for item in items]
    with ThreadPoolExecutor(threads, thread_name_prefix="walberg-jvm") as pool:
        return list(pool.map(call, items))


def side_by_side(call: Callable[..., None], items: Sequence[tuple[Any, ...]],
                 width: int) -> None:
    """``call(*item)`` for each of ``items``, ``width`` at a time in Python threads of their own
    (each with a JVM thread of its own): for work on independent tables, mostly round trips
    and commits. After a failure no further item starts; those under way finish, and the
    first failure in the items' order is raised."""
    if width <= 1 or len(items) <= 1:
        for item in items:
            call(*item)
        return
    failed = threading.Event()

    def one(item: tuple[Any, ...]) -> None:
        if failed.is_set():
            return
        try:
            call(*item)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(min(width, len(items)), thread_name_prefix="walberg-tables") as pool:
        done = [pool.submit(one, item) for item in items]
    for future in done:
        future.result()


def find_java_table(spark: Any, target: str) -> Optional[Any]:
    """``target`` as an Iceberg Java table (see ``java_table``), or None if it does not exist."""
    from walberg.apply.jvm.helper import batch_helper

    return batch_helper(spark).table(spark._jsparkSession, target, True)


class LakeSession:
    """The Spark session and the source one sink writes for, shared by the sink's helpers."""

    def __init__(self, spark: Any, types: Optional[TypeMap] = None,
                 source: Optional[str] = None, stage_root: Optional[str] = None) -> None:
        """``source``: the sink writes one of several sources that fan in to shared tables: its
        rows carry ``_walberg_source``, and its commits record their LSN as
        ``walberg.lsn.<source>``. ``stage_root``: where staged files are uploaded for the
        executors (None: they read them from the driver's disk; see ``apply.staging``)."""
        self.spark = spark
        self.types = types or TypeMap()
        self.source = source
        self.lsn_property = LSN_PROPERTY if source is None else f"{LSN_PROPERTY}.{source}"
        self.server_property = (SERVER_PROPERTY if source is None
                                else f"{SERVER_PROPERTY}.{source}")
        self.from_property = FROM_PROPERTY if source is None else f"{FROM_PROPERTY}.{source}"
        self.owed_property = (COPY_OWED_PROPERTY if source is None
                              else f"{COPY_OWED_PROPERTY}.{source}")
        self.server: Optional[str] = None  # recorded with each LSN, once the source is met
        self.staging = StageArea(spark, stage_root)
        # The summary of the snapshot each table's last row delta made, for that commit's
        # metrics (``Snapshots.last_commit`` takes it instead of loading the table again).
        self.last_summaries: dict[str, Mapping[str, str]] = {}

    def read_staged(self, files: Sequence[Path]) -> Any:
        """A DataFrame of staged Parquet files that every executor can read."""
        return self.staging.read(files)

    def sql(self, what: str, statement: str) -> Any:
        return spark_call(what, lambda: self.spark.sql(statement))

    def table_exists(self, target: str) -> bool:
        return bool(spark_call(f"looking up {target}",
                               lambda: self.spark.catalog.tableExists(quote_target(target))))

    def refresh(self, target: str) -> None:
        """Drop what Spark caches of ``target``: its next read sees the table afresh."""
        spark_call(f"refreshing {target}",
                   lambda: self.spark.catalog.refreshTable(quote_target(target)))

    def own_rows(self) -> Any:
        """The rows a copy or TRUNCATE replaces: all, or this source's in a shared table."""
        from pyspark.sql.functions import col, lit

        return lit(True) if self.source is None else col(SOURCE_COLUMN) == lit(self.source)

    def marks(self, lsn: Lsn, marks: Optional[Mapping[str, str]],
              since: Optional[Lsn] = None) -> Mapping[str, str]:
        """What a commit records of its source position: ``marks`` when given (a Kafka
        source's offsets), else this sink's LSN property (and ``since``, the commit LSN of the
        first transaction it holds: see ``FROM_PROPERTY``)."""
        if marks is not None:
            return marks
        found = {self.lsn_property: str(lsn)}
        if self.server is not None:
            found[self.server_property] = self.server
        if since is not None:
            found[self.from_property] = str(since)
        return found

    def writer(self, df: Any, target: str, lsn: Lsn,
               marks: Optional[Mapping[str, str]] = None) -> Any:
        """A DataFrameWriterV2 to ``target`` whose commit carries the position it covers."""
        writer = df.writeTo(quote_target(target))
        for key, value in self.marks(lsn, marks).items():
            writer = writer.option(f"snapshot-property.{key}", value)
        return writer

    def typed(self, df: Any, target: str, columns: Sequence[Column], lsn_expr: str,
              keep: Sequence[str] = (), text: bool = False) -> Any:
        """The staged ``c0..cN`` as the table's columns. Each goes through its type's
        ``convert``: a cast of text, and a no-op for a column staged typed already. ``text``:
        the columns are Postgres's text, not staged (a copy read over JDBC)."""
        exprs = [f"{self._convert(c, target, text).format(value_column(i))} "
                 f"AS {quote(c.name)}" for i, c in enumerate(columns)]
        exprs.append(f"{lsn_expr} AS {quote(LSN_COLUMN)}")
        if self.source is not None:
            exprs.append(f"'{self.source}' AS {quote(SOURCE_COLUMN)}")
        exprs.extend(keep)
        return df.selectExpr(*exprs)

    def _convert(self, column: Column, target: str, text: bool) -> str:
        t = self.types.spark_type(column, target)
        return t.from_text if text else t.convert
