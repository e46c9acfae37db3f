"""Writing to Iceberg through Spark: create tables, load the initial copy, apply a staged batch
as one commit per table, and read back the LSN each table's last walberg commit covers.

Exactly once rests on one rule kept here: every commit walberg makes carries ``walberg.lsn`` (the
end LSN of the last source transaction it contains) in its snapshot summary, in the same atomic
commit as the data. What a table holds is therefore always known from the table itself.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from walberg.apply.batch import (
    DLQ_REASON,
    StagedTable,
    effective_truncate,
    seq_filter,
    value_column,
)
from walberg.apply.evolution import Step
from walberg.apply.spark import spark_call, with_commit_properties
from walberg.apply.types import TypeMap, quote, sql_string
from walberg.errors import ApplyError
from walberg.model import Column, Layout, Lsn

LSN_PROPERTY = "walberg.lsn"
# Marks of a chunked initial copy (see source.chunks): first, point, span, catchup.
COPY_PREFIX = "walberg.copy."
# walberg.offset.<topic>.<partition> = the next offset to read: what a Kafka source's commit
# covers, in the same snapshot as its data.
OFFSET_PROPERTY = "walberg.offset"
LSN_COLUMN = "_walberg_lsn"
SOURCE_COLUMN = "_walberg_source"  # with several sources fanning in to one table
OP_COLUMN = "_walberg_op"
# A changelog table's columns after the source's (and _walberg_lsn, the change's commit LSN).
CHANGELOG_COLUMNS = [(LSN_COLUMN, "BIGINT"), (OP_COLUMN, "STRING"), ("_walberg_seq", "BIGINT"),
                     ("_walberg_commit_ts", "TIMESTAMP"), ("_walberg_xid", "BIGINT"),
                     ("_walberg_unchanged", "STRING")]
DLQ_SUFFIX = "__dlq"
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


def _fill_unchanged(df: Any, keys: list[str], unchanged: list[int]) -> Any:
    """An UPDATE that left a TOASTed value untouched does not carry it. If an earlier change in
    the same batch carried it (an INSERT, or an UPDATE that set it), take the value from there;
    otherwise the mark stays and the MERGE keeps what the lake already has."""
    from pyspark.sql import Window
    from pyspark.sql.functions import col, expr, last, struct, when

    upto = (Window.partitionBy(*keys).orderBy(col("_wb_seq"))
            .rowsBetween(Window.unboundedPreceding, Window.currentRow))
    marks = col("_wb_unchanged")
    for i in unchanged:
        name = value_column(i)
        hit = marks.contains(f",{i},")
        carried = last(when(~hit | marks.isNull(), struct(col(name).alias("v"))), True).over(upto)
        df = (df.withColumn("_wb_fill", carried)
              .withColumn(name, when(hit & col("_wb_fill").isNotNull(), col("_wb_fill.v"))
                          .otherwise(col(name)))
              .withColumn("_wb_unchanged",
                          when(hit & col("_wb_fill").isNotNull(),
                               expr(f"nullif(replace(_wb_unchanged, ',{i},', ','), ',')"))
                          .otherwise(marks))
              .drop("_wb_fill"))
    return df


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


def quote_target(target: str) -> str:
    return ".".join(quote(p) for p in target.split("."))


class IcebergSink:
    def __init__(self, session: Any, types: Optional[TypeMap] = None,
                 source: Optional[str] = None) -> None:
        """``source``: this sink writes one of several sources that fan in to shared tables:
        its rows carry ``_walberg_source``, and its commits record their LSN as
        ``walberg.lsn.<source>``."""
        self.spark = session
        self.types = types or TypeMap()
        self.source = source
        self.lsn_property = LSN_PROPERTY if source is None else f"{LSN_PROPERTY}.{source}"
        self._schemas: dict[str, list[tuple[str, str]]] = {}
        self._dead_lsn: dict[str, Optional[Lsn]] = {}

    def sql(self, what: str, statement: str) -> Any:
        return spark_call(what, lambda: self.spark.sql(statement))

    def ensure_table(self, target: str, columns: Sequence[Column],
                     layout: Optional[Layout] = None) -> bool:
        """Create the Iceberg table for these source columns if it does not exist; True if made."""
        if self.table_exists(target):
            return False
        cols = ", ".join(f"{quote(c.name)} {self.types.spark_type(c, target).sql}"
                         for c in columns)
        if self.source is None:
            self._create(target, f"{cols}, {quote(LSN_COLUMN)} BIGINT", layout)
            return True
        # Shared by several sources: each one's rows in a partition of their own, so a copy or
        # a TRUNCATE replaces one source's rows without touching the others'.
        self._create(target, f"{cols}, {quote(LSN_COLUMN)} BIGINT, "
                             f"{quote(SOURCE_COLUMN)} STRING", self._shared(layout))
        return True

    def _shared(self, layout: Optional[Layout]) -> Layout:
        """A table shared by sources is partitioned by source first."""
        layout = layout or Layout()
        if self.source is None:
            return layout
        return Layout((SOURCE_COLUMN, *layout.partition_by), layout.properties,
                      layout.format_version, layout.write_mode, layout.schema_evolution,
                      layout.mode)

    def _create(self, target: str, columns: str, layout: Optional[Layout] = None) -> None:
        catalog, namespace, _ = target.split(".")
        self.sql(f"creating namespace {catalog}.{namespace}",
                 f"CREATE NAMESPACE IF NOT EXISTS {quote(catalog)}.{quote(namespace)}")
        props = ", ".join(f"'{k}'={sql_string(v)}" for k, v in table_properties(layout).items())
        parts = ""
        if layout is not None and layout.partition_by:
            parts = f" PARTITIONED BY ({', '.join(spark_transform(t) for t in layout.partition_by)})"
        self.sql(f"creating table {target}",
                 f"CREATE TABLE IF NOT EXISTS {quote_target(target)} ({columns}) "
                 f"USING iceberg{parts} TBLPROPERTIES ({props})")

    def ensure_changelog(self, target: str, columns: Sequence[Column],
                         layout: Optional[Layout] = None) -> bool:
        """Create a changelog table (one row per change) if it does not exist; True if made."""
        if self.table_exists(target):
            return False
        cols = ", ".join(f"{quote(c.name)} {self.types.spark_type(c, target).sql}"
                         for c in columns)
        meta = ", ".join(f"{quote(n)} {t}" for n, t in CHANGELOG_COLUMNS)
        self._create(target, f"{cols}, {meta}", layout)
        return True

    def append_copy(self, target: str, columns: Sequence[Column], files: Sequence[Path],
                    lsn: Lsn) -> None:
        """An initial copy into a changelog table: rows with _walberg_op 'snapshot', replacing
        those of any earlier copy, the append marked ``lsn``."""
        self.sql(f"replacing the earlier initial copy in {target}",
                 f"DELETE FROM {quote_target(target)} WHERE {quote(OP_COLUMN)} = 'snapshot'")
        df = self.spark.read.parquet(*[str(f) for f in files])
        rows = self._typed(df, target, columns, f"CAST({int(lsn)} AS BIGINT)", keep=[
            f"'snapshot' AS {quote(OP_COLUMN)}", "CAST(NULL AS BIGINT) AS `_walberg_seq`",
            "CAST(NULL AS TIMESTAMP) AS `_walberg_commit_ts`",
            "CAST(NULL AS BIGINT) AS `_walberg_xid`", "CAST(NULL AS STRING) AS `_walberg_unchanged`"])
        spark_call(f"writing the initial copy of {target}",
                   lambda: self._writer(rows, target, lsn).append())

    def append_changes(self, target: str, staged: StagedTable, lsn: Lsn, max_seq: int,
                       void: Sequence[tuple[int, int]],
                       txns: Sequence[tuple[int, int, int, int]], held: Optional[Lsn]) -> int:
        """Append one row per change (and per TRUNCATE) to a changelog table, in one commit
        marked ``lsn``. ``txns``: (commit LSN, xid, commit time in µs since 2000, first seq) of
        the batch's transactions; rows of transactions up to ``held`` are already there."""
        from pyspark.sql.functions import broadcast

        columns = staged.columns
        info = self.spark.createDataFrame(
            list(txns), "t_lsn BIGINT, t_xid BIGINT, t_ts BIGINT, t_first BIGINT")
        meta = [f"CASE _wb_op WHEN 'I' THEN 'insert' WHEN 'U' THEN 'update' "
                f"WHEN 'D' THEN 'delete' ELSE 'truncate' END AS {quote(OP_COLUMN)}",
                "_wb_seq - t_first AS `_walberg_seq`",
                "timestamp_micros(t_ts + 946684800000000) AS `_walberg_commit_ts`",
                "t_xid AS `_walberg_xid`"]
        names = [f"CASE WHEN _wb_unchanged LIKE '%,{i},%' THEN '{c.name.replace(chr(39), '')}' END"
                 for i, c in enumerate(columns) if i in staged.unchanged_columns]
        meta.append(f"nullif(concat_ws(',', {', '.join(names)}), '') AS `_walberg_unchanged`"
                    if names else "CAST(NULL AS STRING) AS `_walberg_unchanged`")
        parts = []
        if staged.files:
            df = self.spark.read.parquet(*[str(f) for f in staged.files])
            df = df.where(seq_filter(max_seq, void, []))
            if held is not None:
                df = df.where(f"_wb_lsn > {int(held)}")
            df = df.join(broadcast(info), df["_wb_lsn"] == info["t_lsn"], "left")
            parts.append(self._typed(df, target, columns, "_wb_lsn", keep=meta))
        cuts = [(seq, staged.truncate_lsns.get(seq, 0)) for seq in staged.truncates
                if seq <= max_seq and not any(lo <= seq <= hi for lo, hi in void)
                and (held is None or staged.truncate_lsns.get(seq, 0) > held)]
        if cuts:
            df = self.spark.createDataFrame(cuts, "_wb_seq BIGINT, _wb_lsn BIGINT")
            df = df.selectExpr("*", "'T' AS _wb_op", "CAST(NULL AS STRING) AS _wb_unchanged",
                               *[f"CAST(NULL AS {self.types.spark_type(c, target).staged_sql})"
                                 f" AS {value_column(i)}" for i, c in enumerate(columns)])
            df = df.join(broadcast(info), df["_wb_lsn"] == info["t_lsn"], "left")
            parts.append(self._typed(df, target, columns, "_wb_lsn", keep=meta))
        if not parts:
            return 0
        rows = parts[0]
        for extra in parts[1:]:
            rows = rows.unionByName(extra)
        rows = rows.cache()
        try:
            count = int(spark_call(f"appending changes to {target}", rows.count))
            if count:
                spark_call(f"appending changes to {target}",
                           lambda: self._writer(rows, target, lsn).append())
        finally:
            rows.unpersist()
        return count

    def partitioning(self, target: str) -> list[str]:
        """The table's current partition fields, normalised (see ``normal_transform``)."""
        rows = self.sql(f"describing {target}",
                        f"DESCRIBE TABLE EXTENDED {quote_target(target)}").collect()
        # Spark prints a spec of identity fields only as "# Partition Information" (one row per
        # column), any other as "# Partitioning" ("Part N" rows with the transform).
        out: list[str] = []
        section = ""
        for r in rows:
            name = (r["col_name"] or "").strip()
            if name in ("# Partitioning", "# Partition Information"):
                section = name
            elif section and (not name or (name.startswith("#") and name != "# col_name")):
                break
            elif section == "# Partitioning" and name.startswith("Part "):
                field = normal_transform(r["data_type"])
                if not field.startswith("void("):  # a field dropped from a v2 spec
                    out.append(field)
            elif section == "# Partition Information" and name != "# col_name":
                out.append(normal_transform(name))
        return out

    def align(self, target: str, layout: Layout) -> list[str]:
        """Evolve the partition spec and set the properties the layout asks for; returns what
        changed. A format version can only go up."""
        t = quote_target(target)
        done: list[str] = []
        layout = self._shared(layout)
        have = self.partitioning(target)
        want = [normal_transform(x) for x in layout.partition_by]
        if have != want:
            for field in [f for f in have if f not in want]:
                self.sql(f"evolving the partitioning of {target}",
                         f"ALTER TABLE {t} DROP PARTITION FIELD {spark_transform(field)}")
                done.append(f"drop partition field {field}")
            for field in [f for f in want if f not in have]:
                self.sql(f"evolving the partitioning of {target}",
                         f"ALTER TABLE {t} ADD PARTITION FIELD {spark_transform(field)}")
                done.append(f"add partition field {field}")
        rows = self.sql(f"reading the properties of {target}",
                        f"SHOW TBLPROPERTIES {t}").collect()
        current = {r["key"]: r["value"] for r in rows}
        changed = {}
        for key, value in table_properties(layout).items():
            if key == "format-version":
                now = int(current.get("format-version", "2"))
                if int(value) < now:
                    raise ApplyError(
                        f"{target} is Iceberg format version {now}; a table cannot go back to "
                        f"{value}. Set format_version: {now} for it in the pipeline file.")
                if int(value) == now:
                    continue
            if current.get(key) != value:
                changed[key] = value
        if changed:
            props = ", ".join(f"'{k}'={sql_string(v)}" for k, v in changed.items())
            self.sql(f"setting properties of {target}", f"ALTER TABLE {t} SET TBLPROPERTIES ({props})")
            done += [f"set {k}={v}" for k, v in changed.items()]
        self._schemas.pop(target, None)
        return done

    def columns_match(self, target: str, columns: Sequence[Column]) -> bool:
        """Whether the Iceberg table has exactly these source columns (names and types)."""
        want = [(c.name, self.types.spark_type(c, target).describe()) for c in columns]
        if self._schemas.get(target) != want:
            self._schemas[target] = self.schema(target)
        return self._schemas[target] == want

    def _marks(self, lsn: Lsn, marks: Optional[Mapping[str, str]]) -> Mapping[str, str]:
        """What a commit records of its source position: ``marks`` when given (a Kafka
        source's offsets), else this sink's LSN property."""
        return marks if marks is not None else {self.lsn_property: str(lsn)}

    def _writer(self, df: Any, target: str, lsn: Lsn,
                marks: Optional[Mapping[str, str]] = None) -> Any:
        """A DataFrameWriterV2 to ``target`` whose commit carries the position it covers."""
        writer = df.writeTo(quote_target(target))
        for key, value in self._marks(lsn, marks).items():
            writer = writer.option(f"snapshot-property.{key}", value)
        return writer

    def forget(self, target: str) -> None:
        """Drop what is cached about ``target`` (after a failed commit: read it afresh)."""
        self._schemas.pop(target, None)
        self._dead_lsn.pop(self.dead_letter_target(target), None)
        spark_call(f"refreshing {target}", lambda: self.spark.catalog.refreshTable(quote_target(target)))

    def schema(self, target: str) -> list[tuple[str, str]]:
        """The table's source columns as (name, Spark SQL type), in order."""
        fields = spark_call(f"reading the schema of {target}",
                            lambda: self.spark.table(quote_target(target)).schema).fields
        return [(f.name, f.dataType.simpleString()) for f in fields
                if not f.name.startswith("_walberg_")]

    def evolve(self, target: str, steps: Sequence[Step], after: dict[str, str]) -> None:
        """Apply schema steps (Iceberg metadata only: no data file is rewritten). ``after``
        places each added column after the named one, keeping the source's column order."""
        t = quote_target(target)
        self._schemas.pop(target, None)
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
            self.sql(f"evolving {target}: {step.describe()}", statement)

    def properties(self, target: str, prefix: str) -> dict[str, str]:
        """The table's properties whose key starts with ``prefix``."""
        rows = self.sql(f"reading the properties of {target}",
                        f"SHOW TBLPROPERTIES {quote_target(target)}").collect()
        return {r["key"]: r["value"] for r in rows if r["key"].startswith(prefix)}

    def set_property(self, target: str, key: str, value: Optional[str]) -> None:
        t = quote_target(target)
        if value is None:
            self.sql(f"updating {target}", f"ALTER TABLE {t} UNSET TBLPROPERTIES IF EXISTS ('{key}')")
        else:
            self.sql(f"updating {target}",
                     f"ALTER TABLE {t} SET TBLPROPERTIES ('{key}' = {sql_string(value)})")

    def fill(self, target: str, column: str, value_expr: str) -> None:
        """Give every row with no value in ``column`` the value ``value_expr`` (a column added
        in Postgres with a default: Postgres's existing rows have it, the stream never says)."""
        self.sql(f"filling {column} of {target} with its default",
                 f"UPDATE {quote_target(target)} SET {quote(column)} = {value_expr} "
                 f"WHERE {quote(column)} IS NULL")

    def table_exists(self, target: str) -> bool:
        return bool(spark_call(f"looking up {target}",
                               lambda: self.spark.catalog.tableExists(quote_target(target))))

    def committed_lsn(self, target: str) -> Optional[Lsn]:
        """The LSN covered by walberg's commits in the table's current history (the highest:
        a maintenance commit may carry an older one), or None when walberg has never committed
        to it (the initial copy is still owed). Read from the snapshots' summaries through
        Iceberg's API: table metadata only, no Spark job (this is asked at every start)."""
        if not self.table_exists(target):
            return None

        def read() -> Optional[Lsn]:
            best: Optional[Lsn] = None
            for summary in self._current_ancestry(target):
                value = summary.get(self.lsn_property)
                if value is not None:
                    lsn = Lsn.parse(value)
                    best = lsn if best is None else max(best, lsn)
            return best

        return spark_call(f"reading the snapshot history of {target}", read)

    def _iceberg_table(self, target: str) -> Any:
        """``target`` as an Iceberg Java table, refreshed (metadata on the driver only)."""
        table = self.spark._jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(
            self.spark._jsparkSession, quote_target(target))
        table.refresh()
        return table

    def _current_ancestry(self, target: str) -> Iterator[Any]:
        """The summary (a Java map) of the table's current snapshot and of each of its
        ancestors still held, newest first: what the ``history`` metadata table calls the
        current ancestors."""
        table = self._iceberg_table(target)
        snapshot = table.currentSnapshot()
        while snapshot is not None:
            yield snapshot.summary()
            parent = snapshot.parentId()
            snapshot = table.snapshot(parent) if parent is not None else None

    def _lsn_marks(self, target: str) -> dict[str, str]:
        """Every source's LSN and Kafka offset in the table's current history (the highest of
        each), so a maintenance commit can carry them all: expiring old snapshots then loses
        none."""
        t = quote_target(target)
        rows = self.sql(
            f"reading the snapshot history of {target}",
            f"SELECT e.key AS key, e.value AS value FROM {t}.snapshots s "
            f"JOIN {t}.history h ON s.snapshot_id = h.snapshot_id "
            f"LATERAL VIEW explode(s.summary) e AS key, value "
            f"WHERE h.is_current_ancestor AND (e.key = '{LSN_PROPERTY}' "
            f"OR e.key LIKE '{LSN_PROPERTY}.%' OR e.key LIKE '{OFFSET_PROPERTY}.%')").collect()
        best: dict[str, int] = {}
        for r in rows:
            key = r["key"]
            value = (int(r["value"]) if key.startswith(OFFSET_PROPERTY + ".")
                     else Lsn.parse(r["value"]))
            best[key] = max(best.get(key, value), value)
        return {k: (str(Lsn(v)) if k.startswith(LSN_PROPERTY) else str(v))
                for k, v in best.items()}

    def committed_offsets(self, target: str) -> dict[tuple[str, int], int]:
        """The next Kafka offset of each (topic, partition) the table's current history
        covers (empty for a table walberg has not committed Kafka records to)."""
        if not self.table_exists(target):
            return {}
        out: dict[tuple[str, int], int] = {}
        prefix = OFFSET_PROPERTY + "."
        for key, value in self._lsn_marks(target).items():
            if key.startswith(prefix):
                topic, _, partition = key[len(prefix):].rpartition(".")
                out[(topic, int(partition))] = int(value)
        return out

    def _own_rows(self) -> Any:
        """The rows a copy or TRUNCATE replaces: all, or this source's in a shared table."""
        from pyspark.sql.functions import col, lit

        return lit(True) if self.source is None else col(SOURCE_COLUMN) == lit(self.source)

    def files(self, target: str) -> dict[str, int]:
        """Data and delete files of the current snapshot, their bytes, and the snapshot count."""
        t = quote_target(target)
        rows = self.sql(f"listing the files of {target}",
                        f"SELECT content, count(*) AS n, coalesce(sum(file_size_in_bytes), 0) AS b "
                        f"FROM {t}.files GROUP BY content").collect()
        by = {r["content"]: (int(r["n"]), int(r["b"])) for r in rows}
        snaps = self.sql(f"counting snapshots of {target}",
                         f"SELECT count(*) AS n FROM {t}.snapshots").collect()[0]["n"]
        return {"data_files": by.get(0, (0, 0))[0],
                "delete_files": by.get(1, (0, 0))[0] + by.get(2, (0, 0))[0],
                "bytes": sum(b for _, b in by.values()), "snapshots": int(snaps)}

    def maintain(self, target: str, target_file_size: int, expire_older_than_ms: int,
                 retain_last: int, orphans_older_than_ms: int) -> dict[str, Any]:
        """Compact data files (applying position deletes), drop dangling deletes, rewrite
        manifests, expire old snapshots and remove orphan files. Commits that replace files
        carry the table's walberg.lsn, so what the lake holds stays known after expiry."""
        before = self.files(target)
        marks = self._lsn_marks(target)
        jvm = self.spark._jvm
        jspark = self.spark._jsparkSession
        # The actions look up helper catalogs through the JVM thread's active session, which a
        # py4j thread other than the one that built the session does not have.
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(jspark)
        actions = jvm.org.apache.iceberg.spark.actions.SparkActions.get(jspark)

        def table() -> Any:  # reloaded for each action: each one commits a new version
            return jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(jspark, quote_target(target))

        def marked(action: Any) -> Any:
            for key, value in marks.items():
                action = action.snapshotProperty(key, value)
            return action

        options = {"target-file-size-bytes": str(target_file_size), "min-input-files": "2",
                   "delete-file-threshold": "1", "remove-dangling-deletes": "true",
                   "partial-progress.enabled": "false"}
        rewrite = marked(actions.rewriteDataFiles(table()))
        for key, value in options.items():
            rewrite = rewrite.option(key, value)
        result = spark_call(f"compacting {target}", rewrite.execute)
        # Position deletes whose data files were just rewritten are void now: drop them.
        spark_call(f"dropping applied delete files of {target}",
                   marked(actions.rewritePositionDeletes(table()).option("rewrite-all", "true"))
                   .execute)
        spark_call(f"rewriting the manifests of {target}",
                   marked(actions.rewriteManifests(table())).execute)
        expired = spark_call(
            f"expiring snapshots of {target}",
            actions.expireSnapshots(table()).expireOlderThan(expire_older_than_ms)
            .retainLast(retain_last).execute)
        orphans = spark_call(
            f"removing orphan files of {target}",
            actions.deleteOrphanFiles(table()).olderThan(orphans_older_than_ms).execute)
        after = self.files(target)
        return {
            "table": target, "before": before, "after": after,
            "rewritten_data_files": int(result.rewrittenDataFilesCount()),
            "added_data_files": int(result.addedDataFilesCount()),
            "expired_snapshots": int(expired.deletedManifestListsCount()),
            "orphan_files_removed": sum(1 for _ in orphans.orphanFileLocations()),
        }

    def _typed(self, df: Any, target: str, columns: Sequence[Column], lsn_expr: str,
               keep: Sequence[str] = ()) -> Any:
        """The staged (or JDBC-read) ``c0..cN`` as the table's columns. Each goes through its
        type's ``convert``: a cast of text, and a no-op for a column staged typed already."""
        exprs = [f"{self.types.spark_type(c, target).convert.format(value_column(i))} "
                 f"AS {quote(c.name)}" for i, c in enumerate(columns)]
        exprs.append(f"{lsn_expr} AS {quote(LSN_COLUMN)}")
        if self.source is not None:
            exprs.append(f"'{self.source}' AS {quote(SOURCE_COLUMN)}")
        exprs.extend(keep)
        return df.selectExpr(*exprs)

    def load_copy(self, target: str, columns: Sequence[Column], files: Sequence[Path],
                  lsn: Lsn) -> None:
        """Replace the table's contents with the initial copy, in one commit marked ``lsn``."""
        df = self.spark.read.parquet(*[str(f) for f in files])
        typed = self._typed(df, target, columns, f"CAST({int(lsn)} AS BIGINT)")
        spark_call(
            f"writing the initial copy of {target}",
            lambda: self._writer(typed, target, lsn).overwrite(self._own_rows()),
        )

    def dead_letter_target(self, target: str) -> str:
        return target + DLQ_SUFFIX

    def _dead_letter_table(self, target: str, columns: Sequence[Column]) -> str:
        """``<target>__dlq``, created if missing, with what it holds known."""
        dlq = self.dead_letter_target(target)
        if dlq not in self._dead_lsn:
            if not self.table_exists(dlq):
                cols = ", ".join(f"{quote(c.name)} STRING" for c in columns)
                self._create(dlq, f"{cols}, {quote(OP_COLUMN)} STRING, {quote(LSN_COLUMN)} BIGINT, "
                                  f"{quote(DLQ_REASON)} STRING")
            self._dead_lsn[dlq] = self.committed_lsn(dlq)
        return dlq

    def load_chunk(self, target: str, columns: Sequence[Column], df: Any, lsn: Lsn,
                   marks: Mapping[str, str], *, first: bool, done: bool,
                   dead_span: Optional[tuple[str, Optional[int], Optional[int]]]
                   ) -> tuple[int, int]:
        """One chunk of a parallel initial copy (``df``: Postgres text in ``c0..cN``) in one
        commit carrying ``marks``; the first replaces the table's rows, the others append. Only
        the last (``done``) carries the LSN mark: until then the copy is still owed. Rows that
        cannot be written exactly go to the dead-letter table first, replacing what an earlier
        attempt at the same key span (``dead_span``: key column, low, high; None: none) left
        there.
        Returns (rows written, dead letters)."""
        from pyspark import StorageLevel

        checks = []
        for i, c in enumerate(columns):
            t = self.types.spark_type(c, target)
            if t.valid:
                checks.append(
                    f"CASE WHEN c{i} IS NOT NULL AND NOT c{i} RLIKE {sql_string(t.valid)} THEN "
                    f"concat({sql_string(f'column {c.name}: ' + chr(39))}, substring(c{i}, 1, 60),"
                    f" {sql_string(chr(39) + ' ' + t.why_invalid)}) END")
        dead = 0
        if checks:
            reason = f"nullif(concat_ws('; ', {', '.join(checks)}), '')"
            df = df.selectExpr("*", f"{reason} AS {DLQ_REASON}").persist(StorageLevel.MEMORY_AND_DISK)
            bad = df.where(f"{DLQ_REASON} IS NOT NULL")
            dead = int(spark_call(f"checking the initial copy of {target}", bad.count))
            dlq_known = self.table_exists(self.dead_letter_target(target))
            if dead or dlq_known:
                dlq = self._dead_letter_table(target, columns)
                where = f"{quote(OP_COLUMN)} = 'snapshot'"
                if not first:
                    if dead_span is None:
                        where = "false"
                    else:
                        key, lo, hi = dead_span
                        k = f"TRY_CAST({quote(key)} AS BIGINT)"
                        where += "".join([f" AND {k} >= {lo}" if lo is not None else "",
                                          f" AND {k} < {hi}" if hi is not None else ""])
                self.sql(f"replacing earlier initial-copy dead letters in {dlq}",
                         f"DELETE FROM {quote_target(dlq)} WHERE {where}")
                if dead:
                    rows = bad.selectExpr(
                        *[f"c{i} AS {quote(c.name)}" for i, c in enumerate(columns)],
                        f"'snapshot' AS {quote(OP_COLUMN)}",
                        f"CAST({int(lsn)} AS BIGINT) AS {quote(LSN_COLUMN)}",
                        f"{DLQ_REASON} AS {quote(DLQ_REASON)}")
                    spark_call(f"writing dead letters to {dlq}",
                               lambda: self._writer(rows, dlq, lsn).append())
                    self._dead_lsn[dlq] = lsn
            df = df.where(f"{DLQ_REASON} IS NULL")
        typed = self._typed(df, target, columns, f"CAST({int(lsn)} AS BIGINT)")
        writer = self._writer(typed, target, lsn,
                              {**marks, self.lsn_property: str(lsn)} if done else marks)
        try:
            if first:
                spark_call(f"writing the initial copy of {target}",
                           lambda: writer.overwrite(self._own_rows()))
            else:
                spark_call(f"writing the initial copy of {target}", writer.append)
            added = self.last_commit_records(target)
        finally:
            if checks:
                df.unpersist()
        return added, dead

    def copy_marks(self, target: str) -> list[dict[str, str]]:
        """The walberg.copy.* marks of the table's current history since the start of its last
        chunked copy, oldest first (empty when no chunked copy was started)."""
        if not self.table_exists(target):
            return []
        t = quote_target(target)
        rows = self.sql(
            f"reading the snapshot history of {target}",
            f"SELECT s.summary AS summary FROM {t}.snapshots s "
            f"JOIN {t}.history h ON s.snapshot_id = h.snapshot_id "
            f"WHERE h.is_current_ancestor ORDER BY s.committed_at, s.snapshot_id").collect()
        marks: list[dict[str, str]] = []
        for r in rows:
            summary = {k: v for k, v in (r["summary"] or {}).items() if k.startswith(COPY_PREFIX)}
            if summary.get(COPY_PREFIX + "first"):
                marks = []
            if summary:
                marks.append(summary)
        return marks

    def last_commit_records(self, target: str) -> int:
        """Records the table's latest commit added."""
        return self.last_commit(target).get("records", 0)

    def write_dead_letters(self, target: str, columns: Sequence[Column], path: Path, lsn: Lsn,
                           where: str = "true", snapshot: bool = False) -> int:
        """Append staged dead letters to ``<target>__dlq`` in one commit marked ``lsn``: the raw
        text of every column, the change's op and LSN, and the reason. Rows of transactions the
        dead-letter table already holds (a replay after a crash) are left out. ``snapshot``: the
        rows come from an initial copy and replace those of any earlier copy. Returns the rows
        written."""
        dlq = self._dead_letter_table(target, columns)
        held = self._dead_lsn[dlq]
        df = self.spark.read.parquet(str(path)).where(where)
        if snapshot:
            self.sql(f"replacing earlier initial-copy dead letters in {dlq}",
                     f"DELETE FROM {quote_target(dlq)} WHERE {quote(OP_COLUMN)} = 'snapshot'")
        elif held is not None:
            df = df.where(f"_wb_lsn > {int(held)}")
        exprs = [f"{value_column(i)} AS {quote(c.name)}" for i, c in enumerate(columns)]
        exprs += [f"CASE _wb_op WHEN 'I' THEN 'insert' WHEN 'U' THEN 'update' "
                  f"WHEN 'S' THEN 'snapshot' ELSE 'delete' END AS {quote(OP_COLUMN)}",
                  f"_wb_lsn AS {quote(LSN_COLUMN)}",
                  f"{DLQ_REASON} AS {quote(DLQ_REASON)}"]
        rows = df.selectExpr(*exprs)
        count = int(spark_call(f"counting dead letters for {target}", rows.count))
        if count:
            spark_call(f"writing dead letters to {dlq}",
                       lambda: self._writer(rows, dlq, lsn).append())
            self._dead_lsn[dlq] = lsn
        return count

    def apply(self, target: str, staged: StagedTable, lsn: Lsn, max_seq: int,
              void: Sequence[tuple[int, int]] = (),
              marks: Optional[Mapping[str, str]] = None, upsert: bool = False) -> None:
        """Apply one table's staged changes in one commit marked ``lsn`` (or ``marks``, see
        ``_marks``): the rows with ``_wb_seq <= max_seq`` outside the ``void`` ranges, after
        the last TRUNCATE that counts. ``upsert``: inserts are merged by key even when the
        batch only inserts (the table may hold some of them already)."""
        from pyspark.sql.functions import col, lit, max_by, struct

        columns = staged.columns
        truncate = effective_truncate(max_seq, void, staged.truncates)
        if staged.files:
            df = self.spark.read.parquet(*[str(f) for f in staged.files])
            df = df.where(seq_filter(max_seq, void, staged.truncates))
        else:
            df = None

        if staged.insert_only and df is not None and not upsert:
            typed = self._typed(df, target, columns, "_wb_lsn")
            spark_call(f"appending to {target}",
                       lambda: self._writer(typed, target, lsn, marks).append())
            return

        if df is not None and all(c.is_key for c in columns):
            # No key but the whole row (REPLICA IDENTITY FULL): the table is a multiset.
            self._apply_multiset(target, columns, df, lsn, truncated=truncate is not None,
                                 marks=marks)
            return

        keys = [value_column(i) for i, c in enumerate(columns) if c.is_key]
        before_netting = df
        if df is not None and not staged.unique_keys:
            if staged.unchanged_columns:
                df = _fill_unchanged(df, keys, sorted(staged.unchanged_columns))
            # The last change per key wins: a hash aggregate, no sort. (Skipped when staging
            # found no key twice: each row is then its key's last change already.)
            df = (df.groupBy(*keys)
                  .agg(max_by(struct(*[c for c in df.columns if c not in keys]), "_wb_seq")
                       .alias("_wb_last"))
                  .select(*keys, "_wb_last.*"))

        if truncate is not None:
            # A TRUNCATE voids everything before it: the table becomes exactly what follows.
            if df is None:
                empty = self.spark.table(quote_target(target)).where(lit(False))
                spark_call(f"truncating {target}",
                           lambda: self._writer(empty, target, lsn, marks)
                           .overwrite(self._own_rows()))
                return
            typed = self._typed(df.where(col("_wb_op") != "D"), target, columns, "_wb_lsn")
            spark_call(f"truncating and reloading {target}",
                       lambda: self._writer(typed, target, lsn, marks)
                       .overwrite(self._own_rows()))
            return

        assert df is not None
        typed = self._typed(df, target, columns, "_wb_lsn",
                            keep=["_wb_op", "_wb_unchanged", "_wb_seq"])
        if staged.moved_unchanged and before_netting is not None:
            typed = self._carry_moved(target, columns, staged, before_netting, typed)
        names = [c.name for c in columns] + [LSN_COLUMN]
        on = " AND ".join(f"t.{quote(c.name)} <=> s.{quote(c.name)}" for c in columns if c.is_key)
        if self.source is not None:
            on = f"t.{quote(SOURCE_COLUMN)} = '{self.source}' AND {on}"
            names.append(SOURCE_COLUMN)  # inserted with the row, never updated

        def assignment(i: int, name: str) -> str:
            if i in staged.unchanged_columns:
                # An untouched TOAST value was not sent: keep what the lake has.
                return (f"t.{quote(name)} = CASE WHEN s._wb_unchanged LIKE '%,{i},%' "
                        f"THEN t.{quote(name)} ELSE s.{quote(name)} END")
            return f"t.{quote(name)} = s.{quote(name)}"

        sets = ", ".join(assignment(i, n) for i, n in enumerate(names) if n != SOURCE_COLUMN)
        cols = ", ".join(quote(n) for n in names)
        vals = ", ".join(f"s.{quote(n)}" for n in names)
        self._merge(target, typed,
                    f"ON {on} "
                    f"WHEN MATCHED AND s._wb_op = 'D' THEN DELETE "
                    f"WHEN MATCHED THEN UPDATE SET {sets} "
                    f"WHEN NOT MATCHED AND s._wb_op <> 'D' THEN INSERT ({cols}) VALUES ({vals})",
                    lsn, marks)

    def _merge(self, target: str, source: Any, clauses: str, lsn: Lsn,
               marks: Optional[Mapping[str, str]]) -> None:
        """``MERGE INTO target t USING <source> s <clauses>`` in one commit marked ``lsn`` (or
        ``marks``). The source is a temporary view of this MERGE's own: views live in the
        Spark session, which the sources of a fan-in table share, each applying from its own
        thread, so a name derived from the target would let one source MERGE the other's
        batch."""
        view = f"walberg_batch_{uuid.uuid4().hex}"
        source.createOrReplaceTempView(view)
        statement = f"MERGE INTO {quote_target(target)} t USING {view} s {clauses}"
        try:
            spark_call(f"merging a batch into {target}",
                       lambda: with_commit_properties(self.spark, dict(self._marks(lsn, marks)),
                                                      lambda: self.spark.sql(statement)))
        finally:
            self.spark.catalog.dropTempView(view)

    def _apply_multiset(self, target: str, columns: Sequence[Column], df: Any, lsn: Lsn,
                        truncated: bool, marks: Optional[Mapping[str, str]] = None) -> None:
        """Apply a batch to a table identified by whole rows, where equal rows may repeat: per
        distinct row, the batch's inserts minus deletes change how many copies the lake holds.
        One MERGE deletes every copy of each changed row and inserts the new number of them
        (after a TRUNCATE, an overwrite with the batch's surviving rows)."""
        from pyspark.sql.functions import coalesce, col, explode, expr, lit, sequence
        from pyspark.sql.functions import max as max_
        from pyspark.sql.functions import sum as sum_

        names = [c.name for c in columns]
        rows = self._typed(df, target, columns, "_wb_lsn", keep=["_wb_op"])
        if self.source is not None:
            rows = rows.drop(SOURCE_COLUMN)
        delta = (rows.groupBy(*[quote(n) for n in names])
                 .agg(sum_(expr("CASE _wb_op WHEN 'I' THEN 1 WHEN 'D' THEN -1 ELSE 0 END"))
                      .alias("_d"), max_(col(quote(LSN_COLUMN))).alias("_lsn"))
                 .where("_d <> 0"))
        if truncated:
            counted = delta.withColumn("_n", col("_d"))
        else:
            lake = (self.spark.table(quote_target(target)).where(self._own_rows())
                    .groupBy(*[quote(n) for n in names]).count()
                    .select(*[col(quote(n)).alias(f"_l{i}") for i, n in enumerate(names)],
                            col("count").alias("_have")))
            on = None
            for i, n in enumerate(names):
                cond = delta[quote(n)].eqNullSafe(lake[f"_l{i}"])
                on = cond if on is None else on & cond
            counted = (delta.join(lake, on, "left")
                       .withColumn("_n", coalesce(col("_have"), lit(0)) + col("_d")))
        extra = ([f"'{self.source}' AS {quote(SOURCE_COLUMN)}"] if self.source is not None
                 else [])
        copies = (counted.where("_n > 0")
                  .withColumn("_copy", explode(sequence(lit(1), col("_n").cast("int"))))
                  .selectExpr(*[quote(n) for n in names], f"_lsn AS {quote(LSN_COLUMN)}",
                              *extra))
        if truncated:
            spark_call(f"truncating and reloading {target}",
                       lambda: self._writer(copies, target, lsn, marks)
                       .overwrite(self._own_rows()))
            return
        deleters = counted.selectExpr(*[quote(n) for n in names],
                                      f"CAST(NULL AS BIGINT) AS {quote(LSN_COLUMN)}",
                                      *([f"'{self.source}' AS {quote(SOURCE_COLUMN)}"]
                                        if self.source is not None else []),
                                      "'D' AS _kind")
        source = deleters.unionByName(copies.withColumn("_kind", lit("I")))
        on_sql = " AND ".join(f"t.{quote(n)} <=> s.{quote(n)}" for n in names)
        if self.source is not None:
            on_sql = f"t.{quote(SOURCE_COLUMN)} = '{self.source}' AND {on_sql}"
        all_names = names + [LSN_COLUMN] + ([SOURCE_COLUMN] if self.source is not None else [])
        cols = ", ".join(quote(n) for n in all_names)
        vals = ", ".join(f"s.{quote(n)}" for n in all_names)
        self._merge(target, source,
                    f"ON s._kind = 'D' AND {on_sql} WHEN MATCHED THEN DELETE "
                    f"WHEN NOT MATCHED AND s._kind = 'I' THEN INSERT ({cols}) VALUES ({vals})",
                    lsn, marks)

    # Key changes of one row within one batch that are followed through (a -> b -> c ...).
    MOVE_CHAIN = 4

    def _carry_moved(self, target: str, columns: Sequence[Column], staged: StagedTable,
                     rows: Any, typed: Any) -> Any:
        """An UPDATE that changed the key and left a TOASTed value unsent became a delete of
        the old key (sequence s-1) and an insert of the new one (s) that lacks the value. Take
        it from the old key as it stood just before: its last earlier change in the batch that
        carried the value, else the lake's row. Chains of key changes in one batch are
        followed ``MOVE_CHAIN`` links deep."""
        from pyspark.sql.functions import col, lit

        names = [c.name for c in columns]
        every = self._typed(rows, target, columns, "_wb_lsn",
                            keep=["_wb_op", "_wb_unchanged", "_wb_seq"])
        lake = (self.spark.table(quote_target(target)).where(self._own_rows())
                .select(*[quote(n) for n in names])
                .withColumn("_wb_seq", lit(-1).cast("bigint"))
                .withColumn("_wb_unchanged", lit(None).cast("string")))
        for _ in range(self.MOVE_CHAIN):
            every = self._fill_moved_once(columns, sorted(staged.unchanged_columns), every,
                                          lake).localCheckpoint()
        moved = "_wb_op = 'I' AND _wb_unchanged IS NOT NULL"
        seqs = typed.where(moved).select(col("_wb_seq").alias("_s"))
        fixed = every.join(seqs, every["_wb_seq"] == seqs["_s"]).drop("_s")
        return typed.where(f"NOT ({moved})").unionByName(fixed.select(*typed.columns))

    @staticmethod
    def _fill_moved_once(columns: Sequence[Column], unchanged: list[int], every: Any,
                         lake: Any) -> Any:
        from pyspark.sql.functions import col, expr, max_by, struct, when

        names = [c.name for c in columns]
        keys = [c.name for c in columns if c.is_key]
        links = every.where("_wb_op = 'D'").select(
            *[col(quote(k)).alias(f"_o{j}") for j, k in enumerate(keys)],
            (col("_wb_seq") + 1).alias("_m_seq"))
        history = every.where("_wb_op <> 'D'").select(
            *[quote(n) for n in names], "_wb_seq", "_wb_unchanged").unionByName(lake)
        is_moved = "_wb_op = 'I' AND _wb_unchanged IS NOT NULL"
        moved = every.where(is_moved)
        wanted = moved.select(col("_wb_seq").alias("_m")).join(links, col("_m") == col("_m_seq"))
        on = None
        for j, k in enumerate(keys):
            cond = history[quote(k)].eqNullSafe(wanted[f"_o{j}"])
            on = cond if on is None else on & cond
        assert on is not None
        joined = wanted.join(history, on & (history["_wb_seq"] < wanted["_m_seq"]))
        marks = col("_wb_unchanged")
        found = joined.groupBy("_m_seq").agg(*[
            max_by(struct(col(quote(names[i])).alias("v")),
                   when(marks.isNull() | ~marks.contains(f",{i},"), col("_wb_seq")))
            .alias(f"_f{i}") for i in unchanged])
        filled = moved.join(found, moved["_wb_seq"] == found["_m_seq"], "left")
        for i in unchanged:
            hit = col("_wb_unchanged").contains(f",{i},") & col(f"_f{i}").isNotNull()
            filled = (filled.withColumn(names[i], when(hit, col(f"_f{i}.v"))
                                        .otherwise(col(quote(names[i]))))
                      .withColumn("_wb_unchanged", when(hit, expr(
                          f"nullif(replace(_wb_unchanged, ',{i},', ','), ',')"))
                          .otherwise(col("_wb_unchanged"))))
        filled = filled.drop("_m_seq", *[f"_f{i}" for i in unchanged])
        return every.where(f"NOT ({is_moved})").unionByName(filled)

    def last_commit(self, target: str) -> dict[str, int]:
        """What the table's current snapshot added: bytes, data files and delete files (from
        its summary; Iceberg metadata only)."""
        def read() -> dict[str, int]:
            snapshot = self._iceberg_table(target).currentSnapshot()
            summary = dict(snapshot.summary()) if snapshot is not None else {}
            return {"bytes": int(summary.get("added-files-size", 0)),
                    "data_files": int(summary.get("added-data-files", 0)),
                    "delete_files": int(summary.get("added-delete-files", 0))
                    + int(summary.get("added-dvs", 0)),
                    "records": int(summary.get("added-records", 0))}

        return spark_call(f"reading the last commit of {target}", read)

    def count(self, target: str) -> int:
        return int(self.sql(f"counting {target}",
                            f"SELECT count(*) AS n FROM {quote_target(target)}").collect()[0]["n"])

    def history(self, target: str) -> list[dict[str, Any]]:
        t = quote_target(target)
        rows = self.sql(
            f"reading the history of {target}",
            f"SELECT h.made_current_at, s.snapshot_id, s.operation, h.is_current_ancestor, "
            f"s.summary['{self.lsn_property}'] AS lsn, s.summary['added-records'] AS added, "
            f"s.summary['deleted-records'] AS deleted, "
            f"s.summary['added-position-deletes'] AS pos_deletes "
            f"FROM {t}.history h JOIN {t}.snapshots s ON s.snapshot_id = h.snapshot_id "
            f"ORDER BY h.made_current_at",
        ).collect()
        return [r.asDict() for r in rows]

    def query(self, statement: str, limit: int) -> tuple[list[tuple[Any, ...]], list[str]]:
        df = self.sql("running the query", statement)
        rows = spark_call("running the query", lambda: df.limit(limit).collect())
        return [tuple(r) for r in rows], list(df.columns)

    def export(self, statement: str, fmt: str, output: Path, limit: Optional[int]) -> int:
        """Write a query's result to one file (csv with a header, JSON lines, or Parquet);
        Spark writes it, so the result never passes through Python. Returns the rows."""
        import shutil
        import tempfile

        df = self.sql("running the query", statement)
        if limit is not None:
            df = df.limit(limit)
        df = df.cache()
        rows = int(spark_call("running the query", df.count))
        work = Path(tempfile.mkdtemp(prefix=".walberg-export-", dir=output.parent))
        try:
            writer = df.coalesce(1).write.mode("overwrite").format(fmt)
            if fmt == "csv":
                writer = writer.option("header", "true")
            spark_call(f"writing the result to {output}", lambda: writer.save(str(work / "out")))
            [part] = sorted((work / "out").glob("part-*"))
            part.replace(output)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            df.unpersist()
        return rows


def pin_tables(statement: str, pins: dict[str, str]) -> str:
    """Add a time-travel clause (``VERSION AS OF 123``, ``TIMESTAMP AS OF '...'``) after every
    reference to each pinned table (catalog.namespace.table, parts optionally in backticks)."""
    import re

    for target, clause in pins.items():
        parts = [rf"(?:{re.escape(p)}|`{re.escape(p)}`)" for p in target.split(".")]
        pattern = r"(?<![\w.`])" + r"\.".join(parts) + r"(?![\w.`])"
        statement = re.sub(pattern, lambda m: f"{m.group(0)} {clause}", statement,  # noqa: B023
                           flags=re.IGNORECASE)
    return statement
