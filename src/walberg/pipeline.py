"""The pipeline: the only module that knows all three stages. It wires them and owns no loop
of its own: a reader (``runtime.pg_reader``) writes the replication stream to segment files,
the applier (``runtime.applier``) commits sealed segments to Iceberg, and the lake's services
(query, history, maintain, verify, status) read what they hold.

    source (replication stream, initial copy) -> buffer (segment files) -> apply (Spark/Iceberg)

Delivery contract. The replication slot delivers at least once; walberg makes replays harmless:
- every Iceberg commit carries the LSN it covers (``walberg.lsn``), atomically with the data;
- a transaction is applied to a table only if it committed after that table's LSN;
- the slot's confirmed flush position only advances to what every table holds in Iceberg;
- segments are removed only once what they hold is in Iceberg.
So a crash at any point is followed by a run that ends with each table equal to its source.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from walberg import metrics, verify
from walberg.apply import catalogs
from walberg.apply.iceberg import IcebergSink, pin_tables, quote_target
from walberg.apply.metadata import read_hadoop_table
from walberg.apply.spark import check_java, find_java, iceberg_jar
from walberg.apply.types import TypeMap, quote
from walberg.buffer.store import SegmentStore, inspect_directory
from walberg.config import Config, load_config
from walberg.errors import ConfigError, SourceError, Terminal, Transient, WalbergError
from walberg.lakeside import open_session, release
from walberg.model import Lsn
from walberg.runtime.applier import Applier
from walberg.runtime.initial_copy import InitialCopy
from walberg.runtime.pg_reader import PgReader, Relations
from walberg.runtime.pg_stager import PgStager
from walberg.runtime.state import RunState
from walberg.runtime.tables import PgTables
from walberg.source import postgres as pg
from walberg.verify import TableVerdict

log = logging.getLogger("walberg")


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str


@dataclass
class RunReport:
    copied: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    changes: int = 0
    applied_lsn: Lsn = Lsn(0)


class Pipeline:
    """Keeps the configured Iceberg tables in step with their Postgres tables."""

    # How long a run waits for a replication slot that another process still streams from.
    slot_wait_seconds = 15.0

    def __init__(self, config: Config, session: Any = None) -> None:
        """``session``: an existing SparkSession with the sink catalog configured (walberg then
        leaves it running on close); by default walberg builds and owns one."""
        self.config = config
        self._owns_session = session is None
        self.pg = config.postgres
        self.types = TypeMap(config.sink.numeric_default, frozenset(config.sink.text_types))
        self._tables = PgTables(config, lambda: self.sink, self.types)
        self.tables = self._tables.tables  # (the same list: follow_publication adds to it)
        self.targets = self._tables.targets
        self.changelogs = self._tables.changelogs
        self._recopy: set[str] = set()  # tables `resync` copies again
        self.report = RunReport()
        self._session: Any = session
        # One of several sources fanning in to shared tables: its rows are tagged.
        self.source_name = config.source_name
        self._tag = config.source_name if config.sink.fan_in else None
        self._sink: Optional[IcebergSink] = (IcebergSink(session, self.types, self._tag)
                                             if session is not None else None)
        self._store: Optional[SegmentStore] = None
        self._state = RunState()
        self._run_error: Optional[BaseException] = None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Pipeline":
        return cls(load_config(path))

    # ---- wiring ------------------------------------------------------------------------------

    def session(self) -> Any:
        if self._session is None:
            self._session = open_session(self.config)
            self._sink = IcebergSink(self._session, self.types, self._tag)
        return self._session

    @property
    def sink(self) -> IcebergSink:
        self.session()
        assert self._sink is not None
        return self._sink

    @property
    def committed(self) -> dict[str, Lsn]:
        """What each table holds in the lake, as far as this run knows."""
        return self._state.committed()

    @property
    def halted(self) -> dict[str, str]:
        """Tables stopped by a change Iceberg cannot follow, with why."""
        return self._state.halted()

    def stop(self) -> None:
        """Ask a running ``run`` to stop after the current step (safe from signal handlers)."""
        self._state.request_stop()

    def close(self) -> None:
        release(self._store, self._session if self._owns_session else None)
        self._store = None
        if self._owns_session:
            self._session = self._sink = None

    @property
    def applied_lsn(self) -> Lsn:
        """Every configured table holds every change that committed before this position."""
        return self._state.applied

    def wait_for(self, lsn: Lsn, timeout: float = 120.0) -> None:
        """Block until the lake holds everything that committed before ``lsn``."""
        deadline = time.monotonic() + timeout
        while self._state.applied < lsn:
            for error in (self._state.error, self._run_error):
                if error is not None:
                    raise error
            if time.monotonic() > deadline:
                raise Terminal(f"the lake did not reach LSN {lsn} within {timeout:.0f} s "
                               f"(it holds up to {self._state.applied})")
            time.sleep(0.05)

    def query(self, statement: str, limit: int = 100, *, as_of: Optional[str] = None,
              snapshot: Optional[int] = None, lsn: Optional[Lsn] = None
              ) -> tuple[list[tuple[Any, ...]], list[str]]:
        """Run Spark SQL against the lake; returns (rows, column names). With ``as_of`` (a
        timestamp), ``snapshot`` (an Iceberg snapshot id of one table) or ``lsn`` (a Postgres
        WAL position), the pipeline's tables are read as they were then."""
        return self.sink.query(self.pinned(statement, as_of, snapshot, lsn), limit)

    def export(self, statement: str, fmt: str, output: Path, limit: Optional[int] = None, *,
               as_of: Optional[str] = None, snapshot: Optional[int] = None,
               lsn: Optional[Lsn] = None) -> int:
        """Write a query's result to ``output`` as csv, json (lines) or parquet."""
        return self.sink.export(self.pinned(statement, as_of, snapshot, lsn), fmt, output, limit)

    def pinned(self, statement: str, as_of: Optional[str] = None,
               snapshot: Optional[int] = None, lsn: Optional[Lsn] = None) -> str:
        """``statement`` with the pipeline's tables read at a point in their history."""
        if sum(x is not None for x in (as_of, snapshot, lsn)) > 1:
            raise ConfigError("give one of --as-of, --snapshot and --lsn, not several")
        pins: dict[str, str] = {}
        if as_of is not None:
            stamp = as_of.replace("'", "")
            pins = {target: f"TIMESTAMP AS OF '{stamp}'" for target in self.targets.values()
                    if self.sink.table_exists(target)}
        elif snapshot is not None:
            for target in self.targets.values():
                if self.sink.table_exists(target) and any(
                        h["snapshot_id"] == snapshot for h in self.sink.history(target)):
                    pins[target] = f"VERSION AS OF {int(snapshot)}"
            if not pins:
                raise Terminal(f"no table of this pipeline has a snapshot {snapshot}; "
                               "`walberg history -c pipeline.yaml TABLE` lists them")
        elif lsn is not None:
            for source, target in self.targets.items():
                if self.sink.table_exists(target):
                    pins[target] = f"VERSION AS OF {self._snapshot_at(source, lsn)}"
        return pin_tables(statement, pins)

    def changes_sql(self, source: str, start: str, end: Optional[str] = None) -> str:
        """Spark SQL for the net changes to a table between two points of its history (snapshot
        ids or timestamps; ``end`` defaults to now): one row per changed key with ``_change``
        (insert, update or delete) and the row's values (the old ones for a delete)."""
        source = source if "." in source else f"public.{source}"
        if source not in self.targets:
            raise Terminal(f"{source} is not one of this pipeline's tables "
                           f"({', '.join(self.tables)}); see source.postgres.tables")
        target = self.targets[source]
        names = [n for n, _ in self.sink.schema(target)]
        conn = pg.connect(self.pg.dsn)
        try:
            keys = [c.name for c in pg.describe_table(conn, source).columns if c.is_key]
        finally:
            conn.close()
        keys = [k for k in keys if k in names] or names
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

    def _snapshot_at(self, source: str, lsn: Lsn) -> int:
        """The last snapshot of the table's current history whose data covers the source only
        up to ``lsn``: what the lake held of it as of that Postgres position."""
        target = self.targets[source]
        chosen: Optional[int] = None
        covered = Lsn(0)
        first: Optional[str] = None
        for h in self.sink.history(target):
            if not h["is_current_ancestor"]:
                continue
            if h["lsn"] is not None:
                covered = max(covered, Lsn.parse(h["lsn"]))
                first = first or h["lsn"]
            if h["lsn"] is not None or chosen is not None:
                if covered > lsn:
                    break
                chosen = int(h["snapshot_id"])
        if chosen is None:
            raise Terminal(f"the lake held nothing of {source} at LSN {lsn}: its first commit "
                           f"covers up to LSN {first or '-'}")
        return chosen

    def history(self, source: str) -> list[dict[str, Any]]:
        """The snapshots of a source table's Iceberg table, oldest first."""
        source = source if "." in source else f"public.{source}"
        if source not in self.targets:
            raise Terminal(f"{source} is not one of this pipeline's tables "
                           f"({', '.join(self.tables)}); see source.postgres.tables")
        return self.sink.history(self.targets[source])

    # ---- maintenance ---------------------------------------------------------------------------

    def maintain(self, tables: Optional[list[str]] = None) -> list[dict[str, Any]]:
        """Compact and clean up the Iceberg tables of these source tables (default: all)."""
        m = self.config.maintenance
        now_ms = int(time.time() * 1000)
        reports = []
        for source in tables or self.tables:
            if source not in self.targets:
                raise Terminal(f"{source} is not one of this pipeline's tables "
                               f"({', '.join(self.tables)}); see source.postgres.tables")
            target = self.targets[source]
            if not self.sink.table_exists(target):
                continue
            started = time.monotonic()
            report = self.sink.maintain(
                target, m.target_file_size_bytes, now_ms - int(m.snapshot_retention * 1000),
                m.retain_last, now_ms - int(m.orphan_retention * 1000))
            report["seconds"] = round(time.monotonic() - started, 2)
            b, a = report["before"], report["after"]
            log.info("maintained %s in %.1f s: data files %d -> %d, delete files %d -> %d, "
                     "snapshots %d -> %d, %d -> %d bytes", target, report["seconds"],
                     b["data_files"], a["data_files"], b["delete_files"], a["delete_files"],
                     b["snapshots"], a["snapshots"], b["bytes"], a["bytes"])
            reports.append(report)
        return reports

    # ---- verify ----------------------------------------------------------------------------------

    def verify(self, tables: Optional[list[str]] = None, limit: int = 20,
               wait_seconds: float = 60.0, attempts: int = 3) -> list[TableVerdict]:
        """Compare each table in Postgres with its Iceberg table: row counts and an
        order-independent hash over all columns, computed by each side's own engine; on a
        difference, the first ``limit`` differing keys.

        The source is read in one snapshot at WAL position X. When a walberg process is running
        on the pipeline, verify waits (up to ``wait_seconds``) until the lake has committed
        past X. A source table still changing meanwhile can make the two disagree for that
        reason alone, so a difference is measured again, ``attempts`` times in all."""
        chosen = tables or [t for t in self.tables
                            if self.config.layout_for(t).mode != "append"]
        for t in chosen:
            if t not in self.targets:
                raise Terminal(f"{t} is not one of this pipeline's tables "
                               f"({', '.join(self.tables)}); see source.postgres.tables")
            if self.config.layout_for(t).mode == "append":
                raise Terminal(f"{t} is written in append mode: its Iceberg table is a "
                               "changelog, not a mirror, so there is nothing to compare")
        self.session()
        conn = pg.connect(self.pg.dsn, autocommit=False)
        verdicts = []
        try:
            infos = {t: pg.describe_table(conn, t) for t in chosen}
            conn.rollback()
            self._learn_types(conn, infos)
            conn.rollback()
            for t in chosen:
                verdict = None
                for _ in range(max(attempts, 1)):
                    verdict = self._verify_table(conn, infos[t], limit, wait_seconds)
                    if verdict.equal:
                        break
                assert verdict is not None
                verdicts.append(verdict)
        finally:
            conn.close()
        return verdicts

    def _verify_table(self, conn: Any, info: pg.TableInfo, limit: int,
                      wait_seconds: float) -> TableVerdict:
        source, target = info.qualified_name, self.targets[info.qualified_name]
        types = [self.types.spark_type(c, target) for c in info.columns]
        table = pg.quote_table(source)
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_current_wal_lsn()::text")
                at = Lsn.parse(cur.fetchone()[0])
            running = inspect_directory(self.config.segment_dir).holder_pid is not None
            lake_lsn = self.sink.committed_lsn(target)
            deadline = time.monotonic() + wait_seconds
            while running and (lake_lsn is None or lake_lsn < at) and time.monotonic() < deadline:
                time.sleep(0.5)
                lake_lsn = self.sink.committed_lsn(target)
            if lake_lsn is None:
                return TableVerdict(source, target, False, 0, 0, str(at), None,
                                    note=f"{target} has no walberg commit yet: run walberg "
                                         f"run -c <pipeline.yaml> --once first")
            src_n, src_hash = verify.source_digest(conn, table, info.columns, types)
            own = f"`_walberg_source` = '{self._tag}'" if self._tag else "true"
            lake_n, lake_hash = verify.lake_digest(self.session(), target, info.columns, types,
                                                   own)
            verdict = TableVerdict(source, target, (src_n, src_hash) == (lake_n, lake_hash),
                                   src_n, lake_n, str(at), str(lake_lsn))
            if lake_lsn < at:
                verdict.note = (f"the lake holds {source} up to LSN {lake_lsn}, the source was "
                                f"read at {at}; changes in between, if any, are not applied yet")
            if not verdict.equal:
                with tempfile.TemporaryDirectory(prefix="walberg-verify-",
                                                 dir=self.config.segment_dir.parent) as work:
                    hashes = Path(work) / "source.parquet"
                    verify.source_row_hashes(conn, table, info.columns, types, hashes)
                    verdict.differences = verify.differing_keys(
                        self.session(), target, info.columns, types, hashes, limit, own)
            return verdict
        finally:
            conn.rollback()
            conn.set_session(isolation_level="READ COMMITTED", readonly=False)

    # ---- inspection: check and status ---------------------------------------------------------

    def check(self) -> list["CheckResult"]:
        """Everything walberg needs, checked without changing anything: one result per item."""
        results: list[CheckResult] = []

        def item(name: str, fn: Callable[[], str]) -> bool:
            try:
                results.append(CheckResult(name, True, fn()))
                return True
            except WalbergError as exc:
                results.append(CheckResult(name, False, str(exc)))
            except Exception as exc:  # a check must report, never crash the command
                results.append(CheckResult(name, False, f"{type(exc).__name__}: {exc}"))
            return False

        conn: Any = None

        def reach() -> str:
            nonlocal conn
            conn = pg.connect(self.pg.dsn)
            with conn.cursor() as cur:
                cur.execute("SHOW server_version")
                return f"PostgreSQL {cur.fetchone()[0]} at {pg.redact(self.pg.dsn)}"

        if item("postgres reachable", reach):
            def wal() -> str:
                pg.check_wal_level(conn)
                return "wal_level = logical"

            def role() -> str:
                name, ok = pg.role_can_replicate(conn)
                if not ok:
                    raise Terminal(f"role {name} may not replicate: ALTER ROLE \"{name}\" "
                                   "REPLICATION;")
                denied = [t for t in self.tables if not pg.can_select(conn, t)]
                if denied:
                    raise Terminal(f"role {name} cannot SELECT {', '.join(denied)}: GRANT SELECT "
                                   f"ON {', '.join(pg.quote_table(t) for t in denied)} TO "
                                   f"\"{name}\";")
                return f"role {name} has REPLICATION and SELECT on the tables"

            def tables() -> str:
                infos = {t: pg.describe_table(conn, t) for t in self.tables}
                for info in infos.values():
                    pg.require_key(info)
                self._learn_types(conn, infos)
                return (f"{len(self.tables)} table(s) exist with a usable replica identity and "
                        "column types walberg maps")

            def publication() -> str:
                missing = pg.publication_missing(conn, self.pg.publication, self.tables)
                if missing is None:
                    return f"publication {self.pg.publication} missing: walberg will create it"
                if missing:
                    raise Terminal(pg.missing_tables_message(self.pg.publication, missing))
                return f"publication {self.pg.publication} covers the tables"

            def slot() -> str:
                state = pg.slot_state(conn, self.pg.slot)
                if state is None:
                    return f"slot {self.pg.slot} missing: walberg will create it"
                used = f", in use by server pid {state.active_pid}" if state.active_pid else ""
                return (f"slot {self.pg.slot} at {state.confirmed_flush} "
                        f"(wal_status {state.wal_status}){used}")

            item("wal_level", wal)
            item("replication role", role)
            item("tables", tables)
            item("publication", publication)
            item("replication slot", slot)
            conn.close()

        def space() -> str:
            directory = self.config.segment_dir
            probe = directory if directory.exists() else next(
                p for p in directory.parents if p.exists())
            free = shutil.disk_usage(probe).free
            need = 4 * self.config.buffer.max_segment_bytes
            if free < need:
                raise Terminal(f"only {free >> 20} MiB free under {probe}; walberg wants at "
                               f"least {need >> 20} MiB (4 segments) for buffer.dir")
            return f"{free >> 30} GiB free for segments under {probe}"

        def java() -> str:
            path = find_java()
            check_java(path)
            return f"Java at {path}"

        def jar() -> str:
            return f"{iceberg_jar().name} intact"

        def warehouse() -> str:
            wh = self.config.warehouse
            cat = self.config.sink.catalog
            props, jars = catalogs.spark_properties(cat.type, wh, cat.uri, cat.options(),
                                                    cat.properties,
                                                    self.config.spark.conf.get("spark.jars", ""))
            reached = ""
            if cat.type == "jdbc" and (cat.uri or "").startswith("jdbc:postgresql://"):
                # The catalog's database answers (the same check walberg's Spark will pass).
                dsn = "postgresql://" + cat.uri.removeprefix("jdbc:postgresql://")  # type: ignore[union-attr]
                params = {k: v for k, v in (("user", cat.user), ("password", cat.password)) if v}
                probe = pg.connect(dsn + ("&" if "?" in dsn else "?") + "&".join(
                    f"{k}={v}" for k, v in params.items()) if params else dsn)
                probe.close()
                reached = f"; catalog database {pg.redact(dsn)} reachable"
            if not wh or ("://" in wh and not wh.startswith("file:")):
                return (f"{cat.type} catalog {cat.name}: {wh or 'warehouse from the catalog'} "
                        f"not checked (remote){reached}")
            root = Path(wh.removeprefix("file:"))
            existing = root
            while not existing.is_dir() and existing != existing.parent:
                existing = existing.parent  # check creates nothing: probe what exists
            with tempfile.NamedTemporaryFile(dir=existing, prefix=".walberg-check-"):
                pass
            state = "is writable" if existing == root else f"will be created under {existing}"
            return (f"{cat.type} catalog {cat.name}: warehouse {root} {state}"
                    + (f"; driver {jars[0]}" if jars else "") + reached)

        item("segment space", space)
        item("java", java)
        item("iceberg jar", jar)
        item("catalog and warehouse", warehouse)
        return results

    def status(self) -> dict[str, Any]:
        """Where each table and the slot stand, read from Postgres, the segment directory and
        the Iceberg metadata; starts no Spark and changes nothing."""
        buffer = inspect_directory(self.config.segment_dir)
        out: dict[str, Any] = {
            "pipeline": {"running": buffer.holder_pid is not None, "pid": buffer.holder_pid,
                         "segment_dir": str(self.config.segment_dir),
                         "pending_segments": buffer.sealed_segments,
                         "pending_bytes": buffer.sealed_bytes + buffer.active_bytes},
            "tables": {},
            "slot": None,
        }
        for t in self.tables:
            _, namespace, table = self.targets[t].split(".")
            hadoop = self.config.sink.catalog.type == "hadoop" and "://" not in self.config.warehouse
            prop = "walberg.lsn" + (f".{self._tag}" if self._tag else "")
            summary = (read_hadoop_table(Path(self.config.warehouse), namespace, table, prop)
                       if hadoop else None)
            out["tables"][t] = {
                "iceberg_table": self.targets[t],
                "snapshot_id": summary.snapshot_id if summary else None,
                "last_lsn": summary.walberg_lsn if summary else None,
                "last_commit_at": _iso(summary.walberg_committed_at_ms) if summary else None,
                "rows": summary.records if summary else None,
                "data_files": summary.data_files if summary else None,
                "delete_files": summary.delete_files if summary else None,
                "snapshots": summary.snapshots if summary else 0,
            }
        try:
            conn = pg.connect(self.pg.dsn)
        except Transient as exc:
            out["slot"] = {"error": str(exc)}
            return out
        try:
            state = pg.slot_state(conn, self.pg.slot)
            now = pg.current_wal_lsn(conn)
            if state is not None:
                out["slot"] = {
                    "name": state.name, "confirmed_flush_lsn": str(state.confirmed_flush),
                    "server_wal_lsn": str(now),
                    "lag_bytes": max(int(now) - int(state.confirmed_flush), 0),
                    "retained_wal_bytes": max(int(now) - int(state.restart_lsn), 0),
                    "wal_status": state.wal_status, "active_pid": state.active_pid,
                }
            else:
                out["slot"] = {"name": self.pg.slot, "missing": True}
        except WalbergError as exc:
            out["slot"] = {"error": str(exc)}
        finally:
            conn.close()
        return out

    # ---- run ---------------------------------------------------------------------------------

    def resync(self, tables: Optional[list[str]] = None) -> RunReport:
        """Copy tables again from Postgres, then catch up (like ``run(once=True)``). With no
        tables, or when the replication slot is lost or gone: drop the slot and copy every
        table, inside the new slot's snapshot. The Iceberg tables are overwritten in one commit
        each; their history stays for time travel."""
        for t in tables or []:
            if t not in self.targets:
                raise Terminal(f"{t} is not one of this pipeline's tables "
                               f"({', '.join(self.tables)}); see source.postgres.tables")
        conn = pg.connect(self.pg.dsn)
        try:
            try:
                state = pg.slot_state(conn, self.pg.slot)
                lost = False
            except SourceError:
                state, lost = None, True
            if tables is None or lost:
                if lost or state is not None:
                    self.drop_slot(conn)
                self._recopy = set(self.tables)
            else:
                self._recopy = set(tables)
        finally:
            conn.close()
        log.info("copying again: %s", ", ".join(sorted(self._recopy)))
        return self.run(once=True)

    def drop_slot(self, conn: Any = None) -> bool:
        """Drop the pipeline's replication slot (refused while a process streams from it);
        True if there was one. The next run creates it anew and copies every table."""
        own = conn is None
        conn = conn or pg.connect(self.pg.dsn)
        try:
            return pg.drop_slot(conn, self.pg.slot)
        finally:
            if own:
                conn.close()

    def run(self, once: bool = False) -> RunReport:
        """Initial copy where owed, then stream. With ``once``, return as soon as everything up
        to the WAL position current at the start is committed to Iceberg."""
        try:
            return self._run(once)
        except BaseException as exc:
            self._run_error = exc  # for wait_for() in another thread
            raise

    def _run(self, once: bool) -> RunReport:
        """Wire the reader, the applier and the lake for one run: what earlier runs left in
        sealed segments is applied first, then the reader streams (main thread) while the
        applier commits (its own thread)."""
        if self.config.metrics.port:
            metrics.serve(self.config.metrics.port, self.config.metrics.host)
        state = self._state
        relations = Relations()
        store = SegmentStore(self.config.segment_dir, self.config.buffer.max_segment_bytes,
                             preamble=relations.preamble)
        self._store = store
        log.info("segments: %s", store.recover())
        copier = InitialCopy(self.config, self._tables, state, self.report, self.session,
                             lambda: self.sink)
        stager = PgStager(self.config, store, state, self._tables, lambda: self.sink,
                          copier.adopt, self.report)
        for segment in store.sealed():
            state.sealed(segment.seq, stager.scan(segment))
        applier = Applier(self.config, store, state, stager, self._tables, lambda: self.sink,
                          self.maintain)
        reader = PgReader(self.config, store, state, self._tables, copier, relations,
                          self._recopy, self.slot_wait_seconds)

        started = reader.start_with_retries(once)
        if started is None:  # stopped while the source was unreachable
            self.report.applied_lsn = state.applied
            return self.report
        stream, target = started

        # Whatever survived in sealed segments from an earlier run goes first.
        applier.apply_ready(drain=True)
        state.advance_applied(min(state.committed().values()))

        thread = threading.Thread(target=applier.loop, name="walberg-apply", daemon=True)
        thread.start()
        state.set_received(state.last_received())
        try:
            reader.stream_with_reconnect(stream, target)
        finally:
            state.request_stop()
            thread.join()
            reader.close()
        if state.error is not None:
            raise state.error
        self.report.applied_lsn = state.confirmable()
        halted = state.halted()
        if halted:
            raise Terminal(" ".join(halted.values()) + " The other tables were applied.")
        return self.report

    # ---- hooks the operator commands use -------------------------------------------------------

    def _learn_types(self, conn: Any, infos: dict[str, pg.TableInfo]) -> None:
        self._tables.learn_types(conn, infos)


