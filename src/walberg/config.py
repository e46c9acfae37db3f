"""The pipeline configuration: one YAML file, validated by pydantic models.

``${VAR}`` anywhere in a string value is replaced from the environment before validation.
Relative paths are taken relative to the directory of the YAML file, so a pipeline directory can
be moved as a whole. Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import yaml
from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from walberg.config_sink import (
    Sink,
    Storage,
    TableLayout,
    _Model,
)
from walberg.errors import ConfigError
from walberg.model import Layout

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
class CopySettings(_Model):
    """How the initial copy reads a table."""

    method: Literal["copy", "jdbc"] = Field(
        "copy", description="copy: one COPY ... TO STDOUT stream per table, staged locally "
                            "(fastest on one machine); jdbc: Spark executors read the table in "
                            "parallel spans over JDBC, inside the slot's snapshot, one commit per "
                            "chunk, resumable after an interruption (for a Spark cluster and "
                            "large tables; needs the PostgreSQL JDBC driver)")
    chunk_rows: int = Field(
        1_000_000, ge=1000, description="jdbc: about this many rows per chunk (one commit each; "
                                        "an interrupted copy resumes after the last chunk "
                                        "committed)")
    parallelism: int = Field(
        0, ge=0, description="jdbc: readers per chunk (0: Spark's default parallelism)")
    fetch_size: int = Field(10_000, ge=1, description="jdbc: rows per round trip of a reader")


class PostgresSource(_Model):
    """Where changes come from."""

    dsn: str = Field(description="libpq connection string or URI; use ${VAR} for the password",
                     repr=False)  # it may hold a password
    slot: str = Field("walberg", description="logical replication slot, created if missing")
    publication: str = Field(
        "walberg", description="publication, created for `tables` if missing; or a list of "
                               "existing publications, combined as a PostgreSQL subscriber "
                               "combines them (row filters ORed, one column list)")
    tables: list[str] = Field(description="tables to mirror, as schema.table (schema defaults to public)")
    status_interval_seconds: float = Field(
        10.0, gt=0, description="how often walberg confirms its position to the server, also when idle"
    )
    stream_in_progress: bool = Field(
        True, description="receive large transactions while they run (pgoutput protocol 2, "
                          "PostgreSQL 14+), spilled to disk until they commit")
    follow_publication: bool = Field(
        False, description="also mirror every other table of the publication, including "
                           "tables added to it while walberg runs (each gets its own initial "
                           "copy when it first appears)")
    reconnect_max_seconds: float = Field(
        300.0, ge=0, description="keep reconnecting a lost source for this long before failing"
    )
    failover_slot: Optional[bool] = Field(
        None, description="make the slot a failover slot (PostgreSQL 17+), which standbys with "
                          "sync_replication_slots = on keep in step, so that a promoted "
                          "standby has it; unset: on where the server supports it (an existing "
                          "slot is altered to one at start)")
    initial_copy: CopySettings = Field(default_factory=lambda: CopySettings(),  # type: ignore[call-arg]
                                       description="how the initial copy reads tables")

    @field_validator("publication", mode="before")
    @classmethod
    def _publications(cls, value: Any) -> Any:
        # Several publications travel as one comma-separated string: the form pgoutput's
        # publication_names option takes.
        if isinstance(value, list):
            if not value:
                raise ValueError("name at least one publication")
            if len(set(value)) != len(value):
                raise ValueError("a publication is listed twice")
            return ",".join(str(v) for v in value)
        return value

    @field_validator("slot", "publication")
    @classmethod
    def _identifier(cls, value: str, info: ValidationInfo) -> str:
        for name in value.split(",") if info.field_name == "publication" else [value]:
            if not re.fullmatch(r"[a-z0-9_]{1,63}", name):
                raise ValueError("use 1-63 lower-case letters, digits or underscores")
        return value

    @property
    def publications(self) -> list[str]:
        """The publications the stream subscribes to (``publication`` names one or a list)."""
        return self.publication.split(",")

    @field_validator("tables")
    @classmethod
    def _qualify(cls, tables: list[str]) -> list[str]:
        if not tables:
            raise ValueError("name at least one table, as schema.table")
        out = []
        for name in tables:
            parts = name.split(".")
            if len(parts) == 1:
                parts = ["public", parts[0]]
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"{name!r} is not of the form schema.table")
            out.append(".".join(parts))
        if len(set(out)) != len(out):
            raise ValueError("a table is listed twice")
        return out


class KafkaTopic(_Model):
    """How one Kafka topic lands in Iceberg (source.kafka.tables.<topic>)."""

    doc_key: ClassVar[str] = "topic"

    table: Optional[str] = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$",
        description="namespace.table in the catalog; default: the topic's last two parts "
                    "(server.schema.table -> sink.namespace or schema, and table)")
    key: list[str] = Field(
        default_factory=list,
        description="key columns; default: the fields of the message key")
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="column: Postgres type (e.g. id: bigint, price: numeric(10,2)), in table "
                    "order; default: the envelope's schema, else the existing Iceberg table, "
                    "else inferred from the first record")


class KafkaSource(_Model):
    """Debezium change events from Kafka topics."""

    bootstrap_servers: str = Field(description="Kafka bootstrap servers, host:port[,host:port]")
    topics: list[str] = Field(description="topics to read, each holding one table's events")
    group_id: str = Field(
        "walberg", description="consumer group; walberg commits offsets to it after each "
                               "Iceberg commit for lag monitoring only, it resumes from the "
                               "offsets in the lake")
    format: Literal["debezium-json"] = Field(
        "debezium-json", description="record format: debezium-json (with or without schema)")
    tables: dict[str, KafkaTopic] = Field(
        default_factory=dict, description="per topic: table, key, columns")
    reconnect_max_seconds: float = Field(
        300.0, ge=0, description="at start, keep asking a broker that cannot be reached for "
                                 "the topics this long before failing (once reading, the "
                                 "consumer reconnects by itself)")
    properties: dict[str, str] = Field(
        default_factory=dict, description="extra librdkafka consumer settings (e.g. "
                                          "security.protocol, sasl.*)", repr=False)

    @field_validator("topics")
    @classmethod
    def _some(cls, topics: list[str]) -> list[str]:
        if not topics:
            raise ValueError("name at least one topic")
        if len(set(topics)) != len(topics):
            raise ValueError("a topic is listed twice")
        return topics

    @model_validator(mode="after")
    def _known(self) -> "KafkaSource":
        unknown = sorted(set(self.tables) - set(self.topics))
        if unknown:
            raise ValueError(f"tables names {', '.join(unknown)}, which topics does not list")
        return self

    def table_for(self, topic: str) -> str:
        """The schema.table name walberg uses for a topic's table (metrics, sink.tables)."""
        chosen = self.tables.get(topic)
        if chosen is not None and chosen.table:
            return chosen.table
        parts = topic.split(".")
        return ".".join(parts[-2:]) if len(parts) >= 2 else f"public.{topic}"


