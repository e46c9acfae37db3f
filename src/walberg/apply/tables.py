"""A table's shape in the lake: creating walberg's tables (mirrors, changelogs, dead-letter
tables) with their properties, evolving the partition spec and properties to the pipeline's
layout, and evolving the schema with the source's."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from walberg.apply.evolution import Step
from walberg.apply.jvm.calls import spark_call
from walberg.apply.session import (
    LSN_COLUMN,
    OP_COLUMN,
    SOURCE_COLUMN,
    LakeSession,
    quote_target,
)
from walberg.apply.types import quote, sql_string
from walberg.errors import ApplyError, StorageUnavailable
from walberg.model import Column, Layout

log = logging.getLogger("walberg")

# A changelog table's columns after the source's (and _walberg_lsn, the change's commit LSN).
CHANGELOG_COLUMNS = [(LSN_COLUMN, "BIGINT"), (OP_COLUMN, "STRING"), ("_walberg_seq", "BIGINT"),
                     ("_walberg_commit_ts", "TIMESTAMP"), ("_walberg_xid", "BIGINT"),
                     ("_walberg_unchanged", "STRING")]
TABLE_PROPERTIES = {
    "format-version": "2",
    # Updates and deletes write position deletes (merge-on-read) instead of rewriting data files.
    "write.merge.mode": "merge-on-read",
    "write.update.mode": "merge-on-read",
    "write.delete.mode": "merge-on-read",
    "write.parquet.compression-codec": "zstd",
    # Unpartitioned tables: no shuffle before writing; files are sized by the batch anyway.
    "write.distribution-mode": "none",
    "write.merge.distribution-mode": "none",
    "write.update.distribution-mode": "none",
    "write.delete.distribution-mode": "none",
    "walberg.managed": "true",
}


def table_properties(layout: Optional[Layout]) -> dict[str, str]:
    """The Iceberg table properties walberg sets: its defaults, then the layout's."""
    props = dict(TABLE_PROPERTIES)
    if layout is None:
        return props
    props["format-version"] = str(layout.format_version)
    for op in ("merge", "update", "delete"):
        props[f"write.{op}.mode"] = layout.write_mode
        if layout.partition_by:
            # Rows clustered by partition before writing: one file per partition and task,
            # instead of a file per partition in every task.
            props[f"write.{op}.distribution-mode"] = "hash"
    if layout.partition_by:
        props["write.distribution-mode"] = "hash"
        # Spark's writers sorted by partition within each task, one file open at a time.
        # Iceberg's default for an unsorted table is a file open per partition a task meets
        # (its "fanout" writer): with a megabyte or more of buffers each, a copy into a table
        # of thousands of partitions (hours over a year) ran the JVM out of memory.
        props["write.spark.fanout.enabled"] = "false"
    props.update(layout.properties)
    return props


_TRANSFORM_NAMES = {"year": "years", "month": "months", "day": "days", "hour": "hours"}


def normal_transform(text: str) -> str:
    """A partition transform in one spelling: ``bucket(16,id)``, ``days(ts)``, ``id``."""
    t = text.replace("`", "").replace(" ", "").lower()
    m = re.fullmatch(r"(\w+)\((.*)\)", t)
    if m is None:
        return t
    name, args = _TRANSFORM_NAMES.get(m.group(1), m.group(1)), m.group(2)
    return args if name == "identity" else f"{name}({args})"


def spark_transform(text: str) -> str:
    """A normalised transform as Spark SQL, with the column quoted."""
    t = normal_transform(text)
    m = re.fullmatch(r"(\w+)\((?:(\d+),)?(\w+)\)", t)
    if m is None:
        return quote(t)
    name, width, column = m.groups()
    return f"{name}({width}, {quote(column)})" if width else f"{name}({quote(column)})"


@dataclass(frozen=True)
class TableFacts:
    """What walberg checks of an existing table: its partition fields (normalised, see
    ``normal_transform``), properties, format version and columns (name, Spark SQL type)."""

    partitioning: list[str]
    properties: dict[str, str]
    format_version: int
    columns: list[tuple[str, str]]


def _partitioning(fields: list[list[str]]) -> list[str]:
    """The partition fields of a spec ([transform, source column] each), normalised; a field a
    v2 spec dropped (a void transform) is left out."""
    out: list[str] = []
    for transform, column in fields:
        m = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", str(transform))
        if m is None or m.group(1) == "void":
            continue
        name, width = m.groups()
        text = column if name == "identity" else (
            f"{name}({width},{column})" if width else f"{name}({column})")
        out.append(normal_transform(text))
    return out


