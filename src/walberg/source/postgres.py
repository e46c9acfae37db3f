"""Talking to the source database outside the replication stream: connections with walberg's
session settings, catalog look-ups, publications and slots. psycopg2 lives only in source/."""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import psycopg2
import psycopg2.extensions
import psycopg2.extras
from psycopg2 import sql

from walberg.errors import SourceError, Transient
from walberg.model import Column, Lsn, PgType

log = logging.getLogger("walberg")

# What the driver raises for a statement the server refused (for callers outside this stage).
DatabaseError = psycopg2.Error

# Every connection (copy, replication, checks) renders values the same way, so the initial copy
# and the stream produce byte-identical text for the same value: one type path.
SESSION_OPTIONS = (
    "-c TimeZone=UTC -c DateStyle=ISO,YMD -c IntervalStyle=iso_8601 "
    "-c extra_float_digits=3 -c bytea_output=hex -c client_encoding=UTF8"
)


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or refused connection (the server restarting, say)."""
    return isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError))


def redact(dsn: str) -> str:
    """The DSN with any password removed, for messages and logs."""
    dsn = re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", dsn)
    return re.sub(r"(password\s*=\s*)(\S+)", r"\1***", dsn)


def session_params(dsn: str) -> dict[str, Any]:
    """``dsn``'s connection parameters with walberg's session settings after the user's own
    options, and walberg's application name unless it names one: what every connection
    walberg makes to the source uses (psycopg2's, and the copy's psql)."""
    params = psycopg2.extensions.parse_dsn(dsn)
    params["options"] = " ".join(filter(None, [params.get("options", ""), SESSION_OPTIONS]))
    params.setdefault("application_name", "walberg")
    return params


def connect(dsn: str, *, replication: bool = False, autocommit: bool = True) -> Any:
    """A psycopg2 connection with walberg's session settings; a failure names the server."""
    params = session_params(dsn)
    try:
        if replication:
            conn = psycopg2.connect(connection_factory=psycopg2.extras.LogicalReplicationConnection,
                                    **params)
        else:
            conn = psycopg2.connect(**params)
            conn.autocommit = autocommit
    except psycopg2.OperationalError as exc:
        reason = " ".join(str(exc).split())
        raise Transient(
            f"cannot connect to PostgreSQL at {redact(dsn)}: {reason} "
            "Check source.postgres.dsn, that the server is running, and pg_hba.conf."
        ) from None
    return conn


# What a read raises on a connection the server dropped since it was made (a restart, a
# failover) or that is closed: a new connection may succeed.
CONNECTION_LOST = (psycopg2.OperationalError, psycopg2.InterfaceError)


def connect_patiently(dsn: str, patience: float, what: str,
                      stop: Optional[threading.Event] = None,
                      waiting: Optional[Callable[[], None]] = None) -> Any:
    """``connect``, tried again with backoff (0.5 s doubling to 30 s) while the server cannot
    be reached (restarting, failing over), for up to ``patience`` seconds
    (source.postgres.reconnect_max_seconds): every connection a running walberg opens gets
    the same patience as its replication stream. ``what``: what the connection is for, for
    the log and the final error; ``waiting``: called before each wait."""
    started = time.monotonic()
    delay = 0.5
    while True:
        try:
            return connect(dsn)
        except Transient as exc:
            if time.monotonic() - started + delay > patience or (stop is not None
                                                               and stop.is_set()):
                raise Transient(f"{exc} (for {what}; gave up after {patience:.0f} s, "
                                "source.postgres.reconnect_max_seconds)") from None
            log.warning("%s; trying again in %.1f s (for %s)", " ".join(str(exc).split()),
                        delay, what)
            if waiting is not None:
                waiting()
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            delay = min(delay * 2, 30.0)