class Source(_Model):
    doc_key: ClassVar[str] = "name"

    postgres: Optional[PostgresSource] = Field(None, description="a PostgreSQL database")
    kafka: Optional[KafkaSource] = Field(None, description="Debezium events from Kafka")

    @model_validator(mode="after")
    def _exactly_one(self) -> "Source":
        if (self.postgres is None) == (self.kafka is None):
            raise ValueError("give exactly one of postgres and kafka")
        return self


class Buffer(_Model):
    dir: str = Field("./segments", description="directory for segment files")
    max_segment_bytes: int = Field(
        16 * 1024 * 1024, ge=64 * 1024, description="seal a segment when it reaches this size"
    )
    max_interval_seconds: float = Field(
        5.0, gt=0, description="seal and apply at least this often while changes arrive"
    )
    max_batch_bytes: int = Field(
        256 * 1024 * 1024, ge=64 * 1024,
        description="apply at most this many bytes of sealed segments in one Iceberg commit "
                    "(a batch takes the segments sealed while it is staged and while the one "
                    "before it commits, up to this)",
    )
    stage_uri: Optional[str] = Field(
        None, pattern=r"^(local|[A-Za-z][A-Za-z0-9+.-]*://.+)$",
        description="where a Spark cluster's executors read staged batches and copies from: "
                    "a URI (s3a://, gs://, abfs://, hdfs://...) the driver uploads them to and "
                    "removes them from after the commit; local: from buffer.dir itself (local "
                    "mode, or buffer.dir mounted alike on every executor); default: local mode "
                    "reads buffer.dir, a cluster stages under <warehouse>/_walberg_staging when "
                    "the warehouse is object storage or HDFS")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: object) -> float:
    """Seconds from 90, "90s", "15m", "1h" or "7d"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a duration like 90s, 15m, 1h or 7d")
    return float(match.group(1)) * _UNIT[match.group(2)]


class Maintenance(_Model):
    """Compaction and cleanup of the Iceberg tables (`walberg maintain`, or on a schedule)."""

    every: Optional[float] = Field(
        None, ge=0, description="run maintenance from `walberg run` this often (e.g. 1h); off if "
                                "unset or 0")
    target_file_size_bytes: int = Field(
        128 * 1024 * 1024, ge=1024 * 1024, description="data file size compaction aims for")
    snapshot_retention: float = Field(
        7 * 86400.0, ge=0, description="expire snapshots older than this (e.g. 7d)")
    retain_last: int = Field(10, ge=1, description="but always keep this many newest snapshots")
    orphan_retention: float = Field(
        3 * 86400.0, ge=3600,
        description="remove unreferenced files older than this (at least 1h: newer ones may "
                    "belong to a commit in progress)")

    @field_validator("every", "snapshot_retention", "orphan_retention", mode="before")
    @classmethod
    def _duration(cls, value: object) -> Optional[float]:
        return None if value is None else parse_duration(value)


class Metrics(_Model):
    port: Optional[int] = Field(None, ge=1, le=65535,
                                description="serve Prometheus metrics at /metrics on this port")
    host: str = Field("127.0.0.1", description="address to serve metrics on (0.0.0.0: all)")


class Spark(_Model):
    master: str = Field("local[*]", description="Spark master URL")
    conf: dict[str, str] = Field(default_factory=dict, description="extra Spark settings")


def changelog_beside(target: str) -> str:
    """The changelog table beside ``target`` in mode both."""
    return f"{target}_changelog"


class Config(_Model):
    source: Source = Field(description="the source database (or use `sources`)")
    sources: dict[str, Source] = Field(
        default_factory=dict,
        description="several source databases (or shards) by name, each with its own slot and "
                    "segments; their tables fan in to one Iceberg table each (sink.fan_in)")
    sink: Sink
    buffer: Buffer = Field(default_factory=lambda: Buffer())  # type: ignore[call-arg]
    spark: Spark = Field(default_factory=lambda: Spark())  # type: ignore[call-arg]
    maintenance: Maintenance = Field(default_factory=lambda: Maintenance())  # type: ignore[call-arg]
    metrics: Metrics = Field(default_factory=lambda: Metrics())  # type: ignore[call-arg]
    storage: Storage = Field(default_factory=lambda: Storage())  # type: ignore[call-arg]
    base_dir: Path = Field(Path("."), exclude=True, description="directory of the YAML file")
    _source_name: Optional[str] = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _one_or_many(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sources"):
            if data.get("source"):
                raise ValueError("give either source or sources, not both")
            sources = data["sources"]
            if not isinstance(sources, dict):
                raise ValueError("sources: a mapping of source names to sources")
            for name in sources:
                if not re.fullmatch(r"[a-z][a-z0-9_]{0,30}", str(name)):
                    raise ValueError(f"sources: the name {name!r} must be 1-31 lower-case "
                                     "letters, digits or underscores, starting with a letter")
            # The first source stands in for `source` until for_source() picks one.
            data = {**data, "source": next(iter(sources.values()))}
        return data

    @property
    def postgres(self) -> PostgresSource:
        """The Postgres source; a clear error when this pipeline reads from Kafka."""
        if self.source.postgres is None:
            raise ConfigError("this command needs a Postgres source (source.postgres); this "
                              "pipeline file reads Debezium events from Kafka (source.kafka)")
        return self.source.postgres

    @property
    def source_name(self) -> Optional[str]:
        """The source this configuration is for, in a pipeline with several (else None)."""
        return self._source_name

    def for_source(self, name: str) -> "Config":
        """The single-source configuration of one of ``sources``: its own slot, publication and
        segment directory (``buffer.dir/<name>``), the same sink."""
        if name not in self.sources:
            raise ConfigError(
                f"there is no source {name!r} in this pipeline file; its sources are "
                f"{', '.join(self.sources)}" if self.sources else
                f"this pipeline file has one source (`source:`), not several, so there is no "
                f"source {name!r} to choose: leave out --source")
        buffer = self.buffer.model_copy(update={"dir": str(Path(self.buffer.dir) / name)})
        one = self.model_copy(update={"source": self.sources[name], "sources": {},
                                      "buffer": buffer})
        one._source_name = name
        return one

    def path(self, value: str) -> Path:
        """A path from the config, relative to the YAML file's directory."""
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else (self.base_dir / p).resolve()

    @property
    def segment_dir(self) -> Path:
        return self.path(self.buffer.dir)

    @property
    def index_dir(self) -> Optional[Path]:
        """Where the key indexes of tables applied by position live (see apply.position.keyed); None
        when ``sink.apply_by_position`` is off."""
        return self.segment_dir / "keyindex" if self.sink.apply_by_position else None

    @property
    def warehouse(self) -> str:
        wh = self.sink.catalog.warehouse or ""
        return wh if "://" in wh or not wh else str(self.path(wh))

    def namespace_for(self, source_table: str) -> str:
        return self.sink.namespace or source_table.split(".")[0]

    def target_for(self, source_table: str) -> str:
        """The Iceberg identifier (catalog.namespace.table) for a source table. With several
        sources and no fan-in, the table's name starts with its source's."""
        layout = self.sink.tables.get(source_table)
        if layout is not None and layout.target:
            return f"{self.sink.catalog.name}.{layout.target}"
        name = source_table.split(".")[1]
        if self._source_name is not None and not self.sink.fan_in:
            name = f"{self._source_name}__{name}"
        return f"{self.sink.catalog.name}.{self.namespace_for(source_table)}.{name}"

    def target_for_topic(self, topic: str) -> str:
        """The Iceberg identifier for a Kafka topic's table: its ``source.kafka.tables.<topic>
        .table`` as given (namespace.table), else as for the source table it names."""
        kafka = self.source.kafka
        assert kafka is not None, "target_for_topic: a Kafka source's pipeline file"
        chosen = kafka.tables.get(topic)
        if chosen is not None and chosen.table:
            return f"{self.sink.catalog.name}.{chosen.table}"
        return self.target_for(kafka.table_for(topic))

    def changelog_for(self, source_table: str) -> str:
        """The changelog table of a source table: the target itself in append mode, else
        ``<target>_changelog`` (mode both)."""
        target = self.target_for(source_table)
        return target if self.layout_for(source_table).mode == "append" else changelog_beside(target)

    def changelog_for_topic(self, topic: str) -> str:
        """The changelog table of a topic's table, as ``changelog_for``."""
        assert self.source.kafka is not None, "changelog_for_topic: a Kafka source's pipeline file"
        target = self.target_for_topic(topic)
        table = self.source.kafka.table_for(topic)
        return target if self.layout_for(table).mode == "append" else changelog_beside(target)

    def layout_for(self, source_table: str) -> Layout:
        t = self.sink.tables.get(source_table) or TableLayout.model_validate({})
        return Layout(tuple(t.partition_by), {**self.sink.properties, **t.properties},
                      t.format_version or self.sink.format_version,
                      t.write_mode or self.sink.write_mode,
                      t.schema_evolution or self.sink.schema_evolution,
                      t.mode or self.sink.mode)

    @model_validator(mode="after")
    def _tables_known(self) -> "Config":
        kafka = self.source.kafka
        if kafka is not None:
            if self.sources:
                raise ValueError("a Kafka source goes in source.kafka; sources takes Postgres "
                                 "sources only")
            every = {kafka.table_for(t) for t in kafka.topics}
            unknown = sorted(set(self.sink.tables) - every)
            if unknown:
                raise ValueError(f"sink.tables names {', '.join(unknown)}, which no topic of "
                                 "source.kafka.topics lands in")
            targets = [self.target_for_topic(t) for t in kafka.topics]
            targets += [self.changelog_for_topic(t) for t in kafka.topics
                        if self.layout_for(kafka.table_for(t)).mode == "both"]
            if len(every) != len(kafka.topics) or len(set(targets)) != len(targets):
                raise ValueError("two topics land in the same table; give one of them a "
                                 "source.kafka.tables.<topic>.table")
            return self
        postgres = [self.postgres] + [s.postgres for s in self.sources.values()
                                      if s.postgres is not None]
        if len(postgres) != len(self.sources) + 1:
            raise ValueError("sources takes Postgres sources only")
        every = set(self.postgres.tables).union(*[set(s.tables) for s in postgres[1:]])
        unknown = sorted(set(self.sink.tables) - every)
        if unknown:
            raise ValueError(f"sink.tables names {', '.join(unknown)}, which source.postgres."
                             "tables does not list")
        if self.sources:
            slots = [s.slot for s in postgres[1:]]
            for name, src in zip(self.sources, postgres[1:], strict=True):
                if slots.count(src.slot) > 1 and len({s.dsn for s in postgres[1:]}) == 1:
                    raise ValueError(f"sources.{name}: two sources on one database need "
                                     "their own slot names")
            if self.sink.fan_in and any(self.layout_for(t).mode != "upsert" for t in every):
                raise ValueError("sink.fan_in with several sources works in upsert mode only")
            return self
        targets = [self.target_for(t) for t in self.postgres.tables]
        targets += [self.changelog_for(t) for t in self.postgres.tables
                    if self.layout_for(t).mode == "both"]
        if len(set(targets)) != len(targets):
            raise ValueError("two source tables map to the same Iceberg table; give one of "
                             "them a sink.tables.<table>.target")
        return self


