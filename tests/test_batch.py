"""Staging and netting: what a batch of changes turns into, checked against a plain model.

The netting runs in the real Spark (the shared session) against real Iceberg tables; the model is
a dict replaying the same changes one by one."""

from __future__ import annotations

import random
import threading
from datetime import datetime
from decimal import Decimal
from itertools import pairwise
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from walberg.apply.batch import (
    BatchBuilder,
    _last_per_key,
    csv_to_parquet,
    effective_truncate,
    seq_filter,
)
from walberg.apply.iceberg import IcebergSink
from walberg.config_sink import Catalog, Sink
from walberg.model import UNCHANGED, Column, Lsn, Op
from walberg.runtime.lakeside import commit_with_retries

COLUMNS = (Column("id", 23, -1, True), Column("v", 25), Column("n", 1700, (10 << 16 | 2) + 4))


def test_seq_filter_keeps_rows_after_the_last_live_truncate() -> None:
    assert seq_filter(10, [], []) == "_wb_seq <= 10"
    # The truncate at 12 is beyond the batch; the one at 5 is inside a voided transaction.
    assert effective_truncate(10, [(4, 6)], [3, 5, 12]) == 3
    assert seq_filter(10, [(4, 6)], [3, 5, 12]) == (
        "_wb_seq <= 10 AND NOT (_wb_seq BETWEEN 4 AND 6) AND _wb_seq > 3")
    assert effective_truncate(10, [], []) is None


def test_builder_writes_text_nulls_and_unchanged_marks_in_chunks(tmp_path: Path) -> None:
    b = BatchBuilder(tmp_path / "stage", chunk_rows=3)
    rows: list[tuple[Any, ...]] = [
        (b"1", b"", None), (b"2", "ünï 🐘".encode(), b"1.50"), (b"3", UNCHANGED, b"2.00"),
        (b"4", b"x", UNCHANGED), (b"5", b"y", b"0.00"),
    ]
    for i, r in enumerate(rows):
        b.add("public.t", COLUMNS, Op.UPDATE if i == 2 else Op.INSERT, i + 1, 100 + i, r)
    staged = b.finish()["public.t"]
    assert staged.rows == 5 and staged.ops == {Op.INSERT: 4, Op.UPDATE: 1, Op.DELETE: 0}
    assert staged.unchanged_columns == {1, 2}
    table = pq.read_table(staged.files)
    assert pq.ParquetFile(staged.files[0]).num_row_groups == 2  # flushed every 3 rows
    assert table.column("c1").to_pylist() == ["", "ünï 🐘", None, "x", "y"]
    assert table.column("c2").to_pylist() == [None, "1.50", "2.00", None, "0.00"]
    assert table.column("_wb_unchanged").to_pylist() == [None, None, ",1,", ",2,", None]
    assert table.column("_wb_seq").to_pylist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("key_type", [23, 25])  # an integer key (numpy), a text key (Arrow)