@dataclass(frozen=True)
class TableInfo:
    schema: str
    name: str
    oid: int
    replica_identity: str
    columns: tuple[Column, ...]
    estimated_rows: int
    dims: dict[str, int] = field(default_factory=dict)  # declared dimensions of array columns
    has_primary_key: bool = False
    # What the publication publishes of the table (see ``describe_table``): the row filter
    # (None: every row) and whether a column list leaves columns out.
    row_filter: Optional[str] = None
    column_list: bool = False
    # A partitioned table (its rows are its partitions', published under its name); an
    # ordinary table's rows are its own, without those of any inheritance children.
    partitioned: bool = False
    # Each column's number (pg_attribute.attnum): a column dropped and added again under the
    # same name and type has a new one, though pgoutput describes it the same.
    attnums: dict[str, int] = field(default_factory=dict)

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.name}"

    def own_rows_sql(self) -> str:
        """The table as a FROM item with the rows the stream sends under its name: an ordinary
        table ONLY, since each inheritance child is published as a table of its own (as
        PostgreSQL's subscriber copies it); a partitioned table with its partitions."""
        table = quote_table(self.qualified_name)
        return table if self.partitioned else f"ONLY {table}"

    def rows_sql(self) -> str:
        """A FROM item with exactly the rows the publication publishes of the table, for the
        initial copy and verify: the table's own rows, or those filtered by the row filter."""
        if self.row_filter is None:
            return self.own_rows_sql()
        return f"(SELECT * FROM {self.own_rows_sql()} WHERE {self.row_filter}) AS published"

    def describe_publishing(self) -> str:
        """What lands of the table, in words, for ``walberg check``."""
        columns = (f"columns ({', '.join(c.name for c in self.columns)})" if self.column_list
                   else "all columns")
        rows = f"rows WHERE {self.row_filter}" if self.row_filter else "all rows"
        return f"{self.qualified_name}: {rows}, {columns}"


def split_name(table: str) -> tuple[str, str]:
    schema, _, name = table.partition(".")
    return schema, name


def describe_table(conn: Any, table: str, publications: Sequence[str] = ()) -> TableInfo:
    """Columns (with the replica-identity key flag) exactly as pgoutput's Relation message has them.

    With ``publications`` (those the stream subscribes to), the table as they publish it: only
    the columns of their column list (and PostgreSQL 18's generated columns where published),
    and their row filter, combined as PostgreSQL's own subscriber combines them for its initial
    copy (see ``_combined``). Without, every ordinary column and every row."""
    return describe_tables(conn, [table], publications)[table]


