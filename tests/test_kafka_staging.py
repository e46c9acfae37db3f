"""A Kafka batch staged with runs of records decoded in columns is the batch staged one record
at a time: the same rows in the same order, the same dead letters, offsets and positions.
Real segment files and the real stager; no broker and no Spark (nothing is committed)."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from walberg.apply.batch import BatchBuilder
from walberg.apply.types import TypeMap
from walberg.buffer.kinds import FrameKind, UnknownFrameKind
from walberg.buffer.store import SegmentStore
from walberg.config import parse_config
from walberg.errors import Terminal
from walberg.runtime.applier import Batch
from walberg.runtime.kafka.frames import FRAME_KAFKA, FRAME_KAFKA_PAST, FRAME_KAFKA_RUN
from walberg.runtime.kafka.stager import KafkaReport, KafkaStager
from walberg.runtime.state import RunState
from walberg.source import kafka

BARE, WRAPPED = "shop.public.orders", "shop.public.items"
COLUMNS = {"id": "text", "qty": "integer", "price": "numeric(10,2)", "placed": "timestamptz",
           "note": "text"}
FIELDS = [{"field": "id", "type": "string"}, {"field": "qty", "type": "int32", "optional": True},
          # (a numeric as Debezium sends it with decimal.handling.mode: string)
          {"field": "price", "type": "string", "optional": True},
          {"field": "placed", "type": "string", "name": "io.debezium.time.ZonedTimestamp",
           "optional": True},
          {"field": "note", "type": "string", "optional": True}]


def _schema(fields: list[dict[str, Any]]) -> bytes:
    row = {"type": "struct", "optional": True, "name": "items.Value", "fields": fields}
    return json.dumps({"type": "struct", "name": "items.Envelope", "fields": [
        {**row, "field": "before"}, {**row, "field": "after"},
        {"field": "op", "type": "string"}]}, separators=(",", ":")).encode()


def _row(i: int, **more: Any) -> dict[str, Any]:
    return {"id": f"o-{i}", "qty": i % 7, "price": f"{i % 500}.{i % 100:02d}",
            "placed": f"2024-0{1 + i % 9}-1{i % 10}T0{i % 10}:00:00.{i % 1000:03d}Z",
            "note": random.Random(i).choice(["", "gift", "__debezium_unavailable_value", None]),
            **more}


def _records(rng: random.Random) -> list[tuple[str, Optional[bytes], Optional[bytes]]]:
    """(topic, key, value): both topics interleaved in stretches, the odd records among them."""
    schema = _schema(FIELDS)
    wider = _schema([*FIELDS, {"field": "extra", "type": "int32", "optional": True}])
    out: list[tuple[str, Optional[bytes], Optional[bytes]]] = []
    for stretch in range(12):
        topic = BARE if stretch % 3 else WRAPPED
        for _ in range(rng.randrange(200, 1500)):
            i = rng.randrange(3000)
            op = rng.choice("ccruud")
            before = _row(i) if op in "ud" else None
            after = _row(i, qty=rng.randrange(100)) if op != "d" else None
            if op == "u" and rng.random() < 0.05:
                after = _row(i + 5000)  # a key change
            odd = rng.random()
            payload = json.dumps({"op": op, "before": before, "after": after,
                                  "source": {"lsn": 1000 + len(out), "db": "shop"}}).encode()
            if odd < 0.01:
                payload = payload[:-1]  # not JSON
            elif odd < 0.02:
                payload = json.dumps({"op": "c", "after": _row(i, qty="many")}).encode()
            elif odd < 0.03 and topic == WRAPPED:
                out.append((topic, None, b'{"schema":' + wider + b',"payload":'
                            + json.dumps({"op": "c", "after": _row(i, extra=1)}).encode() + b"}"))
                continue
            elif odd < 0.04:
                out.append((topic, b'{"id": "o-%d"}' % i, None))  # a tombstone
                continue
            value = payload if topic == BARE else \
                b'{"schema":' + schema + b',"payload":' + payload + b"}"
            out.append((topic, json.dumps({"id": f"o-{i}"}).encode(), value))
    return out


def _stager(tmp: Path, state: RunState, given: tuple[str, ...] = (BARE, WRAPPED)
            ) -> tuple[KafkaStager, SegmentStore]:
    """The stager of the two topics (``given``: those whose columns the pipeline file gives;
    the others' come from their records' schemas)."""
    config = parse_config({
        "buffer": {"dir": str(tmp / "segments"), "max_segment_bytes": 300_000,
                   "max_batch_bytes": 1_000_000},
        "sink": {"catalog": {"name": "lake", "type": "hadoop", "warehouse": str(tmp / "lake")},
                 "namespace": "shop",
                 # (a changelog beside one table: its records' positions are kept)
                 "tables": {"public.orders": {"mode": "both"}}},
        "source": {"kafka": {"bootstrap_servers": "localhost:9092", "topics": [BARE, WRAPPED],
                             "tables": {t: {"columns": COLUMNS, "key": ["id"]}
                                        if t in given else {"key": ["id"]}
                                        for t in (BARE, WRAPPED)}}}}, tmp)
    store = SegmentStore(config.segment_dir, config.buffer.max_segment_bytes)
    store.recover()
    stager = KafkaStager(config, store, state, TypeMap(),
                         {BARE: "lake.shop.orders", WRAPPED: "lake.shop.items"},
                         lambda: pytest.fail("staging asked the lake"), KafkaReport())
    return stager, store


def _write(store: SegmentStore, records: list[tuple[str, Optional[bytes], Optional[bytes]]],
           first: int = 0) -> None:
    """The records as the reader writes them (offsets from ``first``), in runs of a poll's
    length and some one at a time (as walberg wrote them before runs), sealed."""
    rng = random.Random(first)
    todo = [kafka.Record(topic, 0, offset, 0, key, value)
            for offset, (topic, key, value) in enumerate(records, first)]
    while todo:
        size = rng.choice([1, rng.randrange(1, 500)])
        run, todo = todo[:size], todo[size:]
        if size == 1:
            store.append(run[0].offset, FRAME_KAFKA, kafka.encode(run[0]))
        else:
            for last, frame in kafka.runs(run):
                store.append(last, FRAME_KAFKA_RUN, frame)
        if store.should_seal():
            store.seal()
    store.seal()


def _stage_all(tmp: Path, records: list[tuple[str, Optional[bytes], Optional[bytes]]],
               given: tuple[str, ...] = (BARE, WRAPPED)) -> list[Batch]:
    stager, store = _stager(tmp, RunState(), given)
    _write(store, records)
    batches: list[Batch] = []
    batch: Optional[Batch] = None
    while (batch := stager.prepare_next(batch)) is not None:
        batches.append(batch)
        batch.committed.set()  # (as the applier does once its commit is over)
    return batches


def _rows(batch: Batch) -> dict[str, pa.Table]:
    return {name: pa.concat_tables([pq.read_table(f) for f in st.files]).sort_by("_wb_seq")
            for name, st in batch.staged.items() if st.files}


def test_a_batch_in_columns_is_the_batch_one_record_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _records(random.Random(7))
    fast = _stage_all(tmp_path / "columns", records)
    monkeypatch.setattr(KafkaStager, "_form", staticmethod(lambda shape, record: (None, b"")))
    slow = _stage_all(tmp_path / "one-by-one", records)
    assert len(fast) == len(slow) > 1
    staged = 0
    for a, b in zip(fast, slow, strict=True):
        assert (a.max_seq, a.changes, a.offsets, a.records, a.cut) == \
            (b.max_seq, b.changes, b.offsets, b.records, b.cut)
        assert {t for _, t, _, _ in a.records} <= {BARE}
        assert [(r.offset, why) for r, why in a.dead] == [(r.offset, why) for r, why in b.dead]
        rows_a, rows_b = _rows(a), _rows(b)
        assert rows_a.keys() == rows_b.keys()
        for name in rows_a:
            assert rows_a[name].equals(rows_b[name]), name
            staged += rows_a[name].num_rows
        for st in (*a.staged.values(), *b.staged.values()):
            assert st.dead_letters is None  # (the odd values are refused before staging here)
    assert staged > 5000
    # (the items' numeric comes as a string in their schema: read as the column's numeric)
    items = pa.concat_tables(_rows(b)["public.items"] for b in fast
                             if "public.items" in b.staged)
    prices = items.column("c2").drop_null()
    assert pa.types.is_decimal(prices.type) and len(prices) > 1000
    assert sum(len(b.dead) for b in fast) > 50
    assert sum(len(b.records) for b in fast) > 1000  # (the orders' positions: mode both)


def test_a_batch_is_netted_per_key_where_no_changelog_keeps_every_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table in upsert mode gets each key's last change of the batch only (its new rows are
    then written on the driver, not by Spark); a table with a changelog (mode both) keeps every
    change."""
    # (without Debezium's placeholder for a value it left out, which keeps a batch unnetted:
    # the value is then taken from the lake's row)
    records = [(topic, key, None if value is None else
                value.replace(b"__debezium_unavailable_value", b"gift"))
               for topic, key, value in _records(random.Random(11))]
    netted = _stage_all(tmp_path / "netted", records)
    original = BatchBuilder.finish
    monkeypatch.setattr(BatchBuilder, "finish",
                        lambda self, extent=None, net=frozenset(): original(self, extent))
    whole = _stage_all(tmp_path / "whole", records)
    assert len(netted) == len(whole) > 1
    repeated = 0
    for a, b in zip(netted, whole, strict=True):
        rows_a, rows_b = _rows(a), _rows(b)
        assert rows_a.keys() == rows_b.keys()
        if "public.orders" in rows_b:  # (mode both)
            assert rows_a["public.orders"].equals(rows_b["public.orders"])
        if "public.items" not in rows_b:
            continue
        assert a.staged["public.items"].unique_keys
        last: dict[Any, dict[str, Any]] = {}
        for row in rows_b["public.items"].to_pylist():  # (in _wb_seq order)
            last[row["c0"]] = row
        repeated += rows_b["public.items"].num_rows - len(last)
        assert rows_a["public.items"].to_pylist() == sorted(last.values(),
                                                            key=lambda r: r["_wb_seq"])
    assert repeated > 100  # (keys do repeat within a batch: the netting was exercised)


