"""A batch netted in Spark: the last change per key, and the TOASTed values an UPDATE left
unsent carried over from the change that sent them (an earlier change of the batch, the lake's
row, or, across key changes, the old key's history)."""

from __future__ import annotations

from typing import Any, Sequence

from walberg.apply.batch import StagedTable, value_column
from walberg.apply.session import LakeSession, quote_target
from walberg.apply.types import quote


def fill_unchanged(df: Any, keys: list[str], unchanged: list[int]) -> Any:
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


def net(df: Any, staged: StagedTable) -> Any:
    """The last change per key of a batch, each carrying the TOASTed values an earlier change
    of the batch carried (see ``fill_unchanged``). A hash aggregate, no sort; skipped when
    staging found no key twice, each row then being its key's last change already."""
    keys = [value_column(i) for i, c in enumerate(staged.columns) if c.is_key]
    if staged.unchanged_columns:
        df = fill_unchanged(df, keys, sorted(staged.unchanged_columns))
    return last_change(df, keys)


def last_change(df: Any, keys: Sequence[str]) -> Any:
    """Each key's change with the highest ``_wb_seq`` (``keys``: column names as Spark SQL
    takes them)."""
    from pyspark.sql.functions import col, max_by, struct

    names = [k.strip("`") for k in keys]
    rest = [c for c in df.columns if c not in names]
    return (df.groupBy(*[col(k) for k in keys])
            .agg(max_by(struct(*[col(f"`{c}`") for c in rest]), "_wb_seq").alias("_wb_last"))
            .select(*[col(k) for k in keys], "_wb_last.*"))


def carry_unchanged(session: LakeSession, target: str, staged: StagedTable, every: Any,
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
        lake = (session.spark.table(quote_target(target)).where(session.own_rows())
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