def describe_tables(conn: Any, tables: Sequence[str],
                    publications: Sequence[str] = ()) -> dict[str, TableInfo]:
    """``describe_table`` of each of ``tables``, in three queries whatever their number: a
    start at 1,000 tables made four a table, and each look into ``pg_publication_tables``
    works out every table of the publications (30 ms cold, 3 ms warm at 1,000 tables)."""
    names = [split_name(t) for t in tables]
    if not names:
        return {}
    schemas, relnames = [n[0] for n in names], [n[1] for n in names]
    with conn.cursor() as cur:
        cur.execute(
            """SELECT n.nspname, c.relname, c.oid, c.relreplident, c.reltuples::bigint,
                      EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
                      c.relkind = 'p'
               FROM unnest(%s::text[], %s::text[]) AS w(nspname, relname)
               JOIN pg_namespace n ON n.nspname = w.nspname
               JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = w.relname
               WHERE c.relkind IN ('r', 'p')""",
            (schemas, relnames))
        classes = {(r[0], r[1]): r[2:] for r in cur.fetchall()}
        for table, key in zip(tables, names, strict=True):
            if key not in classes:
                raise SourceError(
                    f"table {table} (from source.postgres.tables) does not exist in the source "
                    "database. Create it, or fix the name (schema.table, case-sensitive)."
                )
        cur.execute(
            """SELECT a.attrelid, a.attname, a.atttypid, a.atttypmod,
                      coalesce(a.attnum = ANY(i.indkey), false), a.attndims, a.attgenerated <> '',
                      a.attnum
               FROM pg_attribute a
               JOIN pg_class c ON c.oid = a.attrelid
               LEFT JOIN LATERAL (
                   SELECT ix.indkey FROM pg_index ix
                   WHERE ix.indrelid = a.attrelid
                     AND ((c.relreplident = 'i' AND ix.indisreplident)
                          OR (c.relreplident = 'd' AND ix.indisprimary))
                   LIMIT 1) i ON true
               WHERE a.attrelid = ANY(%s::oid[]) AND a.attnum > 0 AND NOT a.attisdropped
               ORDER BY a.attrelid, a.attnum""",
            ([classes[k][0] for k in names],))
        attributes: dict[int, list[tuple[Any, ...]]] = {}
        for r in cur.fetchall():
            attributes.setdefault(int(r[0]), []).append(tuple(r[1:]))
        published: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
        version = server_version(conn)
        if publications and version >= 150000:
            cur.execute(
                """SELECT p.schemaname, p.tablename, p.pubname, p.attnames::text[], p.rowfilter
                   FROM pg_publication_tables p
                   JOIN unnest(%s::text[], %s::text[]) AS w(nspname, relname)
                     ON w.nspname = p.schemaname AND w.relname = p.tablename
                   WHERE p.pubname = ANY(%s)
                   ORDER BY p.pubname""",
                (schemas, relnames, list(publications)))
            for r in cur.fetchall():
                published.setdefault((r[0], r[1]), []).append(tuple(r[2:]))
    out: dict[str, TableInfo] = {}
    for table, key in zip(tables, names, strict=True):
        oid, identity, estimate, has_pk, partitioned = classes[key]
        rows = attributes.get(int(oid), [])
        publishes = _combined(table, published.get(key, []), [(r[0], r[5]) for r in rows],
                              version) if publications else Publishing(None, None)
        if publishes.columns is None:
            rows = [r for r in rows if not r[5]]  # generated columns are published only by name
        else:
            rows = [r for r in rows if r[0] in publishes.columns]
        cols = tuple(
            Column(name=r[0], type_oid=r[1], type_modifier=r[2],
                   is_key=bool(r[3]) or identity == "f")
            for r in rows
        )
        out[table] = TableInfo(key[0], key[1], oid, identity, cols, max(int(estimate), 0),
                               {r[0]: int(r[4]) for r in rows if r[4]}, bool(has_pk),
                               publishes.row_filter, publishes.column_list, bool(partitioned),
                               {r[0]: int(r[6]) for r in rows})
    return out


def column_numbers(conn: Any, table: str) -> Optional[dict[str, int]]:
    """Each column's number (attnum) as the catalog has it now; None if the table is gone."""
    schema, name = split_name(table)
    with conn.cursor() as cur:
        cur.execute(
            """SELECT a.attname, a.attnum FROM pg_attribute a
               JOIN pg_class c ON c.oid = a.attrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0
                 AND NOT a.attisdropped""",
            (schema, name))
        rows = cur.fetchall()
    return {r[0]: int(r[1]) for r in rows} or None


def inheritance_children(conn: Any, table: str) -> list[str]:
    """The tables that inherit from ``table`` (directly or further down; schema.table), not
    partitions: their rows are not the table's own."""
    schema, name = split_name(table)
    with conn.cursor() as cur:
        cur.execute(
            """WITH RECURSIVE down(oid) AS (
                   SELECT i.inhrelid FROM pg_inherits i
                   JOIN pg_class p ON p.oid = i.inhparent
                   JOIN pg_namespace n ON n.oid = p.relnamespace
                   WHERE n.nspname = %s AND p.relname = %s AND p.relkind = 'r'
                   UNION
                   SELECT i.inhrelid FROM pg_inherits i JOIN down ON i.inhparent = down.oid)
               SELECT n.nspname || '.' || c.relname FROM down
               JOIN pg_class c ON c.oid = down.oid
               JOIN pg_namespace n ON n.oid = c.relnamespace ORDER BY 1""",
            (schema, name))
        return [r[0] for r in cur.fetchall()]


@dataclass(frozen=True)
class Publishing:
    """What a set of publications publishes of one table."""

    columns: Optional[frozenset[str]]  # None: every column that is not generated
    row_filter: Optional[str]  # a boolean SQL expression; None: every row
    column_list: bool = False  # whether a column list leaves some columns out