def test_staging_keeps_each_keys_last_applied_change(tmp_path: Path, key_type: int) -> None:
    """Netting while staging keeps, per key, the change with the highest seq among the rows the
    batch applies: not one beyond its last seq (a transaction left to the next batch), not one
    in a void range (a transaction cut off and sent again), and leaves a batch alone whose
    keys do not repeat."""
    columns = (Column("id", key_type, -1, True), *COLUMNS[1:])
    b = BatchBuilder(tmp_path / "net", chunk_rows=2)
    changes = [  # seq, op, key, value
        (1, Op.INSERT, 1, "a"), (2, Op.INSERT, 2, "b"), (3, Op.UPDATE, 1, "a2"),
        (4, Op.UPDATE, 2, "void"), (5, Op.UPDATE, 2, "void too"),  # cut off, sent again
        (6, Op.UPDATE, 2, "b2"), (7, Op.DELETE, 3, None), (8, Op.INSERT, 3, "c"),
        (9, Op.UPDATE, 1, "next batch"),
    ]
    for seq, op, key, value in changes:
        b.add("public.t", columns, op, seq, 100 + seq,
              (str(key).encode(), None if value is None else value.encode(), None))
    staged = b.finish((8, [(4, 5)]), frozenset({"public.t"}))["public.t"]
    assert staged.unique_keys and staged.rows == len(changes)
    rows = pq.read_table(staged.files).to_pylist()
    assert sorted((r["c0"], r["c1"], r["_wb_op"], r["_wb_seq"]) for r in rows) == [
        ("1", "a2", "U", 3), ("2", "b2", "U", 6), ("3", "c", "I", 8)]

    # Not for a table left out of `net` (its changelog needs every change) ...
    b = BatchBuilder(tmp_path / "all", chunk_rows=2)
    for seq, op, key, value in changes:
        b.add("public.t", columns, op, seq, 1, (str(key).encode(), (value or "").encode(), None))
    staged = b.finish((8, [(4, 5)]))["public.t"]
    assert not staged.unique_keys and pq.read_table(staged.files).num_rows == len(changes)
    # ... and a batch whose applied keys are all distinct is left as it is.
    b = BatchBuilder(tmp_path / "distinct")
    for seq, key in ((1, 1), (2, 2), (3, 1)):
        b.add("public.t", columns, Op.INSERT, seq, 1, (str(key).encode(), b"x", None))
    staged = b.finish((2, []), frozenset({"public.t"}))["public.t"]
    assert staged.unique_keys and pq.read_table(staged.files).num_rows == 3


@pytest.mark.parametrize("seed", range(6))
def test_each_keys_last_change_is_found_for_composite_keys_with_nulls(seed: int) -> None:
    """The rows kept by netting are, per key among the live rows, the one with the highest
    seq, for keys of several columns of other types than one bigint (text, int, NULLs in
    them), in several arrays per column; nothing when no key repeats."""
    rnd = random.Random(seed)
    n = rnd.randrange(1, 400)
    kinds = [rnd.choice([pa.string(), pa.int32(), pa.int64(), pa.date32()])
             for _ in range(rnd.randrange(1, 4))]
    if kinds == [pa.int64()]:
        kinds.append(pa.string())

    def value(kind: pa.DataType) -> Any:
        if rnd.random() < 0.1:
            return None
        v = rnd.randrange(4)
        return f"k{v}" if kind == pa.string() else v

    rows = [tuple(value(k) for k in kinds) for _ in range(n)]
    seq = np.array(rnd.sample(range(10 * n), n), dtype=np.int64)
    live = np.array([rnd.random() < 0.8 for _ in range(n)]) if seed % 2 else None
    cut = sorted({0, n, *(rnd.randrange(n) for _ in range(3))})
    parts = [[pa.array([r[j] for r in rows[a:b]], kinds[j]) for a, b in pairwise(cut)]
             for j in range(len(kinds))]
    last: dict[tuple[Any, ...], int] = {}
    for i, key in enumerate(rows):
        if (live is None or live[i]) and (key not in last or seq[i] > seq[last[key]]):
            last[key] = i
    applied = n if live is None else int(live.sum())
    found = _last_per_key(parts, seq, live)
    if len(last) == applied:
        assert found is None
    else:
        assert found is not None and sorted(found.tolist()) == sorted(last.values())


