"""`walberg query`: Spark SQL against the lake, printed or written to a file, with the
pipeline's tables read at a point of their history (a timestamp, a snapshot id, or the Postgres
WAL position the lake held then)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from walberg.apply.iceberg import pin_tables
from walberg.errors import ConfigError, Terminal
from walberg.lake.services import Lake, LakeSource
from walberg.model import Lsn


def query(lake: Lake, statement: str, limit: int = 100, *, as_of: Optional[str] = None,
          snapshot: Optional[int] = None, lsn: Optional[Lsn] = None
          ) -> tuple[list[tuple[Any, ...]], list[str]]:
    """Run Spark SQL against the lake; returns (rows, column names). With ``as_of`` (a
    timestamp), ``snapshot`` (an Iceberg snapshot id of one table) or ``lsn`` (a Postgres
    WAL position), the pipeline's tables are read as they were then."""
    return lake.sink().query(pinned(lake, statement, as_of, snapshot, lsn), limit)


def export(lake: Lake, statement: str, fmt: str, output: Path, limit: Optional[int] = None, *,
           as_of: Optional[str] = None, snapshot: Optional[int] = None,
           lsn: Optional[Lsn] = None) -> int:
    """Write a query's result to ``output`` as csv, json (lines) or parquet; the rows written."""
    return lake.sink().export(pinned(lake, statement, as_of, snapshot, lsn), fmt, output, limit)


def pinned(lake: Lake, statement: str, as_of: Optional[str] = None,
           snapshot: Optional[int] = None, lsn: Optional[Lsn] = None) -> str:
    """``statement`` with the pipeline's tables read at a point in their history."""
    if sum(x is not None for x in (as_of, snapshot, lsn)) > 1:
        raise ConfigError("give one of --as-of, --snapshot and --lsn, not several")
    sink = lake.sink()
    pins: dict[str, str] = {}
    if as_of is not None:
        stamp = as_of.replace("'", "")
        pins = {target: f"TIMESTAMP AS OF '{stamp}'" for target in lake.targets
                if sink.table_exists(target)}
    elif snapshot is not None:
        for target in lake.targets:
            if sink.table_exists(target) and any(
                    h["snapshot_id"] == snapshot for h in sink.history(target)):
                pins[target] = f"VERSION AS OF {int(snapshot)}"
        if not pins:
            raise Terminal(f"no table of this pipeline has a snapshot {snapshot}; "
                           "`walberg history -c pipeline.yaml TABLE` lists them")
    elif lsn is not None:
        for source in lake.sources:
            for table, target in source.targets.items():
                if target not in pins and lake.sink(source).table_exists(target):
                    pins[target] = f"VERSION AS OF {snapshot_at(lake, source, table, lsn)}"
    return pin_tables(statement, pins)


def snapshot_at(lake: Lake, source: LakeSource, table: str, lsn: Lsn) -> int:
    """The last snapshot of the table's current history whose data covers the source only
    up to ``lsn``: what the lake held of it as of that Postgres position."""
    target = source.targets[table]
    chosen: Optional[int] = None
    covered = Lsn(0)
    first: Optional[str] = None
    for h in lake.sink(source).history(target):
        if not h["is_current_ancestor"]:
            continue
        if h["lsn"] is not None:
            covered = max(covered, Lsn.parse(h["lsn"]))
            first = first or h["lsn"]
        if h["lsn"] is not None or chosen is not None:
            if covered > lsn:
                break
            chosen = int(h["snapshot_id"])
    if chosen is None:
        raise Terminal(f"the lake held nothing of {table} at LSN {lsn}: its first commit "
                       f"covers up to LSN {first or '-'}")
    return chosen
