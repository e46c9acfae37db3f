"""Writing to a table, each write one commit that carries the position it covers: the initial
copy (whole, or chunk by chunk), a staged batch (appended, or MERGEd by key, or as a multiset of
whole rows), a changelog table's rows, and the dead-letter table ``<target>__dlq`` of rows that
cannot be written exactly."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import pyarrow as pa

from walberg.apply import copyfiles
from walberg.apply.batch import (
    DLQ_REASON,
    OP_LABEL_SQL,
    StagedTable,
    effective_truncate,
    seq_filter,
    value_column,
)
from walberg.apply.jvm.spark import one_commit_at_a_time, spark_call, with_commit_properties
from walberg.apply.position.keycodec import ByMerge
from walberg.apply.position.keyed import KeyedApply
from walberg.apply.position.partitions import NotHere
from walberg.apply.session import (
    COPY_PREFIX,
    DLQ_SUFFIX,
    LSN_COLUMN,
    OP_COLUMN,
    SOURCE_COLUMN,
    LakeSession,
    quote_target,
)
from walberg.apply.snapshots import Snapshots
from walberg.apply.tables import Tables
from walberg.apply.types import quote, sql_string
from walberg.model import Column, Lsn, Op

log = logging.getLogger("walberg")


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


def _net(df: Any, staged: StagedTable) -> Any:
    """The last change per key of a batch, each carrying the TOASTed values an earlier change
    of the batch carried (see ``_fill_unchanged``). A hash aggregate, no sort; skipped when
    staging found no key twice, each row then being its key's last change already."""
    keys = [value_column(i) for i, c in enumerate(staged.columns) if c.is_key]
    if staged.unchanged_columns:
        df = _fill_unchanged(df, keys, sorted(staged.unchanged_columns))
    return _last_change(df, keys)


def _last_change(df: Any, keys: Sequence[str]) -> Any:
    """Each key's change with the highest ``_wb_seq`` (``keys``: column names as Spark SQL
    takes them)."""
    from pyspark.sql.functions import col, max_by, struct

    names = [k.strip("`") for k in keys]
    rest = [c for c in df.columns if c not in names]
    return (df.groupBy(*[col(k) for k in keys])
            .agg(max_by(struct(*[col(f"`{c}`") for c in rest]), "_wb_seq").alias("_wb_last"))
            .select(*[col(k) for k in keys], "_wb_last.*"))


