"""Where each key's row lives in an Iceberg table: key -> (data file, row position), kept on local
disk beside the table, so that an update or delete can be written as a position delete without
a join over the table (see ``rowdelta``).

Keys of any type: each key is held as two 64-bit integers, ``key`` and ``check``
(``keycodec``): the value itself for one integer key, an exact pair or a 128-bit digest for
others. The index is sorted and searched by ``key``; a hit counts only when ``check`` matches
too, and two different keys with one ``key`` raise ``KeyClash`` (the caller merges instead).

The index is a sorted *base* (flat arrays on disk: keys, checks, file ids, positions) and a
few small sorted *delta* runs, one per commit since the base was written (joined into one when
there are more than ``max_runs``); a delta entry shadows the base, and a tombstone (file id -1)
says the key is gone. When the deltas hold more than ``max_delta`` entries they are merged
into a new base.

Memory stays flat whatever the table's size: the base is read in chunks of ``chunk`` keys
(8 bytes a key), the deltas are bounded by ``max_delta`` (28 bytes an entry: 56 MB at most).
On disk it takes 28 bytes a key (20 for one integer-like key, whose checks are all 0 and not
written) plus the data file paths once each.

Crash safety: the index describes one snapshot of the table (``snapshot`` in its manifest,
replaced atomically). A caller that finds the table at another snapshot (a crash between an
Iceberg commit and the index update, a compaction, a copy) rebuilds it from the lake.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from walberg.apply.position.keybase import (
    Entry,
    external_sort,
    filled_checks,
    keeps_checks,
    sort_rows,
    write_base,
)
from walberg.apply.position.keycodec import KeyClash

# numpy reads a .npy header with ast.literal_eval, which CPython 3.11 (before 3.11.8) cannot
# run in two threads at once without, now and then, "SystemError: AST constructor recursion
# depth mismatch" (cpython gh-106905); a batch's tables load their indexes side by side.
_NPY_READS = threading.Lock()

log = logging.getLogger("walberg")

MANIFEST = "manifest.json"
# The files every base holds (a base of keys with checks has "checks" too; see write_base).
BASE_FILES = ("keys", "files", "positions")
TOMBSTONE = -1


def encoding_of(manifest: Mapping[str, Any]) -> str:
    """The key codec an index's manifest was made for (indexes from before codecs: integers)."""
    return str(manifest.get("encoding", "int"))


def keys_of(manifest: Mapping[str, Any]) -> Optional[tuple[str, ...]]:
    """The key columns an index's manifest was made for (None: an index from before they were
    recorded, taken as made for the table's key)."""
    keys = manifest.get("keys")
    return None if keys is None else tuple(keys)


def table_of(manifest: Mapping[str, Any]) -> Optional[str]:
    """The Iceberg table (its table-uuid) an index's manifest describes (None: an index from
    before it was recorded)."""
    table = manifest.get("table")
    return None if table is None else str(table)


def made_for(manifest: Mapping[str, Any], encoding: Optional[str],
             keys: Optional[Sequence[str]], table: Optional[str] = None) -> bool:
    """Whether the index of ``manifest`` holds keys of ``encoding`` and of the columns ``keys``
    (None: any), of the Iceberg table whose table-uuid is ``table`` (None: any). A table whose
    key became other columns of the same types (a new primary key, REPLICA IDENTITY USING
    INDEX) must not read the index of the old ones; nor may a table dropped and created again
    under the same name (or another table put in its place) read the old table's, even at a
    snapshot id that happens to be the same. An index from before the table was recorded
    describes no table for sure: it is made again."""
    held = keys_of(manifest)
    return ((encoding is None or encoding_of(manifest) == encoding)
            and (keys is None or held is None or held == tuple(keys))
            and (table is None or table_of(manifest) == table))


@dataclass
class Hits:
    """Keys found in the index, with the data file and position of their current row."""

    keys: np.ndarray  # int64, sorted
    files: list[str]  # the data file of each hit
    positions: np.ndarray  # int64


@dataclass
class _Run:
    keys: np.ndarray
    checks: np.ndarray
    file_ids: np.ndarray
    positions: np.ndarray


