"""`walberg query`: Spark SQL against the lake, printed or written to a file, with the
pipeline's tables read at a point of their history (a timestamp, a snapshot id, or the Postgres
WAL position the lake held then)."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Cut:
    """A position of the source that every table of the pipeline holds whole, and the
    snapshot of each table that holds exactly what the source held there."""

    lsn: Lsn
    snapshots: dict[str, int]  # by Iceberg table

    def pin(self, statement: str) -> str:
        """``statement`` with every table of the cut read at its snapshot."""
        return pin_tables(statement, {t: f"VERSION AS OF {s}" for t, s in self.snapshots.items()})

    def describe(self) -> str:
        return f"consistent cut at LSN {self.lsn}: " + ", ".join(
            f"{t} at snapshot {s}" for t, s in sorted(self.snapshots.items()))


def consistent_cut(lake: Lake) -> Cut:
    """The newest position P of the (one, Postgres) source at which every table of the
    pipeline can be read as the source was: a reader of these snapshots never sees part of a
    source transaction, whatever the catalog; and a later cut is never older than an earlier.

    Each commit walberg makes covers a batch up to its LSN, the same LSN in every table the
    batch changed. A table holds what the source held at P (see ``_Known``) at its commits'
    LSNs; between a commit at L and the next at N, up to the first transaction the next one
    holds (its ``walberg.from-lsn``); and from its newest commit up to the slot's confirmed
    position (the slot moves only past what the lake holds). P starts at the least of how far
    each table is known and comes down, table by table, to the newest position every one is
    known at."""
    if len(lake.sources) != 1 or lake.sources[0].kind != "postgres":
        raise Terminal("--consistent reads the tables of one PostgreSQL source: with several "
                       "sources give --source NAME (their positions are not comparable), and a "
                       "Kafka source has no position common to its topics")
    source = lake.sources[0]
    sink = lake.sink(source)
    # The slot first, the tables' histories after: each history then holds every commit up to
    # the slot's confirmed position.
    confirmed = _confirmed(source)
    return cut_of({target: sink.spans(target) for target in source.targets.values()
                   if sink.table_exists(target)}, confirmed)


def cut_of(histories: dict[str, list[tuple[int, Optional[str], Optional[str]]]],
           confirmed: Lsn) -> Cut:
    """``consistent_cut`` of tables whose lineages (snapshot id, ``walberg.lsn``,
    ``walberg.from-lsn``, oldest first) were read after the slot was confirmed up to
    ``confirmed``."""
    known = {target: _Known.of(history, confirmed) for target, history in histories.items()}
    lines = {target: line for target, line in known.items() if line.marks}
    if not lines:
        raise Terminal("no table of this pipeline holds anything yet: nothing to read")
    cut = min(line.spans[-1][1] for line in lines.values())
    while True:
        lower = cut
        for line in lines.values():
            at = line.newest_at_or_before(cut)
            if at is None:
                raise Terminal(f"no position is held whole by every table: one holds "
                               f"nothing at or before LSN {cut} (its first commit covers "
                               f"{line.marks[0][0]}); run again once walberg has caught up")
            lower = min(lower, at)
        if lower == cut:
            break
        cut = lower
    return Cut(cut, {target: line.snapshot_at(cut) for target, line in lines.items()})


@dataclass(frozen=True)
class _Known:
    """Where one table's history is known to hold the table as the source was."""

    marks: list[tuple[Lsn, int]]  # (LSN covered, snapshot), oldest first
    spans: list[tuple[Lsn, Lsn]]  # (first, last) position held whole, by the snapshot at first

    @classmethod
    def of(cls, history: list[tuple[int, Optional[str], Optional[str]]],
           confirmed: Lsn) -> "_Known":
        """From the table's lineage: (snapshot id, LSN mark, from-LSN), oldest first."""
        covered = Lsn(0)
        marks: list[tuple[Lsn, int]] = []
        spans: list[tuple[Lsn, Lsn]] = []
        for snapshot, mark, since in history:
            at = Lsn.parse(mark) if mark is not None else covered
            if at > covered:
                if covered:
                    # Up to the first transaction this commit holds, its parent held the table
                    # as it was (a commit without the mark, a copy, is known at its LSN only).
                    upto = Lsn.parse(since) if since is not None else covered
                    spans.append((covered, min(max(upto, covered), at)))
                covered = at
            if covered:
                marks.append((covered, snapshot))
        if covered:
            spans.append((covered, max(covered, confirmed)))
        return cls(marks, spans)

    def newest_at_or_before(self, position: Lsn) -> Optional[Lsn]:
        found = [min(last, position) for first, last in self.spans if first <= position]
        return max(found) if found else None

    def snapshot_at(self, position: Lsn) -> int:
        return [snapshot for at, snapshot in self.marks if at <= position][-1]


def _confirmed(source: LakeSource) -> Lsn:
    """How far the source's replication slot is confirmed (0 if it cannot be read)."""
    from walberg.source import postgres as pg
    from walberg.source import slots

    try:
        conn = pg.connect(source.postgres.dsn)
    except Exception:  # noqa: BLE001  (without it the cut is only more cautious)
        return Lsn(0)
    try:
        state = slots.slot_state(conn, source.postgres.slot)
    finally:
        conn.close()
    return Lsn(0) if state is None else Lsn(int(state.confirmed_flush))


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
