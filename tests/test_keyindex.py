"""The key index (apply/position/keyindex.py) against a plain dict: whatever sequence of rebuilds and
commits, a lookup finds exactly the keys the table holds, with their current file and
position; the deltas merge into the base without changing an answer; a reopened index answers
the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from walberg.apply.position.keybase import Entry, KeysAsWritten
from walberg.apply.position.keycodec import ByMerge, KeyClash, KeyCodec
from walberg.apply.position.keyindex import MANIFEST, KeyIndex

Model = dict[int, tuple[str, int]]


def _batches(model: Model, size: int) -> Iterator[Entry]:
    keys = sorted(model)
    for lo in range(0, len(keys), size):
        part = keys[lo:lo + size]
        yield (np.array(part, np.int64), None, [model[k][0] for k in part],
               np.array([model[k][1] for k in part], np.int64))


def _answers(index: KeyIndex, keys: list[int]) -> Model:
    hits = index.lookup(np.array(keys, np.int64))
    return {int(k): (f, int(p)) for k, f, p in zip(hits.keys, hits.files, hits.positions,
                                                   strict=True)}


_keys = st.integers(min_value=-50, max_value=400)
_commit = st.tuples(st.lists(_keys, max_size=30), st.lists(_keys, max_size=30))


@settings(max_examples=60, deadline=None)
@given(start=st.lists(_keys, max_size=120, unique=True), commits=st.lists(_commit, max_size=12),
       chunk=st.integers(1, 40), max_delta=st.integers(1, 60), max_runs=st.integers(1, 4))
def test_lookups_follow_every_commit(tmp_path_factory: object, start: list[int],
                                     commits: list[tuple[list[int], list[int]]], chunk: int,
                                     max_delta: int, max_runs: int) -> None:
    folder: Path = tmp_path_factory.mktemp("index")  # type: ignore[attr-defined]
    model: Model = {k: (f"file-{k % 3}", k * 10) for k in start}
    index = KeyIndex(folder, chunk=chunk, max_delta=max_delta, max_runs=max_runs)
    index.rebuild(1, _batches(model, 7))
    probe = list(range(-60, 410))
    assert _answers(index, probe) == model
    for n, (gone, added) in enumerate(commits, start=2):
        # A commit deletes `gone`, and writes a new row for each key of `added` (an update of
        # a key held already, or an insert): the new rows sit in a new file.
        fresh = sorted(set(added))
        for k in gone:
            model.pop(k, None)
        for pos, k in enumerate(fresh):
            model[k] = (f"new-{n}", pos)
        index.commit(n, np.array(sorted(set(gone) | set(fresh)), np.int64),
                     (np.array(fresh, np.int64), None, [f"new-{n}"] * len(fresh),
                      np.arange(len(fresh), dtype=np.int64)))
        assert _answers(index, probe) == model
        # (the deltas joined past max_runs, however many commits: one delta file each)
        assert len(list(folder.glob("delta-*.npz"))) <= max_runs
    reopened = KeyIndex(folder, chunk=chunk, max_delta=max_delta)
    assert reopened.snapshot == index.snapshot
    assert _answers(reopened, probe) == model


def test_entries_out_of_order_are_refused(tmp_path: Path) -> None:
    index = KeyIndex(tmp_path)
    try:
        index.rebuild(1, iter([(np.array([3, 2]), None, ["a", "a"], np.array([0, 1]))]))
    except ValueError as exc:
        assert "ascending key order" in str(exc)
    else:
        raise AssertionError("unsorted entries were taken")


@settings(max_examples=60, deadline=None)
@given(files=st.lists(st.lists(st.integers(-10**12, 10**12), max_size=40), max_size=8),
       run=st.integers(1, 50), group=st.integers(1, 15))
def test_rebuild_from_files_sorts_on_disk(tmp_path_factory: object, files: list[list[int]],
                                          run: int, group: int) -> None:
    """Keys of data files in any order, sorted in runs on disk and merged: the index answers
    as if built from the table read in key order, whatever the run and row-group sizes."""
    folder: Path = tmp_path_factory.mktemp("index")  # type: ignore[attr-defined]
    seen: set[int] = set()
    model: Model = {}
    contents: list[list[int]] = []
    for n, keys in enumerate(files):
        keys = [k for k in dict.fromkeys(keys) if k not in seen]  # each key in one row
        seen.update(keys)
        contents.append(keys)
        model.update({k: (f"data-{n}.parquet", pos) for pos, k in enumerate(keys)})

    def rows() -> Iterator[tuple[int, int, np.ndarray, None]]:
        for n, keys in enumerate(contents):  # a row group at a time, as file_keys reads
            for lo in range(0, len(keys), group):
                yield n, lo, np.array(keys[lo:lo + group], np.int64), None

    scratch = folder / "scratch"
    scratch.mkdir()
    index = KeyIndex(folder / "index", chunk=7)
    index.rebuild_from_files(5, [f"data-{n}.parquet" for n in range(len(contents))], rows(),
                             scratch, run=run)
    assert index.snapshot == 5 and index.size == len(model)
    assert _answers(index, sorted(model) + [10**13]) == model
    assert _answers(KeyIndex(folder / "index"), sorted(model)) == model


@settings(max_examples=40, deadline=None)
@given(files=st.lists(st.lists(st.integers(-10**12, 10**12), max_size=40), max_size=6),
       run=st.integers(1, 50), group=st.integers(1, 15), seed=st.integers(0, 2**32 - 1),
       early=st.booleans())
def test_keys_taken_as_a_copy_writes_them(tmp_path_factory: object, files: list[list[int]],
                                          run: int, group: int, seed: int,
                                          early: bool) -> None:
    """A copy's parts handed over as they are written (the parts of several files, as a
    partitioned copy's, interleaved), encoded and sorted in a thread: the index answers as if
    rebuilt from the files, whatever the run and part sizes. With ``early`` the runs are
    merged once every part was handed over (``written``, before the copy's commit); the
    table's index stays as it was until ``finish`` (the commit's snapshot)."""
    folder: Path = tmp_path_factory.mktemp("copykeys")  # type: ignore[attr-defined]
    seen: set[int] = set()
    model: Model = {}
    parts: list[list[tuple[int, list[int]]]] = []  # each file's parts, in order
    for n, keys in enumerate(files):
        keys = [k for k in dict.fromkeys(keys) if k not in seen]  # each key in one row
        seen.update(keys)
        model.update({k: (f"data-{n}.parquet", pos) for pos, k in enumerate(keys)})
        parts.append([(lo, keys[lo:lo + group]) for lo in range(0, len(keys), group)])
    codec = KeyCodec.for_types(["BIGINT"])
    assert codec is not None
    (folder / "scratch").mkdir()
    taken = KeysAsWritten(["id"], codec, folder / "scratch", run=run)
    rng = np.random.default_rng(seed)
    while any(parts):  # a file drawn at random gives its next part
        n = int(rng.choice([i for i, left in enumerate(parts) if left]))
        first, keys = parts[n].pop(0)
        taken.add(f"data-{n}.parquet", first,
                  pa.table({"id": pa.array(keys, pa.int64()), "v": [0] * len(keys)}))
    index = KeyIndex(folder / "index", chunk=7)
    index.rebuild(3, iter([(np.array([10**13]), None, ["before.parquet"], np.array([0]))]))
    if early:
        taken.written()
        assert KeyIndex(folder / "index").snapshot == 3
    taken.finish(index, 9)
    assert index.snapshot == 9 and index.size == len(model)
    assert _answers(index, sorted(model) + [10**13]) == model
    assert _answers(KeyIndex(folder / "index"), sorted(model) + [10**13]) == model
    assert not (folder / "scratch").exists()
    assert [p.name for p in (folder / "index").iterdir() if p.name.startswith("base-")] == \
        [KeyIndex(folder / "index")._base]  # (the index before: gone)


def test_keys_a_copy_cannot_index_are_said_at_its_end(tmp_path: Path) -> None:
    """A key the index cannot hold (here NULL) fails ``finish`` with ``ByMerge`` (the table
    is then merged), and nothing sorted is left behind."""
    codec = KeyCodec.for_types(["BIGINT"])
    assert codec is not None
    (tmp_path / "scratch").mkdir()
    taken = KeysAsWritten(["id"], codec, tmp_path / "scratch", run=2)
    taken.add("data-0.parquet", 0, pa.table({"id": pa.array([1, 2, 3], pa.int64())}))
    taken.add("data-0.parquet", 3, pa.table({"id": pa.array([4, None], pa.int64())}))
    for _ in range(10):  # (more parts than the queue holds: the thread has stopped)
        taken.add("data-0.parquet", 5, pa.table({"id": pa.array([9], pa.int64())}))
    with pytest.raises(ByMerge):
        taken.finish(KeyIndex(tmp_path / "index"), 1)
    assert not (tmp_path / "scratch").exists()


def test_a_hit_counts_only_when_its_check_matches(tmp_path: Path) -> None:
    """Keys held as (key, check): a lookup whose check differs from the entry's is two keys
    sharing an entry, and says so instead of answering with the other key's row."""
    index = KeyIndex(tmp_path, chunk=2, encoding="blake2b-128:str")
    index.rebuild(1, iter([(np.array([1, 2, 3]), np.array([10, 20, 30]), ["a", "a", "b"],
                            np.array([0, 1, 0]))]))
    hits = index.lookup(np.array([3, 1, 9]), np.array([30, 10, 90]))
    assert hits.keys.tolist() == [1, 3] and hits.files == ["a", "b"]
    with pytest.raises(KeyClash):
        index.lookup(np.array([2]), np.array([21]))
    index.commit(2, np.array([1]), (np.array([4]), np.array([40]), ["c"], np.array([0])))
    with pytest.raises(KeyClash):
        index.lookup(np.array([4]), np.array([41]))
    with pytest.raises(KeyClash):  # two keys of one batch
        index.lookup(np.array([5, 5]), np.array([1, 2]))
    with pytest.raises(KeyClash):  # ... whose pairs do not come together
        index.lookup(np.array([5, 3, 5, 5]), np.array([1, 30, 2, 1]))
    # One key asked twice is one hit.
    assert index.lookup(np.array([3, 2, 3]), np.array([30, 20, 30])).keys.tolist() == [2, 3]
    # A key deleted (a tombstone in a delta run, which keeps no check) and looked up again,
    # as a later batch inserting it again does: not there, and no clash.
    assert index.lookup(np.array([1]), np.array([10])).keys.tolist() == []
    # An index made for another key encoding is not read: the caller rebuilds it.
    assert KeyIndex(tmp_path, encoding="blake2b-128:str").built
    assert not KeyIndex(tmp_path, encoding="int").built
    with pytest.raises(KeyClash):
        KeyIndex(tmp_path / "other").rebuild(1, iter([(np.array([1, 1]), np.array([1, 2]),
                                                        ["a", "a"], np.array([0, 1]))]))