def server_version(conn: Any) -> int:
    """The server's version as PostgreSQL numbers it (150004 for 15.4)."""
    return int(conn.server_version)


def _combined(table: str, found: Sequence[Sequence[Any]], every: Sequence[Sequence[Any]],
              version: int) -> Publishing:
    """The columns and rows a set of publications publish of ``table``, combined the way
    PostgreSQL's subscriber combines them for its initial copy: a row is published if any
    publication's row filter passes (a publication without a filter, or FOR ALL TABLES,
    publishes every row); the column lists must agree (PostgreSQL refuses to subscribe to
    publications that publish one table with different column lists). ``found``: each
    publication's (name, column list, row filter) for the table, by name; ``every``: each
    column's (name, generated).

    Row filters and column lists exist from PostgreSQL 15 on; generated columns are published
    from 18 on, when a column list names them or with ``publish_generated_columns = stored``."""
    if version < 150000 or not found:
        return Publishing(None, None)
    lists = {frozenset(attnames or ()) for _, attnames, _ in found}
    if len(lists) > 1:
        raise SourceError(
            f"publications {', '.join(p for p, _, _ in found)} publish {table} with "
            "different column lists, which PostgreSQL's subscribers refuse too. Give the table "
            "the same column list in each (ALTER PUBLICATION ... SET TABLE ... (columns)), or "
            "subscribe to one of them (source.postgres.publication).")
    generated = frozenset(n for n, gen in every if gen)
    ordinary = frozenset(n for n, gen in every if not gen)
    columns = lists.pop()
    if version < 180000:
        # Before PostgreSQL 18, attnames may name generated columns the stream never carries.
        columns = columns - generated
    filters = [f for _, _, f in found]
    row_filter = None if any(f is None for f in filters) else \
        " OR ".join(f"({f})" for f in sorted(set(filters)))
    return Publishing(columns, row_filter, column_list=not ordinary <= columns)


_CONSTANT = re.compile(r"^\(?(NULL|true|false|-?\d+(\.\d+)?|'(?:[^']|'')*')\)?"
                       r"(::[a-z ]+(\(\d+(,\d+)?\))?(\[\])?)?$")


def column_default(conn: Any, table: str, column: str) -> tuple[bool, Optional[str]]:
    """Whether the rows that existed when ``column`` was added got a value, and that value (as
    text). Postgres records a constant default's value for them in pg_attribute.attmissingval,
    which stays when the default is dropped later (as Django adds a column): that value. A
    volatile default (random(), nextval(), an identity) rewrites the table with values the
    replication stream never carries: (True, None). A constant default without a recorded
    value: the table was rewritten since the column was added (ALTER ... TYPE, VACUUM FULL:
    the rows hold it now), or the default was set after the column was added, when they kept
    NULL (``_default_set_later`` tells them apart by the rows). No default and no recorded
    value: NULL, unless the table was rewritten since the column's last change (a default
    dropped after the ADD, then a rewrite): the rows hold the value then."""
    with conn.cursor() as cur:
        cur.execute(
            """SELECT a.atthasdef, a.atthasmissing, a.attmissingval::text,
                      pg_get_expr(d.adbin, d.adrelid), a.attidentity <> ''
               FROM pg_attribute a
               LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
               WHERE a.attrelid = %s::regclass AND a.attname = %s AND NOT a.attisdropped""",
            (quote_table(table), column),
        )
        row = cur.fetchone()
        if row is not None and row[1]:
            return True, row[2]
        if row is not None and row[4]:
            return True, None  # an identity (no pg_attrdef row): numbered by the rewrite
        if row is not None and not row[0]:
            # No default now. A column added with one, which was dropped later (as Django
            # does), has no recorded value either once the table was rewritten since; the
            # rows hold it then.
            if _rows_older_than_the_column(cur, table, column):
                return False, None
            try:
                held = _what_the_oldest_rows_hold(cur, table, column)
            except ExistingValuesUnknown:
                return False, None  # (changed since the ADD: the stream carries them)
            return held if held is not None and held[0] else (False, None)
        if row is None or _default_set_later(cur, table, column):
            return False, None
        cur.execute(f"EXPLAIN (VERBOSE, FORMAT JSON) SELECT {row[3]}")
        plan = cur.fetchone()[0]
        output = plan[0]["Plan"].get("Output", [""])[0]
        if not _CONSTANT.match(output):
            return True, None
        held = _what_the_oldest_rows_hold(cur, table, column)
        if held is not None:
            return held
        cur.execute(f"SELECT ARRAY[({row[3]})]::text")
        return True, cur.fetchone()[0]


