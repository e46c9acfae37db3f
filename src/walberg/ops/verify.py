"""`walberg verify`: prove that each Iceberg table equals its Postgres table (row counts, an
order-independent hash over all columns, and on a difference the first differing keys). How
each side hashes its rows is in ``walberg.ops.digest``; this module reads the source at one WAL
position, waits for a running walberg to commit past it, and compares."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from walberg.apply import staging
from walberg.buffer.files import inspect_directory
from walberg.errors import SourceError, Terminal, WalbergError
from walberg.lake.services import Lake, LakeSource, qualified
from walberg.model import Lsn
from walberg.ops import digest
from walberg.ops.digest import TableVerdict
from walberg.source import postgres as pg
from walberg.source import slots


def verify(lake: Lake, tables: Optional[list[str]] = None, limit: int = 20,
           wait_seconds: float = 60.0, attempts: int = 3) -> list[TableVerdict]:
    """Compare each table (default: every table not written in append mode) of every source
    with its Iceberg table. With several sources, a verdict's ``source`` is
    ``<source name>:<table>``."""
    sources = lake.postgres_sources("verify compares the lake with a database source")
    wanted = [qualified(t) for t in tables or []]
    unknown = [t for t in wanted if not any(t in s.targets for s in sources)]
    if unknown:
        lake.find(unknown[0])  # the error that lists the pipeline's tables
    verdicts = []
    for source in sources:
        mine = [t for t in wanted if t in source.targets] if wanted else None
        if wanted and not mine:
            continue
        for v in verify_source(lake, source, mine, limit, wait_seconds, attempts):
            if source.name:
                v.source = f"{source.name}:{v.source}"
            verdicts.append(v)
    return verdicts


def verify_source(lake: Lake, source: LakeSource, tables: Optional[list[str]] = None,
                  limit: int = 20, wait_seconds: float = 60.0,
                  attempts: int = 3) -> list[TableVerdict]:
    """Compare each table of one source in Postgres with its Iceberg table: row counts and an
    order-independent hash over all columns, computed by each side's own engine; on a
    difference, the first ``limit`` differing keys.

    The source is read in one snapshot at WAL position X. When a walberg process is running
    on the pipeline, verify waits (up to ``wait_seconds``) until the lake has committed
    past X. A source table still changing meanwhile can make the two disagree for that
    reason alone, so a difference is measured again, ``attempts`` times in all."""
    config = source.config
    chosen = tables or [t for t in source.targets if config.layout_for(t).mode != "append"]
    for t in chosen:
        source.target(t)  # a table the source does not have: the error that lists them
        if config.layout_for(t).mode == "append":
            raise Terminal(f"{t} is written in append mode: its Iceberg table is a "
                           "changelog, not a mirror, so there is nothing to compare")
    lake.session()
    conn = pg.connect(source.postgres.dsn, autocommit=False)
    verdicts = []
    try:
        infos = pg.describe_tables(conn, list(chosen), source.postgres.publications)
        conn.rollback()
        lake.learn_types(source, conn, infos)
        conn.rollback()
        for t in chosen:
            verdict = None
            tries = max(attempts, 1)
            for attempt in range(tries):
                try:
                    verdict = _verify_table(lake, source, conn, infos[t], limit, wait_seconds,
                                            last=attempt == tries - 1)
                except pg.DatabaseError as exc:
                    conn.rollback()
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                        type(exc).__name__
                    raise SourceError(
                        f"verify could not read {t} from Postgres: {first}. If the table "
                        "holds a value walberg's comparison does not know, report it with "
                        "this message; `walberg verify` of the other tables still works "
                        "(name them).") from exc
                if verdict.equal:
                    break
            assert verdict is not None
            verdicts.append(verdict)
    finally:
        conn.close()
    return verdicts


def _stage_area(lake: Lake, source: LakeSource) -> staging.StageArea:
    """Where a cluster's executors read the source's row hashes from: a folder of this command's
    own in the pipeline's stage area (a running pipeline owns its folder there)."""
    config, session = source.config, lake.session()
    area = staging.stage_uri(session.sparkContext.master, config.buffer.stage_uri,
                             config.warehouse)
    return staging.StageArea(session, area and f"{area}/verify-{uuid.uuid4().hex[:12]}",
                             owner=False)


def _source_snapshot(conn: Any) -> Lsn:
    """Start the repeatable-read snapshot the source is read in; its WAL position."""
    conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
    return pg.current_wal_lsn(conn)


def _confirmed(conn: Any, slot: str) -> Lsn:
    """How far the slot is confirmed (0: no usable slot): walberg confirms only what the lake
    holds."""
    try:
        state = slots.slot_state(conn, slot)
    except WalbergError:  # (lost, or not walberg's: the run says so; verify compares anyway)
        return Lsn(0)
    return Lsn(0) if state is None else state.confirmed_flush


