"""The key index of an initial copy written on the driver (``apply.initial.files``), made from the
copy's rows as they are written instead of read back from the lake.

The index of a table applied by position was made after its copy by reading the copy's data
files back, encoding their keys and sorting them: at 10M uuid keys 4.7 s, 40% of the copy.
Here each part of the copy hands its key columns over as it is written, with its data file and
the position of its first row; a thread encodes them and sorts them into runs on disk (as
``KeyIndex.rebuild_from_files`` does) while the copy goes on. Once every row was written
(``written``) the runs are merged into an index base while the copy is committed (the JVM's
work: a core left free), and the commit's snapshot makes it the table's index (``finish``):
at 10M uuid keys the merge took 0.9-1.0 s after the commit before.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from queue import Full, Queue
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa

from walberg.apply.position.keycodec import KeyCodec
from walberg.apply.position.keyindex import KeyIndex, keeps_checks, sort_rows, write_base


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
