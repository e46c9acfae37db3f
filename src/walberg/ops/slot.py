"""`walberg slot create|drop`: a Postgres source's replication slot, by hand. Dropping it frees
the WAL it holds; the next run creates it anew and copies every table."""

from __future__ import annotations

from typing import Optional

from walberg.config import Config
from walberg.errors import ConfigError
from walberg.source import postgres as pg
from walberg.source.stream import CreatedSlot, ReplicationStream


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
        return pg.drop_slot(conn, src.slot)
    finally:
        conn.close()


def create_slot(config: Config) -> Optional[CreatedSlot]:
    """Create the source's replication slot; None if it exists already."""
    src = config.postgres
    conn = pg.connect(src.dsn)
    try:
        if pg.slot_state(conn, src.slot) is not None:
            return None
    finally:
        conn.close()
    stream = ReplicationStream(src.dsn, src.slot, src.publication)
    stream.open()
    try:
        return stream.create_slot()
    finally:
        stream.close()