def _columns_differ(lake: list[tuple[str, str]], info: pg.TableInfo,
                    types: list[str]) -> Optional[str]:
    """Why the lake's columns are not the source's (None: they are): a table that a schema
    change stopped holds the old columns (or types: ``types`` are the source columns' as the
    lake would hold them), and there is nothing to compare value by value."""
    names = dict(lake)
    source = [c.name for c in info.columns]
    only_source = [c for c in source if c not in names]
    only_lake = [n for n, _ in lake if n not in source]
    retyped = [f"{c} ({names[c]} in the lake, {t} from the source)"
               for c, t in zip(source, types, strict=True) if c in names and names[c] != t]
    if not only_source and not only_lake and not retyped:
        return None
    parts = ([f"in the source only: {', '.join(only_source)}"] if only_source else []) + \
        ([f"in the lake only: {', '.join(only_lake)}"] if only_lake else []) + \
        ([f"of another type: {', '.join(retyped)}"] if retyped else [])
    return (f"the columns differ ({'; '.join(parts)}), so the rows were not compared. A "
            f"schema change walberg could not follow in order stops the table (the run said "
            f"so); `walberg resync -c <pipeline.yaml> {info.qualified_name}` copies it with "
            "the source's columns.")


def _verify_table(lake: Lake, source: LakeSource, conn: Any, info: pg.TableInfo, limit: int,
                  wait_seconds: float, last: bool = True) -> TableVerdict:
    """One comparison of a table; the differing keys are looked for only when it is the
    ``last`` attempt (a scan of both sides and a join)."""
    table_name, target = info.qualified_name, source.targets[info.qualified_name]
    sink = lake.sink(source)
    types = [lake.types(source).spark_type(c, target) for c in info.columns]
    # The source side: what the publication publishes of the table (its row filter), not
    # the whole table.
    table = info.rows_sql()
    try:
        at = _source_snapshot(conn)
        running = inspect_directory(source.config.segment_dir).holder_pid is not None
        lake_lsn = sink.committed_lsn(target)
        deadline = time.monotonic() + wait_seconds

        def holds() -> bool:
            # The table's mark moves only when it changes; the slot's confirmed position moves
            # only past what every table's Iceberg commits hold: past ``at``, a quiet table
            # holds everything before it too.
            return lake_lsn is not None and (
                lake_lsn >= at or _confirmed(conn, source.postgres.slot) >= at)

        held = holds()
        while running and not held and time.monotonic() < deadline:
            time.sleep(0.5)
            lake_lsn = sink.committed_lsn(target)
            held = holds()
        if lake_lsn is None:
            return TableVerdict(table_name, target, False, 0, 0, str(at), None,
                                note=f"{target} has no walberg commit yet: run walberg "
                                     f"run -c <pipeline.yaml> --once first")
        stopped = _columns_differ(sink.schema(target), info, [t.describe() for t in types])
        if stopped:
            return TableVerdict(table_name, target, False, 0, 0, str(at), str(lake_lsn),
                                note=stopped)
        src_n, src_hash = digest.source_digest(conn, table, info.columns, types)
        own = f"`_walberg_source` = '{source.tag}'" if source.tag else "true"
        with digest.utc_session(lake.session()):
            lake_n, lake_hash = digest.lake_digest(lake.session(), target, info.columns, types,
                                                   own)
        verdict = TableVerdict(table_name, target, (src_n, src_hash) == (lake_n, lake_hash),
                               src_n, lake_n, str(at), str(lake_lsn))
        if not held:
            verdict.note = (f"the lake holds {table_name} up to LSN {lake_lsn}, the source was "
                            f"read at {at}; changes in between, if any, are not applied yet")
        if not verdict.equal and last:
            # In buffer.dir, which executors of a cluster read as it is when buffer.stage_uri
            # is `local` (its parent need not be shared); a killed verify's folder is removed
            # at the pipeline's next start (staging.LOCAL_FOLDERS).
            source.config.segment_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=staging.VERIFY_FOLDER,
                                             dir=source.config.segment_dir) as work:
                hashes = Path(work) / "source.parquet"
                digest.source_row_hashes(conn, table, info.columns, types, hashes)
                stage = _stage_area(lake, source)
                try:
                    with digest.utc_session(lake.session()):
                        verdict.differences = digest.differing_keys(
                            lake.session(), target, info.columns, types,
                            stage.read([hashes]), limit, own)
                finally:
                    stage.release(Path(work))
                    stage.close()
        return verdict
    finally:
        conn.rollback()
        conn.set_session(isolation_level="READ COMMITTED", readonly=False)
