"""How the commands show their results: a human table or text, or JSON (``--json``). Each
command returns typed results (dataclasses); ``emit`` prints them one way or the other, and the
human renderers below are the only place that lays them out for people."""

from __future__ import annotations

import dataclasses
import json
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

if TYPE_CHECKING:
    from walberg.lake.history import Snapshot
    from walberg.lake.maintain import TableMaintenance
    from walberg.ops.check import SourceChecks
    from walberg.ops.digest import TableVerdict
    from walberg.ops.status import Status

T = TypeVar("T")


def emit(result: T, as_json: bool, human: Callable[[T], str],
         shape: Optional[Callable[[T], Any]] = None) -> None:
    """Print ``result`` as JSON (``shape`` picks what of it, default all) or for people."""
    if as_json:
        print(json.dumps(plain((shape or (lambda r: r))(result)), indent=2))
    else:
        print(human(result))


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data: dataclasses as objects, times as ISO 8601 text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


def by_source(results: Sequence[Any]) -> Any:
    """Per-source results (each with ``source``) for JSON: the lone result of a file with one
    source, else an object by source name."""
    if len(results) == 1 and results[0].source is None:
        return results[0]
    return {r.source: r for r in results}


def format_table(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[("NULL" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    line = "  ".join(n.ljust(w) for n, w in zip(names, widths, strict=False))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def _headed(source: Optional[str], text: str) -> str:
    return f"source {source}:\n{text}" if source else text


# ---- the commands' results, for people --------------------------------------------------


def status_text(statuses: Sequence["Status"]) -> str:
    return "\n".join(_headed(s.source, _one_status(s)) for s in statuses)


def _one_status(status: "Status") -> str:
    p = status.pipeline
    running = f"running (pid {p.pid})" if p.running else "not running"
    behind = ("" if p.oldest_waiting_s is None
              else f"; the oldest change not yet in the lake committed {p.oldest_waiting_s:.1f} s ago"
              if p.oldest_waiting_s else "; the lake holds everything it has read")
    lines = [f"walberg: {running}; {p.pending_segments} sealed segment(s) pending, "
             f"{p.pending_bytes:,} bytes in {p.segment_dir}{behind}"]
    rows = [(name + (" (PARKED)" if t.parked else ""), t.iceberg_table, t.last_lsn or "-",
             "-" if t.waiting_s is None else f"{t.waiting_s:.1f} s",
             t.last_commit_at or "-",
             "-" if t.rows is None else f"{t.rows:,}" + (" (all sources)" if t.shared else ""),
             t.data_files or 0, t.delete_files or 0, t.snapshot_id or "-")
            for name, t in status.tables.items()]
    # behind: the age of the table's oldest committed change not yet in the lake
    lines.append(format_table(["source", "iceberg table", "lsn", "behind", "committed at",
                               "rows", "files", "delete files", "snapshot"], rows))
    for name, t in status.tables.items():
        if t.parked:
            lines.append(f"PARKED {name}: {t.parked} (its changes are held for it; the other "
                         "tables go on)")
    slot = status.slot
    if slot is not None and slot.error:
        lines.append(f"slot: {slot.error}")
    elif slot is not None and slot.missing:
        lines.append(f"slot {slot.name}: does not exist yet (created by the first run)")
    elif slot is not None:
        room = ("" if slot.safe_wal_bytes is None
                else f", {max(slot.safe_wal_bytes, 0):,} bytes more before it is invalidated")
        kind = ", a failover slot" if slot.failover else ""
        lines.append(f"slot {slot.name}: confirmed {slot.confirmed_flush_lsn}, server at "
                     f"{slot.server_wal_lsn}, lag {slot.lag_bytes or 0:,} bytes, retains "
                     f"{slot.retained_wal_bytes or 0:,} bytes of WAL ({slot.wal_status}{room}"
                     f"{kind})")
        if slot.warning:
            lines.append(f"WARNING: {slot.warning}")
    if status.catalog is not None:
        cat = status.catalog
        lines.append(f"catalog {cat.name} ({cat.type}): "
                     + (cat.error if cat.error else cat.commits))
    if status.broker_error:
        lines.append(f"broker: {status.broker_error}")
    if status.partitions is not None:
        lines.append(format_table(
            ["topic", "partition", "lake offset", "end offset", "lag"],
            [(q.topic, q.partition, "-" if q.lake_offset is None else q.lake_offset,
              q.end_offset, f"{q.lag:,}") for q in status.partitions]))
    return "\n".join(lines)


def checks_text(checks: Sequence["SourceChecks"]) -> str:
    lines = []
    for group in checks:
        if group.source:
            lines.append(f"source {group.source}:")
        lines += [f"[{'ok  ' if r.ok else 'FAIL'}] {r.name}: {r.detail}" for r in group.results]
    every = [r for group in checks for r in group.results]
    lines.append(f"{sum(r.ok for r in every)} of {len(every)} checks passed")
    return "\n".join(lines)


def verdicts_text(verdicts: Sequence["TableVerdict"]) -> str:
    lines = []
    for v in verdicts:
        mark = "ok  " if v.equal else "DIFF"
        lines.append(f"[{mark}] {v.source} -> {v.target}: source {v.source_rows:,} rows (at LSN "
                     f"{v.source_lsn}), lake {v.lake_rows:,} rows (up to LSN {v.lake_lsn or '-'})")
        if v.note:
            lines.append(f"       {v.note}")
        for d in v.differences:
            key = ", ".join(f"{k}={val}" for k, val in d["key"].items())
            lines.append(f"       {key}: {d['problem']}")
    return "\n".join(lines)


def maintenance_table(reports: Sequence["TableMaintenance"]) -> str:
    return format_table(
        ["table", "data files", "delete files", "snapshots", "bytes", "seconds"],
        [(r.table, f"{r.before.data_files} -> {r.after.data_files}",
          f"{r.before.delete_files} -> {r.after.delete_files}",
          f"{r.before.snapshots} -> {r.after.snapshots}",
          f"{r.before.bytes:,} -> {r.after.bytes:,}", r.seconds) for r in reports])


def history_table(snapshots: Sequence["Snapshot"]) -> str:
    return format_table(
        ["committed at", "snapshot", "operation", "walberg.lsn", "rows added", "rows deleted"],
        [(h.committed_at, h.snapshot_id, h.operation, h.lsn or "-", h.added, h.deleted)
         for h in snapshots])
