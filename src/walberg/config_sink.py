"""The lake side of the pipeline configuration: the Iceberg catalog, each table's layout
(target, partitioning, properties, write mode), the sink, and object storage. ``config``
builds the whole file from these and the source's settings."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from walberg.model import Evolution, Mode, WriteMode

_IDENT = r"[A-Za-z_][A-Za-z0-9_$]*"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Catalog(_Model):
    name: str = Field("lake", pattern=_IDENT, description="Spark catalog name used in SQL")
    type: Literal["hadoop", "jdbc", "rest", "hive", "glue", "nessie"] = Field(
        "hadoop", description="Iceberg catalog type: hadoop, jdbc, rest, hive, glue or nessie")
    warehouse: Optional[str] = Field(
        None, description="warehouse location: a directory or s3a:// path (required for "
                          "hadoop and jdbc)")
    uri: Optional[str] = Field(
        None, description="jdbc: jdbc:postgresql://...; rest: the REST endpoint; hive: "
                          "thrift://...; nessie: the API URL", repr=False)
    user: Optional[str] = Field(None, description="jdbc: the catalog database's user")
    password: Optional[str] = Field(
        None, description="jdbc: its password (use ${VAR})", repr=False)
    credential: Optional[str] = Field(
        None, description="rest: OAuth2 client credential (id:secret; use ${VAR})", repr=False)
    token: Optional[str] = Field(None, description="rest: bearer token (use ${VAR})", repr=False)
    oauth2_server_uri: Optional[str] = Field(None, description="rest: OAuth2 token endpoint")
    scope: Optional[str] = Field(None, description="rest: OAuth2 scope")
    region: Optional[str] = Field(None, description="glue: AWS region")
    catalog_id: Optional[str] = Field(None, description="glue: the Glue catalog id (account)")
    ref: Optional[str] = Field(None, description="nessie: branch or tag (default main)")
    properties: dict[str, str] = Field(
        default_factory=dict, description="extra Iceberg catalog properties, passed through"
    )

    @model_validator(mode="after")
    def _needs(self) -> "Catalog":
        if self.type in ("hadoop", "jdbc") and not self.warehouse:
            raise ValueError(f"catalog type {self.type} needs a warehouse")
        if self.type in ("jdbc", "rest", "hive", "nessie") and not self.uri:
            raise ValueError(f"catalog type {self.type} needs a uri")
        return self

    def options(self) -> dict[str, Optional[str]]:
        """The type-specific settings, by name (see apply.catalog.catalogs)."""
        return {"user": self.user, "password": self.password, "credential": self.credential,
                "token": self.token, "oauth2_server_uri": self.oauth2_server_uri,
                "scope": self.scope, "region": self.region, "catalog_id": self.catalog_id,
                "ref": self.ref}


_TRANSFORM = re.compile(
    r"^(?:(?:identity|years|months|days|hours|year|month|day|hour)\(\s*(\w+)\s*\)"
    r"|(?:bucket|truncate)\(\s*\d+\s*,\s*(\w+)\s*\)|(\w+))$")
# The two halves YAML leaves of "bucket(16, c)" written unquoted in a [...] list.
_SPLIT_HEAD = re.compile(r"^\s*(?:bucket|truncate)\(\s*\d+\s*$")
_SPLIT_TAIL = re.compile(r"^\s*\w+\s*\)\s*$")
# Parquet codecs the Iceberg writer has here (brotli would need Hadoop's BrotliCodec, which no
# package on PyPI ships).
_CODECS = {"none": "uncompressed", "uncompressed": "uncompressed", "snappy": "snappy",
           "gzip": "gzip", "lz4": "lz4", "zstd": "zstd"}


def _check_properties(props: dict[str, str]) -> dict[str, str]:
    out = dict(props)
    codec = out.get("write.parquet.compression-codec")
    if codec is not None:
        if codec.lower() not in _CODECS:
            extra = (" (brotli needs Hadoop's BrotliCodec, which this installation lacks)"
                     if codec.lower() == "brotli" else "")
            raise ValueError(f"write.parquet.compression-codec {codec!r}: use one of "
                             f"{', '.join(sorted(_CODECS))}{extra}")
        out["write.parquet.compression-codec"] = _CODECS[codec.lower()]
    return out


class TableLayout(_Model):
    """How one table is laid out in Iceberg (sink.tables.<schema.table>)."""

    target: Optional[str] = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$",
        description="namespace.table in the catalog; default: sink.namespace and the table name")
    partition_by: list[str] = Field(
        default_factory=list,
        description="Iceberg partition transforms: column, bucket(N, c), truncate(W, c), "
                    "years/months/days/hours(c) (quote those with a comma in a [...] list); "
                    "changing it evolves the partition spec")
    properties: dict[str, str] = Field(
        default_factory=dict, description="Iceberg table properties for this table")
    format_version: Optional[Literal[2, 3]] = Field(
        None, description="Iceberg format version: 2, or 3 (deletion vectors)")
    write_mode: Optional[WriteMode] = Field(
        None, description="how updates and deletes are written")
    schema_evolution: Optional[Evolution] = Field(
        None, description="as sink.schema_evolution, for this table")
    mode: Optional[Mode] = Field(None, description="as sink.mode, for this table")

    @field_validator("partition_by")
    @classmethod
    def _transforms(cls, value: list[str]) -> list[str]:
        for t, after in zip(value, [*value[1:], None], strict=True):
            if _SPLIT_HEAD.match(t) and after is not None and _SPLIT_TAIL.match(after):
                # A [...] list in YAML splits at every comma, also inside bucket(16, c).
                whole = f"{t.strip()}, {after.strip()}"
                raise ValueError(f"YAML split {whole!r} at its comma into {t!r} and {after!r}: "
                                 f"quote it (\"{whole}\") or write the list one item a line "
                                 f"(- {whole})")
            if not _TRANSFORM.match(t.strip()):
                raise ValueError(f"{t!r} is not a partition transform: use a column name, "
                                 "bucket(N, col), truncate(W, col), or years/months/days/"
                                 "hours(col)")
        return [t.strip() for t in value]

    @field_validator("properties")
    @classmethod
    def _props(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_properties(value)


class Sink(_Model):
    catalog: Catalog
    namespace: Optional[str] = Field(
        None, pattern=_IDENT, description="Iceberg namespace; default: the Postgres schema name"
    )
    mode: Mode = Field(
        "upsert", description="upsert: the table mirrors Postgres; append: a changelog table, one "
                              "row per change; both: the mirror and <table>_changelog")
    unconstrained_numeric: str = Field(
        "decimal(38,18)", pattern=r"^decimal\(\d{1,2},\d{1,2}\)$",
        description="Iceberg type for NUMERIC columns declared without precision (values that "
                    "do not fit go to the dead-letter table)")
    commit_max_attempts: int = Field(
        8, ge=1, description="tries of one Iceberg commit that failed for the storage or the "
                             "catalog (backoff 100 ms, doubling), before walberg stops")
    commit_max_backoff_seconds: float = Field(
        30.0, gt=0, description="longest wait between two tries of a commit")
    schema_evolution: Literal["strict", "add_columns", "full"] = Field(
        "full", description="on ALTER TABLE in Postgres: full (add, drop, rename, widen), "
                            "add_columns (only additions), strict (stop)")
    text_types: list[str] = Field(
        default_factory=list,
        description="extension types (e.g. geometry) to store as their Postgres text form")
    fan_in: bool = Field(
        True, description="with several sources: tables of the same name land in one Iceberg "
                          "table with a _walberg_source column (true), or each in its own "
                          "<source>__<table> (false)")
    format_version: Literal[2, 3] = Field(
        2, description="Iceberg format version of new tables: 2, or 3 (deletion vectors)")
    write_mode: WriteMode = Field(
        "merge-on-read", description="updates and deletes: merge-on-read (delete files, fast "
                                     "writes) or copy-on-write (rewritten data files, fast reads)")
    apply_by_position: bool = Field(
        True, description="apply a batch to a keyed table (integer, date, timestamp, text or "
                          "uuid key columns, partitioned or not, format 2 or 3, fanned in or "
                          "not) as one row delta found through a key index in buffer.dir "
                          "(cost follows the changes); false: always MERGE (cost follows the "
                          "table)")
    commit_parallelism: int = Field(
        4, ge=1, le=64,
        description="how many tables of a batch are committed side by side (each its own "
                    "Iceberg commit carrying its own position); 1: one after another. Many "
                    "small tables are fresh sooner with more, up to what the catalog and the "
                    "machine take")
    atomic_commits: bool = Field(
        True, description="where the catalog commits several tables at once (a REST catalog "
                          "offering POST /v1/{prefix}/transactions/commit), the tables of a "
                          "batch become visible together, in one catalog transaction: a reader "
                          "never sees one table of a source transaction without the others; "
                          "false: each table commits on its own")
    key_index_in_warehouse: bool = Field(
        True, description="keep each table's key index (see apply_by_position) in the "
                          "warehouse too, versioned by the snapshot it describes: a driver on "
                          "another machine fetches it instead of reading every key of the "
                          "table back. Under <table>/_walberg_keys; on a rest catalog, one "
                          "Puffin file in the table's metadata folder registered as the "
                          "statistics file of its snapshot (kept by orphan-file removal)")
    properties: dict[str, str] = Field(
        default_factory=dict, description="Iceberg table properties for every table")
    tables: dict[str, TableLayout] = Field(
        default_factory=dict, description="per source table (schema.table): target, "
                                          "partition_by, properties, format_version, "
                                          "write_mode, schema_evolution, mode")

    @field_validator("properties")
    @classmethod
    def _props(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_properties(value)

    @field_validator("tables")
    @classmethod
    def _qualify_tables(cls, value: dict[str, TableLayout]) -> dict[str, TableLayout]:
        return {(k if "." in k else f"public.{k}"): v for k, v in value.items()}

    @property
    def index_in_metadata(self) -> bool:
        """Whether a key index kept in the warehouse is a file the table's metadata names (a
        REST catalog may own the storage and remove whatever no metadata names) rather than
        a folder beside the table."""
        return self.catalog.type == "rest"

    @property
    def numeric_default(self) -> tuple[int, int]:
        p, s = re.findall(r"\d+", self.unconstrained_numeric)
        return int(p), int(s)

    @model_validator(mode="after")
    def _numeric_fits(self) -> "Sink":
        p, s = self.numeric_default
        if not 1 <= p <= 38 or s > p:
            raise ValueError(f"unconstrained_numeric {self.unconstrained_numeric}: precision must "
                             "be 1..38 and the scale at most the precision")
        return self


class S3Storage(_Model):
    endpoint: Optional[str] = Field(
        None, description="S3 endpoint URL; set for MinIO and other S3-compatible servers")
    region: Optional[str] = Field(None, description="AWS region")
    path_style_access: bool = Field(
        False, description="bucket in the path, not the host name (MinIO and most others)")
    access_key_id: Optional[str] = Field(None, description="access key (use ${VAR})",
                                         repr=False)
    secret_access_key: Optional[str] = Field(None, description="secret key (use ${VAR})",
                                             repr=False)
    jars: list[str] = Field(
        default_factory=list, description="hadoop-aws and aws-java-sdk-bundle jars; default: "
                                          "those of the sagemaker-pyspark package")


class GcsStorage(_Model):
    project_id: Optional[str] = Field(None, description="GCP project")
    service_account_json_keyfile: Optional[str] = Field(
        None, description="path of a service account key file")
    jars: list[str] = Field(default_factory=list, description="the gcs-connector jar")


class AzureStorage(_Model):
    account_name: Optional[str] = Field(None, description="storage account")
    account_key: Optional[str] = Field(None, description="its key (use ${VAR})", repr=False)
    jars: list[str] = Field(default_factory=list, description="hadoop-azure and its jars")


class Storage(_Model):
    """Where an object-store warehouse lives (sink.catalog.warehouse: s3a://bucket/path)."""

    timeout_seconds: float = Field(
        60.0, gt=0, description="how long a read or write of an object-store warehouse may "
                                "wait for a store that does not answer (or refuses the "
                                "credentials) before it fails with a message naming the "
                                "endpoint: `run --once` then stops, `run` tries the commit "
                                "again (sink.commit_max_attempts); also bounds the s3a "
                                "connector's own timeouts and retries")
    s3: Optional[S3Storage] = Field(None, description="S3 or S3-compatible storage")
    gcs: Optional[GcsStorage] = Field(None, description="Google Cloud Storage (gs://)")
    azure: Optional[AzureStorage] = Field(None, description="Azure Data Lake Storage (abfss://)")


