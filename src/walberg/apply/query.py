"""Reading the lake with Spark SQL for people: a query's first rows, a query's whole result
written to one file, and pinning tables of a query to a snapshot or a time."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from walberg.apply.jvm.calls import spark_call
from walberg.apply.session import LakeSession


class Queries:
    """Spark SQL over the lake, through one sink's session."""

    def __init__(self, lake: LakeSession) -> None:
        self.lake = lake

    def query(self, statement: str, limit: int) -> tuple[list[tuple[Any, ...]], list[str]]:
        """The first ``limit`` rows of a query and its column names."""
        df = self.lake.sql("running the query", statement)
        rows = spark_call("running the query", lambda: df.limit(limit).collect())
        return [tuple(r) for r in rows], list(df.columns)

    def export(self, statement: str, fmt: str, output: Path, limit: Optional[int]) -> int:
        """Write a query's result to one file (csv with a header, JSON lines, or Parquet);
        Spark writes it, so the result never passes through Python. Returns the rows."""
        df = self.lake.sql("running the query", statement)
        if limit is not None:
            df = df.limit(limit)
        df = df.cache()
        rows = int(spark_call("running the query", df.count))
        work = Path(tempfile.mkdtemp(prefix=".walberg-export-", dir=output.parent))
        try:
            writer = df.coalesce(1).write.mode("overwrite").format(fmt)
            if fmt == "csv":
                # RFC 4180: a quote inside a quoted value is doubled (Spark's default, a
                # backslash, is not CSV that csvkit, pandas or a spreadsheet read back).
                writer = writer.option("header", "true").option("escape", '"')
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
    for target, clause in pins.items():
        parts = [rf"(?:{re.escape(p)}|`{re.escape(p)}`)" for p in target.split(".")]
        pattern = r"(?<![\w.`])" + r"\.".join(parts) + r"(?![\w.`])"
        statement = re.sub(pattern, lambda m: f"{m.group(0)} {clause}", statement,  # noqa: B023
                           flags=re.IGNORECASE)
    return statement
