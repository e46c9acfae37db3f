"""The initial copy: read a table inside the snapshot a replication slot exported, as CSV.

The copy runs ``COPY ... TO STDOUT`` straight into a file the caller opened (a named pipe whose
reader parses the rows as they come), so memory stays flat whatever the table's size. Values
come out through the same output functions and session settings as the stream's, so both
paths hand identical text to the apply stage.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Optional

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from walberg.errors import SourceError
from walberg.source.postgres import TableInfo, connect, quote_table, session_params

log = logging.getLogger("walberg")


@contextmanager
def in_snapshot(dsn: str, snapshot_name: Optional[str], reading: Optional[str] = None
                ) -> Iterator[Any]:
    """A read-only connection whose transaction sees exactly the snapshot ``snapshot_name``
    (a slot's exported snapshot; None: a snapshot of its own), rolled back and closed after.
    ``reading``: the table the copy reads through it while another connection holds its lock
    (``hold_and_check``): a lock waited for ``LOCK_WAIT`` raises CopyBlocked."""
    conn: Any = connect(dsn, autocommit=False)
    try:
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        with conn.cursor() as cur:
            if snapshot_name:
                cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
            if reading is not None:
                cur.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")
        try:
            yield conn
        except psycopg2.errors.LockNotAvailable:
            if reading is None:
                raise
            raise CopyBlocked(reading) from None
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


def copy_table(dsn: str, table: TableInfo, out: BinaryIO, snapshot_name: Optional[str],
               psql: Optional[Path] = None) -> Optional[int]:
    """Write every row of ``table`` to ``out`` (a file open for writing) as CSV (NULL
    unquoted-empty, empty string quoted). Returns the number of rows, or None when ``psql``
    sent them (it does not say how many; the reader counts them). With ``snapshot_name`` the
    read sees exactly that snapshot.

    The rows go through ``psql`` (the embedded PostgreSQL's client, given by the caller) where
    it can make the same connection: psycopg2 hands each row to Python (an object and a call
    a row, taking the interpreter's lock each time: about 3 CPU-seconds per 10M rows, on the
    copy's critical path), while psql writes them straight into the pipe. That client has no TLS or
    GSSAPI, so it is used only when psycopg2's own connection to the server is not encrypted
    (and for a single host, without a service file); otherwise, or if psql cannot connect,
    psycopg2 copies as before. ``WALBERG_COPY_CLIENT=psycopg2`` keeps psycopg2 always."""
    # Exactly what the publication publishes: its columns, its rows (row filter).
    query = sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT WITH (FORMAT csv)").format(
        sql.SQL(", ").join(sql.Identifier(c.name) for c in table.columns),
        sql.SQL(table.rows_sql()),
    )
    try:
        with in_snapshot(dsn, snapshot_name, table.qualified_name) as conn, \
                conn.cursor() as cur:
            if psql is not None and (psql, dsn) not in _REFUSED and _in_the_clear(conn, dsn) \
                    and _copy_by_psql(psql, dsn, query.as_string(conn), out, snapshot_name, table):
                return None
            cur.copy_expert(query, out, size=1 << 20)
            return int(cur.rowcount)
    except psycopg2.Error as exc:
        raise _copy_failed(table, str(exc).strip()) from None


# How long a copy's COPY waits for its lock on the table. The copy holds that lock already on
# another connection (``hold_and_check``), so COPY waits only behind a request that conflicts
# with it, which came since and waits for the copy's own lock: an ALTER TABLE, TRUNCATE,
# VACUUM FULL or LOCK. Neither would ever go on, and the application's queries on the table
# would queue behind the ALTER.
LOCK_WAIT = "5s"


class CopyBlocked(SourceError):
    """A table's COPY waited ``LOCK_WAIT`` behind a request for a lock that conflicts with the
    one the copy holds (see ``LOCK_WAIT``): nothing was copied."""

    def __init__(self, table: str) -> None:
        super().__init__(
            f"the initial copy of {table} waited {LOCK_WAIT} behind another session's request "
            "for a lock on it (an ALTER TABLE, TRUNCATE, VACUUM FULL or LOCK TABLE) that waits "
            "for the copy's own lock: neither could go on")
        self.table = table


# The psql programs that could not connect to a DSN as psycopg2 did, or not be run, this
# process: not tried again (a copy of each of a thousand tables said so each time).
_REFUSED: set[tuple[Path, str]] = set()


def _copy_failed(table: TableInfo, reason: str) -> SourceError:
    """The initial copy of ``table`` failed for ``reason``, said with what to do."""
    return SourceError(
        f"the initial copy of {table.qualified_name} failed: {reason}. "
        "The role needs SELECT on the table; if the snapshot is gone, run walberg again.")


def _in_the_clear(conn: Any, dsn: str) -> bool:
    """Whether psql may copy for ``conn`` (see ``copy_table``): the connection is not
    encrypted, the DSN names one host and no service file, and WALBERG_COPY_CLIENT allows."""
    if os.environ.get("WALBERG_COPY_CLIENT", "").lower() == "psycopg2":
        return False
    params = psycopg2.extensions.parse_dsn(dsn)
    hosts = (params.get(k) or os.environ.get(f"PG{k.upper()}", "")
             for k in ("host", "hostaddr", "port"))
    if any("," in v for v in hosts) or "service" in params or \
            "PGSERVICE" in os.environ or conn.info.ssl_in_use:
        return False
    if conn.server_version >= 120000:
        with conn.cursor() as cur:
            cur.execute("SELECT encrypted FROM pg_stat_gssapi WHERE pid = pg_backend_pid()")
            found = cur.fetchone()
            if found is not None and found[0]:
                return False
    return True


def _copy_by_psql(psql: Path, dsn: str, query: str, out: Any, snapshot_name: Optional[str],
                  table: TableInfo) -> bool:
    """Run ``query`` (COPY ... TO STDOUT) in ``psql`` in the snapshot ``snapshot_name``, its
    output into ``out``. False if psql could not connect (nothing was written: the caller
    copies through psycopg2 instead); raises SourceError if the copy failed."""
    command, env = psql_invocation(psql, dsn)
    script = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;\n"
    if snapshot_name:
        quoted = snapshot_name.replace("'", "''")
        script += f"SET TRANSACTION SNAPSHOT '{quoted}';\n"
    script += f"SET LOCAL lock_timeout = '{LOCK_WAIT}';\n{query};\nROLLBACK;\n"
    out.flush()
    log.debug("the initial copy of %s goes through %s", table.qualified_name, psql)
    # In a process group of its own: a Ctrl-C meant for walberg (which stops after the
    # current step) does not cancel the COPY under it.
    try:
        done = subprocess.run(command, input=script.encode(), stdout=out.fileno(),
                              stderr=subprocess.PIPE, env=env, process_group=0)
    except OSError as exc:  # (it could not be run at all)
        _REFUSED.add((psql, dsn))
        log.warning("the initial copy of %s goes through psycopg2: %s cannot be run (%s)",
                    table.qualified_name, psql, exc)
        return False
    if done.returncode == 0:
        return True
    said = " ".join(done.stderr.decode(errors="replace").split())
    # No connection, or the program could not start (the loader's exit code): nothing was
    # written.
    if said.startswith("psql: error:") or done.returncode == 127:
        _REFUSED.add((psql, dsn))
        log.warning("the initial copy of %s goes through psycopg2, as will the others this "
                    "run: psql could not connect as it did (%s)", table.qualified_name, said)
        return False
    said = said.split("ERROR:", 1)[-1].strip() if "ERROR:" in said else said
    if said.startswith("canceling statement due to lock timeout"):
        raise CopyBlocked(table.qualified_name)
    raise _copy_failed(table, said or f"psql ended with code {done.returncode}")


def psql_invocation(psql: Path, dsn: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run a script from standard input in ``psql``,
    connected as ``dsn`` says with walberg's session settings, in the clear: quiet (no
    command tags among the rows), no psqlrc, stopping at the first error, never asking for a
    password (-w). The password goes in the child's environment (PGPASSWORD), which only its
    user can read, not on its command line, which every user can."""
    params = session_params(dsn)
    env = dict(os.environ)
    password = params.pop("password", None)
    if password is not None:
        env["PGPASSWORD"] = password
    params.update(sslmode="disable", gssencmode="disable")
    conninfo = psycopg2.extensions.make_dsn(**params)
    return [str(psql), "-X", "-q", "-w", "-v", "ON_ERROR_STOP=1", "-f", "-", conninfo], env