def test_interleaved_topics_are_decoded_a_topic_at_a_time_each_record_once_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of two topics alternating one by one (as an application's transactions
    interleave its tables) are decoded in columns a topic at a time, a run per topic and
    segment, not a run per record; every record is staged once, in its partition's order, and
    each batch's offsets go on from where the batch before stopped."""
    schema = _schema(FIELDS)
    records: list[tuple[str, Optional[bytes], Optional[bytes]]] = []
    for i in range(3000):
        topic = BARE if i % 2 else WRAPPED
        payload = json.dumps({"op": "c", "after": _row(i), "source": {"lsn": 1000 + i}}).encode()
        records.append((topic, json.dumps({"id": f"o-{i}"}).encode(),
                        payload if topic == BARE else
                        b'{"schema":' + schema + b',"payload":' + payload + b"}"))
    runs: list[int] = []
    stage = KafkaStager._stage_decoded

    def counted(self: KafkaStager, into: Any, topic: str, shape: Any, run: list[Any],
                *rest: Any) -> None:
        runs.append(len(run))
        stage(self, into, topic, shape, run, *rest)

    monkeypatch.setattr(KafkaStager, "_stage_decoded", counted)
    batches = _stage_all(tmp_path, records)
    assert len(batches) > 1
    segments = sum(len(b.segments) for b in batches)
    assert 0.9 * len(records) < sum(runs) <= len(records)  # (a few go one at a time)
    assert len(runs) <= 2 * segments, (len(runs), segments)
    orders = [offset for b in batches for _, _, _, offset in sorted(b.records)]
    assert orders == [o for o, (t, _, _) in enumerate(records) if t == BARE]  # once, in order
    items = [row["c0"] for b in batches if "public.items" in _rows(b)
             for row in _rows(b)["public.items"].to_pylist()]
    assert sorted(items) == sorted(f"o-{o}" for o, (t, _, _) in enumerate(records) if t == WRAPPED)
    before: dict[Any, int] = {}
    for b in batches:
        for tp, upto in b.offsets.items():
            assert upto >= before.get(tp, 0)
            before[tp] = upto
    assert before == {(BARE, 0): len(records), (WRAPPED, 0): len(records) - 1}


