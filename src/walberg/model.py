"""Plain data shared by every stage: LSNs, relations, changes. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Final, Literal, Optional, Union


class Lsn(int):
    """A PostgreSQL WAL position (64-bit), printed the way Postgres prints it: ``16/B374D848``."""

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> "Lsn":
        try:
            hi, lo = text.strip().split("/")
            return cls((int(hi, 16) << 32) | int(lo, 16))
        except ValueError as exc:
            raise ValueError(f"not an LSN: {text!r} (expected the form 16/B374D848)") from exc

    def __str__(self) -> str:
        return f"{int(self) >> 32:X}/{int(self) & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn({self})"


class _Unchanged:
    """A TOASTed value that an UPDATE did not touch: pgoutput sends no value for it."""

    _instance: Optional["_Unchanged"] = None

    def __new__(cls) -> "_Unchanged":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()

# A column value as it travels through walberg: the Postgres text representation (bytes),
# None for SQL NULL, or UNCHANGED for an untouched TOAST value.
Value = Union[bytes, None, _Unchanged]
Row = tuple[Value, ...]


class Op(str, Enum):
    """A change's kind. Its value is the one-letter code in a staged file's ``_wb_op``."""

    INSERT = "I"
    UPDATE = "U"
    DELETE = "D"
    TRUNCATE = "T"
    SNAPSHOT = "S"  # a row of the initial copy (its dead letters)

    @property
    def label(self) -> str:
        """The name in a changelog's ``_walberg_op`` and in metrics: ``insert``, ..."""
        return self.name.lower()


# The kinds of change a row of a staged batch holds (TRUNCATE is staged apart, as a seq).
ROW_OPS: Final = (Op.INSERT, Op.UPDATE, Op.DELETE)


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int
    type_modifier: int = -1
    is_key: bool = False


@dataclass(frozen=True, slots=True)
class PgType:
    """What the source catalog (pg_type) says about one type OID."""

    oid: int
    name: str  # pg_type.typname, e.g. "int4", "mood", "citext"
    kind: str  # pg_type.typtype: b base, d domain, e enum, c composite, r range, m multirange
    base: int = 0  # a domain's underlying type
    base_modifier: int = -1  # a domain's type modifier (e.g. numeric(12,2))
    element: int = 0  # an array's element type
    builtin: bool = True  # part of Postgres itself (oid below FirstNormalObjectId)


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    schema: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def key_columns(self) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.is_key)


# ---- decoded pgoutput messages -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: Lsn  # LSN of the transaction's commit record
    commit_ts: int  # microseconds since 2000-01-01 UTC, as Postgres sends it
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn  # end of the commit record: the position a consumer confirms
    commit_ts: int


@dataclass(frozen=True, slots=True)
class Origin:
    commit_lsn: Lsn
    name: str


@dataclass(frozen=True, slots=True)
class TypeInfo:
    oid: int
    schema: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relation_oid: int
    new: Row


@dataclass(frozen=True, slots=True)
class Update:
    relation_oid: int
    new: Row
    old: Optional[Row] = None  # present when the key changed ('K') or REPLICA IDENTITY FULL ('O')
    old_kind: Optional[str] = None  # 'K' or 'O'


@dataclass(frozen=True, slots=True)
class Delete:
    relation_oid: int
    old: Row
    old_kind: str  # 'K' or 'O'


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_oids: tuple[int, ...]
    cascade: bool = False
    restart_identity: bool = False


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: Lsn
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class StreamStart:
    """Protocol v2: a chunk of a transaction still in progress follows."""

    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    pass


@dataclass(frozen=True, slots=True)
class StreamCommit:
    xid: int
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_ts: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    xid: int
    subxid: int


Message = Union[
    Begin,
    Commit,
    Origin,
    Relation,
    TypeInfo,
    Insert,
    Update,
    Delete,
    Truncate,
    LogicalMessage,
    StreamStart,
    StreamStop,
    StreamCommit,
    StreamAbort,
]


@dataclass(slots=True)
class TableState:
    """What the lake holds for one source table: the LSN its last walberg commit covers."""

    source: str  # schema.table in Postgres
    committed_lsn: Lsn = field(default_factory=lambda: Lsn(0))


# A table's write mode: a mirror (upsert), a changelog of every change (append), or both.
Mode = Literal["upsert", "append", "both"]
# How far the Iceberg schema follows ALTER TABLE in the source.
Evolution = Literal["strict", "add_columns", "full"]
# How updates and deletes are written: delete files, or rewritten data files.
WriteMode = Literal["merge-on-read", "copy-on-write"]


@dataclass(frozen=True)
class Layout:
    """How one Iceberg table is laid out: the pipeline file's sink.tables entry with the sink's
    defaults filled in."""

    partition_by: tuple[str, ...] = ()
    properties: dict[str, str] = field(default_factory=dict)
    format_version: int = 2
    write_mode: WriteMode = "merge-on-read"
    schema_evolution: Evolution = "full"
    mode: Mode = "upsert"


_PG_EPOCH = 946684800.0  # 2000-01-01 UTC


def pg_epoch(micros: int) -> float:
    """Unix time of a timestamp Postgres sends as microseconds since 2000-01-01 UTC."""
    return _PG_EPOCH + micros / 1_000_000