def _facts_of(found: dict[str, Any]) -> TableFacts:
    """``TableFacts`` from the facts ``Batch.describe`` says."""
    from pyspark.sql.types import StructType

    struct = StructType.fromJson(found["struct"])
    return TableFacts(_partitioning(found["spec"]),
                      {str(k): str(v) for k, v in found["properties"].items()},
                      int(found["format"]),
                      [(f.name, f.dataType.simpleString()) for f in struct.fields])


class Tables:
    """DDL and evolution of the tables one sink writes. Keeps what it read of each table
    (``TableFacts``) until it changes the table, so that checking a batch's columns costs no
    Spark call while nothing changed. Facts are read through Iceberg's Java API: a table's
    metadata, without Spark SQL's parsing and planning (the first statements of a process
    cost seconds, and a run with nothing to apply makes no other)."""

    def __init__(self, lake: LakeSession) -> None:
        self.lake = lake
        self._facts: dict[str, TableFacts] = {}
        # Each table's marks as its facts were last read: (when the read began, LSN marks,
        # server mark); see marks_read_since.
        self._marks: dict[str, tuple[float, list[str], Optional[str]]] = {}
        self._told: set[str] = set()  # tables whose codec's caveat was said

    def _codec_caveat(self, target: str, layout: Optional[Layout]) -> None:
        """Say once per table and process what an lz4 table costs its readers and writes."""
        if layout is None or target in self._told or \
                layout.properties.get("write.parquet.compression-codec") != "lz4":
            return
        self._told.add(target)
        log.warning("%s: write.parquet.compression-codec is lz4. Spark writes lz4 Parquet with "
                    "Hadoop's framing, which DuckDB refuses and pyarrow (and so PyIceberg) "
                    "fails on for some files (\"Corrupt Lz4 compressed data\"); and walberg's "
                    "driver does not write lz4, so Spark writes every batch's new rows "
                    "(slower). Unless only Spark reads this table, set zstd (the default) or "
                    "snappy in the pipeline file (files already written keep theirs).", target)

    def describe(self, target: str) -> Optional[TableFacts]:
        """The table's facts, as last read (None: the table does not exist). A read takes the
        table's marks in the same call (``marks_read_since``)."""
        found = self._facts.get(target)
        if found is None:
            def read() -> Optional[dict[str, Any]]:
                from walberg.apply.jvm.helper import batch_helper

                said = batch_helper(self.lake.spark).describe(
                    self.lake.spark._jsparkSession, target, self.lake.lsn_property,
                    self.lake.server_property)
                return None if said is None else json.loads(said)

            read_at = time.monotonic()
            said = spark_call(f"reading the metadata of {target}", read)
            if said is not None:
                found = self._facts[target] = _facts_of(said["facts"])
                lsns, server = said["marks"]
                self._marks[target] = (read_at, [str(x) for x in lsns],
                                       None if server is None else str(server))
        return found

    def marks_read_since(self, target: str, since: float
                         ) -> Optional[tuple[list[str], Optional[str]]]:
        """The table's marks (``Batch.marks``: every LSN mark of its history, its newest server
        mark) as its facts were last read, if that read began at ``since`` (``time.monotonic``)
        or later; taken once. None: not read since then (read them from the table)."""
        held = self._marks.pop(target, None)
        if held is None or held[0] < since:
            return None
        return held[1], held[2]

    def exists(self, target: str) -> bool:
        return self.describe(target) is not None

    def read_already(self, target: str) -> bool:
        """Whether the table's facts are held (it existed when they were read)."""
        return target in self._facts

    def ensure_table(self, target: str, columns: Sequence[Column],
                     layout: Optional[Layout] = None,
                     properties: Optional[dict[str, str]] = None) -> bool:
        """Create the Iceberg table for these source columns if it does not exist; True if made.
        ``properties``: more table properties to make it with (not set on a table that is)."""
        self._codec_caveat(target, layout)
        self.forget(target)  # read afresh: someone else may have changed it since
        if self.exists(target):
            return False
        cols = ", ".join(f"{quote(c.name)} {self.lake.types.spark_type(c, target).sql}"
                         for c in columns)
        if self.lake.source is None:
            self.create(target, f"{cols}, {quote(LSN_COLUMN)} BIGINT", layout,
                        properties=properties)
            return True
        # Shared by several sources: each one's rows in a partition of their own, so a copy or
        # a TRUNCATE replaces one source's rows without touching the others'.
        self.create(target, f"{cols}, {quote(LSN_COLUMN)} BIGINT, "
                            f"{quote(SOURCE_COLUMN)} STRING", self.shared(layout),
                    properties=properties)
        return True

    def replace(self, target: str, columns: Sequence[Column],
                layout: Optional[Layout] = None) -> None:
        """Replace the table by an empty one with these source columns, in one commit to the
        catalog (``CREATE OR REPLACE TABLE``): the earlier snapshots stay in its metadata, for
        time travel, but none is current, so the table holds no rows and no walberg mark until
        a copy goes in. For a change of columns no schema update expresses (``walberg
        resync``); never a table shared by sources, whose other rows it would lose."""
        if self.lake.source is not None:
            raise ApplyError(f"{target} is shared by several sources: walberg does not replace "
                             "it (that would lose the other sources' rows)")
        cols = ", ".join(f"{quote(c.name)} {self.lake.types.spark_type(c, target).sql}"
                         for c in columns)
        self.create(target, f"{cols}, {quote(LSN_COLUMN)} BIGINT", layout, replace=True)

    def shared(self, layout: Optional[Layout]) -> Layout:
        """A table shared by sources is partitioned by source first."""
        layout = layout or Layout()
        if self.lake.source is None:
            return layout
        return Layout((SOURCE_COLUMN, *layout.partition_by), layout.properties,
                      layout.format_version, layout.write_mode, layout.schema_evolution,
                      layout.mode)

    def create(self, target: str, columns: str, layout: Optional[Layout] = None,
               replace: bool = False, properties: Optional[dict[str, str]] = None) -> None:
        """``CREATE TABLE IF NOT EXISTS`` (and its namespace) with walberg's properties;
        ``columns``: the column list as Spark SQL. ``replace``: ``CREATE OR REPLACE TABLE``."""
        self.forget(target)
        catalog, namespace, _ = target.split(".")
        self.ensure_namespace(catalog, namespace)
        props = ", ".join(f"'{k}'={sql_string(v)}"
                          for k, v in {**table_properties(layout), **(properties or {})}.items())
        parts = ""
        if layout is not None and layout.partition_by:
            parts = f" PARTITIONED BY ({', '.join(spark_transform(t) for t in layout.partition_by)})"
        if replace:
            self.lake.sql(f"replacing table {target}",
                          f"CREATE OR REPLACE TABLE {quote_target(target)} ({columns}) "
                          f"USING iceberg{parts} TBLPROPERTIES ({props})")
            self.forget(target)
            return
        _once_more(lambda: self.lake.sql(
            f"creating table {target}",
            f"CREATE TABLE IF NOT EXISTS {quote_target(target)} ({columns}) "
            f"USING iceberg{parts} TBLPROPERTIES ({props})"))

    def ensure_namespace(self, catalog: str, namespace: str) -> None:
        """``CREATE NAMESPACE IF NOT EXISTS``, tolerating another writer that created it at the
        same moment."""
        _once_more(lambda: self.lake.sql(
            f"creating namespace {catalog}.{namespace}",
            f"CREATE NAMESPACE IF NOT EXISTS {quote(catalog)}.{quote(namespace)}"))

    def ensure_changelog(self, target: str, columns: Sequence[Column],
                         layout: Optional[Layout] = None) -> bool:
        """Create a changelog table (one row per change) if it does not exist; True if made."""
        self._codec_caveat(target, layout)
        self.forget(target)
        if self.exists(target):
            return False
        cols = ", ".join(f"{quote(c.name)} {self.lake.types.spark_type(c, target).sql}"
                         for c in columns)
        meta = ", ".join(f"{quote(n)} {t}" for n, t in CHANGELOG_COLUMNS)
        self.create(target, f"{cols}, {meta}", layout)
        return True

    def partitioning(self, target: str) -> list[str]:
        """The table's current partition fields, normalised (see ``normal_transform``)."""
        return list(self._known(target).partitioning)

    def _known(self, target: str) -> TableFacts:
        found = self.describe(target)
        if found is None:
            raise ApplyError(f"{target} does not exist in the catalog: was it dropped while "
                             "walberg ran? Run walberg again to copy it anew.")
        return found

    def align(self, target: str, layout: Layout) -> list[str]:
        """Evolve the partition spec and set the properties the layout asks for; returns what
        changed. A format version can only go up."""
        layout = self.shared(layout)
        done = self._align_partitioning(target, layout)
        done += self._align_properties(target, layout)
        if done:
            self.forget(target)
        return done

    def _align_partitioning(self, target: str, layout: Layout) -> list[str]:
        t = quote_target(target)
        done: list[str] = []
        have = self.partitioning(target)
        want = [normal_transform(x) for x in layout.partition_by]
        if have == want:
            return done
        for field in [f for f in have if f not in want]:
            self.lake.sql(f"evolving the partitioning of {target}",
                          f"ALTER TABLE {t} DROP PARTITION FIELD {spark_transform(field)}")
            done.append(f"drop partition field {field}")
        for field in [f for f in want if f not in have]:
            self.lake.sql(f"evolving the partitioning of {target}",
                          f"ALTER TABLE {t} ADD PARTITION FIELD {spark_transform(field)}")
            done.append(f"add partition field {field}")
        return done

    def _align_properties(self, target: str, layout: Layout) -> list[str]:
        t = quote_target(target)
        facts = self._known(target)
        current = facts.properties
        changed = {}
        for key, value in table_properties(layout).items():
            if key == "format-version":
                now = facts.format_version
                if int(value) < now:
                    raise ApplyError(
                        f"{target} is Iceberg format version {now}; a table cannot go back to "
                        f"{value}. Set format_version: {now} for it in the pipeline file.")
                if int(value) == now:
                    continue
            if current.get(key) != value:
                changed[key] = value
        if not changed:
            return []
        props = ", ".join(f"'{k}'={sql_string(v)}" for k, v in changed.items())
        self.lake.sql(f"setting properties of {target}",
                      f"ALTER TABLE {t} SET TBLPROPERTIES ({props})")
        return [f"set {k}={v}" for k, v in changed.items()]

    def columns_match(self, target: str, columns: Sequence[Column]) -> bool:
        """Whether the Iceberg table has exactly these source columns (names and types)."""
        want = [(c.name, self.lake.types.spark_type(c, target).describe()) for c in columns]
        if self.schema(target) != want:
            self.forget(target)  # what was kept may be stale: decide on the table as it is
        return self.schema(target) == want

    def forget(self, target: str) -> None:
        """Drop what is kept of ``target``: the next check reads it afresh."""
        self._facts.pop(target, None)

    def schema(self, target: str) -> list[tuple[str, str]]:
        """The table's source columns as (name, Spark SQL type), in order."""
        return [(name, kind) for name, kind in self._known(target).columns
                if not name.startswith("_walberg_")]

    def evolve(self, target: str, steps: Sequence[Step], after: dict[str, str]) -> None:
        """Apply schema steps (Iceberg metadata only: no data file is rewritten). ``after``
        places each added column after the named one, keeping the source's column order."""
        t = quote_target(target)
        self.forget(target)
        for step in steps:
            if step.kind == "add":
                where = (f" AFTER {quote(after[step.name])}" if after.get(step.name)
                         else " FIRST")
                statement = f"ALTER TABLE {t} ADD COLUMN {quote(step.name)} {step.type}{where}"
            elif step.kind == "drop":
                statement = f"ALTER TABLE {t} DROP COLUMN {quote(step.name)}"
            elif step.kind == "rename":
                statement = (f"ALTER TABLE {t} RENAME COLUMN {quote(step.name)} TO "
                             f"{quote(step.new_name)}")
            else:
                statement = f"ALTER TABLE {t} ALTER COLUMN {quote(step.name)} TYPE {step.type}"
            self.lake.sql(f"evolving {target}: {step.describe()}", statement)

    def properties(self, target: str, prefix: str) -> dict[str, str]:
        """The table's properties whose key starts with ``prefix``."""
        return {k: v for k, v in self._known(target).properties.items() if k.startswith(prefix)}

    def set_property(self, target: str, key: str, value: Optional[str]) -> None:
        t = quote_target(target)
        self.forget(target)
        if value is None:
            self.lake.sql(f"updating {target}",
                          f"ALTER TABLE {t} UNSET TBLPROPERTIES IF EXISTS ('{key}')")
        else:
            self.lake.sql(f"updating {target}",
                          f"ALTER TABLE {t} SET TBLPROPERTIES ('{key}' = {sql_string(value)})")

    def fill(self, target: str, column: str, value_expr: str) -> None:
        """Give every row with no value in ``column`` the value ``value_expr`` (a column added
        in Postgres with a default: Postgres's existing rows have it, the stream never says)."""
        self.lake.sql(f"filling {column} of {target} with its default",
                      f"UPDATE {quote_target(target)} SET {quote(column)} = {value_expr} "
                      f"WHERE {quote(column)} IS NULL")


def _once_more(create: Callable[[], object]) -> None:
    """Run a ``CREATE ... IF NOT EXISTS`` again if it failed. Catalogs check, then insert (the
    jdbc catalog: a row in iceberg_namespace_properties or iceberg_tables): when two sources
    create the same namespace or table at once, the loser's insert fails on the catalog's
    unique key, although what it wanted now exists. The second try sees it and does nothing;
    a failure for any other reason fails again and is raised then."""
    try:
        create()
    except StorageUnavailable:
        raise  # an outage, not a race: the watch has waited already
    except ApplyError:
        create()
