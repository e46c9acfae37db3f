"""A Postgres pipeline's Iceberg tables: which source table goes where (mirror, changelog or
both), creating them, making their schema follow the source (ALTER TABLE), and learning the
source's column types."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from walberg import metrics
from walberg.apply import evolution
from walberg.apply.iceberg import IcebergSink
from walberg.apply.types import (
    INT2,
    INT4,
    INT8,
    TEXT,
    TIME,
    TIMESTAMP,
    TIMESTAMPTZ,
    VARCHAR,
    BadArray,
    TextPrep,
    TypeMap,
    UnsupportedType,
    parse_array,
)
from walberg.config import Config
from walberg.errors import Terminal, WalbergError
from walberg.model import Column, Lsn, Relation
from walberg.source import postgres as pg

log = logging.getLogger("walberg")
T = TypeVar("T")

_INTEGERS = (INT2, INT4, INT8)  # narrowest first
_TIMES = (TIME, TIMESTAMP, TIMESTAMPTZ, 1266)  # (1266: timetz) a precision, 0-6 or none

# Table property holding the default of a column added in Postgres, until the lake's existing
# rows have it.
FILL_PROPERTY = "walberg.fill."
# Table property: the numbers (pg_attribute.attnum) of the source's columns the lake's follow,
# as JSON {name: number}; per source (".<name>" after it) in a table shared by several. A
# column dropped and added again under the same name and type gets a new number, while
# pgoutput describes it as before.
ATTNUM_PROPERTY = "walberg.attnums"


class SchemaStop(Terminal):
    """A table's columns changed in a way its Iceberg table cannot follow."""


class Tables:
    """Where each source table goes in the lake: its mirror and, with a changelog mode, its
    changelog; what the changelog already holds. The applier commits through this."""

    def __init__(self, targets: dict[str, str], changelogs: dict[str, str]) -> None:
        self.tables = list(targets)
        self.targets = targets
        # Changelog tables (sink mode append or both); in append mode it is the target itself.
        self.changelogs = changelogs
        # The changelog of a table in mode both: what it holds (the mirror may hold more).
        self.changelog_held: dict[str, Optional[Lsn]] = {}

    def nettable(self) -> frozenset[str]:
        """Tables whose batches may be netted while staging: not those with a changelog, which
        records every change."""
        return frozenset(t for t in self.tables if t not in self.changelogs)