def test_an_index_is_of_one_table_whatever_its_snapshot_id(tmp_path: Path) -> None:
    """The index records the Iceberg table it describes (its table-uuid) beside the snapshot:
    another table under the same name (dropped and made again, restored from elsewhere) is not
    read at the same snapshot id. An index from before the table was recorded is not read for
    a table either (made again, once); read without one (tools, tests), it still answers."""
    entries = [(np.array([1, 2]), None, ["a", "b"], np.array([0, 0]))]
    KeyIndex(tmp_path / "one", table="uuid-1").rebuild(7, iter(entries))
    assert KeyIndex(tmp_path / "one", table="uuid-1").built
    assert KeyIndex(tmp_path / "one").table == "uuid-1"
    other = KeyIndex(tmp_path / "one", table="uuid-2")
    assert not other.built and other.snapshot is None
    other.rebuild(7, iter(entries))  # made again for the other table, which it is now
    assert KeyIndex(tmp_path / "one").table == "uuid-2"
    assert not KeyIndex(tmp_path / "one", table="uuid-1").built

    KeyIndex(tmp_path / "legacy").rebuild(7, iter(entries))  # as the older code wrote it
    assert "table" not in json.loads((tmp_path / "legacy" / MANIFEST).read_text())
    assert KeyIndex(tmp_path / "legacy").built
    assert not KeyIndex(tmp_path / "legacy", table="uuid-1").built


