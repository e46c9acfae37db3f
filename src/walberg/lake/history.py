"""`walberg history`: the snapshots of a table's Iceberg table, oldest first, each with the
source position (``walberg.lsn``) its data covers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

from walberg.apply.catalog.metadata import read_hadoop_history
from walberg.lake.services import Lake


@dataclass(frozen=True)
class Snapshot:
    committed_at: datetime  # when it became the table's current snapshot
    snapshot_id: int
    operation: str  # append, overwrite, delete, replace (maintenance)
    current: bool  # in the table's current history (not rolled back)
    lsn: Optional[str]  # walberg.lsn of a walberg commit, or of a maintenance commit after one
    added: int  # rows added
    deleted: int  # rows deleted, or position deletes added


def history(lake: Lake, table: str) -> list[Snapshot]:
    """The snapshots of a source table's Iceberg table, oldest first. A table of a hadoop
    catalog in a local warehouse is read from its metadata file, with no Spark session to
    start (well under a second instead of several); other catalogs go through Spark."""
    source, target = lake.find(table)
    local = source.local_metadata(target)
    found = None if local is None else read_hadoop_history(*local, source.lsn_property)
    if found is not None:
        return [_snapshot(h) for h in found]
    return [_snapshot(h) for h in lake.sink(source).history(target)]


def _snapshot(h: dict[str, Any]) -> Snapshot:
    def count(key: str) -> int:
        return int(h[key]) if h[key] is not None else 0

    return Snapshot(committed_at=h["made_current_at"], snapshot_id=int(h["snapshot_id"]),
                    operation=h["operation"], current=bool(h["is_current_ancestor"]),
                    lsn=h["lsn"], added=count("added"),
                    deleted=count("pos_deletes") or count("deleted"))
