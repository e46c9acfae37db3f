"""The parallel initial copy's source side: how a table is cut into chunks, what SQL reads one
chunk's share, and how a JDBC reader joins the snapshot a replication slot exported.

A chunk is the unit of progress: it is read by several readers at once (its *parts*) and lands
in the lake as one commit that records which range it covered. Tables with a single integer key
are cut by key ranges; the others by ranges of heap pages (``ctid``). Key ranges hold the same
rows whatever the physical layout, so a copy cut by key can resume after an interruption: the
remaining ranges are read in a newer snapshot and the stream's replay from the copy's start
makes the difference good (see ``pipeline``). Page ranges do not survive an interruption (rows
move between pages when updated), so such a copy starts over.

Pure except for ``plan_chunks`` and ``table_extent``, which ask the server about the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence
from urllib.parse import quote as url_quote

import psycopg2.extensions

from walberg.errors import ConfigError
from walberg.source.postgres import SESSION_OPTIONS, TableInfo, quote_table, sql_identifier
from walberg.source.snapshot import LOCK_WAIT

# int2, int4, int8: keys whose ranges can be cut arithmetically.
_INTEGER_KEYS = frozenset({21, 23, 20})

Bound = Optional[int]  # None: unbounded on that side


@dataclass(frozen=True)
class Span:
    """A half-open range [lo, hi) of key values (``kind`` "key") or heap pages ("ctid")."""

    kind: str
    lo: Bound
    hi: Bound

    def encode(self) -> str:
        """How a chunk commit records it: ``key:10:20``, ``ctid::500`` (empty: unbounded)."""
        return f"{self.kind}:{'' if self.lo is None else self.lo}:{'' if self.hi is None else self.hi}"

    @staticmethod
    def decode(text: str) -> "Span":
        kind, lo, hi = text.split(":")
        return Span(kind, int(lo) if lo else None, int(hi) if hi else None)

    def predicate(self, key: Optional[str]) -> str:
        if self.kind == "key":
            assert key is not None
            col = sql_identifier(key)
            parts = ([] if self.lo is None else [f"{col} >= {self.lo}"]) + \
                ([] if self.hi is None else [f"{col} < {self.hi}"])
        else:
            parts = ([] if self.lo is None else [f"ctid >= '({self.lo},0)'::tid"]) + \
                ([] if self.hi is None else [f"ctid < '({self.hi},0)'::tid"])
        return " AND ".join(parts) or "TRUE"


@dataclass(frozen=True)
class Chunk:
    """What one commit covers, and the spans its parallel readers take."""

    span: Span
    parts: tuple[Span, ...]


def range_key(info: TableInfo) -> Optional[str]:
    """The column a copy can be cut by value on: a single integer key of a table that has one
    (not a whole-row identity)."""
    keys = [c for c in info.columns if c.is_key]
    if len(keys) == 1 and len(keys) < len(info.columns) and keys[0].type_oid in _INTEGER_KEYS:
        return keys[0].name
    return None


def remaining(done: Sequence[Span]) -> list[Span]:
    """The key spans not yet covered by ``done`` (which may overlap), in order."""
    inf = math.inf
    covered = sorted((-inf if s.lo is None else s.lo, inf if s.hi is None else s.hi)
                     for s in done)
    gaps: list[tuple[float, float]] = []
    cursor = -inf  # everything below it is covered
    for lo, hi in covered:
        if lo > cursor:
            gaps.append((cursor, lo))
        cursor = max(cursor, hi)
    if cursor < inf:
        gaps.append((cursor, inf))
    return [Span("key", None if lo == -inf else int(lo), None if hi == inf else int(hi))
            for lo, hi in gaps]


def cut(spans: Sequence[Span], first: int, last: int, pieces: int, kind: str) -> list[Span]:
    """Cut ``spans`` (within the extent ``first..last``, inclusive) into about ``pieces`` spans
    of equal width, keeping their outer bounds (an unbounded end stays unbounded)."""
    width = max(1, math.ceil((last - first + 1) / max(pieces, 1)))
    out: list[Span] = []
    for span in spans:
        lo = first if span.lo is None else span.lo
        hi = last + 1 if span.hi is None else span.hi
        if hi <= lo:
            if span.lo is None or span.hi is None:
                out.append(span)  # outside the extent now, but rows may arrive there
            continue
        n = max(1, math.ceil((hi - lo) / width))
        edges = [lo + (hi - lo) * i // n for i in range(n + 1)]
        for i in range(n):
            out.append(Span(kind, span.lo if i == 0 else edges[i],
                            span.hi if i == n - 1 else edges[i + 1]))
    return out


def plan_chunks(extent: tuple[int, int], rows: int, chunk_rows: int, parts: int, kind: str,
                todo: Sequence[Span]) -> list[Chunk]:
    """Chunks of about ``chunk_rows`` rows (judged from the table's size), each cut into
    ``parts`` spans for parallel readers, covering ``todo`` within ``extent``."""
    first, last = extent
    chunks = max(1, math.ceil(rows / max(chunk_rows, 1)))
    out = []
    for span in cut(todo, first, last, chunks, kind):
        lo = first if span.lo is None else span.lo
        hi = last + 1 if span.hi is None else span.hi
        pieces = cut([span], lo, max(lo, hi - 1), parts, kind)
        out.append(Chunk(span, tuple(pieces)))
    return out


def table_extent(cur: Any, info: TableInfo, key: Optional[str]) -> tuple[int, int]:
    """The smallest and largest key (or 0 and the last heap page) in the current snapshot."""
    table = quote_table(info.qualified_name)
    if key is not None:
        col = sql_identifier(key)
        cur.execute(f"SELECT min({col}), max({col}) FROM {info.own_rows_sql()}")
        lo, hi = cur.fetchone()
        return (0, 0) if lo is None else (int(lo), int(hi))
    cur.execute("SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::int",
                (table,))
    pages = int(cur.fetchone()[0])
    return 0, max(pages - 1, 0)


def text_query(info: TableInfo, span: Span, key: Optional[str],
               since: Optional[int] = None) -> str:
    """Every column as its Postgres text (``c0..cN``), for one span: the same text COPY and the
    stream give, so the apply stage types it the same way. ``since`` (a snapshot's xmin, see
    ``snapshot_xmin``): only the rows written since."""
    cols = ", ".join(f"{sql_identifier(c.name)}::text AS c{i}" for i, c in enumerate(info.columns))
    written = "" if since is None else f" AND {written_since(since)}"
    return (f"SELECT {cols} FROM {info.own_rows_sql()} "
            f"WHERE {span.predicate(key)}{_published(info)}{written}")


def kept_keys_query(info: TableInfo, span: Span, key: str, since: int) -> str:
    """The key (as text, ``c0``) of each row of one span not written since ``since``."""
    return (f"SELECT {sql_identifier(key)}::text AS c0 FROM {info.own_rows_sql()} "
            f"WHERE {span.predicate(key)}{_published(info)} AND NOT {written_since(since)}")


def _published(info: TableInfo) -> str:
    return "" if info.row_filter is None else f" AND ({info.row_filter})"


def covered(done: Sequence[Span]) -> list[Span]:
    """The key spans ``done`` covers (which may overlap), merged, in order."""
    return remaining(remaining(done))


# A heap tuple's xmin is 32 bits and wraps around: "at or after" is judged on the circle.
_XIDS = 1 << 32


def snapshot_xmin(cur: Any) -> int:
    """The current snapshot's xmin (the oldest transaction still running when it was taken),
    as a tuple's 32-bit xmin: every row inserted or updated after the snapshot was taken has
    its xmin at or after it."""
    cur.execute("SELECT txid_snapshot_xmin(txid_current_snapshot()) %% %s", (_XIDS,))
    return int(cur.fetchone()[0])


def written_since(xmin: int) -> str:
    """SQL: the row was inserted or updated by a transaction at or after ``xmin`` (see
    ``snapshot_xmin``). Rows written a little before (by transactions still running then, or
    over 2^31 transactions before) pass too, which only reads them again; the special ids
    below 3 (frozen, bootstrap) are old."""
    own = "xmin::text::bigint"
    return f"({own} >= 3 AND ({own} - {int(xmin)} + {_XIDS}) % {_XIDS} < {_XIDS // 2})"


def session_init(snapshot: str) -> str:
    """What each JDBC reader runs first: walberg's session settings (so values render as in
    COPY), then the exported snapshot, so every reader sees exactly what the slot's start saw."""
    sets = []
    for option in SESSION_OPTIONS.split("-c "):
        name, _, value = option.strip().partition("=")
        if name:
            sets.append(f"SET {name} = '{value}'")
    snapshot_text = snapshot.replace("'", "")
    return "; ".join(sets + ["SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY",
                             f"SET TRANSACTION SNAPSHOT '{snapshot_text}'"])