@settings(max_examples=30, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(-5, 5), st.integers(-10**6, 10**6)),
                     unique_by=lambda p: p[1], max_size=60),
       run=st.integers(1, 20))
def test_unsorted_entries_with_checks_sort_on_disk(tmp_path_factory: object,
                                                   pairs: list[tuple[int, int]], run: int) -> None:
    folder: Path = tmp_path_factory.mktemp("index")  # type: ignore[attr-defined]
    # keys may repeat only with the same check: one key per check here, so dedupe by key
    seen: dict[int, int] = {}
    for key, check in pairs:
        seen.setdefault(key * 1000 + check % 1000, check)
    keys = list(seen)
    checks = [seen[k] for k in keys]
    files = ["f0", "f1"]
    entries = [(np.array(keys[i:i + 3], np.int64), np.array(checks[i:i + 3], np.int64),
                np.array([i % 2] * len(keys[i:i + 3]), np.int32),
                np.arange(i, i + len(keys[i:i + 3]), dtype=np.int64))
               for i in range(0, len(keys), 3)]
    scratch = folder / "scratch"
    scratch.mkdir()
    index = KeyIndex(folder / "index", chunk=4, encoding="pair:int,int")
    index.rebuild_unsorted(3, files, iter(entries), scratch, run=run)
    hits = index.lookup(np.array(keys, np.int64), np.array(checks, np.int64))
    assert sorted(hits.keys.tolist()) == sorted(keys)


