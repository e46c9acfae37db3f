"""Reading the lake back with an engine other than Spark (PyIceberg), and Postgres rows in the same
shape, so tests compare the two sides value by value."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from pyiceberg.table import StaticTable


def iceberg_rows(warehouse: Path, target: str, key: str = "id") -> list[dict[str, Any]]:
    """All rows of an Iceberg table of the hadoop catalog, read by PyIceberg, sorted by ``key``,
    without walberg's own columns."""
    _, namespace, table = target.split(".")
    meta_dir = warehouse / namespace / table / "metadata"
    version = (meta_dir / "version-hint.text").read_text().strip()
    tbl = StaticTable.from_metadata(str(meta_dir / f"v{version}.metadata.json"))
    rows = tbl.scan().to_arrow().to_pylist()
    rows = [{k: v for k, v in r.items() if not k.startswith("_walberg_")} for r in rows]
    return sorted(rows, key=lambda r: r[key])


def postgres_rows(conn: Any, table: str, key: str = "id") -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {table} ORDER BY {key}")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=False)) for row in cur.fetchall()]


def snapshot_lsns(warehouse: Path, target: str) -> list[str]:
    _, namespace, table = target.split(".")
    meta_dir = warehouse / namespace / table / "metadata"
    version = (meta_dir / "version-hint.text").read_text().strip()
    tbl = StaticTable.from_metadata(str(meta_dir / f"v{version}.metadata.json"))
    return [s.summary.additional_properties.get("walberg.lsn") for s in tbl.snapshots()]


__all__ = ["iceberg_rows", "postgres_rows", "snapshot_lsns", "Decimal"]