class ExistingValuesUnknown(Exception):
    """What the rows that existed when a column was added hold there cannot be told from the
    catalog or the rows (see ``_what_the_oldest_rows_hold``)."""


def _what_the_oldest_rows_hold(cur: Any, table: str, column: str
                               ) -> Optional[tuple[bool, Optional[str]]]:
    """A constant default without a recorded value, where no row older than the default holds
    NULL there: either the column was added with a default and the table rewritten since
    (ALTER ... TYPE: the rows hold the value now), or it was added without one, given one
    (SET DEFAULT), and then the table was rewritten (the rows hold NULL, and the rewrite made
    every row as new as itself, so their age no longer tells). The rows as old as the table's
    oldest (those the rewrite wrote and nothing changed since) hold the answer: all NULL (the
    existing rows kept NULL), or all one value (they have it; the default may have changed
    since). None when the table has no rows (the default, as before); ExistingValuesUnknown
    when they disagree (rows changed between the ADD and the rewrite). Reads the table twice."""
    schema, name = split_name(table)
    cur.execute(
        sql.SQL("""WITH oldest AS (
                       SELECT t.{column}::text AS v, ARRAY[t.{column}]::text AS a
                       FROM {table} t
                       WHERE age(t.xmin) = (SELECT max(age(xmin)) FROM {table}))
                   SELECT count(*), count(*) FILTER (WHERE v IS NULL), count(DISTINCT v),
                          min(a) FILTER (WHERE v IS NOT NULL)
                   FROM oldest""").format(
            table=sql.Identifier(schema, name), column=sql.Identifier(column)))
    rows, nulls, values, value = cur.fetchone()
    if rows == 0:
        return None
    if nulls == rows:
        return False, None
    if nulls == 0 and values == 1:
        return True, value
    raise ExistingValuesUnknown(
        f"column {column} of {table} has a default that no value recorded for the rows before "
        f"it, and the table was rewritten since (ALTER TABLE ... TYPE): its oldest rows hold "
        f"{'NULL and ' if nulls else ''}{values} different value(s) there, so what each row "
        "the lake holds has there in Postgres cannot be told")


def _rows_older_than_the_column(cur: Any, table: str, column: str) -> bool:
    """Whether a row is older than ``column``'s last change in the catalog (its ADD, or the
    rewrite that cleared its recorded value): no rewrite came since, and without a default or
    a recorded value the rows existing then kept NULL. Reads the table until the first such
    row (mostly the first page)."""
    return _a_row_older_than(cur, table, column, "SELECT age(a.xmin) FROM pg_attribute a "
                             "WHERE a.attrelid = %s::regclass AND a.attname = %s")


def _default_set_later(cur: Any, table: str, column: str) -> bool:
    """Whether ``column``'s default came after the column (ADD COLUMN, then ALTER COLUMN ...
    SET DEFAULT): a row older than the default (its xmin before the pg_attrdef row's) holds
    NULL there. Had the column been added with the default, every row older than it would
    hold the default: the rows of a table rewritten since (VACUUM FULL, CLUSTER) keep their
    xmin and hold the value, and a rewrite by ALTER TABLE makes every row as new as itself.
    Reads the table until the first such row (the whole table when there is none)."""
    return _a_row_older_than(
        cur, table, column, "SELECT age(d.xmin) FROM pg_attrdef d JOIN pg_attribute a "
        "ON a.attrelid = d.adrelid AND a.attnum = d.adnum "
        "WHERE d.adrelid = %s::regclass AND a.attname = %s", null_there=True)