class PgTables(Tables):
    """The Iceberg tables of a Postgres source's tables."""

    def __init__(self, config: Config, sink: Callable[[], IcebergSink], types: TypeMap,
                 source_unreachable: Callable[[], None] = lambda: None) -> None:
        """``source_unreachable``: called while a connection to the source cannot be made
        (the reader then lets its replication connection go, see RunState.release_source)."""
        pg_cfg = config.postgres
        super().__init__({t: config.target_for(t) for t in pg_cfg.tables},
                         {t: config.changelog_for(t) for t in pg_cfg.tables
                          if config.layout_for(t).mode in ("append", "both")})
        self.config = config
        self.pg = pg_cfg
        self.types = types
        self._sink = sink
        self.source_unreachable = source_unreachable
        self._followed: dict[str, tuple[Column, ...]] = {}  # the columns of each last batch
        self._attnums: dict[str, dict[str, int]] = {}  # ATTNUM_PROPERTY's, as read or written
        # (staging) the transaction of each table's first description in this run
        self._first_described: dict[str, int] = {}
        # The connection the source's catalog is read through (see _catalog), kept open.
        self._catalog_conn: Any = None
        self._catalog_lock = threading.Lock()

    @property
    def sink(self) -> IcebergSink:
        return self._sink()

    def add(self, table: str) -> bool:
        """Take a table of the publication into the pipeline (follow_publication)."""
        if table in self.targets:
            return False
        self.tables.append(table)
        self.targets[table] = self.config.target_for(table)
        if self.config.layout_for(table).mode in ("append", "both"):
            self.changelogs[table] = self.config.changelog_for(table)
        return True

    def ensure(self, source: str, info: pg.TableInfo) -> None:
        """Create the source's Iceberg table(s) (mirror, changelog, or both) or bring them to
        their layout."""
        layout = self.config.layout_for(source)
        made: list[tuple[str, bool]] = []
        numbers = json.dumps(info.attnums, sort_keys=True) if info.attnums else None
        if layout.mode != "append":
            # (a table made now is made with its column numbers: no second commit for them)
            made.append((self.targets[source], self.sink.ensure_table(
                self.targets[source], info.columns, layout,
                {self._attnum_key(): numbers} if numbers else None)))
            if made[0][1] and numbers:
                self._attnums[source] = dict(info.attnums)
        changelog = self.changelogs.get(source)
        if changelog is not None:
            made.append((changelog, self.sink.ensure_changelog(changelog, info.columns, layout)))
        for target, created in made:
            if not created:
                changed = self.sink.align(target, layout)
                if changed:
                    log.info("%s follows its layout in the pipeline file: %s", target,
                             "; ".join(changed))
        if layout.mode != "append" and not made[0][1]:
            self.finish_fills(source)
        if layout.mode != "append" and (made[0][1] or self._recorded(source) is None):
            self._record(source, info.attnums)  # (from now on: see ``follow``)
        if layout.mode == "both" and changelog is not None:
            self.changelog_held[source] = self.sink.committed_lsn(changelog)

    def description(self, source: str, txn_lsn: int) -> str:
        """(While staging) what kind of description pgoutput's Relation message in the
        transaction committed at ``txn_lsn`` is: "first" in this run (sent again as the batch is
        staged again), else "again" (see StagedTable.described)."""
        first = self._first_described.setdefault(source, txn_lsn)
        return "first" if first == txn_lsn else "again"

    def follow(self, source: str, columns: tuple[Column, ...], lsn: Lsn,
               described: str = "", renumbered_after: bool = False) -> None:
        """Before a commit: the table (and its changelog) take the staged columns. In a batch
        in which pgoutput described the table (``described``), the columns' numbers in the
        catalog tell a column dropped and added again (under the same name and type, or as
        what the names read as a rename) from the same column (``Numbers``).

        ``renumbered_after``: the batch ended before a later description with the same
        columns whose numbers had changed. Where the lake already has the batch's columns, the
        change of numbers is the next batch's to follow (a column dropped and added again
        after this batch's rows); where it has not, this batch's own description brought the
        new columns (pgoutput describes a table again in every streamed transaction, with
        nothing changed since), and its numbers are this batch's to follow."""
        target, changelog = self.targets[source], self.changelogs.get(source)
        if renumbered_after and described and self.sink.columns_match(target, columns):
            described = ""
        if not any(c.is_key for c in columns) and changelog != target:
            # (the stream then says nothing of which row an update or delete is: the source
            # refuses those, but inserts and TRUNCATE go on, and a batch with no key to
            # net by would keep one of them)
            raise SchemaStop(
                f"{source} lost its key in Postgres before LSN {lsn} (its primary key was "
                "dropped, or REPLICA IDENTITY set to NOTHING): the replication stream no "
                f"longer tells its rows apart, and {target} cannot follow. Add a primary key, "
                f"or run ALTER TABLE {pg.quote_table(source)} REPLICA IDENTITY FULL; then copy "
                f"the table afresh: `walberg resync -c <pipeline file> {source}`. Nothing "
                "after the last commit was confirmed to the slot, so nothing is lost "
                "meanwhile.")
        self._retyped_in_place(source, columns, lsn)
        numbers = self._numbers_of(source, described, columns) if described else None
        again = numbers.again(c.name for c in columns) if numbers is not None else ()
        if numbers is not None and numbers.refusal is None:
            for name in again:
                log.warning("column %s of %s was dropped and added again in Postgres (before "
                            "LSN %s): its values are gone there, so %s drops and adds it too",
                            name, source, lsn, target)
        for t in ([target] if changelog in (None, target) else [changelog, target]):
            # A changelog keeps a column added again (its rows are the changes as they were
            # made) unless its columns change anyway.
            if not self.sink.columns_match(t, columns) or (
                    again and t == target and changelog != target):
                self.evolve(source, columns, lsn, t, numbers)
        if numbers is not None:
            # (the published columns', as ensure and reshape record them)
            self._record(source, {c.name: numbers.now[c.name] for c in columns
                                  if c.name in numbers.now})

    def _numbers_of(self, source: str, described: str, columns: tuple[Column, ...]
                    ) -> Optional[Numbers]:
        """The columns' numbers the lake follows, and the catalog's now (not as they were at
        the batch's changes); None without a mirror (mode append: the changelog keeps the
        changes as they were made) or when either is missing. A column dropped and added
        again is followed only where the order is sure and the column is this source's alone;
        else the table stops with the way out (``Numbers.refusal``)."""
        if self.config.layout_for(source).mode == "append":
            return None
        now = self._numbers(source)
        known = self._recorded(source)
        if now is None or known is None:
            return None
        refusal = None
        if self.sink.source is not None:
            refusal = ("in a table shared by several sources, whose other sources' values "
                       "there must stay")
        elif described == "first" and self.sink.columns_match(self.targets[source], columns):
            # (a first description is as the table was at its first change since: one that
            # shows the columns the lake has may come before the change or after it; one that
            # shows others, a column moved to the end say, comes after it)
            refusal = ("while walberg was stopped or behind, and which of the table's changes "
                       "since the lake's last came before that cannot be told from the stream")
        return Numbers(known, now, refusal)

    def renumbered(self, source: str, unsure: bool) -> bool:
        """(While staging) pgoutput described ``source`` again with the same columns: whether
        one of them was dropped and added again meanwhile, so that the batch must end before.
        ``unsure``: the answer while the lake's numbers are not read yet (staging begins
        before Spark is up); true ends the batch there, and the next one's ``follow`` tells."""
        if self.config.layout_for(source).mode == "append":
            return False
        known = self._attnums.get(source)
        if known is None:
            return unsure
        now = self._numbers(source)
        return now is not None and bool(Numbers(known, now).again(now))

    def _numbers(self, source: str) -> Optional[dict[str, int]]:
        return self._catalog(f"the column numbers of {source}",
                             lambda conn: pg.column_numbers(conn, source))

    def _catalog(self, what: str, read: Callable[[Any], T]) -> T:
        """``read(conn)`` on a connection to the source, for reading its catalog (``what``:
        for the message while it cannot be made), one caller at a time. The connection is
        kept open between reads (autocommit: no transaction, no snapshot held): pgoutput
        describes tables again often (after each ANALYZE of a busy table, say), and a
        connection each time started and stopped a server process each time. A kept one the
        server dropped meanwhile (a restart, a failover) is replaced and the read made again
        once; a connection a read failed on is closed."""
        with self._catalog_lock:
            while True:
                kept = self._catalog_conn is not None
                if not kept:
                    self._catalog_conn = pg.connect_patiently(
                        self.pg.dsn, self.pg.reconnect_max_seconds, what,
                        waiting=self.source_unreachable)
                conn = self._catalog_conn
                try:
                    return read(conn)
                except BaseException as exc:
                    self._catalog_conn = None
                    _close_quietly(conn)
                    if not (kept and isinstance(exc, pg.CONNECTION_LOST)):
                        raise

    def close(self) -> None:
        """Close the catalog connection, if one is open."""
        with self._catalog_lock:
            conn, self._catalog_conn = self._catalog_conn, None
        if conn is not None:
            _close_quietly(conn)

    def _attnum_key(self) -> str:
        shared_by = self.sink.source
        return ATTNUM_PROPERTY if shared_by is None else f"{ATTNUM_PROPERTY}.{shared_by}"

    def _recorded(self, source: str) -> Optional[dict[str, int]]:
        """The column numbers the lake's table follows (None: not recorded yet)."""
        known = self._attnums.get(source)
        if known is None:
            key = self._attnum_key()
            value = self.sink.properties(self.targets[source], key).get(key)
            try:
                known = {str(k): int(v) for k, v in json.loads(value).items()} if value else None
            except (ValueError, TypeError, AttributeError):
                known = None  # (not walberg's: recorded again)
            if known is not None:
                self._attnums[source] = known
        return known

    def _record(self, source: str, numbers: dict[str, int]) -> None:
        if not numbers or self._recorded(source) == numbers:
            return
        self.sink.set_property(self.targets[source], self._attnum_key(),
                               json.dumps(numbers, sort_keys=True))
        self._attnums[source] = dict(numbers)

    def _retyped_in_place(self, source: str, columns: tuple[Column, ...], lsn: Lsn) -> None:
        """Say so when a column's Postgres type changed (ALTER ... TYPE) to one the lake holds
        the same way (timestamptz(0), char(10), a domain, ... USING): Postgres rewrote the
        existing rows' values, which is never streamed, so the lake keeps the old ones where
        the new type changed them (unless it keeps every value: ``_keeps_values``)."""
        before = {c.name: c for c in self._followed.get(source, ())}
        self._followed[source] = columns
        target = self.targets[source]
        for c in columns:
            old = before.get(c.name)
            if old is None or (old.type_oid, old.type_modifier) == (c.type_oid, c.type_modifier):
                continue
            if self.types.spark_type(old, target) != self.types.spark_type(c, target):
                continue  # a schema change of the lake's column: evolution's to follow or refuse
            if not self._keeps_values(old, c):
                log.warning(
                    "column %s of %s changed type in Postgres (type %d modifier %d -> type %d "
                    "modifier %d, before LSN %s) and is held the same way in %s: the values "
                    "Postgres rewrote (rounded, padded, or by a USING expression) are not "
                    "streamed, so the lake keeps the old ones of the rows that existed. "
                    "`walberg verify -c <pipeline file> %s` tells; `walberg resync -c "
                    "<pipeline file> %s` copies the table.", c.name, source, old.type_oid,
                    old.type_modifier, c.type_oid, c.type_modifier, lsn, target, source, source)

    def evolve(self, source: str, columns: tuple[Column, ...], lsn: Lsn,
               target: Optional[str] = None, numbers: Optional[Numbers] = None) -> None:
        """Make the Iceberg table's schema follow the source's columns (after ALTER TABLE),
        as far as ``sink.schema_evolution`` allows; otherwise stop with what to do. With
        ``numbers``, columns that Postgres dropped and added again are dropped and added here
        (not kept, nor read as renamed)."""
        target = target or self.targets[source]
        wanted = [(c.name, self.types.spark_type(c, target).describe()) for c in columns]
        current = self.sink.schema(target)
        mode = self.config.layout_for(source).schema_evolution
        try:
            steps = numbers.plan(current, wanted, columns) if numbers is not None \
                else evolution.plan(current, wanted)
            refused = [s for s in steps if mode == "strict"
                       or (mode == "add_columns" and s.kind != "add")]
            if refused:
                raise evolution.NotEvolvable(
                    f"{'; '.join(s.describe() for s in refused)} is not allowed by "
                    f"sink.schema_evolution: {mode}")
        except evolution.NotEvolvable as exc:
            raise self.schema_error(source, columns, lsn, str(exc)) from None
        after = {name: (wanted[i - 1][0] if i else "") for i, (name, _) in enumerate(wanted)}
        def record_fills(conn: Any) -> None:
            for step in steps:
                if step.kind == "add":
                    self._record_fill(conn, source, target, columns, step.name)

        try:
            self._catalog(f"the added columns' defaults of {source}", record_fills)
        except pg.ExistingValuesUnknown as exc:
            raise self.schema_error(source, columns, lsn, str(exc)) from None
        self.sink.evolve(target, steps, after)
        log.info("evolved the schema of %s to follow %s (before LSN %s): %s", target, source,
                 lsn, "; ".join(s.describe() for s in steps))
        if target == self.targets[source] and target not in self.changelogs.values():
            self.finish_fills(source)
        else:  # a changelog records changes; its old rows keep what they were
            for key in self.sink.properties(target, FILL_PROPERTY):
                self.sink.set_property(target, key, None)

    def reshape(self, source: str, info: pg.TableInfo) -> bool:
        """Before a table is copied (again: ``walberg resync``, a new slot): its Iceberg
        table(s) take the source's columns as they are now, so that the copy fits them. The
        schema evolves as it does for an ALTER TABLE while streaming (added, dropped, renamed
        and widened columns), whatever ``sink.schema_evolution`` says: a copy asked for is
        the way out of a stop. A change no schema update expresses replaces the mirror table
        by an empty one with the new columns (its history kept for time travel; the copy
        fills it); a changelog, whose past rows exist nowhere else, is never replaced: that
        stops with what to do. Returns whether a table changed."""
        columns = info.columns
        target, changelog = self.targets[source], self.changelogs.get(source)
        # (table, whether it is a changelog); in mode append the target is the changelog.
        which = ([(target, changelog is not None)] if changelog in (None, target)
                 else [(changelog, True), (target, False)])
        changed = False
        for t, records in which:
            if self.sink.columns_match(t, columns):  # (made by ``ensure`` if it was not)
                continue
            wanted = [(c.name, self.types.spark_type(c, t).describe()) for c in columns]
            try:
                steps = evolution.plan(self.sink.schema(t), wanted)
            except evolution.NotEvolvable as exc:
                if records or self.sink.source is not None:
                    kind = ("its changelog, whose rows of past changes exist nowhere else"
                            if records else "a table shared by several sources")
                    raise Terminal(
                        f"{source} cannot be copied into {t} again: {exc}, and walberg does "
                        f"not replace {kind}. Keep what you need of {t}, drop it (DROP TABLE "
                        f"{t} in Spark SQL) and run the resync again: {t} is then created "
                        "with the new columns.") from None
                self.sink.replace_table(t, columns, self.config.layout_for(source))
                log.warning("%s replaced by an empty table with the columns of %s (%s), for "
                            "its copy: %s. Its earlier snapshots stay for time travel.", t,
                            source, ", ".join(f"{n} {k}" for n, k in wanted), exc)
            else:
                after = {name: (wanted[i - 1][0] if i else "")
                         for i, (name, _) in enumerate(wanted)}
                self.sink.evolve(t, steps, after)
                log.info("evolved the schema of %s to the columns of %s, for its copy: %s", t,
                         source, "; ".join(s.describe() for s in steps))
            # A default still owed to the old rows: the copy brings every row's value.
            for key in self.sink.properties(t, FILL_PROPERTY):
                self.sink.set_property(t, key, None)
            changed = True
        if self.config.layout_for(source).mode != "append":
            self._attnums.pop(source, None)  # (a replaced table has no properties of before)
            self._record(source, info.attnums)  # the copy's rows have the columns of now
        return changed

    def _record_fill(self, conn: Any, source: str, target: str, columns: tuple[Column, ...],
                     name: str) -> None:
        """A column added with a default: record, before the column exists, the value the
        lake's existing rows get (so a crash part-way is finished on start)."""
        has_default, value = pg.column_default(conn, source, name)
        if has_default and value is None:
            log.warning(
                "column %s of %s was added with a volatile default (or an identity): "
                "Postgres gave the existing rows values that the replication stream "
                "does not carry, so those rows have NULL there in %s. To get the "
                "values, copy the table again (walberg resync -c <pipeline file> %s).",
                name, source, target, source)
        elif value is not None:
            parsed = parse_array(value)  # attmissingval is a one-element array
            if not parsed or isinstance(parsed[0], list) or parsed[0] is None:
                return
            col = next(c for c in columns if c.name == name)
            try:
                expr = self.types.spark_type(col, target).literal(parsed[0])
            except BadArray:
                log.warning("column %s of %s was added with a default walberg cannot read "
                            "(%r): the lake's existing rows have NULL there. To get the "
                            "values, copy the table again (walberg resync -c <pipeline file> "
                            "%s).", name, source, parsed[0][:60], source)
                return
            self.sink.set_property(target, FILL_PROPERTY + name, expr)

    def _keeps_values(self, old: Column, new: Column) -> bool:
        """Whether every value of type ``old`` is the same value of type ``new``: longer
        text, a wider integer, more fractional digits of a time, a domain and its base type."""
        def base(c: Column) -> tuple[int, int]:
            t = self.types.types.get(c.type_oid)
            if t is not None and t.kind == "d":
                return t.base, (t.base_modifier if c.type_modifier < 0 else c.type_modifier)
            return c.type_oid, c.type_modifier

        (a, am), (b, bm) = base(old), base(new)
        wider = bm < 0 or 0 <= am <= bm
        if {a, b} <= {TEXT, VARCHAR}:
            return wider
        if a in _INTEGERS and b in _INTEGERS:
            return _INTEGERS.index(a) <= _INTEGERS.index(b)
        return a == b and (wider if a in _TIMES else am == bm)

    def finish_fills(self, source: str) -> None:
        """Columns added in Postgres with a default: existing rows get the default in the lake
        too (Postgres keeps it in pg_attribute.attmissingval and never streams it). Pending
        fills are table properties, so one cut short by a crash is finished on the next start."""
        target = self.targets[source]
        names = {name for name, _ in self.sink.schema(target)}
        for key, expr in self.sink.properties(target, FILL_PROPERTY).items():
            name = key[len(FILL_PROPERTY):]
            if name in names:
                self.sink.fill(target, name, expr)
            self.sink.set_property(target, key, None)

    def schema_error(self, source: str, columns: tuple[Column, ...], lsn: Lsn,
                     reason: str = "") -> SchemaStop:
        target = self.targets[source]
        now = ", ".join(f"{c.name} {self.types.spark_type(c, target).describe()}" for c in columns)
        why = (f"{reason}." if reason else
               "The ALTER TABLE ran inside a transaction that changed rows of the table before "
               "it, so no commit separates the old columns from the new.")
        return SchemaStop(
            f"{source} changed its columns in Postgres (ALTER TABLE) before LSN {lsn}; it now "
            f"has ({now}), and {target} cannot follow: {why} To go on, either set "
            f"sink.schema_evolution to allow the change (if it is allowed by Iceberg), or copy "
            f"the table afresh: `walberg resync -c <pipeline file> {source}` brings {target} "
            f"to the new columns (or replaces it) and copies it; or drop the Iceberg table "
            f"(DROP TABLE {target} in Spark SQL) and run walberg again. Either way walberg "
            "streams on from the copy. Nothing after the last commit was confirmed to the "
            "slot, so nothing is lost meanwhile."
        )

    def learn_relation(self, rel: Relation) -> None:
        """A relation description with types the type map has not seen (a column added with a
        new type), or an array column it knows no dimensions of (added, or renamed: they are
        kept by name): ask the source catalog about them, and about the table's array
        dimensions."""
        target = self.targets.get(rel.qualified_name)
        if target is None:
            return
        types = self.types.types
        if all(c.type_oid in types for c in rel.columns) and \
                all((target, c.name) in self.types.dims for c in rel.columns
                    if types[c.type_oid].element):
            return
        def learn(conn: Any) -> None:
            try:
                dims = pg.describe_table(conn, rel.qualified_name).dims
            except WalbergError:
                dims = {}  # dropped or renamed since: the OIDs still tell the types
            found = pg.describe_types(conn, {c.type_oid for c in rel.columns})
            self.types.learn(found, target, dims)

        self._catalog(f"the column types of {rel.qualified_name}", learn)

    def learn_types(self, conn: Any, infos: dict[str, pg.TableInfo],
                    refused: Optional[dict[str, str]] = None) -> None:
        """Tell the type map what the source catalog says about the tables' column types, and
        refuse, before anything runs, a column whose type walberg cannot map (with
        ``refused``: noted there, by table, instead)."""
        found = pg.describe_types(conn, {c.type_oid for i in infos.values() for c in i.columns})
        for t, info in infos.items():
            self.types.learn(found, self.targets[t], info.dims)
            for c in info.columns:
                try:
                    self.types.spark_type(c, self.targets[t])
                except UnsupportedType as exc:
                    if refused is None:
                        raise
                    refused.setdefault(t, str(exc))

    def prep(self, source: str, columns: tuple[Column, ...]) -> TextPrep:
        return self.types.prep(columns, self.targets[source])