def test_a_runs_first_batch_grows_while_the_reader_catches_up(tmp_path: Path) -> None:
    """While the reader is still reading what the topics held when it began
    (``catching_up``), the run's first batch takes the segments it seals, up to
    ``buffer.max_batch_bytes``: a backlog that fits one batch is one commit."""
    state = RunState()
    stager, store = _stager(tmp_path, state)
    records = [r for r in _records(random.Random(3)) if r[0] == BARE]
    _write(store, records[:500])
    state.catching_up.set()
    got: list[Optional[Batch]] = []
    staging = threading.Thread(target=lambda: got.append(stager.prepare_next(None)))
    staging.start()
    staging.join(1.0)
    assert staging.is_alive()  # (staged the first segment; waits for more)
    _write(store, records[500:2500], 500)
    state.catching_up.clear()  # (the reader has sealed its last segment)
    staging.join(30)
    (batch,) = got
    assert batch is not None and len(batch.segments) == len(store.sealed()) >= 2
    assert batch.offsets == {(BARE, 0): 2500}


def test_a_first_batch_with_no_room_for_the_next_segment_goes_without_the_catch_up(
        tmp_path: Path) -> None:
    """The reader pauses while four batches' worth of segments wait, and a paused reader never
    finishes catching up: a first batch that waited for the catch-up once it had no room for
    the next sealed segment waited for ever (a 10M-record topic in the benchmark). A batch
    with no room for the next sealed segment is full: it goes, and the catch-up goes on."""
    state = RunState()
    stager, store = _stager(tmp_path, state)
    records = [r for r in _records(random.Random(3)) if r[0] == BARE]
    _write(store, records)  # past max_batch_bytes (1 MB), in segments of ~300 KB
    sizes = [info.size_bytes for info in store.sealed()]
    fit = next(n for n in range(len(sizes)) if sum(sizes[:n + 1]) > 1_000_000)
    assert 0 < fit < len(sizes)
    state.catching_up.set()  # (and it stays set: the reader is paused)
    got: list[Optional[Batch]] = []
    staging = threading.Thread(target=lambda: got.append(stager.prepare_next(None)),
                               daemon=True)
    staging.start()
    staging.join(30)
    if staging.is_alive():
        state.stop.set()  # (lets the thread go)
        pytest.fail("the first batch waited for a catch-up that a paused reader never ends")
    (batch,) = got
    assert batch is not None and len(batch.segments) == fit
    assert batch.segments == store.sealed()[:fit]