def _interpolate(node: Any, where: str) -> Any:
    if isinstance(node, dict):
        return {k: _interpolate(v, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, f"{where}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, str):
        def repl(m: re.Match[str]) -> str:
            value = os.environ.get(m.group(1))
            if value is None:
                raise ConfigError(
                    f"{where}: the environment variable {m.group(1)} is not set. "
                    f"Export it before starting walberg, or write the value into the file."
                )
            return value
        return _ENV_REF.sub(repl, node)
    return node


def _describe(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        kind = e["type"]
        if kind == "extra_forbidden":
            lines.append(f"  {loc}: unknown key (check its spelling; see the configuration reference)")
        elif kind == "missing":
            lines.append(f"  {loc}: required but missing")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return f"{origin} is not a valid walberg configuration:\n" + "\n".join(lines)


def parse_config(data: Any, base_dir: Path, origin: str = "the configuration") -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must be a YAML mapping with source, sink, buffer and spark keys")
    data = _interpolate(data, "")
    try:
        return Config.model_validate({**data, "base_dir": base_dir})
    except ValidationError as err:
        raise ConfigError(_describe(err, origin)) from None


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration file {path}: {exc.strerror}. "
                          "Pass the right path with -c.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return parse_config(data, path.resolve().parent, str(path))
