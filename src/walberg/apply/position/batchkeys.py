"""A batch applied by position, as read from its staged files on the driver: the keys it
changes, looked up in the key index and written as deletes (``look_up``, ``batch_keys``); the
rows it adds, in the data files' schema (``new_rows``); and the index entries of rows as the
driver wrote them (``entries_as_written``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from walberg.apply.batch import StagedTable, applied_rows, value_column
from walberg.apply.position.deletefiles import (
    Positions,
    Vectors,
    deletion_vectors,
    position_delete_files,
)
from walberg.apply.position.entries import local_path
from walberg.apply.position.keycodec import KeyCodec
from walberg.apply.position.keyindex import Hits, KeyIndex, sorted_unique_pairs
from walberg.apply.position.livefiles import LiveFiles, read_blob


def look_up(spark: Any, index: KeyIndex, staged: StagedTable, positions: Sequence[int],
            codec: KeyCodec, key_names: Sequence[str], max_seq: int,
            void: Sequence[tuple[int, int]], live: Optional[LiveFiles], scratch: Path
            ) -> tuple[Hits, list[Positions] | Optional[Vectors], Optional[tuple[str, Any, Any]],
                       float]:
    """The rows a batch deletes, found in the index and written as deletes (position-delete
    files, or deletion vectors in a table that has them), with the range of the batch's keys
    and the seconds it took."""
    started = time.monotonic()
    changed, checks, span = batch_keys(staged.files, positions, codec, max_seq, void)
    hits = index.lookup(changed, checks)
    deletes: list[Positions] | Optional[Vectors]
    if live is not None and live.vectors:
        deletes = deletion_vectors(
            hits.files, hits.positions, scratch, live.of,
            lambda v: read_blob(spark, v, local_path(v.location)))
    else:
        deletes = position_delete_files(
            hits.files, hits.positions, scratch,
            None if live is None else lambda p: live.of(p).group)
    # The commit conflicts with another writer's changes to keys in this range (of the first
    # key column).
    keys = None if span is None else (key_names[0], *span)
    return hits, deletes, keys, time.monotonic() - started


def batch_keys(files: Sequence[Path], positions: Sequence[int], codec: KeyCodec, max_seq: int,
               void: Sequence[tuple[int, int]]
               ) -> tuple[np.ndarray, np.ndarray, Optional[tuple[Any, Any]]]:
    """The distinct keys the batch changes (index keys and checks), read from its staged files
    on the driver; with the lowest and highest value of the first key column among them (in
    the form an Iceberg expression on that column takes; None if the batch changes none)."""
    names = [value_column(i) for i in positions]
    keys: list[np.ndarray] = []
    checks: list[np.ndarray] = []
    firsts: list[tuple[Any, Any]] = []
    for path in files:
        table = pq.read_table(path, columns=["_wb_seq", *names])
        seq = table.column("_wb_seq").to_numpy(zero_copy_only=False).astype(np.int64)
        applied = applied_rows(seq, max_seq, void)
        if not applied.any():
            continue
        table = table.filter(pa.array(applied))
        k, c = codec.encode([table.column(n) for n in names])
        keys.append(k)
        checks.append(c)
        firsts.append(codec.span(table.column(names[0])))
    if not keys:
        return np.empty(0, np.int64), np.empty(0, np.int64), None
    unique_keys, unique_checks = sorted_unique_pairs(np.concatenate(keys),
                                                     np.concatenate(checks))
    return unique_keys, unique_checks, (min(f[0] for f in firsts), max(f[1] for f in firsts))


def entries_as_written(parts: Sequence[tuple[str, int, pa.Table]], key_names: Sequence[str],
                       codec: KeyCodec) -> tuple[np.ndarray, np.ndarray, list[str], np.ndarray]:
    """Index entries of rows written on the driver: each part's key columns, its data file's
    location and its first row's position there (its rows follow in order)."""
    entries = []
    for location, first, part in parts:
        keys, checks = codec.encode([part.column(n) for n in key_names])
        entries.append((keys, checks, [location] * len(keys),
                        np.arange(first, first + len(keys), dtype=np.int64)))
    return concat_entries(entries)


def concat_entries(entries: Sequence[tuple[np.ndarray, np.ndarray, list[str], np.ndarray]]
                   ) -> tuple[np.ndarray, np.ndarray, list[str], np.ndarray]:
    if not entries:
        return np.empty(0, np.int64), np.empty(0, np.int64), [], np.empty(0, np.int64)
    return (np.concatenate([e[0] for e in entries]), np.concatenate([e[1] for e in entries]),
            [p for e in entries for p in e[2]], np.concatenate([e[3] for e in entries]))


def new_rows(files: Sequence[Path], schema: pa.Schema, max_seq: int,
             void: Sequence[tuple[int, int]], source: Optional[str]) -> Iterator[pa.Table]:
    """The rows a netted batch adds (its applied inserts and updates), a row group at a time,
    in the data files' schema: the staged values, each change's LSN as ``_walberg_lsn``, and
    in a table several sources share, the source's name."""
    values = len(schema) - (1 if source is None else 2)
    for path in files:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            part = parquet.read_row_group(group)
            seq = part.column("_wb_seq").to_numpy(zero_copy_only=False).astype(np.int64)
            keep = applied_rows(seq, max_seq, void) & np.asarray(
                pc.not_equal(part.column("_wb_op"), "D").to_numpy(zero_copy_only=False),
                dtype=np.bool_)
            if not keep.any():
                continue
            part = part.filter(pa.array(keep))
            named = [] if source is None else [pa.array([source] * part.num_rows, pa.string())]
            yield pa.Table.from_arrays(
                [*part.columns[:values], part.column("_wb_lsn"), *named], schema=schema)
