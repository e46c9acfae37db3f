"""Staging a batch for Spark: decoded changes and initial-copy CSV become Parquet files, one
set per table, written in bounded chunks so memory stays flat whatever the size of a transaction
or a table.

Staged columns: ``c0..cN`` hold each source column's value (NULL as null): parsed into its type
for numbers, booleans, dates and timestamps, else Postgres's text (``apply.types.TextPrep``),
``_wb_seq`` orders the
changes of the batch (commit order, then position in the transaction), ``_wb_op`` is I/U/D,
``_wb_lsn`` is the commit LSN of the change's transaction (where its commit record begins: a
transaction committed right after a batch's last has the batch's end LSN), ``_wb_unchanged``
lists (as ",i,j,") columns an UPDATE left untouched (unchanged TOAST values). The netting (last change per key
wins) happens here at the end of staging when the keys' text is their identity and the batch's
extent is known (``BatchBuilder.finish``), else in Spark, see ``apply.merge.netting``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generator, Optional, Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from walberg.apply.types import TextPrep
from walberg.model import ROW_OPS, UNCHANGED, Column, Op, Row

META = ("_wb_seq", "_wb_op", "_wb_lsn", "_wb_unchanged")
# Key types whose staged value is one-to-one with the key (int2, int4, int8, text, varchar,
# bpchar, uuid as their text; date, timestamp, timestamptz typed): equal keys have equal staged
# values, so repeats can be found on them.
_EXACT_TEXT_KEYS = frozenset({21, 23, 20, 25, 1043, 1042, 2950, 1082, 1114, 1184})
_INT_KEYS = frozenset({21, 23, 20})
_KEY_TRACK_LIMIT = 5_000_000
# A batch's staged files live for one commit on local disk and are read once: written plain
# (no compression, no dictionaries), which costs a third of the CPU of snappy with dictionaries.
_BATCH_FILES = {"compression": "none", "use_dictionary": False}
DLQ_REASON = "_dlq_reason"
CSV_BLOCK_BYTES = 16 << 20  # a copy's CSV is parsed this much at a time


# A staged row's ``_wb_op`` (Op's code) as its name (Op.label), in Spark SQL.
OP_LABEL_SQL = ("CASE _wb_op " + " ".join(f"WHEN '{op.value}' THEN '{op.label}'" for op in Op)
                + " END")


def value_column(i: int) -> str:
    return f"c{i}"


def _schema(values: Sequence[pa.DataType], last: str = "_wb_unchanged") -> pa.Schema:
    """Staged columns: ``c0..cN`` of the given types, then the change's metadata."""
    return pa.schema(
        [pa.field(value_column(i), t) for i, t in enumerate(values)]
        + [pa.field("_wb_seq", pa.int64()), pa.field("_wb_op", pa.string()),
           pa.field("_wb_lsn", pa.int64()), pa.field(last, pa.string())]
    )


class DeadLetters:
    """Rows that cannot be written as they are, staged with their raw text and the reason, for
    the table's dead-letter table (see ``apply.writes``)."""

    def __init__(self, path: Path, ncols: int) -> None:
        self.path = path
        self.schema = _schema([pa.string()] * ncols, DLQ_REASON)
        self.writer: Optional[pq.ParquetWriter] = None
        self.rows = 0

    def split(self, raw: Sequence[pa.Array], reasons: Optional[pa.Array],
              seq: pa.Array, ops: pa.Array, lsn: pa.Array) -> Optional[pa.Array]:
        """Stage the rows that have a reason; return the mask of the rows to keep (None: all)."""
        if reasons is None or reasons.null_count == len(reasons):
            return None
        bad = pc.is_valid(reasons)
        table = pa.Table.from_arrays([*raw, seq, ops, lsn, reasons], schema=self.schema)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, self.schema, compression="snappy")
        self.writer.write_table(table.filter(bad))
        self.rows += int(pc.sum(bad.cast(pa.int64())).as_py())
        return pc.invert(bad)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@dataclass