class Writes:
    """Every commit of data to the tables one sink writes. Keeps what each dead-letter table
    already holds (the LSN of its last commit), so a replayed batch adds no dead letter twice."""

    def __init__(self, lake: LakeSession, tables: Tables, snapshots: Snapshots,
                 keyed: Optional[KeyedApply] = None) -> None:
        self.lake = lake
        self.tables = tables
        self.snapshots = snapshots
        self.keyed = keyed if keyed is not None else KeyedApply(lake, tables, None)
        self._dead_lsn: dict[str, Optional[Lsn]] = {}

    def forget(self, target: str) -> None:
        """Drop what is kept of ``target`` and its dead-letter table: the next write reads them
        afresh."""
        self._dead_lsn.pop(self.dead_letter_target(target), None)
        self.keyed.forget(target)

    def append_copy(self, target: str, columns: Sequence[Column], files: Sequence[Path],
                    lsn: Lsn) -> None:
        """An initial copy into a changelog table: rows with _walberg_op 'snapshot', replacing
        those of any earlier copy, the append marked ``lsn``."""
        self.lake.sql(f"replacing the earlier initial copy in {target}",
                      f"DELETE FROM {quote_target(target)} WHERE {quote(OP_COLUMN)} = 'snapshot'")
        df = self.lake.read_staged(files)
        rows = self.lake.typed(df, target, columns, f"CAST({int(lsn)} AS BIGINT)", keep=[
            f"'snapshot' AS {quote(OP_COLUMN)}", "CAST(NULL AS BIGINT) AS `_walberg_seq`",
            "CAST(NULL AS TIMESTAMP) AS `_walberg_commit_ts`",
            "CAST(NULL AS BIGINT) AS `_walberg_xid`", "CAST(NULL AS STRING) AS `_walberg_unchanged`"])
        spark_call(f"writing the initial copy of {target}",
                   lambda: self.lake.writer(rows, target, lsn).append())

    def append_changes(self, target: str, staged: StagedTable, lsn: Lsn, max_seq: int,
                       void: Sequence[tuple[int, int]],
                       txns: Sequence[tuple[int, int, int, int]], held: Optional[Lsn]) -> int:
        """Append one row per change (and per TRUNCATE) to a changelog table, in one commit
        marked ``lsn``. ``txns``: (commit LSN, xid, commit time in µs since 2000, first seq) of
        the batch's transactions; rows of transactions up to ``held`` are already there."""
        from pyspark.sql.functions import broadcast

        columns = staged.columns
        info = self.lake.spark.createDataFrame(
            list(txns), "t_lsn BIGINT, t_xid BIGINT, t_ts BIGINT, t_first BIGINT")
        meta = [f"{OP_LABEL_SQL} AS {quote(OP_COLUMN)}",
                "_wb_seq - t_first AS `_walberg_seq`",
                "timestamp_micros(t_ts + 946684800000000) AS `_walberg_commit_ts`",
                "t_xid AS `_walberg_xid`"]
        names = [f"CASE WHEN _wb_unchanged LIKE '%,{i},%' THEN '{c.name.replace(chr(39), '')}' END"
                 for i, c in enumerate(columns) if i in staged.unchanged_columns]
        meta.append(f"nullif(concat_ws(',', {', '.join(names)}), '') AS `_walberg_unchanged`"
                    if names else "CAST(NULL AS STRING) AS `_walberg_unchanged`")
        parts = []
        if staged.files:
            df = self.lake.read_staged(staged.files)
            df = df.where(seq_filter(max_seq, void, []))
            if held is not None:
                df = df.where(f"_wb_lsn >= {int(held)}")
            df = df.join(broadcast(info), df["_wb_lsn"] == info["t_lsn"], "left")
            parts.append(self.lake.typed(df, target, columns, "_wb_lsn", keep=meta))
        cuts = [(seq, staged.truncate_lsns.get(seq, 0)) for seq in staged.truncates
                if seq <= max_seq and not any(lo <= seq <= hi for lo, hi in void)
                and (held is None or staged.truncate_lsns.get(seq, 0) >= held)]
        if cuts:
            df = self.lake.spark.createDataFrame(cuts, "_wb_seq BIGINT, _wb_lsn BIGINT")
            df = df.selectExpr("*", f"'{Op.TRUNCATE.value}' AS _wb_op",
                               "CAST(NULL AS STRING) AS _wb_unchanged",
                               *[f"CAST(NULL AS {self.lake.types.spark_type(c, target).staged_sql})"
                                 f" AS {value_column(i)}" for i, c in enumerate(columns)])
            df = df.join(broadcast(info), df["_wb_lsn"] == info["t_lsn"], "left")
            parts.append(self.lake.typed(df, target, columns, "_wb_lsn", keep=meta))
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
                           lambda: one_commit_at_a_time(
                               target, lambda: self.lake.writer(rows, target, lsn).append()))
        finally:
            rows.unpersist()
        return count

    def load_copy(self, target: str, columns: Sequence[Column], files: Sequence[Path],
                  lsn: Lsn, on_driver: bool = True) -> None:
        """Replace the table's contents with the initial copy, in one commit marked ``lsn``:
        written on the driver when staging left every column in its type (apply.copyfiles),
        else by Spark. ``on_driver``: False when ``copy_here`` or ``write_copy_parts`` has
        already found (and said) that this table's copy is Spark's."""
        copied = copyfiles.write_copy(
            self.lake, self.tables, target, columns, files, lsn, self.lake.marks(lsn, None),
            lambda: self.keyed.keys_as_written(target, columns)) if on_driver else None
        if copied is not None:
            self.lake.refresh(target)
        else:
            df = self.lake.read_staged(files)
            typed = self.lake.typed(df, target, columns, f"CAST({int(lsn)} AS BIGINT)")
            spark_call(
                f"writing the initial copy of {target}",
                lambda: self.lake.writer(typed, target, lsn).overwrite(self.lake.own_rows()),
            )
        spark_call(f"indexing the keys of {target}",
                   lambda: self.keyed.prepare(target, columns, copied))

    def copy_here(self, target: str, columns: Sequence[Column],
                  staged: Sequence[pa.DataType]) -> bool:
        """Whether a copy staged in these column types is written on the driver as it is read
        (``write_copy_parts``); if not, the log says why and the copy is staged for
        ``load_copy``."""
        why = copyfiles.why_not_here(self.lake, self.tables, target, columns, [staged])
        if why is not None:
            log.info("initial copy of %s: staged for Spark, because %s", target, why)
        return why is None

    def write_copy_parts(self, target: str, columns: Sequence[Column],
                         parts: Iterable[pa.Table], lsn: Lsn,
                         scratch: Path) -> Optional[copyfiles.CopyFiles]:
        """The copy's rows as they are read (tables of ``c0..cN``) written as the table's data
        files, for ``commit_copy``; None (nothing written, the log says why) if this table's
        rows turn out to need Spark."""
        try:
            return copyfiles.write_files(self.lake, target, columns, parts, lsn, scratch,
                                         self.keyed.keys_as_written(target, columns))
        except NotHere as exc:
            log.info("initial copy of %s: staged for Spark after all, because %s", target, exc)
            return None

    def commit_copy(self, files: copyfiles.CopyFiles, columns: Sequence[Column],
                    lsn: Lsn) -> None:
        """Replace the table's rows with the copy's written files, in one commit marked
        ``lsn``."""
        copyfiles.commit(self.lake, files, self.lake.marks(lsn, None))
        self.lake.refresh(files.target)
        spark_call(f"indexing the keys of {files.target}",
                   lambda: self.keyed.prepare(files.target, columns, files))

    def dead_letter_target(self, target: str) -> str:
        return target + DLQ_SUFFIX

    def _dead_letter_table(self, target: str, columns: Sequence[Column]) -> tuple[str, list[str]]:
        """``<target>__dlq``, created if missing, with what it holds known, and the select
        expressions (NULLs) for its columns that ``columns`` lack. It follows the table's
        columns as they are added (as text) and keeps those dropped since. Beside a table
        several sources fan in to, its rows say their source (``_walberg_source``, added to a
        table made before), so that one source's copy replaces its own earlier copy's dead
        letters, never another's."""
        dlq = self.dead_letter_target(target)
        shared = self.lake.source is not None
        if dlq not in self._dead_lsn:
            if not self.lake.table_exists(dlq):
                cols = ", ".join(f"{quote(c.name)} STRING" for c in columns)
                own = f", {quote(SOURCE_COLUMN)} STRING" if shared else ""
                self.tables.create(dlq, f"{cols}, {quote(OP_COLUMN)} STRING, "
                                        f"{quote(LSN_COLUMN)} BIGINT, {quote(DLQ_REASON)} STRING"
                                        f"{own}")
            self._dead_lsn[dlq] = self.snapshots.committed_lsn(dlq)
        facts = self.tables.describe(dlq)
        held = [] if facts is None else [n for n, _ in facts.columns]
        wanted = [c.name for c in columns] + ([SOURCE_COLUMN] if shared else [])
        missing = [n for n in wanted if n not in held]
        if facts is not None and missing:
            self.lake.sql(f"adding {', '.join(missing)} to {dlq}",
                          f"ALTER TABLE {quote_target(dlq)} ADD COLUMNS ("
                          + ", ".join(f"{quote(n)} STRING" for n in missing) + ")")
            self.tables.forget(dlq)
        given = {c.name for c in columns} | {OP_COLUMN, LSN_COLUMN, DLQ_REASON, SOURCE_COLUMN}
        return dlq, [f"CAST(NULL AS STRING) AS {quote(n)}" for n in held if n not in given]

    def _dead_letters_of_this_source(self) -> tuple[str, list[str]]:
        """A dead-letter table's rows of this sink's source (an SQL condition) and the column
        that says so (the select expressions), both empty for a table of one source."""
        if self.lake.source is None:
            return "true", []
        me = sql_string(self.lake.source)
        return f"{quote(SOURCE_COLUMN)} = {me}", [f"{me} AS {quote(SOURCE_COLUMN)}"]

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

        checks = self._copy_checks(target, columns)
        dead = 0
        if checks:
            reason = f"nullif(concat_ws('; ', {', '.join(checks)}), '')"
            df = df.selectExpr("*", f"{reason} AS {DLQ_REASON}").persist(StorageLevel.MEMORY_AND_DISK)
            dead = self._chunk_dead_letters(target, columns, df, lsn, first, dead_span)
            df = df.where(f"{DLQ_REASON} IS NULL")
        typed = self.lake.typed(df, target, columns, f"CAST({int(lsn)} AS BIGINT)", text=True)
        if self.lake.source is not None:  # whose copy it is, in a table sources share
            marks = {**marks, COPY_PREFIX + "source": self.lake.source}
        writer = self.lake.writer(typed, target, lsn,
                                  {**marks, self.lake.lsn_property: str(lsn)} if done else marks)
        try:
            if first:
                spark_call(f"writing the initial copy of {target}",
                           lambda: writer.overwrite(self.lake.own_rows()))
            else:
                spark_call(f"writing the initial copy of {target}", writer.append)
            added = self.snapshots.last_commit_records(target)
        finally:
            if checks:
                df.unpersist()
        if done:
            spark_call(f"indexing the keys of {target}",
                       lambda: self.keyed.prepare(target, columns))
        return added, dead

    def _copy_checks(self, target: str, columns: Sequence[Column]) -> list[str]:
        """For each column whose type only takes some spellings of Postgres text, an SQL
        expression that says why a value cannot be written exactly (NULL when it can)."""
        checks = []
        for i, c in enumerate(columns):
            t = self.lake.types.spark_type(c, target)
            if t.valid:
                checks.append(
                    f"CASE WHEN c{i} IS NOT NULL AND NOT c{i} RLIKE {sql_string(t.valid)} THEN "
                    f"concat({sql_string(f'column {c.name}: ' + chr(39))}, substring(c{i}, 1, 60),"
                    f" {sql_string(chr(39) + ' ' + t.why_invalid)}) END")
        return checks

    def _chunk_dead_letters(self, target: str, columns: Sequence[Column], df: Any, lsn: Lsn,
                            first: bool,
                            dead_span: Optional[tuple[str, Optional[int], Optional[int]]]) -> int:
        """Write a chunk's rows that failed a check (``df`` carries the reason) to the
        dead-letter table, after removing what an earlier attempt at the same chunk left there
        (see ``load_chunk``). Returns the dead letters."""
        bad = df.where(f"{DLQ_REASON} IS NOT NULL")
        dead = int(spark_call(f"checking the initial copy of {target}", bad.count))
        dlq_known = self.lake.table_exists(self.dead_letter_target(target))
        if not (dead or dlq_known):
            return dead
        dlq, dropped = self._dead_letter_table(target, columns)
        mine, tag = self._dead_letters_of_this_source()
        where = f"{quote(OP_COLUMN)} = 'snapshot' AND {mine}"
        if not first:
            if dead_span is None:
                where = "false"
            else:
                key, lo, hi = dead_span
                k = f"TRY_CAST({quote(key)} AS BIGINT)"
                where += "".join([f" AND {k} >= {lo}" if lo is not None else "",
                                  f" AND {k} < {hi}" if hi is not None else ""])
        self.lake.sql(f"replacing earlier initial-copy dead letters in {dlq}",
                      f"DELETE FROM {quote_target(dlq)} WHERE {where}")
        if dead:
            rows = bad.selectExpr(
                *[f"c{i} AS {quote(c.name)}" for i, c in enumerate(columns)],
                f"'snapshot' AS {quote(OP_COLUMN)}",
                f"CAST({int(lsn)} AS BIGINT) AS {quote(LSN_COLUMN)}",
                f"{DLQ_REASON} AS {quote(DLQ_REASON)}", *tag, *dropped)
            spark_call(f"writing dead letters to {dlq}",
                       lambda: self.lake.writer(rows, dlq, lsn).append())
            self._dead_lsn[dlq] = lsn
        return dead

    def write_dead_letters(self, target: str, columns: Sequence[Column], path: Path, lsn: Lsn,
                           where: str = "true", snapshot: bool = False) -> int:
        """Append staged dead letters to ``<target>__dlq`` in one commit marked ``lsn``: the raw
        text of every column, the change's op and LSN, and the reason. Rows of transactions the
        dead-letter table already holds (a replay after a crash) are left out. ``snapshot``: the
        rows come from an initial copy and replace those of any earlier copy. Returns the rows
        written."""
        dlq, dropped = self._dead_letter_table(target, columns)
        held = self._dead_lsn[dlq]
        df = self.lake.read_staged([path]).where(where)
        mine, tag = self._dead_letters_of_this_source()
        if snapshot:
            self.lake.sql(f"replacing earlier initial-copy dead letters in {dlq}",
                          f"DELETE FROM {quote_target(dlq)} "
                          f"WHERE {quote(OP_COLUMN)} = 'snapshot' AND {mine}")
        elif held is not None:
            df = df.where(f"_wb_lsn >= {int(held)}")
        exprs = [f"{value_column(i)} AS {quote(c.name)}" for i, c in enumerate(columns)]
        exprs += [f"{OP_LABEL_SQL} AS {quote(OP_COLUMN)}",
                  f"_wb_lsn AS {quote(LSN_COLUMN)}",
                  f"{DLQ_REASON} AS {quote(DLQ_REASON)}", *tag, *dropped]
        rows = df.selectExpr(*exprs)
        count = int(spark_call(f"counting dead letters for {target}", rows.count))
        if count:
            spark_call(f"writing dead letters to {dlq}",
                       lambda: self.lake.writer(rows, dlq, lsn).append())
            self._dead_lsn[dlq] = lsn
        return count

    def write_record_dead_letters(self, target: str, path: Path,
                                  marks: Mapping[str, str]) -> int:
        """Append raw source records that could not be applied (a Kafka source's: topic,
        partition, offset, timestamp, key, value, the table meant, ``_dlq_reason``; Parquet at
        ``path``) to ``<target>__dlq`` in one commit carrying ``marks`` (the next offset of
        each partition they come from). Records at offsets the dead-letter table holds already
        (a replay after a crash) are left out. Returns the records written."""
        dlq = self.dead_letter_target(target)
        if not self.lake.table_exists(dlq):
            self.tables.create(dlq, f"topic STRING, `partition` INT, `offset` BIGINT, "
                                    f"timestamp_ms BIGINT, `key` BINARY, `value` BINARY, "
                                    f"`table` STRING, {quote(DLQ_REASON)} STRING")
        held = self.snapshots.committed_offsets(dlq)
        df = self.lake.read_staged([path])
        if held:
            seen = " OR ".join(f"(topic = {sql_string(t)} AND `partition` = {int(p)} AND "
                               f"`offset` < {int(o)})" for (t, p), o in sorted(held.items()))
            df = df.where(f"NOT ({seen})")
        count = int(spark_call(f"counting dead letters for {target}", df.count))
        if count:
            spark_call(f"writing dead letters to {dlq}",
                       lambda: self.lake.writer(df, dlq, Lsn(0), marks).append())
        return count

    def apply(self, target: str, staged: StagedTable, lsn: Lsn, max_seq: int,
              void: Sequence[tuple[int, int]] = (),
              marks: Optional[Mapping[str, str]] = None, upsert: bool = False) -> None:
        """Apply one table's staged changes in one commit marked ``lsn`` (or ``marks``, see
        ``LakeSession.marks``): the rows with ``_wb_seq <= max_seq`` outside the ``void``
        ranges, after the last TRUNCATE that counts. ``upsert``: inserts are merged by key even
        when the batch only inserts (the table may hold some of them already)."""
        truncate = effective_truncate(max_seq, void, staged.truncates)

        def staged_rows() -> Any:
            df = self.lake.read_staged(staged.files)
            return df.where(seq_filter(max_seq, void, staged.truncates))

        if (staged.files and not (staged.insert_only and not upsert)
                and spark_call(f"reading the layout of {target}",
                               lambda: self.keyed.takes(target, staged))):
            # One row delta by position: no join over the table (see apply.position.keyed). Spark
            # reads the staged rows only if the new rows cannot be written on the driver.
            def last_changes() -> Any:
                df = staged_rows()
                return df if staged.unique_keys else _net(df, staged)

            try:
                spark_call(f"applying a batch to {target} by position",
                           lambda: self.keyed.apply(target, staged, last_changes, lsn, max_seq,
                                                    void, self.lake.marks(lsn, marks)))
                return
            except ByMerge as exc:
                self.keyed.clashed(target, exc)  # nothing was committed: MERGE below

        # Sources fanning in to this table apply from threads of one process: one Spark SQL
        # write at a time per table, as the row delta commits (see one_commit_at_a_time).
        one_commit_at_a_time(target, lambda: self._apply_by_spark(
            target, staged, staged_rows() if staged.files else None, lsn, truncate, marks,
            upsert))

    def _apply_by_spark(self, target: str, staged: StagedTable, df: Optional[Any], lsn: Lsn,
                        truncate: Optional[int], marks: Optional[Mapping[str, str]],
                        upsert: bool) -> None:
        """``apply``'s Spark SQL write: an append, a multiset's, a MERGE, or a reload after a
        TRUNCATE."""
        columns = staged.columns
        if staged.insert_only and df is not None and not upsert:
            typed = self.lake.typed(df, target, columns, "_wb_lsn")
            spark_call(f"appending to {target}",
                       lambda: self.lake.writer(typed, target, lsn, marks).append())
            return

        if df is not None and all(c.is_key for c in columns):
            # No key but the whole row (REPLICA IDENTITY FULL): the table is a multiset.
            self._apply_multiset(target, columns, df, lsn, truncated=truncate is not None,
                                 marks=marks)
            return

        meta = ["_wb_op", "_wb_unchanged", "_wb_seq"]
        netted: Optional[Any] = None
        if df is not None and staged.moved_unchanged:
            # A key change left a TOASTed value unsent: follow each row back through its key
            # changes to where the value was sent (or to the lake), then net.
            typed = self.lake.typed(df, target, columns, "_wb_lsn", keep=meta)
            typed = self._carry_unchanged(target, staged, typed, from_lake=truncate is None)
            netted = _last_change(typed, [quote(c.name) for c in columns if c.is_key])
        elif df is not None:
            if not staged.unique_keys:
                df = _net(df, staged)
            netted = self.lake.typed(df, target, columns, "_wb_lsn", keep=meta)

        if truncate is not None:
            self._reload(target, netted, lsn, marks)
            return

        assert netted is not None
        self._merge_by_key(target, staged, netted, lsn, marks)

    def _reload(self, target: str, typed: Optional[Any], lsn: Lsn,
                marks: Optional[Mapping[str, str]]) -> None:
        """A TRUNCATE voids everything before it: the table (this source's rows of it) becomes
        exactly what follows, ``typed`` netted per key (None: nothing)."""
        from pyspark.sql.functions import lit

        if typed is None:
            empty = self.lake.spark.table(quote_target(target)).where(lit(False))
            spark_call(f"truncating {target}",
                       lambda: self.lake.writer(empty, target, lsn, marks)
                       .overwrite(self.lake.own_rows()))
            return
        rows = typed.where("_wb_op <> 'D'").drop("_wb_op", "_wb_unchanged", "_wb_seq")
        spark_call(f"truncating and reloading {target}",
                   lambda: self.lake.writer(rows, target, lsn, marks)
                   .overwrite(self.lake.own_rows()))

    def _merge_by_key(self, target: str, staged: StagedTable, typed: Any, lsn: Lsn,
                      marks: Optional[Mapping[str, str]]) -> None:
        """MERGE the last change per key (``typed``: the table's columns, ``_wb_op``,
        ``_wb_unchanged``, ``_wb_seq``) into the table: deletes, updates (keeping what the lake
        has of a TOASTed value the change did not carry) and inserts."""
        columns = staged.columns
        names = [c.name for c in columns] + [LSN_COLUMN]
        on = " AND ".join(f"t.{quote(c.name)} <=> s.{quote(c.name)}" for c in columns if c.is_key)
        if self.lake.source is not None:
            on = f"t.{quote(SOURCE_COLUMN)} = '{self.lake.source}' AND {on}"
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
                       lambda: with_commit_properties(self.lake.spark,
                                                      dict(self.lake.marks(lsn, marks)),
                                                      lambda: self.lake.spark.sql(statement)))
        finally:
            self.lake.spark.catalog.dropTempView(view)

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
        rows = self.lake.typed(df, target, columns, "_wb_lsn", keep=["_wb_op"])
        if self.lake.source is not None:
            rows = rows.drop(SOURCE_COLUMN)
        delta = (rows.groupBy(*[quote(n) for n in names])
                 .agg(sum_(expr("CASE _wb_op WHEN 'I' THEN 1 WHEN 'D' THEN -1 ELSE 0 END"))
                      .alias("_d"), max_(col(quote(LSN_COLUMN))).alias("_lsn"))
                 .where("_d <> 0"))
        if truncated:
            counted = delta.withColumn("_n", col("_d"))
        else:
            lake = (self.lake.spark.table(quote_target(target)).where(self.lake.own_rows())
                    .groupBy(*[quote(n) for n in names]).count()
                    .select(*[col(quote(n)).alias(f"_l{i}") for i, n in enumerate(names)],
                            col("count").alias("_have")))
            on = None
            for i, n in enumerate(names):
                cond = delta[quote(n)].eqNullSafe(lake[f"_l{i}"])
                on = cond if on is None else on & cond
            counted = (delta.join(lake, on, "left")
                       .withColumn("_n", coalesce(col("_have"), lit(0)) + col("_d")))
        extra = ([f"'{self.lake.source}' AS {quote(SOURCE_COLUMN)}"] if self.lake.source is not None
                 else [])
        copies = (counted.where("_n > 0")
                  .withColumn("_copy", explode(sequence(lit(1), col("_n").cast("int"))))
                  .selectExpr(*[quote(n) for n in names], f"_lsn AS {quote(LSN_COLUMN)}",
                              *extra))
        if truncated:
            spark_call(f"truncating and reloading {target}",
                       lambda: self.lake.writer(copies, target, lsn, marks)
                       .overwrite(self.lake.own_rows()))
            return
        deleters = counted.selectExpr(*[quote(n) for n in names],
                                      f"CAST(NULL AS BIGINT) AS {quote(LSN_COLUMN)}",
                                      *([f"'{self.lake.source}' AS {quote(SOURCE_COLUMN)}"]
                                        if self.lake.source is not None else []),
                                      "'D' AS _kind")
        source = deleters.unionByName(copies.withColumn("_kind", lit("I")))
        on_sql = " AND ".join(f"t.{quote(n)} <=> s.{quote(n)}" for n in names)
        if self.lake.source is not None:
            on_sql = f"t.{quote(SOURCE_COLUMN)} = '{self.lake.source}' AND {on_sql}"
        all_names = names + [LSN_COLUMN] + ([SOURCE_COLUMN] if self.lake.source is not None else [])
        cols = ", ".join(quote(n) for n in all_names)
        vals = ", ".join(f"s.{quote(n)}" for n in all_names)
        self._merge(target, source,
                    f"ON s._kind = 'D' AND {on_sql} WHEN MATCHED THEN DELETE "
                    f"WHEN NOT MATCHED AND s._kind = 'I' THEN INSERT ({cols}) VALUES ({vals})",
                    lsn, marks)

    def _carry_unchanged(self, target: str, staged: StagedTable, every: Any,
                         from_lake: bool) -> Any:
        """Fill in the TOASTed values that UPDATEs left unsent, in a batch where a key change
        did (``every``: the batch's rows, typed, not netted). A row's unsent value is its
        predecessor's: for an UPDATE, the change before it of the same key (back to that
        key's last INSERT, or the lake's row); for the insert half of a key change (sequence
        s, its delete half s-1 names the old key), the old key's last change before s-1. Each
        pass fills every row whose predecessor has the value, so a chain of key changes and
        updates of any length is followed to where the value was sent; the passes stop when
        one fills nothing. ``from_lake``: a value not sent in the batch is the lake's (not so
        after a TRUNCATE). Returns the batch's rows, filled."""
        from pyspark.sql import Window
        from pyspark.sql.functions import col, expr, last, length, lit, max_by, struct, when
        from pyspark.sql.functions import sum as sum_

        columns = staged.columns
        names = [c.name for c in columns]
        keys = [quote(c.name) for c in columns if c.is_key]
        unchanged = sorted(staged.unchanged_columns)
        if from_lake:
            # The lake's row of each key the batch touches heads that key's history.
            touched = every.select(*keys).distinct()
            lake = (self.lake.spark.table(quote_target(target)).where(self.lake.own_rows())
                    .join(touched, [k.strip("`") for k in keys], "left_semi"))
            meta = ("_wb_op", "_wb_unchanged", "_wb_seq")
            heads = lake.select(*[col(quote(c)) for c in every.columns if c not in meta],
                                lit("L").alias("_wb_op"),
                                lit(None).cast("string").alias("_wb_unchanged"),
                                lit(-1).cast("bigint").alias("_wb_seq"))
            every = every.unionByName(heads).localCheckpoint()

        def marked(i: int) -> Any:
            return col("_wb_unchanged").contains(f",{i},")

        def filled(df: Any, i: int, found: Any) -> Any:
            hit = marked(i) & found.isNotNull()
            return (df.withColumn(names[i], when(hit, found.getField("v"))
                                  .otherwise(col(quote(names[i]))))
                    .withColumn("_wb_unchanged", when(hit, expr(
                        f"nullif(replace(_wb_unchanged, ',{i},', ','), ',')"))
                        .otherwise(col("_wb_unchanged"))))

        def left(df: Any) -> int:
            return int(df.select(sum_(length(col("_wb_unchanged")))).first()[0] or 0)

        remaining = left(every)
        while remaining:
            # An UPDATE takes the value from the last change of its key since the key's last
            # INSERT (a segment) that has it.
            by_key = Window.partitionBy(*keys).orderBy("_wb_seq").rowsBetween(
                Window.unboundedPreceding, Window.currentRow)
            every = every.withColumn("_wb_seg", sum_(
                when(col("_wb_op").isin("I", "L"), 1).otherwise(0)).over(by_key))
            in_segment = Window.partitionBy(*keys, "_wb_seg").orderBy("_wb_seq").rowsBetween(
                Window.unboundedPreceding, Window.currentRow)
            for i in unchanged:
                source = (col("_wb_op") != "D") & (col("_wb_unchanged").isNull() | ~marked(i))
                found = last(when(source, struct(col(quote(names[i])).alias("v"))), True) \
                    .over(in_segment)
                every = filled(every, i, when(col("_wb_op") == "U", found))
            every = every.drop("_wb_seg")
            # The insert half of a key change takes it from the old key's last change before.
            moved = every.where("_wb_op = 'I' AND _wb_unchanged IS NOT NULL")
            links = every.where("_wb_op = 'D'").select(
                *[col(k).alias(f"_o{j}") for j, k in enumerate(keys)],
                (col("_wb_seq") + 1).alias("_m_seq"))
            wanted = moved.select(col("_wb_seq").alias("_m")).join(
                links, col("_m") == col("_m_seq")).drop("_m")
            history = every.where("_wb_op <> 'D'")
            on = None
            for j, k in enumerate(keys):
                cond = history[k].eqNullSafe(wanted[f"_o{j}"])
                on = cond if on is None else on & cond
            assert on is not None
            before = wanted.join(history, on & (history["_wb_seq"] < wanted["_m_seq"] - 1))
            last_before = before.groupBy("_m_seq").agg(max_by(struct(
                *[col(quote(names[i])).alias(f"v{i}") for i in unchanged],
                col("_wb_unchanged").alias("u")), col("_wb_seq")).alias("_p"))
            every = every.join(last_before, every["_wb_seq"] == last_before["_m_seq"], "left")
            for i in unchanged:
                has = col("_p").isNotNull() & (col("_p.u").isNull()
                                               | ~col("_p.u").contains(f",{i},"))
                every = filled(every, i, when(has, struct(col(f"_p.v{i}").alias("v"))))
            every = every.drop("_m_seq", "_p").localCheckpoint()
            now = left(every)
            if now == remaining:
                break
            remaining = now
        return every.where("_wb_op <> 'L'")
