"""`walberg status`: where each table and each source stands, read from the segment directory,
the Iceberg metadata and the source (the replication slot, or the Kafka partitions' ends);
starts no Spark and changes nothing."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from walberg.apply.catalog.catalog_reads import commits_together, describe_rest
from walberg.apply.catalog.metadata import TableSummary
from walberg.buffer.files import Mapped, inspect_directory, read_freshness
from walberg.buffer.recovery import NAME
from walberg.buffer.segment import Scanner, check_magic
from walberg.errors import Transient, WalbergError
from walberg.lake.services import Lake, LakeSource
from walberg.model import Lsn, pg_epoch
from walberg.runtime.lakeside import check_catalog
from walberg.runtime.parking import parked_why
from walberg.source import kafka, slots
from walberg.source import postgres as pg
from walberg.source.framing import commit_end_lsn, commit_time
from walberg.source.pgoutput import Decoder, Tag

log = logging.getLogger("walberg")


@dataclass(frozen=True)
class BufferStatus:
    running: bool  # a walberg process holds the segment directory
    pid: Optional[str]
    segment_dir: str
    pending_segments: int
    pending_bytes: int
    # A running walberg's freshness: how long ago the oldest transaction it holds and the lake
    # does not committed (0: none waits; None: not running, or it has not said).
    oldest_waiting_s: Optional[float] = None


@dataclass(frozen=True)
class TableStatus:
    iceberg_table: str
    snapshot_id: Optional[int]
    last_lsn: Optional[str]  # what walberg's last commit covers (Postgres sources)
    last_commit_at: Optional[str]  # ISO 8601, UTC
    rows: Optional[int]
    data_files: Optional[int]
    delete_files: Optional[int]
    snapshots: int
    # Freshness: the age, now, of the table's oldest change in the segment files that the
    # lake does not hold yet (0: none waits; None: not known, see _waiting).
    waiting_s: Optional[float] = None
    # Why the table is parked (it cannot follow its source; see runtime.parking), or None.
    parked: Optional[str] = None
    # Several sources fan in to the table: its rows, files and snapshots are the whole
    # table's, every source's together (its LSN and freshness are this source's own).
    shared: bool = False


@dataclass(frozen=True)
class SlotStatus:
    """A Postgres source's replication slot; ``error`` when the source could not be read."""

    name: Optional[str] = None
    missing: bool = False  # created by the first run
    confirmed_flush_lsn: Optional[str] = None
    server_wal_lsn: Optional[str] = None
    lag_bytes: Optional[int] = None
    retained_wal_bytes: Optional[int] = None
    wal_status: Optional[str] = None
    # WAL the server may still write before it invalidates the slot (max_slot_wal_keep_size;
    # None: no limit), and whether it is a failover slot (None: PostgreSQL before 17).
    safe_wal_bytes: Optional[int] = None
    failover: Optional[bool] = None
    active_pid: Optional[int] = None
    warning: Optional[str] = None  # the slot is about to be lost, and what to do
    error: Optional[str] = None


@dataclass(frozen=True)
class PartitionStatus:
    """A Kafka source's partition: the next offset the lake holds and the partition's end."""

    topic: str
    partition: int
    lake_offset: Optional[int]  # None: the lake holds none of it
    end_offset: int
    lag: int  # records the lake does not hold yet


@dataclass(frozen=True)
class CatalogStatus:
    """The catalog, and whether the tables of a batch become visible together."""

    type: str
    name: str
    atomic_commits: bool  # one catalog transaction for all tables of a batch
    commits: str  # how the catalog commits, said for people
    error: Optional[str] = None  # a REST catalog refused or did not answer


@dataclass(frozen=True)
class Status:
    source: Optional[str]  # its name among several sources
    pipeline: BufferStatus
    tables: dict[str, TableStatus]  # by source table
    slot: Optional[SlotStatus] = None  # Postgres
    partitions: Optional[list[PartitionStatus]] = None  # Kafka
    broker_error: Optional[str] = None  # Kafka: the broker could not be read
    catalog: Optional[CatalogStatus] = None


def status(lake: Lake) -> list[Status]:
    """Where each source of the pipeline stands."""
    return [_status(source) for source in lake.sources]