def _a_row_older_than(cur: Any, table: str, column: str, catalog_age: str,
                      null_there: bool = False) -> bool:
    """Whether a row of ``table`` (with NULL in ``column``, if ``null_there``) is older than
    the catalog row whose age ``catalog_age`` selects (parameters: the table, the column)."""
    schema, name = split_name(table)
    null = sql.SQL("t.{} IS NULL AND ").format(sql.Identifier(column)) if null_there \
        else sql.SQL("")
    cur.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM {table} t WHERE {null}age(t.xmin) > ({age}))")
        .format(table=sql.Identifier(schema, name), null=null, age=sql.SQL(catalog_age)),
        (quote_table(table), column))
    return bool(cur.fetchone()[0])


# Postgres's FirstNormalObjectId: OIDs below it belong to Postgres itself.
_FIRST_USER_OID = 16384


def describe_types(conn: Any, oids: set[int]) -> dict[int, PgType]:
    """pg_type rows for ``oids`` and, transitively, the types they are built on (a domain's base
    type, an array's element type)."""
    found: dict[int, PgType] = {}
    todo = set(oids)
    with conn.cursor() as cur:
        while todo:
            cur.execute(
                """SELECT t.oid, t.typname, t.typtype, t.typbasetype, t.typtypmod,
                          CASE WHEN t.typcategory = 'A' THEN t.typelem ELSE 0 END
                   FROM pg_type t WHERE t.oid = ANY(%s)""",
                (sorted(todo),),
            )
            for oid, name, kind, base, base_mod, element in cur.fetchall():
                found[oid] = PgType(int(oid), name, kind, int(base), int(base_mod), int(element),
                                    int(oid) < _FIRST_USER_OID)
            todo = {o for t in found.values() for o in (t.base, t.element) if o} - found.keys()
    return found


def require_key(info: TableInfo) -> None:
    """Refuse a table whose updates and deletes the stream cannot identify, with the fix."""
    if any(c.is_key for c in info.columns):
        return
    table = quote_table(info.qualified_name)
    if info.replica_identity == "n":
        fix = "REPLICA IDENTITY DEFAULT" if info.has_primary_key else "REPLICA IDENTITY FULL"
        raise SourceError(
            f"table {info.qualified_name} has REPLICA IDENTITY NOTHING, so its updates and "
            "deletes carry no key in the replication stream and cannot be applied. Run: "
            f"ALTER TABLE {table} {fix};")
    raise SourceError(
        f"table {info.qualified_name} has no primary key or replica identity index, so its "
        "updates and deletes cannot be identified in the replication stream. Add a primary "
        f"key, or run: ALTER TABLE {table} REPLICA IDENTITY FULL;"
    )


def sql_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_table(table: str) -> str:
    schema, name = split_name(table)
    return f'"{schema.replace(chr(34), chr(34) * 2)}"."{name.replace(chr(34), chr(34) * 2)}"'