class StagedTable:
    """One table's share of a batch, ready for Spark."""

    source: str  # schema.table in Postgres
    columns: tuple[Column, ...]
    files: list[Path] = field(default_factory=list)
    rows: int = 0
    ops: dict[Op, int] = field(default_factory=lambda: dict.fromkeys(ROW_OPS, 0))
    truncates: list[int] = field(default_factory=list)  # seq of each TRUNCATE in the batch
    truncate_lsns: dict[int, int] = field(default_factory=dict)  # its transaction's LSN, by seq
    unchanged_columns: set[int] = field(default_factory=set)
    dead_letters: Optional[Path] = None  # staged rows for the dead-letter table
    dead_rows: int = 0
    # An UPDATE that changed the key and left a TOASTed value unsent: its value lives under
    # the old key (see apply.merge.netting.carry_unchanged).
    moved_unchanged: bool = False
    # No key occurs twice among the staged rows: the batch needs no netting per key.
    unique_keys: bool = False
    # pgoutput described the table (Relation) in this batch: "first" (its first description in
    # the run, which may come before or after a change to the table), "again" (a later one,
    # which the server sends after a change to the table: DDL, which may have re-created a
    # column), "" (not described).
    described: str = ""
    # The batch ended before a later description of the table with the same columns, because
    # the catalog's column numbers had changed (a column dropped and added again, perhaps
    # after this batch's changes): see Tables.follow.
    renumbered_after: bool = False

    @property
    def insert_only(self) -> bool:
        return not self.truncates and self.ops[Op.UPDATE] == 0 and self.ops[Op.DELETE] == 0


