"""How keys become index entries (apply/position/keycodec.py): one value, whatever form it arrives in
(a staged batch file, a data file written on the driver, one written by Spark); different keys
never the same entry where the encoding is exact."""

from __future__ import annotations

import datetime as dt
import uuid

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from walberg.apply.position.keycodec import KeyCodec, KeyEncodingError


def _pairs(codec: KeyCodec, *columns: pa.Array) -> list[tuple[int, int]]:
    keys, checks = codec.encode(list(columns))
    return list(zip(keys.tolist(), checks.tolist(), strict=True))


def test_one_value_one_entry_whatever_its_arrow_form() -> None:
    ids = [str(uuid.uuid4()) for _ in range(50)]
    text = KeyCodec.for_types(["STRING"])
    assert text is not None and not text.exact and text.name == "short16+blake2b:str"
    assert _pairs(text, pa.array(ids)) == _pairs(text, pa.array(ids, pa.large_string())) \
        == _pairs(text, pa.chunked_array([pa.array(ids[:20]), pa.array(ids[20:])]))
    assert len(set(_pairs(text, pa.array(ids)))) == 50

    stamps = [dt.datetime(2024, 1, 1, 12, 0, 0, 5), dt.datetime(1969, 12, 31, 23, 59, 59)]
    ts = KeyCodec.for_types(["TIMESTAMP"])
    assert ts is not None and ts.single and ts.sorted_like_the_table
    micros = _pairs(ts, pa.array(stamps, pa.timestamp("us", "UTC")))
    assert micros == _pairs(ts, pa.array(stamps, pa.timestamp("ns", "UTC")))  # Spark's INT96
    assert micros == _pairs(ts, pa.array([1704110400000005, -1000000], pa.int64()))  # unix_micros

    day = KeyCodec.for_types(["DATE"])
    assert day is not None
    assert _pairs(day, pa.array([dt.date(2024, 3, 1)], pa.date32())) == \
        _pairs(day, pa.array([(dt.date(2024, 3, 1) - dt.date(1970, 1, 1)).days], pa.int64()))

    one = KeyCodec.for_types(["INT"])
    assert one is not None and one.name == "int"
    assert _pairs(one, pa.array([7, -1], pa.int32())) == [(7, 0), (-1, 0)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(-2**63, 2**63 - 1), st.integers(-2**31, 2**31 - 1)),
                unique=True, max_size=80))
def test_two_integer_columns_are_exact(keys: list[tuple[int, int]]) -> None:
    """(key, check) gives both values back: two different keys never share an entry."""
    codec = KeyCodec.for_types(["BIGINT", "INT"])
    assert codec is not None and codec.exact and not codec.single
    pairs = _pairs(codec, pa.array([k[0] for k in keys], pa.int64()),
                   pa.array([k[1] for k in keys], pa.int32()))
    assert len(set(pairs)) == len(keys)
    assert [c for _, c in pairs] == [k[1] for k in keys]


def test_composite_text_keys_do_not_run_together() -> None:
    codec = KeyCodec.for_types(["STRING", "STRING"])
    assert codec is not None and not codec.exact
    a = _pairs(codec, pa.array(["ab", "a"]), pa.array(["c", "bc"]))
    assert a[0] != a[1]
    mixed = KeyCodec.for_types(["STRING", "BIGINT"])
    assert mixed is not None and mixed.name == "blake2b-128:str,int"
    assert len(set(_pairs(mixed, pa.array(["t1", "t1", "t2"]),
                          pa.array([1, 2, 1], pa.int64())))) == 3


def test_keys_without_a_canonical_form_take_the_merge() -> None:
    assert KeyCodec.for_types(["DOUBLE"]) is None
    assert KeyCodec.for_types(["DECIMAL(12,2)"]) is None
    assert KeyCodec.for_types(["BINARY", "INT"]) is None
    codec = KeyCodec.for_types(["STRING"])
    assert codec is not None
    with pytest.raises(KeyEncodingError):
        codec.encode([pa.array(["a", None])])
    assert codec.encode([pa.array([], pa.string())])[0].dtype == np.int64


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.booleans())
def test_deletion_vectors_round_trip(positions: list[int], dense: bool) -> None:
    """A deletion-vector-v1 blob (apply/position/dv.py) gives back the positions it was made of; a
    corrupted one is refused."""
    from walberg.apply.position import dv

    if dense:
        positions = positions + list(range(1000, 9000))  # a bitmap container, and runs
    blob = dv.encode(np.asarray(positions, np.int64))
    assert list(dv.decode(blob)) == sorted(set(positions))
    broken = bytearray(blob)
    broken[-5] ^= 1
    with pytest.raises(ValueError):
        dv.decode(bytes(broken))


def test_uuids_are_exact_and_parsed_from_their_text() -> None:
    ids = [uuid.uuid4() for _ in range(200)]
    codec = KeyCodec.for_types(["STRING"], [True])
    assert codec is not None and codec.exact and codec.name == "pair:uuid"
    keys, checks = codec.encode([pa.array([str(u) for u in ids]).slice(0)])
    assert checks.tolist() == [int.from_bytes(u.bytes[8:], "big", signed=True) for u in ids]
    assert len(set(zip(keys.tolist(), checks.tolist(), strict=True))) == 200
    # a sliced array reads from its own offset
    k2, c2 = codec.encode([pa.array([str(u) for u in ids]).slice(5, 10)])
    assert k2.tolist() == keys[5:15].tolist() and c2.tolist() == checks[5:15].tolist()
    for bad in (str(ids[0]).upper(), str(ids[0]).replace("-", ""), "{" + str(ids[0]) + "}"):
        with pytest.raises(KeyEncodingError):
            codec.encode([pa.array([bad])])


_TEXT = st.text(st.characters(codec="utf-8"), max_size=24)


@settings(max_examples=60, deadline=None)
@given(st.lists(_TEXT, unique=True, max_size=60))
def test_one_text_column_short_values_exact_long_ones_hashed(values: list[str]) -> None:
    """A value of at most 16 bytes (no NUL) is its own padded bytes; a longer one a digest that
    can never equal a padded value; different values never share an entry, however the batch
    mixes the two forms, and a value's entry does not depend on its batch."""
    codec = KeyCodec.for_types(["STRING"])
    assert codec is not None
    pairs = _pairs(codec, pa.array(values, pa.string()))
    assert len(set(pairs)) == len(values)
    assert pairs == [_pairs(codec, pa.array([v]))[0] for v in values]
    assert pairs == _pairs(codec, pa.array(values, pa.large_string()))
    for value, (_, check) in zip(values, pairs, strict=True):
        raw = value.encode()
        word = check.to_bytes(8, "little", signed=True)
        if len(raw) <= 16 and b"\0" not in raw:
            assert word == raw.ljust(16, b"\0")[8:]
        else:
            assert word[6] == 0 and word[7] & 1


def test_text_keys_of_one_prefix_spread() -> None:
    """Keys that share their first 8 bytes, or their last 8, still differ in the index's sort
    key (else the table would take the MERGE for a clash)."""
    codec = KeyCodec.for_types(["STRING"])
    assert codec is not None
    values = [f"customer-{i}" for i in range(20000)] + [f"{i:08d}-suffix!" for i in range(20000)]
    keys, _ = codec.encode([pa.chunked_array([pa.array(values[:7]), pa.array(values[7:])])])
    assert len(set(keys.tolist())) == len(values)
    assert codec.encode([pa.array(values).slice(3, 5)])[0].tolist() == keys[3:8].tolist()
