"""Writing to a table, each write one commit that carries the position it covers: the initial
copy (whole, or chunk by chunk), a staged batch (by position, see apply.position.keyed, else by
Spark SQL, see apply.merge), a changelog table's rows, and the dead-letter table
``<target>__dlq`` of rows that cannot be written exactly."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import pyarrow as pa

from walberg.apply.batch import (
    DLQ_REASON,
    OP_LABEL_SQL,
    StagedTable,
    effective_truncate,
    seq_filter,
    value_column,
)
from walberg.apply.initial import files as copyfiles
from walberg.apply.jvm.calls import spark_call
from walberg.apply.jvm.commits import one_commit_at_a_time
from walberg.apply.merge.merging import MergeApply
from walberg.apply.merge.netting import net
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


class Writes:
    """Every commit of data to the tables one sink writes. Keeps what each dead-letter table
    already holds (the LSN of its last commit), so a replayed batch adds no dead letter twice."""

    def __init__(self, lake: LakeSession, tables: Tables, snapshots: Snapshots,
                 keyed: Optional[KeyedApply] = None) -> None:
        self.lake = lake
        self.tables = tables
        self.snapshots = snapshots
        self.keyed = keyed if keyed is not None else KeyedApply(lake, tables, None)
        self.merge = MergeApply(lake)
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
                       txns: Sequence[tuple[int, int, int, int]], held: Optional[Lsn],
                       since: Optional[Lsn] = None) -> int:
        """Append one row per change (and per TRUNCATE) to a changelog table, in one commit
        marked ``lsn`` (and ``since``, as ``apply``). ``txns``: (commit LSN, xid, commit time
        in µs since 2000, first seq) of the batch's transactions; rows of transactions up to
        ``held`` are already there."""
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
                               target, lambda: self.lake.writer(
                               rows, target, lsn, self.lake.marks(lsn, None, since)).append()))
        finally:
            rows.unpersist()
        return count

    def load_copy(self, target: str, columns: Sequence[Column], files: Sequence[Path],
                  lsn: Lsn, on_driver: bool = True) -> None:
        """Replace the table's contents with the initial copy, in one commit marked ``lsn``:
        written on the driver when staging left every column in its type (apply.initial.files),
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
              marks: Optional[Mapping[str, str]] = None, upsert: bool = False,
              since: Optional[Lsn] = None) -> None:
        """Apply one table's staged changes in one commit marked ``lsn`` (or ``marks``, see
        ``LakeSession.marks``): the rows with ``_wb_seq <= max_seq`` outside the ``void``
        ranges, after the last TRUNCATE that counts. ``upsert``: inserts are merged by key even
        when the batch only inserts (the table may hold some of them already). ``since``: the
        commit LSN of the first transaction the rows come from (recorded with ``lsn``)."""
        if marks is None and since is not None:
            marks = self.lake.marks(lsn, None, since)
        truncate = effective_truncate(max_seq, void, staged.truncates)
        self.lake.last_summaries.pop(target, None)  # (this commit's, if a row delta's)

        def staged_rows() -> Any:
            df = self.lake.read_staged(staged.files)
            return df.where(seq_filter(max_seq, void, staged.truncates))

        # Every batch of a table applied by position is a row delta, one of inserts alone too:
        # its new rows are written on the driver and their keys go into the index as written
        # (a Spark append was a Spark job, and the index then read the appended files back).
        if (bool(staged.files)
                and spark_call(f"reading the layout of {target}",
                               lambda: self.keyed.takes(target, staged))):
            # One row delta by position: no join over the table (see apply.position.keyed). Spark
            # reads the staged rows only if the new rows cannot be written on the driver.
            def last_changes() -> Any:
                df = staged_rows()
                return df if staged.unique_keys else net(df, staged)

            try:
                spark_call(f"applying a batch to {target} by position",
                           lambda: self.keyed.apply(target, staged, last_changes, lsn, max_seq,
                                                    void, self.lake.marks(lsn, marks)))
                return
            except ByMerge as exc:
                self.keyed.clashed(target, exc)  # nothing was committed: MERGE below

        # Sources fanning in to this table apply from threads of one process: one Spark SQL
        # write at a time per table, as the row delta commits (see one_commit_at_a_time).
        one_commit_at_a_time(target, lambda: self.merge.apply(
            target, staged, staged_rows() if staged.files else None, lsn, truncate, marks,
            upsert))
