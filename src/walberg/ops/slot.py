"""`walberg slot create|drop`: a Postgres source's replication slot, by hand. Dropping it frees
the WAL it holds; the next run creates it anew and copies every table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from walberg.config import Config
from walberg.errors import ConfigError, SourceError
from walberg.source import postgres as pg
from walberg.source import slots
from walberg.source.stream import CreatedSlot, ReplicationStream

if TYPE_CHECKING:
    from walberg.lake.services import LakeSource


def slot_source(config: Config, source: Optional[str], origin: str) -> Config:
    """The configuration whose slot a command acts on: the file's one source, or the one
    ``source`` names. With several sources a name is required: dropping several slots (and
    so copying several databases again) unasked is too easy a mistake."""
    if config.sources and source is None:
        raise ConfigError(f"{origin} has several sources ({', '.join(config.sources)}), each "
                          f"with its own replication slot: name one with --source NAME")
    if source is not None:
        config = config.for_source(source)  # a name it does not have: ConfigError
    if config.source.kafka is not None:
        raise ConfigError("a replication slot belongs to a database source; this pipeline "
                          "reads Kafka")
    return config


def drop_slot(config: Config) -> bool:
    """Drop the source's replication slot (refused while a process streams from it); True if
    there was one."""
    src = config.postgres
    conn = pg.connect(src.dsn)
    try:
        return slots.drop_slot(conn, src.slot)
    finally:
        conn.close()


# Catalogs walberg reads only through Spark (no Python client for them here).
READ_THROUGH_SPARK = ("hive", "glue", "nessie")


def create_slot(config: Config, session: Any = None) -> Optional[CreatedSlot]:
    """Create the source's replication slot; None if it exists already. Refused while the
    lake holds any of the source's tables: a slot made now streams only what commits from
    now on, and a run could not tell it from the slot those tables were read from, so the
    changes in between would be missing from them for good."""
    src = config.postgres
    conn = pg.connect(src.dsn)
    try:
        if slots.slot_state(conn, src.slot) is not None:
            return None
    finally:
        conn.close()
    held = (_held_through_spark(config, session)
            if config.sink.catalog.type in READ_THROUGH_SPARK else _held(config))
    if held:
        first, lsn = next(iter(held.items()))
        raise SourceError(
            f"the lake holds {len(held)} of this source's tables already ({first} up to LSN "
            f"{lsn}); a replication slot {src.slot} created now would stream only what commits "
            "from now on, and the changes since would be missing from them. Run `walberg "
            "resync -c <pipeline.yaml>` instead: it creates the slot and copies every table "
            "in its snapshot.")
    stream = ReplicationStream(src.dsn, src.slot, src.publication)
    stream.open()
    try:
        return stream.create_slot()
    finally:
        stream.close()


def _source(config: Config) -> "LakeSource":
    from walberg.lake.services import LakeSource

    # (named as in the pipeline file: a table shared by several sources marks each one's LSN)
    return LakeSource(config.source_name, config, "postgres",
                      {t: config.target_for(t) for t in config.postgres.tables}, {})


def _held_through_spark(config: Config, session: Any = None) -> dict[str, str]:
    """``_held`` for a catalog walberg reads only through Spark (hive, glue, nessie): the
    tables' marks as a run reads them, in a Spark session (``session``, or one started for
    this and stopped after)."""
    from walberg.lake.services import Lake

    source = _source(config)
    held = {}
    with Lake(config, session=session) as lake:
        sink = lake.sink(source)
        for t, target in source.targets.items():
            try:
                lsn = sink.committed_lsn(target) if sink.table_exists(target) else None
            except Exception as exc:  # (the catalog's or the storage's own error)
                raise SourceError(
                    f"{target} could not be read through the {config.sink.catalog.type} catalog "
                    f"({' '.join(str(exc).split())[:300]}), so walberg cannot tell whether the "
                    f"lake holds {t}; creating the slot by hand is refused until it can."
                ) from exc
            if lsn is not None:
                held[t] = str(lsn)
    return held


def _held(config: Config) -> dict[str, str]:
    """The source's tables that walberg has committed to in the lake, with the LSN they hold,
    read from the tables' metadata as `walberg status` reads it (no Spark; a catalog read only
    through Spark is read by ``_held_through_spark``). Metadata that cannot be read is an
    error: the table may hold rows."""
    source = _source(config)
    held = {}
    for t, target in source.targets.items():
        try:
            found = source.table_summary(target)
        except Exception as exc:  # (the catalog's or the storage's own error, said as it is)
            raise SourceError(
                f"the metadata of {target} could not be read ({' '.join(str(exc).split())[:300]}),"
                f" so walberg cannot tell whether the lake holds {t}; creating the slot by hand "
                "is refused until it can (`walberg status -c <pipeline.yaml>` reads the same)."
            ) from exc
        if found is not None and found.walberg_lsn:
            held[t] = found.walberg_lsn
    return held