def _iso(ms: Optional[int]) -> Optional[str]:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")


__all__ = ["CheckResult", "Pipeline", "Pipelines", "RunReport"]


class Pipelines:
    """A pipeline file with several ``sources``: one ``Pipeline`` per source (its own slot,
    publication and segment directory), one Spark session, run side by side. Tables of the same
    name fan in to one Iceberg table (``sink.fan_in``), each source's rows tagged with
    ``_walberg_source`` and recorded exactly once by its own ``walberg.lsn.<source>``."""

    def __init__(self, config: Config, session: Any = None,
                 names: Optional[list[str]] = None) -> None:
        """``names``: the sources to open (default: all of them)."""
        if not config.sources:
            raise ConfigError("this pipeline file has one source; use Pipeline")
        self.config = config
        names = names or list(config.sources)
        first = Pipeline(config.for_source(names[0]), session=session)
        shared = first.session()
        self.pipelines = {names[0]: first}
        for name in names[1:]:
            self.pipelines[name] = Pipeline(config.for_source(name), session=shared)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Pipelines":
        return cls(load_config(path))

    def run(self, once: bool = False) -> dict[str, RunReport]:
        """Run every source's pipeline; if one fails, the others are stopped and its error
        raised."""
        reports: dict[str, RunReport] = {}
        failures: list[BaseException] = []

        def run_one(name: str, pipeline: Pipeline) -> None:
            try:
                reports[name] = pipeline.run(once=once)
            except BaseException as exc:
                failures.append(exc)
                self.stop()

        threads = [threading.Thread(target=run_one, args=(n, p), name=f"walberg-{n}")
                   for n, p in self.pipelines.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        return reports

    def _tables_by_source(self, tables: Optional[list[str]]
                          ) -> dict[str, Optional[list[str]]]:
        return self.config.tables_by_source(tables, list(self.pipelines))

    def verify(self, tables: Optional[list[str]] = None, limit: int = 20,
               wait_seconds: float = 60.0) -> list[TableVerdict]:
        verdicts = []
        for name, mine in self._tables_by_source(tables).items():
            for v in self.pipelines[name].verify(mine, limit, wait_seconds):
                v.source = f"{name}:{v.source}"
                verdicts.append(v)
        return verdicts

    def maintain(self, tables: Optional[list[str]] = None) -> list[dict[str, Any]]:
        """Maintain the Iceberg tables of every source (or of these source tables), each once:
        with fan-in several sources share a table, and compacting it twice would only cost.
        The maintenance commits carry every source's ``walberg.lsn.<source>`` (see
        ``IcebergSink.maintain``), whichever source's pipeline makes them."""
        reports: list[dict[str, Any]] = []
        done: set[str] = set()
        for name, mine in self._tables_by_source(tables).items():
            pipeline = self.pipelines[name]
            todo = [t for t in mine or pipeline.tables if pipeline.targets[t] not in done]
            done.update(pipeline.targets[t] for t in todo)
            if todo:
                reports += pipeline.maintain(todo)
        return reports

    def resync(self, tables: Optional[list[str]] = None) -> dict[str, RunReport]:
        """``Pipeline.resync`` for each source, one after the other: the named tables where a
        source has them, or (none named) every table of every source, each with a new slot.
        In a shared table a source's copy replaces only its own rows."""
        return {name: self.pipelines[name].resync(mine)
                for name, mine in self._tables_by_source(tables).items()}

    def stop(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.stop()

    def close(self) -> None:
        # The first pipeline owns the Spark session (when it built it): closed last.
        for pipeline in reversed(list(self.pipelines.values())):
            pipeline.close()