def jdbc_target(dsn: str) -> tuple[str, dict[str, str]]:
    """The JDBC URL and connection properties for a libpq DSN (host, port, database, user,
    password and the TLS settings the PostgreSQL JDBC driver shares with libpq)."""
    params = psycopg2.extensions.parse_dsn(dsn)
    host = params.get("host", "localhost").split(",")[0]
    if host.startswith("/"):
        raise ConfigError(
            "source.postgres.initial_copy.method jdbc reads over TCP, but source.postgres.dsn names a "
            f"Unix socket ({host}); give the server's host name or 127.0.0.1 instead.")
    port = params.get("port", "5432").split(",")[0]
    database = params.get("dbname", params.get("user", "postgres"))
    url = f"jdbc:postgresql://{host}:{port}/{url_quote(database, safe='')}"
    # Every connection (Spark's look at the query's columns too, which runs before any
    # reader's first statement) waits for a lock no longer than a COPY does: see
    # snapshot.LOCK_WAIT.
    props = {"driver": "org.postgresql.Driver", "ApplicationName": "walberg-copy",
             "options": f"-c lock_timeout={LOCK_WAIT}"}
    # The driver takes these under libpq's names.
    for name in ("user", "password", "sslmode", "sslrootcert", "sslcert", "sslkey"):
        if params.get(name):
            props[name] = params[name]
    return url, props