class _TableStage:
    # Changes arrive in columns (the pipeline's columnar decoder) or one row at a time (kept as
    # tuples and transposed at flush); both are written by _write_columns.
    def __init__(self, source: str, columns: tuple[Column, ...], directory: Path, chunk_rows: int,
                 prep: TextPrep):
        self.staged = StagedTable(source, columns)
        self.prep = prep
        self.dead = DeadLetters(directory / f"dlq-{source}.parquet", len(columns))
        self.directory = directory
        self.chunk_rows = chunk_rows
        self.ncols = len(columns)
        self.rows: list[Row] = []
        self.meta: list[tuple[int, str, int]] = []  # seq, op, lsn
        self.schema = _schema(prep.staged_types(self.ncols))
        self.writer: Optional[pq.ParquetWriter] = None
        # Key columns seen, to tell at close whether any key repeats; only for keys whose
        # Postgres text is their identity (integers, text, uuid), and up to a bound.
        self.key_index = [i for i, c in enumerate(columns) if c.is_key]
        # A delete needs only its key: its other values (a whole old row, as a Debezium before
        # image under REPLICA IDENTITY FULL carries) are staged as NULL where they cannot be
        # written, rather than keep the row from its delete. (A table without a key is keyed
        # by all its columns: nothing is beside the key there.)
        self.beside_key = [i for i, c in enumerate(columns) if not c.is_key] \
            if self.key_index else []
        exact = self.key_index and not all(c.is_key for c in columns) and all(
            columns[i].type_oid in _EXACT_TEXT_KEYS for i in self.key_index)
        self.keys: Optional[list[list[pa.Array]]] = [[] for _ in self.key_index] if exact \
            else None
        self.seqs: list[npt.NDArray[np.int64]] = []  # with the keys: each row's _wb_seq
        self.key_rows = 0

    def add(self, op: str, seq: int, lsn: int, row: Row) -> None:
        if len(row) != self.ncols:
            raise ValueError(f"{self.staged.source}: a change has {len(row)} columns, the relation "
                             f"has {self.ncols}")
        self.rows.append(row)
        self.meta.append((seq, op, lsn))
        if len(self.rows) >= self.chunk_rows:
            self.flush()

    def add_columns(self, ops: Sequence[str] | npt.NDArray[np.str_],
                    seq: Sequence[int] | npt.NDArray[np.int64],
                    lsn: Sequence[int] | npt.NDArray[np.int64], values: Sequence[pa.Array],
                    unchanged: Sequence[Optional[npt.NDArray[np.bool_]]]) -> None:
        """Stage many changes at once, already in columns (binary values, null for NULL);
        ``unchanged[i]`` flags the rows whose column i is an untouched TOAST value."""
        self.flush()  # rows added one by one go first, in their own row group
        self._write_columns(ops, seq, lsn, values, unchanged)

    def _write_columns(self, ops: Sequence[str] | npt.NDArray[np.str_],
                       seq: Sequence[int] | npt.NDArray[np.int64],
                       lsn: Sequence[int] | npt.NDArray[np.int64], values: Sequence[pa.Array],
                       unchanged: Sequence[Optional[npt.NDArray[np.bool_]]]) -> None:
        op_array = np.asarray(ops)
        n = len(op_array)
        marks: list[Optional[str]] = [None] * n
        for i, flags in enumerate(unchanged):
            if flags is None:
                continue
            for r in np.flatnonzero(flags).tolist():
                marks[r] = f"{marks[r] or ','}{i},"
                if op_array[r] == Op.INSERT.value:  # only the insert half of a key-changing update
                    self.staged.moved_unchanged = True
            self.staged.unchanged_columns.add(i)
        raw = [v.cast(pa.string()) for v in values]
        arrays, reasons = self.prep.apply(raw, (pa.array(op_array == Op.DELETE.value),
                                                self.beside_key))
        meta = [pa.array(seq, pa.int64()), pa.array(op_array, pa.string()),
                pa.array(lsn, pa.int64())]
        table = pa.Table.from_arrays([*arrays, *meta, pa.array(marks, pa.string())],
                                     schema=self.schema)
        keep = self.dead.split(raw, reasons, *meta)
        if keep is not None:
            table = table.filter(keep)
            op_array = op_array[np.asarray(keep)]
            n = table.num_rows
        self._write(table)
        if self.keys is not None:
            self.key_rows += table.num_rows
            if self.key_rows > _KEY_TRACK_LIMIT:
                self.keys = None  # too many to keep: net in Spark
            else:
                for slot, i in zip(self.keys, self.key_index, strict=True):
                    key = table.column(i).combine_chunks()
                    # Integers as int64: 8 bytes a row, and quicker to hash than their text.
                    is_int = self.staged.columns[i].type_oid in _INT_KEYS
                    slot.append(key.cast(pa.int64()) if is_int else key)
                self.seqs.append(table.column("_wb_seq").to_numpy())
        for op in ROW_OPS:
            self.staged.ops[op] += int(np.count_nonzero(op_array == op.value))
        self.staged.rows += n

    def truncate(self, seq: int, lsn: int) -> None:
        # Rows before it become void at apply time; they stay staged because the TRUNCATE's own
        # transaction may turn out not to be part of this batch.
        self.staged.truncates.append(seq)
        self.staged.truncate_lsns[seq] = lsn

    def flush(self) -> None:
        """Turn the rows added one by one into columns (the transposition runs in C) and write
        them like any other columns."""
        if not self.rows:
            return
        rows, meta = self.rows, self.meta
        self.rows, self.meta = [], []
        seq, ops, lsn = zip(*meta, strict=True)
        values: list[pa.Array] = []
        unchanged: list[Optional[npt.NDArray[np.bool_]]] = []
        for col in zip(*rows, strict=True):
            if UNCHANGED in col:
                unchanged.append(np.fromiter((v is UNCHANGED for v in col), np.bool_, len(col)))
                col = tuple(None if v is UNCHANGED else v for v in col)
            else:
                unchanged.append(None)
            values.append(pa.array(col, pa.binary()))
        self._write_columns(ops, seq, lsn, values, unchanged)

    def _write(self, table: pa.Table) -> None:
        if self.writer is None:
            path = self.directory / f"{len(self.staged.files):05d}-{self.staged.source}.parquet"
            self.staged.files.append(path)
            self.writer = pq.ParquetWriter(path, self.schema, **_BATCH_FILES)
        self.writer.write_table(table)

    def close(self, extent: Optional[tuple[int, Sequence[tuple[int, int]]]] = None,
              net: bool = False) -> None:
        """Finish the table's files and tell whether any key repeats among the rows the batch
        applies (``extent``: its last seq and void ranges, see ``seq_filter``; None: all rows).
        With ``net``, a batch whose keys repeat is netted here: only each key's last change
        stays in the files, so Spark needs no aggregation before its MERGE."""
        self.flush()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        parts, self.keys = self.keys, None
        seqs, self.seqs = self.seqs, []
        if parts is not None and self.key_rows and not self.staged.truncates:
            seq = np.concatenate(seqs)
            seqs.clear()
            live = applied_rows(seq, *extent) if extent is not None else None
            if live is not None and live.all():
                live = None
            winners = _last_per_key(parts, seq, live)
            unique = winners is None
            if unique:
                self.staged.unique_keys = True
            elif net and extent is not None and not self.staged.unchanged_columns:
                keep = np.zeros(len(seq), dtype=np.bool_)
                keep[winners] = True
                self._keep(pa.array(keep))
                self.staged.unique_keys = True
        self.dead.close()
        if self.dead.rows:
            self.staged.dead_letters, self.staged.dead_rows = self.dead.path, self.dead.rows

    def _keep(self, mask: pa.BooleanArray) -> None:
        """Rewrite the staged files with only the rows ``mask`` keeps (it runs over the files'
        rows in order), a row group at a time."""
        offset = 0
        for n, path in enumerate(self.staged.files):
            netted = path.with_name(path.stem + "-net.parquet")
            source = pq.ParquetFile(path)
            with pq.ParquetWriter(netted, self.schema, **_BATCH_FILES) as writer:
                for group in range(source.num_row_groups):
                    table = source.read_row_group(group)
                    writer.write_table(table.filter(mask.slice(offset, table.num_rows)))
                    offset += table.num_rows
            path.unlink()
            self.staged.files[n] = netted


