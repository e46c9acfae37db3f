"""`walberg maintain`: compact the Iceberg tables' files, apply deletes, expire old snapshots and
remove orphan files (``maintenance:`` in the pipeline file says how much to keep)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from walberg.apply.iceberg import IcebergSink
from walberg.config import Maintenance
from walberg.lake.services import Lake, LakeSource

log = logging.getLogger("walberg")


@dataclass(frozen=True)
class FileStats:
    data_files: int
    delete_files: int
    snapshots: int
    bytes: int


@dataclass(frozen=True)
class TableMaintenance:
    table: str  # the Iceberg table
    before: FileStats
    after: FileStats
    rewritten_data_files: int
    added_data_files: int
    expired_snapshots: int
    orphan_files_removed: int
    seconds: float


def maintain(lake: Lake, tables: Optional[list[str]] = None) -> list[TableMaintenance]:
    """Maintain the Iceberg tables of these source tables (default: all of every source), each
    once: with fan-in several sources share a table, and compacting it twice would only cost.
    The maintenance commits carry every source's progress marks (see ``IcebergSink.maintain``),
    whichever source's sink makes them."""
    todo: dict[str, LakeSource] = {}
    if tables:
        for table in tables:
            source, target = lake.find(table)
            todo.setdefault(target, source)
    else:
        for source in lake.sources:
            for target in source.targets.values():
                todo.setdefault(target, source)
    reports = []
    for source in lake.sources:
        mine = [target for target, s in todo.items() if s is source]
        reports += maintain_tables(lake.sink(source), lake.config.maintenance, mine)
    return reports


def maintain_tables(sink: IcebergSink, settings: Maintenance,
                    targets: Iterable[str]) -> list[TableMaintenance]:
    """Maintain these Iceberg tables (those that exist) as ``settings`` say: what ``walberg
    maintain`` does, and what a running pipeline does every ``maintenance.every``."""
    reports = []
    for target in targets:
        if sink.table_exists(target):
            reports.append(_maintain_table(sink, settings, target))
    return reports


def _maintain_table(sink: IcebergSink, m: Maintenance, target: str) -> TableMaintenance:
    now_ms = int(time.time() * 1000)
    started = time.monotonic()
    done = sink.maintain(
        target, m.target_file_size_bytes, now_ms - int(m.snapshot_retention * 1000),
        m.retain_last, now_ms - int(m.orphan_retention * 1000))
    report = TableMaintenance(
        table=target, before=_stats(done["before"]), after=_stats(done["after"]),
        rewritten_data_files=done["rewritten_data_files"],
        added_data_files=done["added_data_files"], expired_snapshots=done["expired_snapshots"],
        orphan_files_removed=done["orphan_files_removed"],
        seconds=round(time.monotonic() - started, 2))
    b, a = report.before, report.after
    log.info("maintained %s in %.1f s: data files %d -> %d, delete files %d -> %d, "
             "snapshots %d -> %d, %d -> %d bytes", target, report.seconds,
             b.data_files, a.data_files, b.delete_files, a.delete_files,
             b.snapshots, a.snapshots, b.bytes, a.bytes)
    return report


def _stats(files: dict[str, Any]) -> FileStats:
    return FileStats(data_files=files["data_files"], delete_files=files["delete_files"],
                     snapshots=files["snapshots"], bytes=files["bytes"])
