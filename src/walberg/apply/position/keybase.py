"""How a key index's base is made (``keyindex``): entries in ascending key order written as
flat arrays (``write_base``); entries in any order sorted on the way, in runs of a bounded size
spilled to scratch files and then merged a block of each at a time, so memory stays bounded by
the run whatever the table's size (``sort_rows``, ``external_sort``: a rebuild from the lake);
and the keys of an initial copy written on the driver sorted beside the copy as its rows are
written (``KeysAsWritten``).

The index of a table applied by position was made after its copy by reading the copy's data
files back, encoding their keys and sorting them: at 10M uuid keys 4.7 s, 40% of the copy.
``KeysAsWritten`` takes each part of the copy's key columns as it is written, with its data
file and the position of its first row; a thread encodes them and sorts them into runs on disk
while the copy goes on. Once every row was written (``written``) the runs are merged into an
index base while the copy is committed (the JVM's work: a core left free), and the commit's
snapshot makes it the table's index (``finish``): at 10M uuid keys the merge took 0.9-1.0 s
after the commit before.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from pathlib import Path
from queue import Full, Queue
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional, Sequence

import numpy as np
import pyarrow as pa

from walberg.apply.position.keycodec import KeyClash, KeyCodec

if TYPE_CHECKING:
    from walberg.apply.position.keyindex import KeyIndex

# A batch of index entries: (keys, checks or None for all 0, data file paths or numbers,
# positions).
Entry = tuple[np.ndarray, Optional[np.ndarray], Any, np.ndarray]


def filled_checks(checks: Optional[np.ndarray], n: int) -> np.ndarray:
    """``checks`` as int64; all 0 where None (a key whose check is always 0)."""
    return np.zeros(n, np.int64) if checks is None else np.asarray(checks, dtype=np.int64)


def numbered_entries(rows: Iterator[tuple[int, Any, np.ndarray, Optional[np.ndarray]]]
                     ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(keys, checks, file numbers, positions) of rows of numbered files: consecutive rows
    from a first position, or rows at an array of positions."""
    for file_number, at, keys, checks in rows:
        keys = np.asarray(keys, dtype=np.int64)
        positions = (np.asarray(at, dtype=np.int64) if isinstance(at, np.ndarray)
                     else np.arange(at, at + len(keys), dtype=np.int64))
        yield (keys, filled_checks(checks, len(keys)),
               np.full(len(keys), file_number, np.int32), positions)


def keeps_checks(encoding: str) -> bool:
    """Whether a base of ``encoding`` keeps its checks: not for a key whose checks are all 0
    (one integer-like column; 20 bytes a key instead of 28)."""
    return not (encoding == "int" or encoding.startswith("one:"))


def write_base(folder: Path, entries: Iterator[Entry], with_checks: bool,
               file_id: Optional[Callable[[Any], int]] = None) -> int:
    """Write ``entries`` (as ``KeyIndex.rebuild`` takes them: ascending key order across
    batches) as an index base in ``folder`` (made here), their checks only ``with_checks``;
    the number of entries written. ``file_id``: a data file's number, where the entries give
    paths (None: they give numbers). ``KeyClash`` if two different keys share a key entry."""
    folder.mkdir()
    size = 0
    last: Optional[tuple[int, int]] = None
    with open(folder / "keys", "wb") as k, \
            (open(folder / "checks", "wb") if with_checks else contextlib.nullcontext()) as c, \
            open(folder / "files", "wb") as f, open(folder / "positions", "wb") as p:
        for keys, checks, paths, positions in entries:
            keys = np.asarray(keys, dtype=np.int64)
            if len(keys) == 0:
                continue
            checks = filled_checks(checks, len(keys))
            if last is not None:
                keys = np.concatenate(([last[0]], keys))
                checks = np.concatenate(([last[1]], checks))
            if np.any(keys[1:] < keys[:-1]):
                raise ValueError("key index entries must come in ascending key order, "
                                 "each key once")
            same = keys[1:] == keys[:-1]
            if same.any():
                if bool(np.all(checks[1:][same] == checks[:-1][same])):
                    raise ValueError("key index entries must come in ascending key order, "
                                     "each key once")
                raise KeyClash("two keys of the table share an index entry")
            if last is not None:
                keys, checks = keys[1:], checks[1:]
            ids = (np.asarray(paths, dtype=np.int32) if file_id is None else
                   np.fromiter((file_id(x) for x in paths), dtype=np.int32, count=len(keys)))
            keys.tofile(k)
            if c is not None:
                checks.tofile(c)
            ids.tofile(f)
            np.asarray(positions, dtype=np.int64).tofile(p)
            size, last = size + len(keys), (int(keys[-1]), int(checks[-1]))
    return size


Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # keys, checks, files, positions