def ensure_publication(conn: Any, publication: str, tables: list[str]) -> bool:
    """Create the publication for `tables` if missing; True if created. A publication that
    exists but lacks tables is an error naming the statement that fixes it. ``publication``
    may name several (comma-separated): then each must exist, and together they must
    publish the tables."""
    names = publication.split(",")
    with conn.cursor() as cur:
        cur.execute("SELECT pubname, pubviaroot FROM pg_publication WHERE pubname = ANY(%s)",
                    (names,))
        found = dict(cur.fetchall())
        cur.execute("SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n "
                    "ON n.oid = c.relnamespace WHERE c.relkind = 'p' AND "
                    "n.nspname || '.' || c.relname = ANY(%s)", (tables,))
        partitioned = [r[0] for r in cur.fetchall()]
    missing = publication_missing(conn, publication, tables)  # (several: each must exist)
    for name, via_root in found.items():
        if partitioned and not via_root:
            raise SourceError(
                f"publication {name} sends the changes of the partitioned table(s) "
                f"{', '.join(partitioned)} under each partition's name, so walberg would not "
                f"see them as {partitioned[0]}. Run: ALTER PUBLICATION "
                f"{sql_identifier(name)} SET (publish_via_partition_root = true);")
    if missing is None:
        with conn.cursor() as cur:
            # Partitioned tables: changes arrive under the root's name, as one table.
            # An ordinary table ONLY: its inheritance children are tables of their own, sent
            # under their own names (walberg copies and streams a table's own rows).
            cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} "
                                "WITH (publish_via_partition_root = true)").format(
                sql.Identifier(publication),
                sql.SQL(", ").join(
                    sql.Identifier(*split_name(t)) if t in partitioned
                    else sql.SQL("ONLY ") + sql.Identifier(*split_name(t)) for t in tables)))
        return True
    if missing:
        raise SourceError(missing_tables_message(publication, missing))
    return False


def missing_tables_message(publication: str, missing: list[str]) -> str:
    names = ", ".join(quote_table(t) for t in missing)
    first = publication.split(",")[0]
    return (f"publication {publication} (source.postgres.publication) does not include "
            f"{', '.join(missing)}. Add them with: ALTER PUBLICATION \"{first}\" ADD TABLE "
            f"{names};")


def check_wal_level(conn: Any) -> None:
    with conn.cursor() as cur:
        cur.execute("SHOW wal_level")
        level = cur.fetchone()[0]
    if level != "logical":
        raise SourceError(
            f"the source server runs with wal_level={level}; logical replication needs "
            "wal_level=logical. Set it in postgresql.conf (ALTER SYSTEM SET wal_level = logical;) "
            "and restart the server."
        )


def current_wal_lsn(conn: Any) -> Lsn:
    """The WAL insert position: past every transaction committed so far, also asynchronously
    committed ones (pg_current_wal_lsn() is only the write position and can lag behind them)."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        return Lsn.parse(cur.fetchone()[0])


def role_can_replicate(conn: Any) -> tuple[str, bool]:
    """The connected role and whether it may use replication (REPLICATION or superuser)."""
    with conn.cursor() as cur:
        cur.execute("SELECT rolname, rolreplication OR rolsuper FROM pg_roles "
                    "WHERE rolname = current_user")
        name, ok = cur.fetchone()
    return str(name), bool(ok)


def can_select(conn: Any, table: str) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT has_table_privilege(%s, 'SELECT')", (quote_table(table),))
        return bool(cur.fetchone()[0])


def published_tables(conn: Any, publication: str) -> list[str]:
    """The tables a publication (or several, comma-separated) publishes, as schema.table
    (partition roots with publish_via_partition_root)."""
    with conn.cursor() as cur:
        cur.execute("SELECT DISTINCT schemaname || '.' || tablename FROM pg_publication_tables "
                    "WHERE pubname = ANY(%s) ORDER BY 1", (publication.split(","),))
        return [r[0] for r in cur.fetchall()]


def publication_missing(conn: Any, publication: str, tables: list[str]) -> Optional[list[str]]:
    """The tables the publication (or, comma-separated, the publications together) lacks;
    None if it does not exist. Several named of which some do not exist: the error."""
    names = publication.split(",")
    with conn.cursor() as cur:
        cur.execute("SELECT pubname, puballtables FROM pg_publication WHERE pubname = ANY(%s)",
                    (names,))
        found = dict(cur.fetchall())
        if len(names) > 1 and len(found) < len(names):
            absent = [n for n in names if n not in found]
            raise SourceError(
                f"publication(s) {', '.join(absent)} (source.postgres.publication) do not "
                "exist. walberg creates a publication only when the pipeline names one; with "
                f"several, create each first (CREATE PUBLICATION {sql_identifier(absent[0])} "
                "FOR TABLE ...).")
        if not found:
            return None
        if any(found.values()):
            return []
    published = set(published_tables(conn, publication))
    return [t for t in tables if t not in published]