def _last_per_key(parts: list[list[pa.Array]], seq: npt.NDArray[np.int64],
                  live: Optional[npt.NDArray[np.bool_]]) -> Optional[npt.NDArray[np.int64]]:
    """Positions of each key's last change (highest seq) among the ``live`` rows (None: all),
    or None when no key repeats among them. ``parts``: per key column, its arrays in row
    order (a single integer key as int64). The parts are let go of as they are joined.

    Every key becomes one int64, equal for equal keys (a single integer key is that integer;
    other keys the codes of Arrow's dictionary encoding, see ``_key_codes``), sorted with
    numpy: no hash aggregation (Arrow's group-by loads its query engine at first use, 0.1-0.15
    s of a run's first batch)."""
    columns = []
    for part in parts:
        columns.append(pa.concat_arrays(part))
        part.clear()
    index = np.flatnonzero(live) if live is not None else None
    if len(columns) == 1 and pa.types.is_int64(columns[0].type):
        key = columns[0].to_numpy()
        if index is not None:
            key = key[index]
    else:
        if index is not None:
            taken = pa.array(index)
            columns = [c.take(taken) for c in columns]
        key = _key_codes(columns)
    del columns
    if index is not None:
        seq = seq[index]
    order = np.lexsort((seq, key))  # by key, then seq
    ordered = key[order]
    last = np.ones(len(ordered), dtype=np.bool_)
    np.not_equal(ordered[1:], ordered[:-1], out=last[:-1])
    if last.all():
        return None
    winners = order[last]
    return winners if index is None else index[winners]


def _key_codes(columns: list[pa.Array]) -> npt.NDArray[np.int64]:
    """One int64 per row, equal exactly where the rows' values of all ``columns`` are equal:
    each column's dictionary code (NULL a value of its own), combined column by column as
    ``code * len(dictionary) + next code``, made dense again between columns so that the
    product stays below the square of the row count."""
    codes: Optional[npt.NDArray[np.int64]] = None
    for j, column in enumerate(columns):
        encoded = pc.dictionary_encode(column, null_encoding="encode")
        indices = np.asarray(encoded.indices.to_numpy(), dtype=np.int64)
        if codes is None:
            codes = indices
        else:
            codes = codes * len(encoded.dictionary) + indices
            if j < len(columns) - 1:
                codes = np.unique(codes, return_inverse=True)[1].astype(np.int64)
    assert codes is not None
    return codes