def sorted_unique(keys: np.ndarray) -> np.ndarray:
    """The distinct values of ``keys`` (int64), ascending. A sort and a compare: several times
    faster than ``np.unique`` on integer keys, and free on keys sorted and distinct already."""
    keys = np.asarray(keys, dtype=np.int64)
    if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
        keys = np.sort(keys)
        keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
    return keys


def sorted_unique_pairs(keys: np.ndarray, checks: Optional[np.ndarray]
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (key, check) pairs, ascending by key; ``KeyClash`` if two different pairs
    share a key."""
    keys = np.asarray(keys, dtype=np.int64)
    if checks is None:
        unique = sorted_unique(keys)
        return unique, np.zeros(len(unique), np.int64)
    checks = np.asarray(checks, dtype=np.int64)
    # By key alone (a third of a lexsort's time): a key's pairs then sit together, and any
    # two of them that differ make a clash, in whatever order they come.
    order = np.argsort(keys, kind="stable")
    keys, checks = keys[order], checks[order]
    if len(keys) > 1:
        fresh = np.concatenate(([True], (keys[1:] != keys[:-1]) | (checks[1:] != checks[:-1])))
        keys, checks = keys[fresh], checks[fresh]
        if len(keys) > 1 and bool(np.any(keys[1:] == keys[:-1])):
            raise KeyClash("two keys of one batch share an index entry")
    return keys, checks


def _sorted_unique_last(keys: np.ndarray, *columns: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sort by key; where a key repeats, keep its last entry."""
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    last = np.ones(len(keys), dtype=bool)
    if len(keys):
        last[:-1] = keys[1:] != keys[:-1]
    return (keys[last], *(c[order][last] for c in columns))


class KeyIndex:
    """The index of one table, in ``directory``."""

    def __init__(self, directory: Path, chunk: int = 1 << 20, max_delta: int = 2_000_000,
                 encoding: str = "int", keys: Optional[Sequence[str]] = None,
                 max_runs: int = 16, table: Optional[str] = None) -> None:
        """``encoding``: the key codec's name (``keycodec.KeyCodec.name``); ``keys``: the key
        columns' names (None: those of the index on disk); ``table``: the Iceberg table's
        table-uuid (None: that of the index on disk). An index on disk made for another
        encoding, other columns or another table is not read (the caller rebuilds it). More
        than ``max_runs`` deltas are joined into one."""
        self.directory = directory
        self.encoding = encoding
        self.keys: Optional[tuple[str, ...]] = None if keys is None else tuple(keys)
        self.table = table
        self.chunk = chunk
        self.max_delta = max_delta
        self.max_runs = max_runs
        self.snapshot: Optional[int]
        self._files: list[str]
        self._file_ids: dict[str, int]
        self._base: Optional[str]  # name of the base's folder
        self._base_size: int
        self._deltas: list[_Run]
        self._delta_names: list[str]
        self._unbuilt()
        self._load()

    def _unbuilt(self) -> None:
        """As made, before anything was read: not built."""
        self.snapshot, self._files, self._file_ids = None, [], {}
        self._base, self._base_size, self._deltas, self._delta_names = None, 0, [], []

    # ---- state on disk ---------------------------------------------------------------------

    def _load(self) -> None:
        """The index as its manifest names it; one whose manifest or files cannot be read
        whole is not built (the caller makes it again from the lake), and said so."""
        path = self.directory / MANIFEST
        if not path.exists():
            return
        try:
            self._read(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
            log.warning("key index in %s cannot be read whole (%s: %s); it is made again from "
                        "the lake", self.directory, type(exc).__name__, exc)
            self._unbuilt()

    def _read(self, manifest: dict[str, Any]) -> None:
        if not made_for(manifest, self.encoding, self.keys, self.table):
            return
        if self.keys is None:
            self.keys = keys_of(manifest)
        if self.table is None:
            self.table = table_of(manifest)
        self.snapshot = manifest["snapshot"]
        self._files = manifest["files"]
        self._file_ids = {f: i for i, f in enumerate(self._files)}
        self._base = manifest["base"]
        self._base_size = manifest["base_size"]
        self._delta_names = manifest["deltas"]
        if self._base is not None:
            missing = [name for name in BASE_FILES if not (self.directory / self._base / name)
                       .is_file()]
            if missing:
                raise FileNotFoundError(f"its base has no {', '.join(missing)}")
        for name in self._delta_names:
            with _NPY_READS, np.load(self.directory / name) as run:
                checks = run["checks"] if "checks" in run.files else \
                    np.zeros(len(run["keys"]), np.int64)
                self._deltas.append(_Run(run["keys"], checks, run["file_ids"], run["positions"]))

    def _save(self) -> None:
        """Replace the manifest atomically (write, fsync, rename, fsync the folder); then
        remove what it no longer names."""
        manifest = {"snapshot": self.snapshot, "files": self._files, "base": self._base,
                    "base_size": self._base_size, "deltas": self._delta_names,
                    "encoding": self.encoding,
                    **({} if self.keys is None else {"keys": list(self.keys)}),
                    **({} if self.table is None else {"table": self.table})}
        partial = self.directory / f"{MANIFEST}.{uuid.uuid4().hex}"
        with open(partial, "w") as out:
            json.dump(manifest, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.directory / MANIFEST)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        keep = {MANIFEST, *self._delta_names, *([self._base] if self._base else [])}
        for entry in self.directory.iterdir():
            if entry.name not in keep:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    @property
    def built(self) -> bool:
        """Whether the index was built, for this encoding."""
        return self._base is not None

    @property
    def size(self) -> int:
        """Entries in the base and the deltas (an upper bound on the keys held)."""
        return self._base_size + sum(len(d.keys) for d in self._deltas)

    def _file_id(self, path: str) -> int:
        found = self._file_ids.get(path)
        if found is None:
            found = self._file_ids[path] = len(self._files)
            self._files.append(path)
        return found

    # ---- building ---------------------------------------------------------------------------

    def rebuild(self, snapshot: Optional[int], entries: Iterator[Entry],
                files: Optional[list[str]] = None) -> None:
        """Make the index anew from ``entries``: batches of (keys, checks, data file paths,
        positions) in ascending key order across batches (the lake read sorted by key), for
        the table at ``snapshot``. With ``files``, each batch gives its rows' data files as
        numbers in that list (which the entries may extend as they come) instead of paths.
        ``KeyClash`` if two different keys share a
        key entry."""
        self.directory.mkdir(parents=True, exist_ok=True)
        # (Not a copy: the entries may add the files they number as they come.)
        self._files = files if files is not None else []
        self._file_ids = {f: i for i, f in enumerate(self._files)}
        base = f"base-{uuid.uuid4().hex}"
        size = write_base(self.directory / base, entries, keeps_checks(self.encoding),
                          None if files is not None else self._file_id)
        self._adopt(snapshot, base, size)

    def adopt(self, snapshot: int, folder: Path, size: int, files: list[str]) -> None:
        """Make the base ``write_base`` wrote in ``folder`` (``size`` entries, on this index's
        file system, for its encoding) the index of the table at ``snapshot``, its data files
        numbered in ``files``. The folder is moved in."""
        self.directory.mkdir(parents=True, exist_ok=True)
        base = f"base-{uuid.uuid4().hex}"
        os.replace(folder, self.directory / base)
        self._files = files
        self._adopt(snapshot, base, size)

    def _adopt(self, snapshot: Optional[int], base: str, size: int) -> None:
        self._deltas, self._delta_names = [], []
        self._file_ids = {f: i for i, f in enumerate(self._files)}
        self._base, self._base_size, self.snapshot = base, size, snapshot
        self._save()

    def rebuild_from_files(self, snapshot: Optional[int], files: list[str],
                           rows: Iterator[tuple[int, Any, np.ndarray, Optional[np.ndarray]]],
                           scratch: Path, run: int = 1 << 21) -> None:
        """Make the index anew from the keys of data files, in any order: ``rows`` gives
        (file number in ``files``, the position of the first of consecutive rows or an array
        of the rows' positions, their keys and checks).
        Sorted on disk under ``scratch`` in runs of ``run`` keys, then merged, so memory stays
        bounded by the run whatever the table's size (about 50 bytes a key of the run: 100 MB
        for the default run of 2M keys)."""
        self.rebuild(snapshot, sort_rows(rows, scratch, run), files)

    def rebuild_unsorted(self, snapshot: Optional[int], files: list[str],
                         entries: Iterator[Entry], scratch: Path, run: int = 1 << 21) -> None:
        """``rebuild`` from entries in any order (data files given as numbers in ``files``),
        sorted on disk as ``rebuild_from_files`` does."""
        self.rebuild(snapshot, external_sort(entries, scratch, run), files)

    # ---- reading ----------------------------------------------------------------------------

    def _base_chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(offset, keys) of the base, ``chunk`` keys at a time."""
        if not self._base:
            return
        path = self.directory / self._base / "keys"
        for offset in range(0, self._base_size, self.chunk):
            count = min(self.chunk, self._base_size - offset)
            yield offset, np.fromfile(path, dtype=np.int64, count=count, offset=offset * 8)

    def lookup(self, keys: np.ndarray, checks: Optional[np.ndarray] = None) -> Hits:
        """The current row of each of ``keys`` (with ``checks``, see the module docstring)
        that the table holds. ``KeyClash`` if a key's entry has another check."""
        queries, wanted = sorted_unique_pairs(keys, checks)
        found_keys: list[np.ndarray] = []
        found_ids: list[np.ndarray] = []
        found_pos: list[np.ndarray] = []
        pending = np.ones(len(queries), dtype=bool)  # not yet decided by a newer run
        for run in reversed(self._deltas):  # newest first: a newer entry shadows older ones
            at = np.searchsorted(run.keys, queries)
            hit = pending & (at < len(run.keys))
            hit[hit] = run.keys[at[hit]] == queries[hit]
            live = hit.copy()
            live[hit] = run.file_ids[at[hit]] != TOMBSTONE
            # A tombstone says the entry's row is gone, whichever key it was (its check is not
            # kept): only a live entry must be the key looked up.
            _same(run.checks[at[live]], wanted[live])
            found_keys.append(queries[live])
            found_ids.append(run.file_ids[at[live]])
            found_pos.append(run.positions[at[live]])
            pending &= ~hit
        for offset, chunk in self._base_chunks():
            lo = int(np.searchsorted(queries, chunk[0], side="left"))
            hi = int(np.searchsorted(queries, chunk[-1], side="right"))
            if lo >= hi:
                continue
            window = queries[lo:hi]
            at = np.searchsorted(chunk, window)
            hit = pending[lo:hi] & (at < len(chunk))
            hit[hit] = chunk[at[hit]] == window[hit]
            if not hit.any():
                continue
            _same(self._base_slice("checks", np.int64, offset, len(chunk))[at[hit]],
                  wanted[lo:hi][hit])
            found_keys.append(window[hit])
            # The hit chunk's file ids and positions are read whole: mapping the columns instead
            # held every page a lookup touched (most of them, for keys spread at random) in the
            # process's memory, 432 MB for 100k keys at 50M rows.
            found_ids.append(self._base_slice("files", np.int32, offset, len(chunk))[at[hit]])
            found_pos.append(self._base_slice("positions", np.int64, offset, len(chunk))[at[hit]])
        if not found_keys:
            return Hits(np.empty(0, np.int64), [], np.empty(0, np.int64))
        k = np.concatenate(found_keys)
        ids = np.concatenate(found_ids) if found_ids else np.empty(0, np.int32)
        pos = np.concatenate(found_pos) if found_pos else np.empty(0, np.int64)
        order = np.argsort(k, kind="stable")
        return Hits(k[order], [self._files[i] for i in ids[order]], pos[order])

    # ---- changing ---------------------------------------------------------------------------

    def commit(self, snapshot: int, gone: np.ndarray, added: Entry) -> None:
        """Record a commit that made the table ``snapshot``: the keys in ``gone`` no longer
        have a row (deleted, or replaced by a row in ``added``), ``added`` gives (keys,
        checks, data files, positions) of the rows it wrote."""
        keys, checks, paths, positions = added
        keys = np.asarray(keys, dtype=np.int64)
        ids = np.fromiter((self._file_id(x) for x in paths), dtype=np.int32, count=len(keys))
        gone = np.asarray(gone, dtype=np.int64)
        all_keys = np.concatenate([gone, keys])
        all_checks = np.concatenate([np.zeros(len(gone), np.int64),
                                     filled_checks(checks, len(keys))])
        all_ids = np.concatenate([np.full(len(gone), TOMBSTONE, np.int32), ids])
        all_pos = np.concatenate([np.zeros(len(gone), np.int64),
                                  np.asarray(positions, dtype=np.int64)])
        run = _Run(*_sorted_unique_last(all_keys, all_checks, all_ids, all_pos))
        self._deltas.append(run)
        self._delta_names.append(self._write_run(run))
        self.snapshot = snapshot
        if sum(len(d.keys) for d in self._deltas) > self.max_delta:
            self._merge()
        else:
            if len(self._deltas) > self.max_runs:
                # A run for each commit, and small commits (a quiet table, one source's of a
                # shared table) never reach max_delta: every lookup, start and keep would read
                # more of them the longer walberg runs. Joined, tombstones kept (they shadow
                # the base).
                joined = self._joined()
                self._deltas, self._delta_names = [joined], [self._write_run(joined)]
            self._save()

    def _write_run(self, run: _Run) -> str:
        """A delta run written (and synced) beside the manifest; its file's name."""
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"delta-{uuid.uuid4().hex}.npz"
        with open(self.directory / name, "wb") as out:
            np.savez(out, keys=run.keys, checks=run.checks, file_ids=run.file_ids,
                     positions=run.positions)
            out.flush()
            os.fsync(out.fileno())
        return name

    def _joined(self) -> _Run:
        """The deltas as one run: each key's newest entry."""
        return _Run(*_sorted_unique_last(
            np.concatenate([d.keys for d in self._deltas]),
            np.concatenate([d.checks for d in self._deltas]),
            np.concatenate([d.file_ids for d in self._deltas]),
            np.concatenate([d.positions for d in self._deltas])))

    def _merge(self) -> None:
        """Fold the deltas into a new base, chunk by chunk of the old one."""
        delta = self._joined()
        base = f"base-{uuid.uuid4().hex}"
        folder = self.directory / base
        folder.mkdir()
        size, taken = 0, 0
        chunks = list(self._base_chunks()) or [(0, np.empty(0, np.int64))]
        with open(folder / "keys", "wb") as k, self._checks_file(folder) as c, \
                open(folder / "files", "wb") as f, open(folder / "positions", "wb") as p:
            for n, (offset, chunk) in enumerate(chunks):
                count = len(chunk)
                checks = self._base_slice("checks", np.int64, offset, count)
                ids = self._base_slice("files", np.int32, offset, count)
                pos = self._base_slice("positions", np.int64, offset, count)
                upto = len(delta.keys) if n == len(chunks) - 1 else \
                    int(np.searchsorted(delta.keys, chunk[-1], side="right"))
                d = slice(taken, upto)
                taken = upto
                keys_m = np.concatenate([chunk, delta.keys[d]])
                checks_m = np.concatenate([checks, delta.checks[d]])
                ids_m = np.concatenate([ids, delta.file_ids[d]])
                pos_m = np.concatenate([pos, delta.positions[d]])
                keys_m, checks_m, ids_m, pos_m = _sorted_unique_last(keys_m, checks_m, ids_m,
                                                                     pos_m)
                live = ids_m != TOMBSTONE
                keys_m[live].tofile(k)
                if c is not None:
                    checks_m[live].tofile(c)
                ids_m[live].tofile(f)
                pos_m[live].tofile(p)
                size += int(live.sum())
        self._base, self._base_size = base, size
        self._deltas, self._delta_names = [], []
        self._save()

    def _checks_file(self, folder: Path) -> Any:
        """Where a new base's checks go (nowhere: see ``keeps_checks``)."""
        if not keeps_checks(self.encoding):
            return contextlib.nullcontext(None)
        return open(folder / "checks", "wb")

    def _base_slice(self, column: str, dtype: type, offset: int, count: int) -> np.ndarray:
        if not self._base or count == 0:
            return np.empty(0, dtype)
        path = self.directory / self._base / column
        if column == "checks" and not path.exists():  # all 0 (see keeps_checks)
            return np.zeros(count, dtype)
        width = np.dtype(dtype).itemsize
        return np.fromfile(path, dtype=dtype, count=count, offset=offset * width)


def _same(held: np.ndarray, wanted: np.ndarray) -> None:
    """Hits count only when the check matches: two keys share the entry otherwise."""
    if len(held) and not bool(np.array_equal(held, wanted)):
        raise KeyClash("a key of the batch shares its index entry with another key")
