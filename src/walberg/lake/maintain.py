"""`walberg maintain`: compact the Iceberg tables' files, apply deletes, expire old snapshots and
remove orphan files (``maintenance:`` in the pipeline file says how much to keep)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from walberg import metrics
from walberg.apply.iceberg import IcebergSink
from walberg.apply.jvm.commits import one_commit_at_a_time
from walberg.apply.session import DLQ_SUFFIX
from walberg.config import Config, Maintenance, changelog_beside
from walberg.errors import WalbergError
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
    steps: dict[str, float] = field(default_factory=dict)  # the seconds of each step taken


def maintain(lake: Lake, tables: Optional[list[str]] = None) -> list[TableMaintenance]:
    """Maintain the Iceberg tables of these source tables (default: all of every source), each
    once: with fan-in several sources share a table, and compacting it twice would only cost.
    The maintenance commits carry every source's progress marks (see ``IcebergSink.maintain``),
    whichever source's sink makes them."""
    todo: dict[str, LakeSource] = {}
    if tables:
        for table in tables:
            source, target = lake.find(table)
            for t in written_beside(source.config, {source.resolve(table) or table: target}):
                todo.setdefault(t, source)
    else:
        for source in lake.sources:
            for t in written_beside(source.config, source.targets):
                todo.setdefault(t, source)
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


def written_beside(config: Config, targets: dict[str, str]) -> list[str]:
    """The Iceberg tables walberg writes for these tables (source table -> its Iceberg table):
    each one, the changelog beside it (mode both) and its dead-letter table (``<table>__dlq``),
    whether they exist or not. All grow by a commit per batch, so all need maintenance."""
    out: list[str] = []
    for table, target in targets.items():
        out += [target, target + DLQ_SUFFIX]
        if config.layout_for(table).mode == "both":
            out.append(changelog_beside(target))
    return list(dict.fromkeys(out))


# When each table was last maintained on schedule by this process (see maintain_on_schedule).
_scheduled: dict[str, float] = {}
_scheduled_guard = threading.Lock()


def maintain_on_schedule(sink: IcebergSink, settings: Maintenance, targets: Iterable[str],
                         stop: threading.Event) -> None:
    """What ``walberg run`` does every ``maintenance.every``, between two of its batches.
    Sources fanning in to one table each come here for it: it is maintained once a period (by
    the first to come), and never while another thread of this process commits to it. A table
    whose maintenance fails is said and counted (``walberg_maintenance_failures_total``) and
    tried again a period later: maintenance never ends the run, nor holds its stop."""
    assert settings.every
    for target in targets:
        if stop.is_set():
            return
        with _scheduled_guard:
            last = _scheduled.get(target)
            if last is not None and time.monotonic() - last < settings.every / 2:
                continue  # another source's applier maintained it this period
            _scheduled[target] = time.monotonic()
        try:
            if sink.table_exists(target):
                _maintain_table(sink, settings, target)
        except WalbergError as exc:
            metrics.MAINTENANCE_FAILURES.labels(target).inc()
            log.error("scheduled maintenance of %s failed: %s. The run goes on; it is tried "
                      "again in %.0f s (maintenance.every), or run `walberg maintain`", target,
                      exc, settings.every)
        finally:
            with _scheduled_guard:
                _scheduled[target] = time.monotonic()  # a period from its end


def _maintain_table(sink: IcebergSink, m: Maintenance, target: str) -> TableMaintenance:
    now_ms = int(time.time() * 1000)
    started = time.monotonic()
    # Sources fanning in to the table commit from other threads of this process: they wait
    # (compaction rewrites the files their row deltas name, and would fail their validation or
    # its own otherwise).
    done = one_commit_at_a_time(target, lambda: sink.maintain(
        target, m.target_file_size_bytes, now_ms - int(m.snapshot_retention * 1000),
        m.retain_last, now_ms - int(m.orphan_retention * 1000)))
    report = TableMaintenance(
        table=target, before=_stats(done["before"]), after=_stats(done["after"]),
        rewritten_data_files=done["rewritten_data_files"],
        added_data_files=done["added_data_files"], expired_snapshots=done["expired_snapshots"],
        orphan_files_removed=done["orphan_files_removed"],
        seconds=round(time.monotonic() - started, 2), steps=done["seconds"])
    b, a = report.before, report.after
    log.info("maintained %s in %.1f s (%s): data files %d -> %d, delete files %d -> %d, "
             "snapshots %d -> %d, %d -> %d bytes", target, report.seconds,
             ", ".join(f"{k} {v:.1f} s" for k, v in report.steps.items()),
             b.data_files, a.data_files, b.delete_files, a.delete_files,
             b.snapshots, a.snapshots, b.bytes, a.bytes)
    return report


def _stats(files: dict[str, Any]) -> FileStats:
    return FileStats(data_files=files["data_files"], delete_files=files["delete_files"],
                     snapshots=files["snapshots"], bytes=files["bytes"])
