"""`walberg resync`: copy tables from Postgres again (after a lost slot, or to repair a table),
then catch up. The copy is the pipeline's own: this module decides what to copy again (and
drops the slot when every table is copied), then runs the pipeline once."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from walberg.buffer import spill
from walberg.buffer.store import SegmentStore
from walberg.errors import SlotLost, TablesParked
from walberg.lake.services import Lake, LakeSource, qualified
from walberg.pipeline import Pipeline, RunReport
from walberg.source import postgres as pg
from walberg.source import slots

log = logging.getLogger("walberg")

Plan = list[tuple[LakeSource, Optional[list[str]]]]


def plan(lake: Lake, tables: Optional[list[str]] = None) -> Plan:
    """Which source copies which of ``tables`` (None: all of its tables, with a new slot).
    A source with none of the named tables is left out; a table no source has is an error.
    A source whose slot the server invalidated copies every table whatever is named (what
    the slot lost is not known table by table), so the question asked says so."""
    sources = lake.postgres_sources("resync copies tables from a database source again")
    if not tables:
        return [(s, None) for s in sources]
    wanted = [qualified(t) for t in tables]
    for t in wanted:
        if not any(t in s.targets for s in sources):
            lake.find(t)  # the error that lists the pipeline's tables
    return [(s, None if _slot_lost(s) else [t for t in wanted if t in s.targets])
            for s in sources if any(t in s.targets for t in wanted)]


def _slot_lost(source: LakeSource) -> bool:
    """Whether the source's replication slot was invalidated (its WAL removed). Any other
    trouble with the slot (one of another plugin or database by that name) is an error."""
    conn = pg.connect(source.postgres.dsn)
    try:
        slots.slot_state(conn, source.postgres.slot)
        return False
    except SlotLost:
        return True
    finally:
        conn.close()


def describe(chosen: Plan) -> str:
    """What a resync will do, for the confirmation question."""
    def one(source: LakeSource, tables: Optional[list[str]]) -> str:
        what = (", ".join(f"{t} -> {source.targets[t]}" for t in tables) if tables else
                f"every table, after dropping replication slot {source.postgres.slot}")
        return f"from source {source.name}: {what}" if source.name else what

    return "; ".join(one(s, t) for s, t in chosen)


def resync(lake: Lake, chosen: Plan) -> dict[Optional[str], RunReport]:
    """Each source of the plan, one after the other: its named tables copied again, or (none
    named) every table, with a new slot. In a shared table a source's copy replaces only its
    own rows. Returns each source's run report."""
    return {source.name: resync_source(lake, source, tables) for source, tables in chosen}


def resync_source(lake: Lake, source: LakeSource,
                  tables: Optional[list[str]] = None) -> RunReport:
    """Copy tables of one source again from Postgres, then catch up (like ``run --once``).
    With no tables, or when the replication slot is lost or gone: drop the slot and copy every
    table, inside the new slot's snapshot. The Iceberg tables are overwritten in one commit
    each; their history stays for time travel."""
    for t in tables or []:
        source.target(t)  # a table the source does not have: the error that lists them
    src = source.postgres
    config = source.config
    # The segment directory's lock, before the slot is touched (dropping it under a running
    # walberg would stop that walberg) and until the old segments are gone; the run below
    # takes it again.
    with SegmentStore(config.segment_dir, config.buffer.max_segment_bytes):
        conn = pg.connect(src.dsn)
        try:
            try:
                state = slots.slot_state(conn, src.slot)
                lost = False
            except SlotLost:
                state, lost = None, True
            if tables is None or lost:
                if lost or state is not None:
                    slots.drop_slot(conn, src.slot)
                _discard_segments(config.segment_dir)
                again = set(source.targets)
            else:
                again = set(tables)
        finally:
            conn.close()
    log.info("copying again: %s", ", ".join(sorted(again)))
    pipeline = Pipeline(source.config, session=lake.session())
    try:
        pipeline.copy_again(again)
        try:
            return pipeline.run(once=True)
        except TablesParked as exc:
            if again & set(exc.parked) or not isinstance(exc.report, RunReport):
                raise
            # Tables not copied now are still parked: said, not this command's failure.
            log.warning("still parked (not copied by this resync): %s; `walberg status` says "
                        "why", ", ".join(sorted(exc.parked)))
            return exc.report
    finally:
        pipeline.close()


def _discard_segments(directory: Path) -> None:
    """Every table is copied again in a new slot's snapshot: what the segments hold from the
    old slot is either in that copy or, from another server (a failover, a new DSN), not to be
    applied; and the reader would skip the new slot's transactions below the last one they
    hold. Removed, with any spilled transaction (call with the directory's lock held)."""
    old = [p for p in directory.iterdir() if p.suffix in (".sealed", ".active")]
    for path in old:
        path.unlink()
    spill.clear(directory / "spill")
    if old:
        log.info("removed %d segment(s) of the old replication slot from %s", len(old),
                 directory)