def _catalog(source: LakeSource) -> CatalogStatus:
    config = source.config
    cat = config.sink.catalog
    if cat.type != "rest":
        return CatalogStatus(cat.type, cat.name, False,
                             f"commits one table at a time (a {cat.type} catalog cannot commit "
                             "several tables at once)")
    try:
        endpoints = check_catalog(config)
    except WalbergError as exc:
        return CatalogStatus(cat.type, cat.name, False, "unknown", error=str(exc))
    return CatalogStatus(cat.type, cat.name,
                         commits_together(endpoints, config.sink.atomic_commits),
                         describe_rest(endpoints, config.sink.atomic_commits))


def _status(source: LakeSource) -> Status:
    catalog = _catalog(source)
    return replace(_source_status(source), catalog=catalog)


def _source_status(source: LakeSource) -> Status:
    summaries = {t: _summary(source, target) for t, target in source.targets.items()}
    tables = {t: replace(_table(source.targets[t], s, source.tag), shared=source.tag is not None)
              for t, s in summaries.items()}
    buffer = _buffer(source.config.segment_dir)
    if source.kind == "kafka":
        held: dict[tuple[str, int], int] = {}
        for s in summaries.values():
            held.update(s.offsets if s is not None else {})
        try:
            partitions = _partitions(source, held)
        except WalbergError as exc:
            return Status(source.name, buffer, tables, broker_error=str(exc))
        return Status(source.name, buffer, tables, partitions=partitions)
    ages = _waiting(source.config.segment_dir,
                    {t: Lsn.parse(x.last_lsn) if x.last_lsn else Lsn(0) for t, x in tables.items()})
    slot = _slot(source)
    if not buffer.running and (slot.lag_bytes or 0) > 0:
        # No walberg reads the slot: what it holds past its confirmed position is not in the
        # segment files, so "nothing waits" is not known of any table.
        ages = {t: age or None for t, age in ages.items()}
    tables = {t: replace(x, waiting_s=ages.get(t)) for t, x in tables.items()}
    return Status(source.name, buffer, tables, slot=slot)


def _waiting(directory: Path, held: dict[str, Lsn],
             budget_s: float = 2.0) -> dict[str, Optional[float]]:
    """Per table, how long ago its oldest transaction that the segment files hold and the lake
    does not (its commit LSN past the table's mark) committed at the source: what the lake
    is behind by, for that table. Read from the files alone (a running walberg is not asked),
    oldest segment first, for at most ``budget_s``: a table not met by then is None (unknown)
    if the files were not read through, else 0. Transactions still open are not counted: they
    have not committed."""
    try:
        files = sorted((int(m.group(1)), m.group(2) == "sealed", directory / e)
                       for e in os.listdir(directory) if (m := NAME.match(e)))
    except OSError:
        return {}
    names: dict[int, str] = {}
    oldest: dict[str, int] = {}
    touched: set[int] = set()
    deadline = time.monotonic() + budget_s
    complete = True
    change = (Tag.INSERT, Tag.UPDATE, Tag.DELETE)
    for _, sealed, path in files:
        if time.monotonic() > deadline:
            complete = False
            break
        try:
            with Mapped(path) as data:
                check_magic(data)
                for _lsn, _kind, payload in Scanner(data, sealed=sealed):
                    tag = payload[0] if payload else 0
                    if tag in change:
                        touched.add(int.from_bytes(payload[1:5], "big"))
                    elif tag == Tag.BEGIN:
                        touched = set()
                    elif tag == Tag.COMMIT:
                        end, ts = commit_end_lsn(payload), commit_time(payload)
                        for oid in touched:
                            table = names.get(oid)
                            if table in held and end > held[table]:
                                oldest.setdefault(table, ts)
                        touched = set()
                    elif tag == Tag.TRUNCATE:
                        count = int.from_bytes(payload[1:5], "big")
                        touched.update(int.from_bytes(payload[6 + 4 * i:10 + 4 * i], "big")
                                       for i in range(count))
                    elif tag == Tag.RELATION:
                        rel = Decoder().decode(bytes(payload))
                        names[rel.oid] = rel.qualified_name  # type: ignore[union-attr]
        except (OSError, WalbergError):
            complete = False  # (a file renamed or removed as it was read: a running walberg)
    now = time.time()
    return {t: max(now - pg_epoch(oldest[t]), 0.0) if t in oldest else (0.0 if complete else None)
            for t in held}