def test_csv_copy_keeps_null_and_empty_string_apart(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_bytes(b'1,,""\n2,"multi\nline","a,""b"""\n')
    rows = csv_to_parquet(csv, 3, tmp_path / "t.parquet")
    assert rows == 2
    t = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert t == [{"c0": "1", "c1": None, "c2": ""}, {"c0": "2", "c1": "multi\nline", "c2": 'a,"b"'}]
    empty = tmp_path / "e.csv"
    empty.write_bytes(b"")
    assert csv_to_parquet(empty, 3, tmp_path / "e.parquet") == 0


def _model_apply(state: dict[int, tuple[str, Optional[str]]], op: str, key: int,
                 row: Optional[tuple[str, Optional[str]]]) -> None:
    if op == "D":
        state.pop(key, None)
    else:
        assert row is not None
        state[key] = row


@pytest.mark.parametrize("where", ["spark", "staging"])
@pytest.mark.parametrize("seed", range(4))
def test_netting_matches_replaying_changes_one_by_one(spark: Any, tmp_path: Path, seed: int,
                                                      where: str) -> None:
    """Random inserts, updates, deletes and truncates on a small key space, many per key, in one
    batch: the Iceberg table after one commit equals the dict after replaying them in order,
    whether the batch is netted by Spark or while staging (batches with a TRUNCATE always go
    to Spark)."""
    rnd = random.Random(seed)
    sink = IcebergSink(spark)
    target = f"lake.netting.t{seed}"
    spark.sql(f"DROP TABLE IF EXISTS {target}")
    sink.ensure_table(target, COLUMNS)
    state: dict[int, tuple[str, Optional[str]]] = {k: (f"init{k}", "1.00") for k in range(20)}
    init = BatchBuilder(tmp_path / "init")
    for seq, (k, (v, n)) in enumerate(state.items(), 1):
        init.add("public.t", COLUMNS, Op.INSERT, seq, 1, (str(k).encode(), v.encode(), n.encode()))
    sink.apply(target, init.finish()["public.t"], Lsn(1), max_seq=len(state))

    b = BatchBuilder(tmp_path / "batch", chunk_rows=7)
    seq = 0
    for _ in range(rnd.randint(20, 80)):
        seq += 1
        k = rnd.randrange(30)
        if rnd.random() < 0.03:
            b.truncate("public.t", COLUMNS, seq)
            state.clear()
            continue
        if k in state and rnd.random() < 0.4:
            b.add("public.t", COLUMNS, Op.DELETE, seq, 2, (str(k).encode(), None, None))
            _model_apply(state, "D", k, None)
        else:
            row = (f"v{seq}", rnd.choice([None, f"{rnd.randint(0, 9999)}.{rnd.randint(0, 99):02d}"]))
            op = Op.UPDATE if k in state else Op.INSERT
            b.add("public.t", COLUMNS, op, seq, 2,
                  (str(k).encode(), row[0].encode(), None if row[1] is None else row[1].encode()))
            _model_apply(state, op.value, k, row)
    if where == "staging":
        staged = b.finish((seq, []), frozenset({"public.t"}))["public.t"]
        assert staged.unique_keys or staged.truncates
    else:
        staged = b.finish()["public.t"]
    sink.apply(target, staged, Lsn(2), max_seq=seq)

    got = {r["id"]: (r["v"], None if r["n"] is None else f"{r['n']:.2f}")
           for r in spark.sql(f"SELECT * FROM {target}").collect()}
    assert got == state
    assert sink.committed_lsn(target) == Lsn(2)


def test_unchanged_toast_values_are_never_overwritten(spark: Any, tmp_path: Path) -> None:
    sink = IcebergSink(spark)
    target = "lake.netting.toast"
    spark.sql(f"DROP TABLE IF EXISTS {target}")
    sink.ensure_table(target, COLUMNS)
    big = "x" * 100_000
    first = BatchBuilder(tmp_path / "a")
    first.add("public.t", COLUMNS, Op.INSERT, 1, 1, (b"1", big.encode(), b"1.00"))
    sink.apply(target, first.finish()["public.t"], Lsn(1), max_seq=1)

    b = BatchBuilder(tmp_path / "b")
    # Row 1 existed before the batch: its large value is only in the lake.
    b.add("public.t", COLUMNS, Op.UPDATE, 1, 2, (b"1", UNCHANGED, b"2.00"))
    # Row 2 is inserted and then updated in the same batch: the value is in the batch.
    b.add("public.t", COLUMNS, Op.INSERT, 2, 2, (b"2", b"inserted", b"3.00"))
    b.add("public.t", COLUMNS, Op.UPDATE, 3, 2, (b"2", UNCHANGED, b"4.00"))
    b.add("public.t", COLUMNS, Op.UPDATE, 4, 2, (b"2", UNCHANGED, b"5.00"))
    sink.apply(target, b.finish()["public.t"], Lsn(2), max_seq=4)
    got = {r["id"]: (r["v"], str(r["n"])) for r in spark.sql(f"SELECT * FROM {target}").collect()}
    assert got == {1: (big, "2.00"), 2: ("inserted", "5.00")}


def test_staging_tells_whether_any_key_repeats(tmp_path: Path) -> None:
    from walberg.model import Column as Col

    cols = (Col("id", 23, -1, True), Col("v", 25))
    b = BatchBuilder(tmp_path / "unique", chunk_rows=2)
    for seq, key in enumerate([1, 2, 3, 4, 5]):
        b.add("public.t", cols, Op.INSERT if seq % 2 else Op.UPDATE, seq, 10,
              (str(key).encode(), b"x"))
    assert b.finish()["public.t"].unique_keys is True
    b = BatchBuilder(tmp_path / "repeat", chunk_rows=2)
    for seq, key in enumerate([1, 2, 3, 2]):
        b.add("public.t", cols, Op.UPDATE, seq, 10, (str(key).encode(), b"x"))
    assert b.finish()["public.t"].unique_keys is False
    # A key whose text is not its identity (numeric: 1.0 = 1.00) is never trusted.
    b = BatchBuilder(tmp_path / "numeric")
    b.add("public.t", (Col("n", 1700, -1, True), Col("v", 25)), Op.UPDATE, 1, 10,
          (b"1.0", b"x"))
    assert b.finish()["public.t"].unique_keys is False


def test_a_delete_needs_only_its_key_to_be_staged(tmp_path: Path) -> None:
    """A delete whose old row (a Debezium before image under REPLICA IDENTITY FULL) holds a
    value outside its key that cannot be written is staged all the same, that value NULL: it
    must delete the row. A change whose key cannot be written, or an insert or update with such
    a value, is a dead letter."""
    from walberg.apply.types import TypeMap
    from walberg.model import PgType

    cols = (*COLUMNS, Column("at", 1114), Column("tags", 1007))
    types = TypeMap()
    types.learn({1007: PgType(1007, "_int4", "b", element=23)})
    b = BatchBuilder(tmp_path / "stage", prep=lambda s, c: types.prep(c))
    rows: list[tuple[Op, tuple[Any, ...]]] = [
        (Op.INSERT, (b"1", b"a", b"1.00", b"2020-01-01 00:00:00", b"{1,2}")),
        (Op.UPDATE, (b"1", b"a", b"NaN", b"2020-01-01 00:00:00", b"{1}")),  # dead letter
        (Op.DELETE, (b"1", b"a", b"NaN", b"infinity", b"{{1},{2}}")),  # deletes all the same
        (Op.DELETE, (b"2", b"b", b"3.50", b"2020-01-02 00:00:00", b"{3}")),
        (Op.DELETE, (b"x", b"c", b"1.00", None, None)),  # its key cannot be written
        (Op.INSERT, (b"4", b"d", b"1" * 12, None, None)),  # dead letter
    ]
    for seq, (op, row) in enumerate(rows, start=1):
        b.add("public.t", cols, op, seq, 100, row)
    staged = b.finish()["public.t"]
    table = pq.read_table(staged.files).to_pylist()
    assert [(r["_wb_seq"], r["_wb_op"], r["c0"], r["c2"], r["c3"], r["c4"]) for r in table] == [
        (1, "I", 1, Decimal("1.00"), datetime(2020, 1, 1), [1, 2]),
        (3, "D", 1, None, None, None),
        (4, "D", 2, Decimal("3.50"), datetime(2020, 1, 2), [3])]
    assert staged.ops == {Op.INSERT: 1, Op.UPDATE: 0, Op.DELETE: 2}
    assert staged.dead_letters is not None and staged.dead_rows == 3
    dead = pq.read_table(staged.dead_letters).to_pylist()
    assert [(r["_wb_seq"], r["_dlq_reason"].split(":")[0]) for r in dead] == [
        (2, "column n"), (5, "column id"), (6, "column n")]


def test_two_sources_merging_into_one_table_at_once_keep_their_batches_apart(
        spark: Any, tmp_path: Path) -> None:
    """Two sources fan in to one table, each applying its batches from its own thread in the
    one Spark session, as a multi-source pipeline does. Each batch updates a row and inserts one
    (a MERGE); every source's rows must come from its own batches only, each exactly once."""
    target = "lake.netting.fan_in"
    spark.sql(f"DROP TABLE IF EXISTS {target}")
    sinks = {name: IcebergSink(spark, source=name) for name in ("a", "b")}
    for sink in sinks.values():
        sink.ensure_table(target, COLUMNS)
    rounds = 6
    failures: list[BaseException] = []
    together = threading.Barrier(len(sinks), timeout=300)  # each round's commits race

    def source(name: str) -> None:
        sink = sinks[name]
        try:
            for r in range(1, rounds + 1):
                # The first batch only inserts (an append); the others update row 1 and insert
                # one row (a MERGE).
                b = BatchBuilder(tmp_path / f"{name}{r}")
                op = Op.INSERT if r == 1 else Op.UPDATE
                b.add("public.t", COLUMNS, op, 1, r, (b"1", f"{name}{r}".encode(), None))
                b.add("public.t", COLUMNS, Op.INSERT, 2, r,
                      (f"{100 + r}".encode(), name.encode(), f"{r}.00".encode()))
                staged = b.finish()["public.t"]
                lsn = Lsn(r)

                def landed(lsn: Lsn = lsn) -> bool:
                    held = sink.committed_lsn(target)
                    return held is not None and held >= lsn

                together.wait()
                commit_with_retries(
                    Sink(catalog=Catalog(warehouse=str(tmp_path))),
                    threading.Event(), sink, "public.t", target,
                    lambda staged=staged, lsn=lsn: sink.apply(target, staged, lsn, max_seq=2),
                    landed, f"LSN {lsn}", "-")
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=source, args=(name,)) for name in sinks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    got = sorted((r["_walberg_source"], r["id"], r["v"], r["_walberg_lsn"])
                 for r in spark.sql(f"SELECT * FROM {target}").collect())
    want = sorted([(name, 1, f"{name}{rounds}", rounds) for name in sinks]
                  + [(name, 100 + r, name, r) for name in sinks for r in range(1, rounds + 1)])
    assert got == want
    for name, sink in sinks.items():
        assert sink.committed_lsn(target) == Lsn(rounds), name


