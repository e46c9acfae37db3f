"""The columnar decoder must say exactly what the scalar decoder says, row by row."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgoutput_encoder as enc
from walberg.model import UNCHANGED, Column, Delete, Insert, Relation, Update
from walberg.source.columnar import Changes, Malformed, decode_changes
from walberg.source.pgoutput import Decoder

values = st.one_of(st.none(), st.just(UNCHANGED), st.binary(max_size=40))
key_values = st.one_of(st.none(), st.binary(max_size=12))


def rows(ncols: int, vals: st.SearchStrategy[object] = values) -> st.SearchStrategy[tuple[object, ...]]:
    return st.tuples(*[vals for _ in range(ncols)])


@st.composite
def messages(draw: st.DrawFn) -> tuple[int, list[object]]:
    ncols = draw(st.integers(1, 6))
    out: list[object] = []
    for _ in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from("IUUD"))
        if kind == "I":
            out.append(Insert(7, draw(rows(ncols))))
        elif kind == "D":
            out.append(Delete(7, draw(rows(ncols, key_values)), draw(st.sampled_from("KO"))))
        else:
            old_kind = draw(st.sampled_from([None, "K", "O"]))
            old = draw(rows(ncols, key_values)) if old_kind else None
            out.append(Update(7, draw(rows(ncols)), old, old_kind))
    return ncols, out


def as_rows(changes: Changes, which: str, n: int) -> list[tuple[object, ...] | None]:
    cols = changes.new if which == "new" else changes.old
    out: list[tuple[object, ...] | None] = []
    for r in range(n):
        if cols is None:
            out.append(None)
            continue
        row = []
        for c, arr in enumerate(cols.values):
            u = cols.unchanged[c]
            row.append(UNCHANGED if u is not None and u[r] else arr[r].as_py())
        out.append(tuple(row))
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_columnar_equals_scalar(case: tuple[int, list[object]]) -> None:
    ncols, msgs = case
    payloads = [enc.encode(m) for m in msgs]
    got = decode_changes(payloads, ncols)
    new_rows = as_rows(got, "new", len(msgs))
    old_rows = as_rows(got, "old", len(msgs))
    scalar = Decoder()
    scalar.relations[7] = Relation(7, "public", "t", "d",
                                   tuple(Column(f"c{i}", 25) for i in range(ncols)))
    for i, payload in enumerate(payloads):
        want = scalar.decode(payload)
        assert got.tag[i] == payload[0]
        if isinstance(want, Delete):
            assert got.has_old[i] and old_rows[i] == want.old
        else:
            assert new_rows[i] == want.new
            if isinstance(want, Update) and want.old is not None:
                assert got.has_old[i] and old_rows[i] == want.old
                assert got.old_full[i] == (want.old_kind == "O")
            else:
                assert not got.has_old[i]


@settings(max_examples=100, deadline=None)
@given(messages(), st.data())
def test_damaged_chunks_are_refused_not_misread(case: tuple[int, list[object]],
                                               data: st.DataObject) -> None:
    ncols, msgs = case
    if not msgs:
        return
    payloads = [enc.encode(m) for m in msgs]
    i = data.draw(st.integers(0, len(payloads) - 1))
    cut = data.draw(st.integers(1, len(payloads[i]) - 1))
    payloads[i] = payloads[i][:cut]
    with pytest.raises(Malformed):
        decode_changes(payloads, ncols)