class BatchBuilder:
    """Collects the changes of one batch per table into Parquet files under ``directory``."""

    def __init__(self, directory: Path, chunk_rows: int = 100_000,
                 prep: Callable[[str, tuple[Column, ...]], TextPrep] = lambda s, c: TextPrep(c, [])
                 ) -> None:
        self.directory = directory
        self.chunk_rows = chunk_rows
        self.prep = prep
        self._tables: dict[str, _TableStage] = {}
        self._described: dict[str, str] = {}
        self._renumbered_after: set[str] = set()
        directory.mkdir(parents=True, exist_ok=True)

    def _stage(self, source: str, columns: tuple[Column, ...]) -> _TableStage:
        stage = self._tables.get(source)
        if stage is None:
            stage = self._tables[source] = _TableStage(source, columns, self.directory,
                                                       self.chunk_rows, self.prep(source, columns))
        elif stage.staged.columns != columns:
            raise SchemaChanged(source)
        return stage

    def columns_of(self, source: str) -> Optional[tuple[Column, ...]]:
        """The columns ``source`` is staged with in this batch, if it has changes yet."""
        stage = self._tables.get(source)
        return stage.staged.columns if stage is not None else None

    def describe(self, source: str, kind: str) -> None:
        """The source described ``source`` (its columns) in this batch: ``kind`` as
        StagedTable.described ("again" outweighs "first"); "": the batch ends before a
        description, and what the catalog says by then is not about its rows;
        "renumbered-after": the batch ends before a description with the same columns whose
        numbers changed (StagedTable.renumbered_after)."""
        if not kind:
            self._described.pop(source, None)
        elif kind == "renumbered-after":
            self._renumbered_after.add(source)
        elif self._described.get(source) != "again":
            self._described[source] = kind

    def add(self, source: str, columns: tuple[Column, ...], op: Op, seq: int, lsn: int,
            row: Row) -> None:
        self._stage(source, columns).add(op.value, seq, lsn, row)

    def add_columns(self, source: str, columns: tuple[Column, ...],
                    ops: Sequence[str] | npt.NDArray[np.str_],
                    seq: Sequence[int] | npt.NDArray[np.int64],
                    lsn: Sequence[int] | npt.NDArray[np.int64], values: Sequence[pa.Array],
                    unchanged: Sequence[Optional[npt.NDArray[np.bool_]]]) -> None:
        self._stage(source, columns).add_columns(ops, seq, lsn, values, unchanged)

    def truncate(self, source: str, columns: tuple[Column, ...], seq: int, lsn: int = 0) -> None:
        self._stage(source, columns).truncate(seq, lsn)

    def finish(self, extent: Optional[tuple[int, Sequence[tuple[int, int]]]] = None,
               net: frozenset[str] = frozenset()) -> dict[str, StagedTable]:
        """Close every table's files. ``extent``: the batch's last seq and void ranges (which
        rows it applies); ``net``: the tables that may be netted here (not those whose every
        change goes to a changelog)."""
        for name, stage in self._tables.items():
            stage.close(extent, name in net)
            stage.staged.described = self._described.get(name, "")
            stage.staged.renumbered_after = name in self._renumbered_after
        return {name: stage.staged for name, stage in self._tables.items()}

    def discard(self) -> None:
        for stage in self._tables.values():
            if stage.writer is not None:
                stage.writer.close()
            stage.dead.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class SchemaChanged(Exception):
    """A table's columns changed inside a batch."""

    def __init__(self, source: str) -> None:
        super().__init__(source)
        self.source = source


def csv_to_parquet(csv_path: Path, ncols: int, out_path: Path,
                   prep: Optional[TextPrep] = None, dead: Optional[tuple[DeadLetters, int]] = None,
                   progress: Optional[Callable[[int], None]] = None) -> int:
    """Convert a COPY ... (FORMAT csv) file into staged Parquet (``c0..cN``), streaming: the
    tables of ``csv_tables``. Returns the rows staged for the table."""
    schema = staged_schema(ncols, prep)
    rows = 0
    # Snappy (a copy's staging may hold a whole large table), without dictionaries: a
    # table's values are mostly distinct, and trying dictionaries costs a third of the write.
    tables = csv_tables(csv_path, ncols, prep, dead, progress)
    try:
        with pq.ParquetWriter(out_path, schema, compression="snappy",
                              use_dictionary=False) as writer:
            for table in tables:
                writer.write_table(table)
                rows += table.num_rows
    finally:
        tables.close()  # (the file closed now, not when a traceback lets go of it: a pipe's
        # writer waits for that)
    return rows


def staged_schema(ncols: int, prep: Optional[TextPrep] = None) -> pa.Schema:
    """The schema of a copy's staged tables: ``c0..cN`` in their staged types (text without
    ``prep``)."""
    types = prep.staged_types(ncols) if prep is not None else [pa.string()] * ncols
    return pa.schema([pa.field(value_column(i), t) for i, t in enumerate(types)])