def test_offsets_found_to_hold_no_record_move_the_batchs_offsets_past_them(
        tmp_path: Path) -> None:
    """A transaction's commit marker takes an offset and is never a record: where the reader
    found a partition's end past its last record, the batch's offsets (what its commits
    record) go there, so a later gap at the marker is not taken for records lost."""
    stager, store = _stager(tmp_path, RunState())
    records = [r for r in _records(random.Random(5)) if r[0] == BARE][:3]
    for last, frame in kafka.runs([kafka.Record(t, 0, o, 0, k, v)
                                   for o, (t, k, v) in enumerate(records)]):
        store.append(last, FRAME_KAFKA_RUN, frame)
    store.append(4, FRAME_KAFKA_PAST, kafka.encode_past({(BARE, 0): 4, (WRAPPED, 1): 7}))
    store.seal()
    batch = stager.prepare_next(None)
    assert batch is not None and batch.offsets == {(BARE, 0): 4, (WRAPPED, 1): 7}


def test_a_segment_with_a_frame_of_an_unknown_kind_is_refused_with_the_way_out(
        tmp_path: Path) -> None:
    """A newer walberg may write frames of a kind this one does not know (as kind 3, runs of
    records, was new once, and the walberg before it skipped them: their records never
    reached the lake, without a word). Such a segment is refused, when read and at start,
    naming the file, the kind and what to do; and so is a kind of another pipeline's."""
    stager, store = _stager(tmp_path, RunState())
    _write(store, [r for r in _records(random.Random(5)) if r[0] == BARE][:3])
    store.append(9, 200, b"a frame of a walberg to come")
    store.seal()
    newer = store.sealed()[-1].path
    with pytest.raises(UnknownFrameKind) as read:
        while (batch := stager.prepare_next(None)) is not None:
            store.remove(batch.segments)
    store.close()
    with pytest.raises(UnknownFrameKind) as start, SegmentStore(newer.parent, 300_000) as again:
        again.recover()
    for refused in (read.value, start.value):
        said = str(refused)
        assert str(newer) in said and "kind 200" in said, said
        assert "Run the walberg version that wrote it" in said
        assert "delete this file and every segment file" in said
    newer.unlink()

    # A pgoutput frame (a Postgres pipeline's) in a Kafka pipeline's buffer.dir
    stager, store = _stager(tmp_path, RunState())
    store.append(1, int(FrameKind.PGOUTPUT), b"B...")
    store.seal()
    with pytest.raises(Terminal, match="kind 0 .PGOUTPUT., which a Kafka pipeline never"):
        stager.prepare_next(None)