def test_a_chunk_of_large_values_is_decoded_before_it_grows_past_its_bytes(
        tmp_path: Path) -> None:
    """Changes wait in their relation's chunk until 100,000 of them or ``max_bytes`` of them
    are there: a chunk of large values is decoded before one column's values near what one
    Arrow string array holds (2 GiB), and every value is staged whole."""
    import pgoutput_encoder as enc
    from walberg.model import Insert, Relation
    from walberg.runtime.pg_decode import Chunk

    rel = Relation(7, "public", "t", "d", (Column("id", 23, -1, True), Column("v", 25)))
    builder = BatchBuilder(tmp_path / "batch")
    chunk = Chunk(rel, builder, 100_000, max_bytes=1 << 20)
    values = [bytes([65 + i]) * 300_000 for i in range(10)]
    waiting = []
    for i, v in enumerate(values):
        chunk.add(enc.encode(Insert(7, (str(i).encode(), v))), 2 * (i + 1), 100)
        waiting.append(len(chunk.payloads))
    chunk.flush()
    assert max(waiting) == 3  # (the fourth's bytes pass 1 MiB: the four are decoded)
    staged = builder.finish()["public.t"]
    got = pq.read_table(staged.files).to_pydict()
    assert got["c0"] == [str(i) for i in range(10)]
    assert [v.encode() for v in got["c1"]] == values
