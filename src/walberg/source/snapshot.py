"""The initial copy: read a table inside the snapshot a replication slot exported, as CSV.

The copy runs ``COPY ... TO STDOUT`` straight into a local file, so memory stays flat whatever the
table's size. Values come out through the same output functions and session settings as the
stream's, so both paths hand identical text to the apply stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import psycopg2
from psycopg2 import sql

from walberg.errors import SourceError
from walberg.source.postgres import TableInfo, connect, quote_table


@contextmanager
def in_snapshot(dsn: str, snapshot_name: Optional[str]) -> Iterator[Any]:
    """A read-only connection whose transaction sees exactly the snapshot ``snapshot_name``
    (a slot's exported snapshot; None: a snapshot of its own), rolled back and closed after."""
    conn: Any = connect(dsn, autocommit=False)
    try:
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        if snapshot_name:
            with conn.cursor() as cur:
                cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
        yield conn
        conn.rollback()
    finally:
        conn.close()


def hold_and_check(conn: Any, table: TableInfo) -> list[str]:
    """Lock ``table`` (ACCESS SHARE, with its partitions: the lock COPY itself takes) in
    ``conn``'s transaction, held until it ends, and return the relations of it (the table, or
    its partitions) whose storage was replaced since the transaction's snapshot. One snapshot
    serves every table of a copy, so a table copied after others may have been rewritten
    meanwhile (ALTER TABLE ... TYPE, VACUUM FULL, CLUSTER, TRUNCATE): its rows then sit in a
    new file that the older snapshot reads as empty, PostgreSQL's documented MVCC caveat, and
    the stream never carries them again. pg_class as the snapshot has it against the file the
    server uses now (read once the lock is held) tells."""
    with conn.cursor() as cur:
        cur.execute(f"LOCK TABLE {table.own_rows_sql()} IN ACCESS SHARE MODE")
        cur.execute(
            "WITH RECURSIVE tree(oid) AS ("
            "  SELECT %s::regclass::oid"
            "  UNION ALL SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.oid"
            "  WHERE %s) "
            "SELECT c.oid::regclass::text FROM tree JOIN pg_class c ON c.oid = tree.oid "
            "WHERE c.relkind IN ('r', 'm') "
            "AND c.relfilenode IS DISTINCT FROM pg_relation_filenode(c.oid) ORDER BY 1",
            (quote_table(table.qualified_name), table.partitioned))
        return [str(r[0]) for r in cur.fetchall()]


def copy_table(dsn: str, table: TableInfo, out_path: Path, snapshot_name: Optional[str]) -> int:
    """Write every row of ``table`` to ``out_path`` as CSV (NULL unquoted-empty, empty string
    quoted). Returns the number of rows. With ``snapshot_name`` the read sees exactly that
    snapshot."""
    # Exactly what the publication publishes: its columns, its rows (row filter).
    query = sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT WITH (FORMAT csv)").format(
        sql.SQL(", ").join(sql.Identifier(c.name) for c in table.columns),
        sql.SQL(table.rows_sql()),
    )
    try:
        # The output first: a named pipe opens once its reader comes, and a connection that
        # fails after that ends the reader's stream; one that failed before the pipe was open
        # left a reader that came later waiting for a writer for good.
        with open(out_path, "wb", buffering=1 << 20) as out, \
                in_snapshot(dsn, snapshot_name) as conn, conn.cursor() as cur:
            cur.copy_expert(query, out, size=1 << 20)
            return int(cur.rowcount)
    except psycopg2.Error as exc:
        raise SourceError(
            f"the initial copy of {table.qualified_name} failed: {str(exc).strip()}. "
            "The role needs SELECT on the table; if the snapshot is gone, run walberg again."
        ) from None