def csv_tables(csv_path: Path, ncols: int, prep: Optional[TextPrep] = None,
               dead: Optional[tuple[DeadLetters, int]] = None,
               progress: Optional[Callable[[int], None]] = None
               ) -> Generator[pa.Table, None, None]:
    """A COPY ... (FORMAT csv) file as tables in ``staged_schema``, a block at a time. With
    ``prep`` the text is prepared (and typed) like the stream's; rows that cannot be written go
    to ``dead`` (dead letters, marked with the copy's LSN). Without, the columns stay text.
    ``progress`` is told the rows read so far.

    Postgres writes NULL as an unquoted empty field and an empty string as ``""``; the reader
    is told exactly that, so the two never mix."""
    schema = staged_schema(ncols, prep)
    names = schema.names
    # The path may be a named pipe that COPY is writing into. Buffered, so that each read of a
    # block returns the whole block: a pipe hands out 64 KiB at a time, and a row longer than
    # the piece read would otherwise straddle two of pyarrow's blocks.
    with open(csv_path, "rb", buffering=1 << 20) as raw:
        try:
            reader = pacsv.open_csv(
                pa.PythonFile(raw, mode="r"),
                read_options=pacsv.ReadOptions(column_names=names,
                                               block_size=CSV_BLOCK_BYTES),
                parse_options=pacsv.ParseOptions(newlines_in_values=True, double_quote=True),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in names}, null_values=[""],
                    strings_can_be_null=True, quoted_strings_can_be_null=False),
            )
        except pa.ArrowInvalid as exc:
            if "Empty CSV" not in str(exc):
                raise
            return
        rows = 0
        for chunk in reader:
            if prep is not None and prep.active:
                columns = chunk.columns
                arrays, reasons = prep.apply(columns)
                table = pa.Table.from_arrays(arrays, schema=schema)
                if dead is not None and reasons is not None:
                    n = len(reasons)
                    keep = dead[0].split(columns, reasons, pa.array(np.zeros(n, np.int64)),
                                         pa.array([Op.SNAPSHOT.value] * n),
                                         pa.array(np.full(n, dead[1])))
                    if keep is not None:
                        table = table.filter(keep)
            else:
                table = pa.Table.from_batches([chunk], schema=schema)
            rows += chunk.num_rows
            if progress is not None:
                progress(rows)
            yield table


def effective_truncate(max_seq: int, void: Sequence[tuple[int, int]],
                       truncates: Sequence[int]) -> Optional[int]:
    """The last TRUNCATE that the batch really applies, if any."""
    live = [t for t in truncates
            if t <= max_seq and not any(lo <= t <= hi for lo, hi in void)]
    return max(live) if live else None


def applied_rows(seq: npt.NDArray[np.int64], max_seq: int,
                 void: Sequence[tuple[int, int]]) -> npt.NDArray[np.bool_]:
    """Which of the rows (by ``_wb_seq``) a batch applies, TRUNCATE aside: ``seq_filter`` in
    numpy."""
    keep = seq <= max_seq
    for lo, hi in void:
        keep &= (seq < lo) | (seq > hi)
    return keep


def dead_rows(path: Path, max_seq: int, void: Sequence[tuple[int, int]]) -> int:
    """How many of the dead letters staged at ``path`` a batch applies (``applied_rows``)."""
    seq = pq.read_table(path, columns=["_wb_seq"]).column("_wb_seq").to_numpy()
    return int(np.count_nonzero(applied_rows(seq, max_seq, void)))


def seq_filter(max_seq: int, void: Sequence[tuple[int, int]], truncates: Sequence[int]) -> str:
    """The Spark SQL predicate that keeps the staged rows a batch really applies: those up to the
    batch's last commit, outside transactions that were cut off and resent, and after the last
    TRUNCATE that counts."""
    parts = [f"_wb_seq <= {int(max_seq)}"]
    parts += [f"NOT (_wb_seq BETWEEN {int(lo)} AND {int(hi)})" for lo, hi in void]
    cut = effective_truncate(max_seq, void, truncates)
    if cut is not None:
        parts.append(f"_wb_seq > {cut}")
    return " AND ".join(parts)
