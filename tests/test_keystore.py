"""The key index kept in the warehouse (apply/position/keystore.py), on local folders standing
in for the warehouse's file system: whatever the index holds (a base, deltas, keys anywhere in
the 64-bit range, checks), the index fetched into a fresh folder answers every lookup as the
one kept; packed (as on object storage) or linked (a warehouse on this disk); only the
newest state is kept, older files are removed, and a manifest of an unusable snapshot or
another encoding is not fetched. The same with a real S3 server: tests/test_storage.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyarrow import fs as pafs

from walberg.apply.position import keystore
from walberg.apply.position.keyindex import KeyIndex
from walberg.apply.position.keystore import KeyStore, Place


def _index(folder: Path, keys: list[int], encoding: str = "pair") -> KeyIndex:
    index = KeyIndex(folder, encoding=encoding, chunk=5, max_delta=1000, keys=["a", "b"],
                     table="uuid-1")
    ordered = np.array(sorted(set(keys)), np.int64)
    checks = ordered * 7 + 1 if encoding == "pair" else None  # ("int": no checks written)
    index.rebuild(10, iter([(ordered, checks, [f"s3a://b/t/data/f{k % 3}.parquet"
                                               for k in ordered.tolist()],
                             np.arange(len(ordered), dtype=np.int64)[::-1].copy())]))
    return index


def _answers(index: KeyIndex, keys: list[int]) -> list[tuple[int, str, int]]:
    checks = np.array(keys, np.int64) * 7 + 1 if index.encoding == "pair" else None
    hits = index.lookup(np.array(keys, np.int64), checks)
    return list(zip(hits.keys.tolist(), hits.files, hits.positions.tolist(), strict=True))


_any = st.integers(-(2 ** 63), 2 ** 63 - 1)


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(_any, min_size=1, max_size=60, unique=True),
       later=st.lists(_any, max_size=20), packed=st.booleans(), chunk=st.sampled_from([1, 2, 7]),
       encoding=st.sampled_from(["pair", "int"]))
def test_a_fetched_index_answers_as_the_kept_one(tmp_path_factory: object, keys: list[int],
                                                 later: list[int], packed: bool,
                                                 chunk: int, encoding: str) -> None:
    root: Path = tmp_path_factory.mktemp("keys")  # type: ignore[attr-defined]
    index = _index(root / "here", keys, encoding)
    index.commit(11, np.array(keys[:3], np.int64),
                 (np.array(later, np.int64),
                  np.array(later, np.int64) * 7 + 1 if encoding == "pair" else None,
                  ["s3a://b/t/data/new.parquet"] * len(later),
                  np.arange(len(later), dtype=np.int64)))
    place = Place(pafs.LocalFileSystem(), str(root / "warehouse"), local=not packed)
    store = KeyStore()
    old_piece = keystore.PIECE
    keystore.PIECE = 8 * chunk  # several pieces of a file, the last one short
    try:
        store.keep("t", place, index.directory, root)
        store.close()
        # Another table in its place (dropped and made again), at the same snapshot id: none.
        assert store.fetch(place, root / "other", encoding, ["a", "b"], "uuid-2",
                           lambda s: True) is None
        fetched = store.fetch(place, root / "there", encoding, ["a", "b"], "uuid-1",
                              lambda s: True)
    finally:
        keystore.PIECE = old_piece
    assert fetched == 11
    again = KeyIndex(root / "there", encoding=encoding)
    probe = sorted({*keys, *later, 0, 1, -1})
    assert again.snapshot == 11 and _answers(again, probe) == _answers(index, probe)


def test_only_the_newest_state_stays_and_only_usable_ones_are_fetched(tmp_path: Path) -> None:
    index = _index(tmp_path / "here", list(range(0, 2000, 3)))
    place = Place(pafs.LocalFileSystem(), str(tmp_path / "warehouse"), local=False)
    store = KeyStore()
    store.keep("t", place, index.directory, tmp_path)
    store.close()
    first = keystore._listing(place)
    assert "snapshot-10.json" in first and any(n.startswith("base-") for n in first)
    # The same state again (a run that starts where the last one ended): nothing is written.
    manifest = tmp_path / "warehouse" / "snapshot-10.json"
    written = manifest.stat().st_mtime_ns
    store.keep("t", place, index.directory, tmp_path)
    store.close()
    assert manifest.stat().st_mtime_ns == written and keystore._listing(place) == first
    for snapshot in (11, 12, 13):
        index.commit(snapshot, np.array([snapshot], np.int64),
                     (np.empty(0, np.int64), None, [], np.empty(0, np.int64)))
        store.keep("t", place, index.directory, tmp_path)
    index.max_delta = 0  # the next commit folds the deltas into a new base
    index.commit(14, np.array([3], np.int64), (np.empty(0, np.int64), None, [],
                                               np.empty(0, np.int64)))
    store.keep("t", place, index.directory, tmp_path)
    store.close()
    left = keystore._listing(place)
    manifests = sorted(n for n in left if n.startswith("snapshot-"))
    assert manifests == ["snapshot-14.json"], left
    # The old base is gone with the deltas; the new one is there, whole.
    bases = {n.split("/")[0] for n in left if n.startswith("base-")}
    assert bases == {index._base}, left
    assert not list(tmp_path.glob("keep-*")), "the links taken to keep are removed"

    assert store.fetch(place, tmp_path / "a", "pair", None, None, lambda s: s != 14) is None
    assert store.fetch(place, tmp_path / "b", "int", None, None, lambda s: True) is None
    # Made for the key (a, b): not for another key of the same types (a new primary key).
    assert store.fetch(place, tmp_path / "b", "pair", ["a", "c"], None, lambda s: True) is None
    assert store.fetch(place, tmp_path / "c", "pair", ["a", "b"], None, lambda s: s == 14) == 14
    assert _answers(KeyIndex(tmp_path / "c", encoding="pair"), list(range(20))) == \
        _answers(index, list(range(20)))
    assert not KeyIndex(tmp_path / "c", encoding="pair", keys=["a", "c"]).built
    assert KeyIndex(tmp_path / "c", encoding="pair").keys == ("a", "b")


def test_a_fetch_that_fails_leaves_no_index(tmp_path: Path) -> None:
    index = _index(tmp_path / "here", list(range(100)))
    place = Place(pafs.LocalFileSystem(), str(tmp_path / "warehouse"), local=False)
    store = KeyStore()
    store.keep("t", place, index.directory, tmp_path)
    store.close()
    (tmp_path / "warehouse" / index._base / "positions.0").write_bytes(b"not zstd")
    with pytest.raises(OSError):  # (Arrow: the zstd stream is not one)
        store.fetch(place, tmp_path / "there", "pair", None, None, lambda s: True)
    assert not (tmp_path / "there").exists()
    assert not KeyIndex(tmp_path / "there", encoding="pair").built