@dataclass(frozen=True)
class Numbers:
    """A table's column numbers (pg_attribute.attnum), as the lake follows them (``known``) and
    as the catalog has them ``now``: a column keeps its number through a rename or a type
    change; one dropped and added again has a new one."""

    known: dict[str, int]
    now: dict[str, int]
    refusal: Optional[str] = None  # why a column dropped and added again is not followed

    def again(self, names: Iterable[str]) -> tuple[str, ...]:
        """Those of ``names`` dropped and added again (their number changed)."""
        return tuple(n for n in names if n in self.known and n in self.now
                     and self.known[n] != self.now[n])

    def plan(self, current: Sequence[tuple[str, str]], wanted: Sequence[tuple[str, str]],
             columns: Sequence[Column]) -> list[evolution.Step]:
        """``evolution.plan``, told by the numbers: a column added again is dropped first and
        planned as new (Postgres puts it at the end); a rename whose two names have other
        numbers is a column dropped and another added."""
        again = set(self.again(c.name for c in columns))
        gone = [n for n, _ in current if n in again]
        self._allowed(gone)
        steps = evolution.plan([(n, k) for n, k in current if n not in again], wanted)
        kinds = dict(wanted)
        out = [evolution.Step("drop", n) for n in gone]
        added: set[str] = set()
        for step in steps:
            if step.kind == "rename" and step.name in self.known and \
                    step.new_name in self.now and \
                    self.known[step.name] != self.now[step.new_name]:
                self._allowed([step.new_name])
                out += [evolution.Step("drop", step.name),
                        evolution.Step("add", step.new_name, kinds[step.new_name])]
                added.add(step.new_name)
            elif not (step.kind == "widen" and step.name in added):
                out.append(step)
        return out

    def _allowed(self, names: Sequence[str]) -> None:
        if names and self.refusal is not None:
            raise evolution.NotEvolvable(
                f"column(s) {', '.join(names)} were dropped and added again in Postgres (their "
                f"numbers in the catalog changed) {self.refusal}")


def count_dead(sink: IcebergSink, source: str, target: str, rows: int) -> None:
    if rows:
        metrics.DEAD_LETTERS.labels(source).inc(rows)
        log.warning("%d row(s) of %s could not be written exactly and went to %s with the "
                    "reason in _dlq_reason", rows, source, sink.dead_letter_target(target))


def _close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:
        pass  # (broken already: nothing to release)