def _buffer(directory: Path) -> BufferStatus:
    state = inspect_directory(directory)
    running = state.holder_pid is not None
    waiting: Optional[float] = None
    told = read_freshness(directory) if running else None
    if told is not None and time.time() - told[0] < 30:  # (said within the last seconds)
        waiting = 0.0 if told[1] is None else max(time.time() - told[1], 0.0)
    return BufferStatus(running=running, pid=state.holder_pid,
                        segment_dir=str(directory), pending_segments=state.sealed_segments,
                        pending_bytes=state.sealed_bytes + state.active_bytes,
                        oldest_waiting_s=waiting)


def _summary(source: LakeSource, target: str) -> Optional[TableSummary]:
    """The table's metadata: the files of a local hadoop warehouse, else read through the
    catalog (None: the table does not exist yet, or the catalog could not be read, with a
    warning saying why)."""
    try:
        return source.table_summary(target)
    except Exception as exc:  # status reports what it can; a catalog it cannot read is a line
        if source.local_metadata(target) is not None:
            raise  # (a file of a local warehouse: not the catalog's trouble)
        log.warning("could not read %s through the catalog (%s): %s", target,
                    source.config.sink.catalog.type, " ".join(str(exc).split())[:300])
        return None


def _table(target: str, summary: Optional[TableSummary],
           shared_by: Optional[str] = None) -> TableStatus:
    if summary is None:
        return TableStatus(target, None, None, None, None, None, None, 0)
    return TableStatus(
        iceberg_table=target, snapshot_id=summary.snapshot_id, last_lsn=summary.walberg_lsn,
        last_commit_at=_iso(summary.walberg_committed_at_ms), rows=summary.records,
        data_files=summary.data_files, delete_files=summary.delete_files,
        snapshots=summary.snapshots, parked=parked_why(summary.properties, shared_by))


def _slot(source: LakeSource) -> SlotStatus:
    src = source.postgres
    try:
        conn = pg.connect(src.dsn)
    except Transient as exc:
        return SlotStatus(error=str(exc))
    try:
        state = slots.slot_state(conn, src.slot)
        now = pg.current_wal_lsn(conn)
    except WalbergError as exc:
        return SlotStatus(error=str(exc))
    finally:
        conn.close()
    if state is None:
        return SlotStatus(name=src.slot, missing=True)
    retained = max(int(now) - int(state.restart_lsn), 0)
    return SlotStatus(
        name=state.name, confirmed_flush_lsn=str(state.confirmed_flush),
        server_wal_lsn=str(now), lag_bytes=max(int(now) - int(state.confirmed_flush), 0),
        retained_wal_bytes=retained, wal_status=state.wal_status,
        safe_wal_bytes=state.safe_wal_size, failover=state.failover,
        active_pid=state.active_pid, warning=_slot_warning(state, retained))


def _slot_warning(state: slots.SlotState, retained: int) -> Optional[str]:
    """Say so before the server invalidates the slot: once it has, every table must be copied
    again. 'unreserved': the WAL is past max_slot_wal_keep_size and goes at the next
    checkpoint; and a slot whose remaining room is no more than what it holds already."""
    safe = state.safe_wal_size
    if state.wal_status != "unreserved" and (safe is None or safe > retained):
        return None
    room = ("none" if safe is None or safe <= 0 else f"{safe / 2**20:,.0f} MiB")
    return (f"slot {state.name} is about to be invalidated (wal_status {state.wal_status}, "
            f"room left before max_slot_wal_keep_size: {room}, held: {retained / 2**20:,.0f} "
            "MiB): once it is, every table must be copied again. Let walberg catch up (is it "
            "running? see the lag), or raise max_slot_wal_keep_size.")


def _partitions(source: LakeSource, held: dict[tuple[str, int], int]) -> list[PartitionStatus]:
    settings = source.config.source.kafka
    assert settings is not None
    consumer = kafka.Consumer(settings.bootstrap_servers, settings.group_id, settings.properties)
    try:
        out = []
        for topic, partition in consumer.partitions(list(source.topics.values())):
            end = consumer.high_watermark(topic, partition)
            lake = held.get((topic, partition))
            out.append(PartitionStatus(topic, partition, lake, end, max(end - (lake or 0), 0)))
        return out
    finally:
        consumer.close()


def _iso(ms: Optional[int]) -> Optional[str]:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")
