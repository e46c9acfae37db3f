"""A resumed chunked copy's first part made current: the key ranges committed before the copy
was cut short hold the rows as its first snapshot had them; the rows changed since leave them
here (the rows as they are now come as a chunk of their own, see ``runtime.initial_copy``)."""

from __future__ import annotations

import uuid
from typing import Any, Optional, Sequence

from walberg.apply.jvm.calls import spark_call
from walberg.apply.jvm.commits import one_commit_at_a_time
from walberg.apply.session import SOURCE_COLUMN, LakeSession, quote_target
from walberg.apply.types import quote, sql_string

Bounds = tuple[Optional[int], Optional[int]]  # a half-open key range; None: unbounded


def drop_changed(lake: LakeSession, target: str, key: str, spans: Sequence[Bounds],
                 kept: Any) -> None:
    """Delete the rows of ``target`` (this source's, in a table sources share) whose key lies
    in ``spans`` but is not among ``kept`` (a DataFrame of the source's keys as text, ``c0``:
    the rows there unchanged since the copy began), in one commit."""
    column = quote(key)
    within = " OR ".join(_within(column, lo, hi) for lo, hi in spans)
    if not within:
        return
    held = (lake.spark.table(quote_target(target)).where(lake.own_rows())
            .where(within).selectExpr(f"{column} AS _wb_key"))
    gone = held.join(kept.selectExpr("CAST(c0 AS BIGINT) AS _wb_key"), "_wb_key", "left_anti")
    on = f"t.{column} = s._wb_key"
    if lake.source is not None:
        on = f"t.{quote(SOURCE_COLUMN)} = {sql_string(lake.source)} AND {on}"
    view = f"walberg_changed_{uuid.uuid4().hex}"  # (the session is shared by fanned-in sources)
    gone.createOrReplaceTempView(view)
    statement = f"MERGE INTO {quote_target(target)} t USING {view} s ON {on} WHEN MATCHED THEN DELETE"
    try:
        one_commit_at_a_time(target, lambda: spark_call(
            f"removing from {target} the rows changed since its copy was cut short",
            lambda: lake.spark.sql(statement)))
    finally:
        lake.spark.catalog.dropTempView(view)


def _within(column: str, lo: Optional[int], hi: Optional[int]) -> str:
    parts = ([] if lo is None else [f"{column} >= {int(lo)}"]) + \
        ([] if hi is None else [f"{column} < {int(hi)}"])
    return "(" + (" AND ".join(parts) or "true") + ")"
