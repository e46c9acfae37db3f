"""`walberg changes`: the net inserts, updates and deletes of a table between two points of its
history, as one Spark SQL statement (for incremental downstream jobs)."""

from __future__ import annotations

from typing import Optional

from walberg.apply.iceberg import quote_target
from walberg.apply.types import quote
from walberg.lake.services import Lake, LakeSource
from walberg.source import postgres as pg


def changes_sql(lake: Lake, table: str, start: str, end: Optional[str] = None) -> str:
    """Spark SQL for the net changes to a table between two points of its history (snapshot
    ids or timestamps; ``end`` defaults to now): one row per changed key with ``_change``
    (insert, update or delete) and the row's values (the old ones for a delete)."""
    source, target = lake.find(table)
    names = [n for n, _ in lake.sink(source).schema(target)]
    keys = [k for k in _keys(source, table) if k in names] or names
    t = quote_target(target)

    def at(point: Optional[str]) -> str:
        if point is None:
            return t
        if point.strip().isdigit():
            return f"{t} VERSION AS OF {int(point)}"
        return f"{t} TIMESTAMP AS OF '{point.replace(chr(39), '')}'"

    on = " AND ".join(f"o.{quote(k)} <=> n.{quote(k)}" for k in keys)
    lsn = quote("_walberg_lsn")
    first_key = quote(keys[0])
    change = (f"CASE WHEN o.{lsn} IS NULL THEN 'insert' WHEN n.{lsn} IS NULL THEN 'delete' "
              "ELSE 'update' END AS _change")
    cols = ", ".join(f"CASE WHEN n.{lsn} IS NULL THEN o.{quote(c)} ELSE n.{quote(c)} END "
                     f"AS {quote(c)}" for c in names + ["_walberg_lsn"])
    return (f"SELECT {change}, {cols} FROM (SELECT * FROM {at(start)}) o "
            f"FULL OUTER JOIN (SELECT * FROM {at(end)}) n ON {on} "
            f"WHERE o.{lsn} IS NULL OR n.{lsn} IS NULL OR o.{lsn} <> n.{lsn} "
            f"ORDER BY coalesce(n.{first_key}, o.{first_key})")


def _keys(source: LakeSource, table: str) -> list[str]:
    """The table's key columns: Postgres's replica identity, or a Kafka topic's configured
    key (none: every column keys a row)."""
    name = source.resolve(table)
    assert name is not None
    if source.kind == "kafka":
        kafka = source.config.source.kafka
        assert kafka is not None
        chosen = kafka.tables.get(source.topics[name])
        return list(chosen.key) if chosen is not None else []
    conn = pg.connect(source.postgres.dsn)
    try:
        return [c.name for c in pg.describe_table(conn, name).columns if c.is_key]
    finally:
        conn.close()
