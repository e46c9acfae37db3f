"""A staged batch committed by Spark SQL, one commit marked with its position: an append, a
MERGE of the last change per key, a multiset's MERGE (a table keyed by whole rows), or a reload
after a TRUNCATE."""

from __future__ import annotations

import uuid
from typing import Any, Mapping, Optional, Sequence

from walberg.apply.batch import StagedTable
from walberg.apply.jvm.calls import spark_call
from walberg.apply.jvm.commits import with_commit_properties
from walberg.apply.merge.netting import carry_unchanged, last_change, net
from walberg.apply.session import LSN_COLUMN, SOURCE_COLUMN, LakeSession, quote_target
from walberg.apply.types import quote
from walberg.model import Column, Lsn


class MergeApply:
    """The Spark SQL writes of a batch to the tables one sink writes."""

    def __init__(self, lake: LakeSession) -> None:
        self.lake = lake

    def apply(self, target: str, staged: StagedTable, df: Optional[Any], lsn: Lsn,
                        truncate: Optional[int], marks: Optional[Mapping[str, str]],
                        upsert: bool) -> None:
        """``Writes.apply``'s Spark SQL write: an append, a multiset's, a MERGE, or a reload after a
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
            typed = carry_unchanged(self.lake, target, staged, typed, from_lake=truncate is None)
            netted = last_change(typed, [quote(c.name) for c in columns if c.is_key])
        elif df is not None:
            if not staged.unique_keys:
                df = net(df, staged)
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
