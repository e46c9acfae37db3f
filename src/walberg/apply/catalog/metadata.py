"""Reading an Iceberg table's metadata without Spark, for `walberg status` and `walberg history`:
the current snapshot, the LSN (or the Kafka offsets) of walberg's last commit, sizes, and the
snapshot log. Read here from a local hadoop warehouse (``<warehouse>/<namespace>/<table>/
metadata/v<N>.metadata.json`` + ``version-hint.text``); ``summarize`` also takes metadata read
through other catalogs (apply.catalog.catalog_reads). No JVM to start, so these answer in well under a
second where a Spark session takes several."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional

from walberg.apply.session import (
    LSN_PROPERTY,
    OFFSET_PROPERTY,
    OFFSETS_PAST_PROPERTY,
    offsets_past,
)
from walberg.model import Lsn


@dataclass(frozen=True)
class TableSummary:
    snapshot_id: Optional[int]
    committed_at_ms: Optional[int]
    walberg_lsn: Optional[str]  # the highest a walberg commit of the current history covers
    walberg_committed_at_ms: Optional[int]
    records: Optional[int]  # live rows: records in data files less position-deleted ones
    data_files: Optional[int]
    delete_files: Optional[int]
    snapshots: int
    # Kafka: the next offset of each (topic, partition) the current history covers.
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    # The table's properties of walberg's own (``walberg.*``: a park, see runtime.parking).
    properties: dict[str, str] = field(default_factory=dict)


def newest_version(names: Iterable[str]) -> Optional[int]:
    """The highest N among metadata file names ``v<N>.metadata.json``, or None if none is one."""
    versions = [int(m.group(1)) for m in map(_VERSION_FILE.fullmatch, names) if m]
    return max(versions, default=None)


_VERSION_FILE = re.compile(r"v(\d+)\.metadata\.json")


def _current_metadata(warehouse: Path, namespace: str, table: str) -> Optional[dict[str, Any]]:
    meta_dir = warehouse / namespace / table / "metadata"
    try:
        version: Optional[int] = int((meta_dir / "version-hint.text").read_text().strip())
    except FileNotFoundError:
        # A hadoop catalog's commit deletes the hint and then renames the new one in: read in
        # between, it is missing for a moment. The metadata files say the same (Iceberg's own
        # reader takes the highest when there is no hint).
        names = [p.name for p in meta_dir.iterdir()] if meta_dir.is_dir() else []
        version = newest_version(names)
        if version is None:
            return None
    meta: dict[str, Any] = json.loads((meta_dir / f"v{version}.metadata.json").read_text())
    return meta


def read_hadoop_history(warehouse: Path, namespace: str, table: str,
                        lsn_property: str = LSN_PROPERTY) -> Optional[list[dict[str, Any]]]:
    """What Iceberg's ``history`` metadata table joined with ``snapshots`` says, read from the
    metadata file: every snapshot the table made current, oldest first, with whether it is
    an ancestor of the current one, its operation, the LSN mark and the records it added and
    deleted. None if the table does not exist."""
    meta = _current_metadata(warehouse, namespace, table)
    if meta is None:
        return None
    snapshots = {s["snapshot-id"]: s for s in meta.get("snapshots", [])}
    ancestors: set[int] = set()
    walk = snapshots.get(meta.get("current-snapshot-id"))
    while walk is not None:
        ancestors.add(walk["snapshot-id"])
        walk = snapshots.get(walk.get("parent-snapshot-id"))
    rows = []
    for entry in meta.get("snapshot-log", []):
        snap = snapshots.get(entry["snapshot-id"], {})
        summary = snap.get("summary", {})
        rows.append({
            "made_current_at": datetime.fromtimestamp(entry["timestamp-ms"] / 1000, timezone.utc)
            .replace(tzinfo=None),
            "snapshot_id": entry["snapshot-id"], "operation": summary.get("operation"),
            "is_current_ancestor": entry["snapshot-id"] in ancestors,
            "lsn": summary.get(lsn_property), "added": summary.get("added-records"),
            "deleted": summary.get("deleted-records"),
            "pos_deletes": summary.get("added-position-deletes"),
        })
    return rows


def read_hadoop_table(warehouse: Path, namespace: str, table: str,
                      lsn_property: str = LSN_PROPERTY) -> Optional[TableSummary]:
    """The summary of a hadoop-catalog table, or None if it does not exist. ``lsn_property``:
    the summary key of the LSN to report (``walberg.lsn.<source>`` in a shared table)."""
    meta = _current_metadata(warehouse, namespace, table)
    return None if meta is None else summarize(meta, lsn_property)


def summarize(meta: dict[str, Any], lsn_property: str = LSN_PROPERTY) -> TableSummary:
    """The summary of a table from its current metadata (the metadata file's JSON), however
    it was read (see apply.catalog.catalog_reads for catalogs other than a local hadoop warehouse)."""
    snapshots = {s["snapshot-id"]: s for s in meta.get("snapshots", [])}
    current_id = meta.get("current-snapshot-id")
    current = snapshots.get(current_id) if current_id not in (None, -1) else None
    lsn: Optional[str] = None
    lsn_at: Optional[int] = None
    offsets: dict[tuple[str, int], int] = {}
    prefix = OFFSET_PROPERTY + "."
    # The whole current history: the highest LSN, as the run reads it (a maintenance commit
    # may carry an older one than the commit it raced), and when it was first committed (a
    # maintenance commit carries its parent's).
    walk = current
    ancestry: set[int] = set()
    while walk is not None:
        ancestry.add(walk["snapshot-id"])
        summary = walk.get("summary", {})
        if lsn_property in summary and (lsn is None or Lsn.parse(summary[lsn_property])
                                        >= Lsn.parse(lsn)):
            lsn, lsn_at = summary[lsn_property], walk.get("timestamp-ms")
        for key, value in summary.items():
            if key.startswith(prefix):
                topic, _, partition = key[len(prefix):].rpartition(".")
                offsets[(topic, int(partition))] = max(int(value),
                                                       offsets.get((topic, int(partition)), 0))
                if lsn is None and lsn_at is None:
                    lsn_at = walk.get("timestamp-ms")
        walk = snapshots.get(walk.get("parent-snapshot-id"))
    properties = meta.get("properties") or {}
    for tp, o in offsets_past(properties.get(OFFSETS_PAST_PROPERTY), ancestry).items():
        if tp in offsets:  # (offsets that held no record, past the last commit: see the key)
            offsets[tp] = max(offsets[tp], o)

    def total(key: str) -> Optional[int]:
        if current is None:
            return None
        value = current.get("summary", {}).get(key)
        return int(value) if value is not None else None

    return TableSummary(
        snapshot_id=current["snapshot-id"] if current else None,
        committed_at_ms=current.get("timestamp-ms") if current else None,
        walberg_lsn=lsn, walberg_committed_at_ms=lsn_at,
        records=(None if current is None
                 else (total("total-records") or 0) - (total("total-position-deletes") or 0)),
        data_files=total("total-data-files"),
        delete_files=total("total-delete-files"), snapshots=len(snapshots), offsets=offsets,
        properties={k: str(v) for k, v in properties.items()
                    if k.startswith("walberg.")},
    )
