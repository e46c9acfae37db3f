"""Insert/Update/Delete messages of a Postgres batch, decoded in columnar chunks per relation
and staged as rows (the scalar decoder only handles the control messages around them)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from walberg.apply.batch import BatchBuilder
from walberg.errors import DecodeError
from walberg.faults import crash_point
from walberg.model import Lsn, Op, Relation
from walberg.source.columnar import Changes, Malformed, TupleColumns, decode_changes
from walberg.source.pgoutput import Decoder, Tag


class Chunk:
    """Change messages of one relation waiting to be decoded together."""

    def __init__(self, relation: Relation, builder: BatchBuilder, size: int,
                 max_bytes: int = 64 << 20) -> None:
        """``size`` changes, or ``max_bytes`` of them, at most: a column's values of a chunk
        stay far below Arrow's 2 GiB for one string array (a chunk of 100,000 changes of
        large values reached it), and the decoding's index arrays (8 bytes for each byte of
        values) small."""
        self.relation = relation
        self.name = relation.qualified_name
        self.builder = builder
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self.payloads: list[bytes] = []
        self.seqs: list[int] = []
        self.lsns: list[int] = []

    def add(self, payload: bytes, seq: int, lsn: int) -> None:
        self.payloads.append(payload)
        self.seqs.append(seq)
        self.lsns.append(lsn)
        self.bytes += len(payload)
        if len(self.payloads) >= self.size or self.bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.payloads:
            return
        rel = self.relation
        try:
            decoded = decode_changes(self.payloads, len(rel.columns))
        except Malformed:
            # The scalar decoder names the exact message, LSN and byte.
            scalar = Decoder()
            scalar.relations[rel.oid] = rel
            for payload, lsn in zip(self.payloads, self.lsns, strict=True):
                scalar.decode(payload, lsn)
            raise DecodeError(f"could not decode changes of {rel.qualified_name} near LSN "
                              f"{Lsn(self.lsns[0])}: the messages are malformed") from None
        crash_point("decode")
        stage_changes(self.builder, rel, decoded, np.asarray(self.seqs, dtype=np.int64),
                      np.asarray(self.lsns, dtype=np.int64))
        self.payloads, self.seqs, self.lsns, self.bytes = [], [], [], 0


class Chunks:
    """One ``Chunk`` per relation oid, re-made when a relation's description changes."""

    SIZE = 100_000

    def __init__(self, builder: BatchBuilder) -> None:
        self.builder = builder
        self._by_oid: dict[int, Chunk] = {}

    def for_relation(self, rel: Relation) -> Chunk:
        chunk = self._by_oid.get(rel.oid)
        if chunk is None or chunk.relation != rel:
            if chunk is not None:
                chunk.flush()  # decoded with the columns they were sent with
            chunk = self._by_oid[rel.oid] = Chunk(rel, self.builder, self.SIZE)
        return chunk

    def relation_changed(self, rel: Relation) -> None:
        chunk = self._by_oid.get(rel.oid)
        if chunk is not None and chunk.relation != rel:
            chunk.flush()
            del self._by_oid[rel.oid]

    def holds(self, oid: int) -> bool:
        """Whether changes of the relation wait in its chunk."""
        chunk = self._by_oid.get(oid)
        return chunk is not None and bool(chunk.payloads)

    def flush_all(self) -> None:
        for chunk in self._by_oid.values():
            chunk.flush()


def stage_changes(builder: BatchBuilder, rel: Relation, changes: Changes,
                  seq: npt.NDArray[np.int64], lsn: npt.NDArray[np.int64]) -> None:
    """Turn decoded changes into staged rows: inserts and updates from their new tuple,
    deletes from their old one, and an update that changed the key into a delete of the old key
    (one sequence number earlier) plus an insert of the new row."""
    tag = changes.tag
    is_delete = tag == Tag.DELETE
    key_changed = np.zeros(len(tag), dtype=np.bool_)
    if changes.old is not None:
        is_update_with_old = (tag == Tag.UPDATE) & changes.has_old
        if is_update_with_old.any():
            same = np.ones(len(tag), dtype=np.bool_)
            for i, col in enumerate(rel.columns):
                if col.is_key:
                    old_v, new_v = changes.old.values[i], changes.new.values[i]
                    eq = pc.fill_null(pc.equal(old_v, new_v), False)
                    both_null = pc.and_(pc.is_null(old_v), pc.is_null(new_v))
                    same &= pc.or_(eq, both_null).to_numpy(zero_copy_only=False)
            key_changed = is_update_with_old & ~same
    source, columns = rel.qualified_name, rel.columns
    new = changes.new if changes.old is None else _unchanged_from_old(changes)
    new_rows = np.flatnonzero(~is_delete)
    if len(new_rows):
        ops = np.where((tag[new_rows] == Tag.INSERT) | key_changed[new_rows],
                       Op.INSERT.value, Op.UPDATE.value)
        take = pa.array(new_rows)
        builder.add_columns(
            source, columns, ops, seq[new_rows], lsn[new_rows],
            [v.take(take) for v in new.values],
            [None if u is None else u[new_rows] for u in new.unchanged])
    old_rows = np.flatnonzero(is_delete | key_changed)
    if len(old_rows):
        assert changes.old is not None
        take = pa.array(old_rows)
        builder.add_columns(
            source, columns, np.full(len(old_rows), Op.DELETE.value),
            np.where(key_changed[old_rows], seq[old_rows] - 1, seq[old_rows]), lsn[old_rows],
            [v.take(take) for v in changes.old.values], [None] * len(columns))


def _unchanged_from_old(changes: Changes) -> TupleColumns:
    """The new tuples, with each value they mark unchanged taken from an old tuple that is the
    whole row: under REPLICA IDENTITY FULL the old row is sent with its TOASTed values inline,
    so the change carries the value (as PostgreSQL's own subscriber takes it) instead of
    leaving it to be found in the lake, where a table without a key never looks."""
    new, old = changes.new, changes.old
    assert old is not None
    full = changes.old_full & (changes.tag == Tag.UPDATE)
    values, unchanged = list(new.values), list(new.unchanged)
    for i, u in enumerate(new.unchanged):
        if u is None:
            continue
        take = u & full
        old_unchanged = old.unchanged[i]
        if old_unchanged is not None:
            take &= ~old_unchanged
        if not bool(take.any()):
            continue
        values[i] = pc.if_else(pa.array(take), old.values[i], new.values[i])
        left = u & ~take
        unchanged[i] = left if bool(left.any()) else None
    return TupleColumns(values, unchanged)
