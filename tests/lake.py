"""Reading the lake back with an engine other than Spark (PyIceberg), and Postgres rows in the same
shape, so tests compare the two sides value by value."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from pyiceberg.table import StaticTable


def hadoop_table(warehouse: Path, target: str) -> StaticTable:
    """The current version of an Iceberg table (catalog.namespace.table) of the hadoop catalog
    in ``warehouse``, for PyIceberg: the metadata file that version-hint.text names."""
    _, namespace, table = target.split(".")
    meta_dir = warehouse / namespace / table / "metadata"
    try:
        version = int((meta_dir / "version-hint.text").read_text().strip())
    except FileNotFoundError:
        # A commit replaces the hint by deleting it and renaming a new one in: read while a
        # run commits, it may be missing for a moment. The versions are on disk either way (as
        # Iceberg's own reader does without a hint).
        version = max(int(f.name[1:].split(".", 1)[0]) for f in meta_dir.glob("v*.metadata.json"))
    # The hint is written after a commit renames its metadata file in: newer versions may lie past it
    # (Iceberg's own reader looks for them too).
    while (meta_dir / f"v{version + 1}.metadata.json").exists():
        version += 1
    return StaticTable.from_metadata(str(meta_dir / f"v{version}.metadata.json"))


def iceberg_rows(warehouse: Path, target: str, key: str = "id",
                 keep_own: bool = False) -> list[dict[str, Any]]:
    """All rows of an Iceberg table of the hadoop catalog, read by PyIceberg, sorted by ``key``,
    without walberg's own columns unless ``keep_own``."""
    rows = hadoop_table(warehouse, target).scan().to_arrow().to_pylist()
    if not keep_own:
        rows = [{k: v for k, v in r.items() if not k.startswith("_walberg_")} for r in rows]
    return sorted(rows, key=lambda r: r[key])


def postgres_rows(conn: Any, table: str, key: str = "id") -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {table} ORDER BY {key}")
        names = [d[0] for d in cur.description]
        # (bytea as bytes: psycopg2's memoryview need not compare equal once its row is gone)
        return [{n: bytes(v) if isinstance(v, memoryview) else v
                 for n, v in zip(names, row, strict=False)} for row in cur.fetchall()]


def snapshot_lsns(warehouse: Path, target: str) -> list[str]:
    return [s.summary.additional_properties.get("walberg.lsn")
            for s in hadoop_table(warehouse, target).snapshots()]


__all__ = ["hadoop_table", "iceberg_rows", "postgres_rows", "snapshot_lsns", "Decimal"]


def duckdb_rows(warehouse: Path, target: str, key: str = "id") -> list[dict[str, Any]]:
    """The same as ``iceberg_rows``, read by DuckDB's iceberg extension (loaded from the
    duckdb-extension-* wheels, offline)."""
    import os

    import duckdb
    import duckdb_extension_avro
    import duckdb_extension_iceberg

    def ext(module: Any, name: str) -> str:
        return os.path.join(os.path.dirname(module.__file__), "extensions",
                            f"v{duckdb.__version__}", f"{name}.duckdb_extension")

    con = duckdb.connect(config={"autoinstall_known_extensions": "false",
                                 "autoload_known_extensions": "false",
                                 "allow_unsigned_extensions": "true"})
    try:
        con.execute(f"LOAD '{ext(duckdb_extension_avro, 'avro')}'")
        con.execute(f"LOAD '{ext(duckdb_extension_iceberg, 'iceberg')}'")
        _, namespace, table = target.split(".")
        cur = con.execute(f"SELECT * FROM iceberg_scan('{warehouse / namespace / table}')")
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()
    rows = [{k: v for k, v in r.items() if not k.startswith("_walberg_")} for r in rows]
    return sorted(rows, key=lambda r: r[key])