def sort_rows(rows: Iterator[tuple[int, Any, np.ndarray, Optional[np.ndarray]]], scratch: Path,
              run: int = 1 << 21) -> Iterator[Columns]:
    """The entries of ``rows`` (as ``rebuild_from_files`` takes them) in ascending key order,
    for ``rebuild`` with the same files: the first batch comes once every row was read and
    sorted into runs on disk under ``scratch``; the rest are merged from them as they are
    taken."""
    return external_sort(numbered_entries(rows), scratch, run)


_NAMES = (("keys", np.int64), ("checks", np.int64), ("files", np.int32), ("positions", np.int64))


def external_sort(entries: Iterator[Entry], scratch: Path, run: int) -> Iterator[Columns]:
    """``entries`` (file numbers, not paths) in ascending key order, in batches: sorted runs
    of at most ``run`` entries written under ``scratch``, then merged a block of each run at a
    time."""
    runs: list[Path] = []
    pending: list[Columns] = []
    held = 0

    def spill() -> None:
        nonlocal pending, held
        sorted_run = _by_key(pending, kind="quicksort")
        folder = Path(tempfile.mkdtemp(prefix="run-", dir=scratch))
        for (name, _), column in zip(_NAMES, sorted_run, strict=True):
            column.tofile(folder / name)
        runs.append(folder)
        pending, held = [], 0

    for keys, checks, numbers, positions in entries:
        keys = np.asarray(keys, dtype=np.int64)
        whole = (keys, filled_checks(checks, len(keys)), np.asarray(numbers, dtype=np.int32),
                 np.asarray(positions, dtype=np.int64))
        for lo in range(0, len(keys), run):
            part = tuple(c[lo:lo + run] for c in whole)
            if held + len(part[0]) > run:
                spill()
            pending.append(part)  # type: ignore[arg-type]
            held += len(part[0])
    if not runs:  # everything fits in one run: sorted in memory
        if pending:
            yield _by_key(pending, kind="quicksort")
        return
    if pending:
        spill()
    yield from _merge(runs, max(1 << 16, run // len(runs)))


def _by_key(parts: list[Columns], kind: Literal["stable", "quicksort"] = "stable") -> Columns:
    """The columns of ``parts`` together, sorted by key. ``kind``: numpy's sort; the default
    (timsort) finds the runs of parts sorted already and merges them, four times faster than
    a quicksort of the same entries; quicksort is faster for entries in no order."""
    keys = np.concatenate([p[0] for p in parts])
    order = np.argsort(keys, kind=kind)
    return (keys[order], *(np.concatenate([p[i] for p in parts])[order]  # type: ignore[return-value]
                           for i in (1, 2, 3)))


class _RunReader:
    """A sorted run on disk, read a block at a time."""

    def __init__(self, folder: Path, block: int) -> None:
        self.folder, self.block = folder, block
        self.size = (folder / "keys").stat().st_size // 8
        self.offset = 0
        self.held: Columns = tuple(np.empty(0, t) for _, t in _NAMES)  # type: ignore[assignment]

    @property
    def more(self) -> bool:
        """Whether entries remain on disk past the block held."""
        return self.offset < self.size

    def fill(self) -> None:
        count = min(self.block, self.size - self.offset)
        self.held = tuple(np.fromfile(self.folder / name, t, count,  # type: ignore[assignment]
                                      offset=self.offset * np.dtype(t).itemsize)
                          for name, t in _NAMES)
        self.offset += count

    def take(self, upto: int) -> Columns:
        """The held entries with a key of at most ``upto``; the rest stay held."""
        n = int(np.searchsorted(self.held[0], upto, side="right"))
        out = tuple(c[:n] for c in self.held)
        self.held = tuple(c[n:] for c in self.held)  # type: ignore[assignment]
        return out  # type: ignore[return-value]


def _merge(folders: list[Path], block: int) -> Iterator[Columns]:
    """Sorted runs merged: each round takes, from every run's held block, the entries up to
    the smallest last key among the blocks of runs that have more on disk (nothing past it can
    come before it), so every round empties at least one block."""
    readers = [_RunReader(f, block) for f in folders]
    while True:
        for r in readers:
            if not len(r.held[0]) and r.more:
                r.fill()
        live = [r for r in readers if len(r.held[0])]
        if not live:
            return
        limits = [int(r.held[0][-1]) for r in live if r.more]
        upto = min(limits) if limits else int(np.iinfo(np.int64).max)
        yield _by_key([r.take(upto) for r in live])


class KeysAsWritten:
    """The keys of a copy's rows, taken as they are written, sorted beside the copy."""

    def __init__(self, names: Sequence[str], codec: KeyCodec, scratch: Path,
                 run: int = 1 << 21) -> None:
        """``names``: the key columns (as the data files name them); ``scratch``: a folder of
        this object's own, removed by ``finish`` or ``discard``."""
        self.names = list(names)
        self.codec = codec
        self.files: list[str] = []  # the data files, numbered as the sorted entries number them
        self._numbers: dict[str, int] = {}
        self._scratch = scratch
        self._queue: Queue[Any] = Queue(4)  # parts waiting to be encoded (memory stays bounded)
        self._size: Optional[int] = None  # the entries of the base merged, once it is
        self._error: Optional[BaseException] = None
        self._handed = False  # every row was handed over
        self._ended = False
        self._thread = threading.Thread(target=self._sort, args=(run,),
                                        name="walberg-copy-keys", daemon=True)
        self._thread.start()

    def add(self, location: str, first: int, part: pa.Table) -> None:
        """``part``'s rows, written to the data file ``location`` from row position ``first``
        on."""
        number = self._numbers.get(location)
        if number is None:
            number = self._numbers[location] = len(self.files)
            self.files.append(location)
        self._put((number, first, [part.column(n) for n in self.names]))

    def written(self) -> None:
        """Every row was handed over: the runs are merged now, while the copy is committed."""
        if not self._handed:
            self._handed = True
            self._put(None)

    def finish(self, index: KeyIndex, snapshot: int) -> None:
        """Make ``index`` that of the table at ``snapshot``, the copy's commit. Raises what
        encoding the keys met (``ByMerge`` for a key the index cannot hold)."""
        try:
            self._end()
            if self._error is not None:
                raise self._error
            assert self._size is not None
            index.adopt(snapshot, self._scratch / "base", self._size, self.files)
        finally:
            self.discard()

    def discard(self) -> None:
        """Stop, and remove what was sorted (a copy that failed, or after ``finish``)."""
        self._end()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self.written()
            self._thread.join()

    def _put(self, item: Any) -> None:
        """Hand ``item`` to the thread, unless it has stopped (on an error: said by ``finish``)."""
        while self._thread.is_alive():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except Full:
                continue

    def _rows(self) -> Iterator[tuple[int, int, np.ndarray, Optional[np.ndarray]]]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            number, first, columns = item
            keys, checks = self.codec.encode(columns)
            yield number, first, keys, checks

    def _sort(self, run: int) -> None:
        try:
            self._size = write_base(self._scratch / "base",
                                    sort_rows(self._rows(), self._scratch, run),
                                    keeps_checks(self.codec.name))
        except BaseException as exc:  # raised by ``finish``
            self._error = exc
