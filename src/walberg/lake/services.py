"""The lake's services for every command that reads or acts on the lake without running a
pipeline: the Spark session (opened on first use, from the pipeline file), one ``IcebergSink``
and one type map (learned from Postgres) per source, and which Iceberg table holds each source table,
for every kind of pipeline file: one Postgres source, several (``sources:``), or Kafka topics.

The Postgres / several sources / Kafka branching of the commands is here, once: a command walks
``Lake.sources`` and asks each ``LakeSource`` for its tables and its kind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Optional

from walberg.apply.catalog import catalog_reads
from walberg.apply.catalog.metadata import TableSummary, read_hadoop_table, summarize
from walberg.apply.iceberg import IcebergSink
from walberg.apply.jvm.spark import stop_session
from walberg.apply.session import LSN_PROPERTY
from walberg.apply.types import TypeMap
from walberg.config import Config, PostgresSource
from walberg.errors import ConfigError, Terminal
from walberg.runtime.lakeside import open_session
from walberg.source import postgres as pg

SourceKind = Literal["postgres", "kafka"]


@dataclass(frozen=True)
class LakeSource:
    """One source of a pipeline file as the lake sees it."""

    name: Optional[str]  # its name under ``sources:``; None in a file with one source
    config: Config  # its own configuration (``Config.for_source`` with several)
    kind: SourceKind
    targets: dict[str, str]  # source table (schema.table) -> Iceberg table (catalog.ns.table)
    topics: dict[str, str]  # Kafka only: source table -> the topic it is read from

    @property
    def tag(self) -> Optional[str]:
        """What its rows and commits carry in tables shared with other sources (fan-in)."""
        return self.name if self.config.sink.fan_in else None

    @property
    def lsn_property(self) -> str:
        """The snapshot-summary key of its LSN mark (``walberg.lsn.<source>`` in a shared
        table)."""
        return LSN_PROPERTY + (f".{self.tag}" if self.tag else "")

    def local_metadata(self, target: str) -> Optional[tuple[Path, str, str]]:
        """(warehouse, namespace, table) of ``target`` when a hadoop catalog keeps it in a
        local warehouse, so its metadata file can be read without Spark; else None."""
        config = self.config
        if config.sink.catalog.type != "hadoop" or "://" in config.warehouse:
            return None
        _, namespace, table = target.split(".")
        return Path(config.warehouse), namespace, table

    def catalog_metadata(self, target: str) -> Optional[dict[str, Any]]:
        """The current metadata of ``target`` read through its catalog from Python (jdbc,
        rest, or a hadoop warehouse on object storage; see apply.catalog.catalog_reads), or None when
        the table does not exist or its catalog type is not read that way."""
        config = self.config
        cat = config.sink.catalog
        s3 = config.storage.s3
        io = catalog_reads.io_properties(None if s3 is None else s3.model_dump(),
                                         config.storage.timeout_seconds)
        _, namespace, table = target.split(".")
        return catalog_reads.table_metadata(cat.type, cat.name, config.warehouse, cat.uri,
                                            cat.options(), io, namespace, table)

    def table_summary(self, target: str) -> Optional[TableSummary]:
        """``target``'s summary from its metadata, with no Spark: the files of a local hadoop
        warehouse, else read through the catalog (None: the table does not exist, or its
        catalog is read only through Spark). Raises what the catalog or storage raised."""
        local = self.local_metadata(target)
        if local is not None:
            return read_hadoop_table(*local, self.lsn_property)
        meta = self.catalog_metadata(target)
        return None if meta is None else summarize(meta, self.lsn_property)

    @property
    def postgres(self) -> PostgresSource:
        return self.config.postgres  # a clear ConfigError on a Kafka source

    @property
    def where(self) -> str:
        """The config key that lists its tables, for messages."""
        if self.kind == "kafka":
            return "source.kafka.topics"
        return f"sources.{self.name}.postgres.tables" if self.name else "source.postgres.tables"

    def target(self, table: str) -> str:
        """The Iceberg table of one of its tables (``schema.table``, a bare name meaning
        ``public.name``, or a Kafka topic); an error that lists its tables otherwise."""
        found = self.resolve(table)
        if found is None:
            raise Terminal(f"{qualified(table)} is not one of this pipeline's tables "
                           f"({', '.join(self.targets)}); see {self.where}")
        return self.targets[found]

    def resolve(self, table: str) -> Optional[str]:
        """The source table ``table`` names, or None if it is not one of this source's."""
        if table in self.topics.values():
            return next(t for t, topic in self.topics.items() if topic == table)
        table = qualified(table)
        return table if table in self.targets else None