def test_an_index_whose_files_cannot_be_read_whole_is_made_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A base whose files are gone, or a delta that is not a whole file, makes the index not
    built (the caller makes it again from the lake, see KeyIndexes.index) and is said in the
    log: a lookup never meets a missing file in the middle of a batch."""
    import logging

    entries = [(np.array([1, 2, 3]), None, ["a", "b", "c"], np.array([0, 1, 2]))]
    no_base = KeyIndex(tmp_path / "no-base", table="t")
    no_base.rebuild(7, iter(entries))
    base = json.loads((tmp_path / "no-base" / MANIFEST).read_text())["base"]
    (tmp_path / "no-base" / base / "keys").unlink()
    broken = KeyIndex(tmp_path / "broken-delta", table="t")
    broken.rebuild(7, iter(entries))
    broken.commit(8, np.array([2]), (np.array([4]), None, ["d"], np.array([0])))
    delta = json.loads((tmp_path / "broken-delta" / MANIFEST).read_text())["deltas"][0]
    whole = (tmp_path / "broken-delta" / delta).read_bytes()
    (tmp_path / "broken-delta" / delta).write_bytes(whole[:len(whole) // 2])
    with caplog.at_level(logging.WARNING, logger="walberg"):
        for name in ("no-base", "broken-delta"):
            again = KeyIndex(tmp_path / name, table="t")
            assert not again.built and again.snapshot is None, name
            again.rebuild(9, iter(entries))  # made again in place
            assert KeyIndex(tmp_path / name, table="t").lookup(
                np.array([1, 3]), np.zeros(2, np.int64)).keys.tolist() == [1, 3]
    assert caplog.text.count("cannot be read whole") == 2, caplog.text


def test_scratch_folders_made_side_by_side_at_a_start_all_survive(tmp_path: Path) -> None:
    """The first use of the index root sweeps the scratch folders a killed run left. Tables
    copied or applied side by side ask for scratch folders at once: the sweep is made once,
    before any of them is made (a second sweep removed one another thread had just made, and
    a base index was moved in without its keys)."""
    import threading

    from walberg.apply.position.indexes import KeyIndexes

    for attempt in range(60):
        root = tmp_path / f"root-{attempt}"
        (root / "scratch-left-by-a-killed-run").mkdir(parents=True)
        indexes = KeyIndexes(None, root, keep=False)  # type: ignore[arg-type]
        gate = threading.Barrier(8)
        made: list[Path] = []

        def take(indexes: KeyIndexes, gate: threading.Barrier, made: list[Path]) -> None:
            gate.wait()
            for _ in range(3):
                made.append(Path(indexes.scratch().path))

        threads = [threading.Thread(target=take, args=(indexes, gate, made)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(made) == 24
        assert all(p.is_dir() for p in made), f"attempt {attempt}: a sweep removed a new folder"
        assert not (root / "scratch-left-by-a-killed-run").exists()