def qualified(table: str) -> str:
    """``schema.table``: a bare table name is in ``public``."""
    return table if "." in table else f"public.{table}"


def _sources(config: Config, names: Optional[list[str]]) -> list[LakeSource]:
    if names and not config.sources:
        config.for_source(names[0])  # the ConfigError that says the file has one source
    kafka = config.source.kafka
    if kafka is not None:
        tables = {kafka.table_for(t): t for t in kafka.topics}
        return [LakeSource(None, config, "kafka",
                           {name: config.target_for_topic(t) for name, t in tables.items()},
                           tables)]
    if not config.sources:
        return [LakeSource(None, config, "postgres",
                           {t: config.target_for(t) for t in config.postgres.tables}, {})]
    out = []
    for name in names or list(config.sources):
        one = config.for_source(name)  # a name the file does not have: ConfigError
        out.append(LakeSource(name, one, "postgres",
                              {t: one.target_for(t) for t in one.postgres.tables}, {}))
    return out


class Lake:
    """The lake of a pipeline file, for the commands. Spark starts only when a command needs
    it; ``close`` stops it (unless the session was given)."""

    def __init__(self, config: Config, session: Any = None,
                 names: Optional[list[str]] = None) -> None:
        """``session``: a SparkSession with the sink catalog configured, left running on close;
        ``names``: of several sources, the ones to act on (default: all)."""
        self.config = config
        self.sources = _sources(config, names)
        self._session = session
        self._owns_session = session is None
        # By source name: two databases may give one type OID to different types of their own.
        self._types: dict[Optional[str], TypeMap] = {}
        self._sinks: dict[Optional[str], IcebergSink] = {}

    def __enter__(self) -> "Lake":
        return self

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    def session(self) -> Any:
        if self._session is None:
            self._session = open_session(self.config)
        return self._session

    def types(self, source: LakeSource) -> TypeMap:
        """The source's type map (what ``learn_types`` told it of its Postgres types)."""
        if source.name not in self._types:
            sink = source.config.sink
            self._types[source.name] = TypeMap(sink.numeric_default, frozenset(sink.text_types))
        return self._types[source.name]

    def sink(self, source: Optional[LakeSource] = None) -> IcebergSink:
        """The IcebergSink as ``source`` writes (default: the first source): in a shared table
        it reads that source's ``walberg.lsn.<source>``."""
        source = source or self.sources[0]
        if source.name not in self._sinks:
            self._sinks[source.name] = IcebergSink(self.session(), self.types(source), source.tag)
        return self._sinks[source.name]

    @property
    def targets(self) -> list[str]:
        """Every Iceberg table of the pipeline, each once (shared tables fan in)."""
        return list(dict.fromkeys(t for s in self.sources for t in s.targets.values()))

    def find(self, table: str) -> tuple[LakeSource, str]:
        """The (first) source that has ``table``, and its Iceberg table."""
        for source in self.sources:
            if source.resolve(table) is not None:
                return source, source.target(table)
        listed = ", ".join(t for s in self.sources for t in s.targets)
        raise Terminal(f"{qualified(table)} is not one of this pipeline's tables ({listed}); "
                       f"see {' and '.join(dict.fromkeys(s.where for s in self.sources))}")

    def postgres_sources(self, need: str) -> list[LakeSource]:
        """The sources, for a command that works on Postgres itself; on a Kafka pipeline file
        a one-line error that starts with ``need`` (what the command does)."""
        if any(s.kind != "postgres" for s in self.sources):
            raise ConfigError(f"{need}; this pipeline reads Kafka")
        return self.sources

    def learn_types(self, source: LakeSource, conn: Any, infos: dict[str, pg.TableInfo]) -> None:
        """Tell the type map what the source catalog says about the tables' column types, and
        refuse a column whose type walberg cannot map."""
        found = pg.describe_types(conn, {c.type_oid for i in infos.values() for c in i.columns})
        types = self.types(source)
        for t, info in infos.items():
            target = source.targets[t]
            types.learn(found, target, info.dims)
            for c in info.columns:
                types.spark_type(c, target)

    def close(self) -> None:
        if self._owns_session and self._session is not None:
            stop_session(self._session)
        self._session = None
        self._sinks.clear()
