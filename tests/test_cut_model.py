"""`query --consistent`'s rule (``lake.query.cut_of``) against a model of how walberg commits:
source transactions over three tables, batches committed table by table in any order, kills
between a batch's tables and the replay that follows, idle stretches in which the slot moves
on, and maintenance commits. Read at any moment, the cut must hold every table exactly as the
source held it at the cut's position, and never be older than the cut read before it.
The randomized test in test_consistent_reads.py does this against a real pipeline; this one
reaches the interleavings (a kill between tables, a table left alone while the slot moves on)
that a real run meets only by chance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from walberg.lake.query import cut_of
from walberg.model import Lsn

TABLES = ("a", "b", "c")


@dataclass(frozen=True)
class Txn:
    commit: int  # the commit record's LSN (pgoutput's commit_lsn)
    end: int  # the end of the commit record: what a commit holding it is marked with
    tables: frozenset[str]


@dataclass
class Lake:
    """What the catalog holds: each table's snapshots (id, walberg.lsn, walberg.from-lsn, the
    transactions it holds), and the slot's confirmed position."""

    snapshots: dict[str, list[tuple[int, str, Optional[str], frozenset[Txn]]]] = field(
        default_factory=lambda: {t: [(i + 1, str(Lsn(50)), None, frozenset())]
                                 for i, t in enumerate(TABLES)})
    confirmed: int = 50
    ids: int = 10

    def commit(self, table: str, mark: int, since: Optional[int], txns: frozenset[Txn]) -> None:
        self.ids += 1
        held = self.snapshots[table][-1][3]
        self.snapshots[table].append((self.ids, str(Lsn(mark)),
                                      None if since is None else str(Lsn(since)), held | txns))

    def mark(self, table: str) -> int:
        return max(int(Lsn.parse(m)) for _, m, _, _ in self.snapshots[table])

    def histories(self) -> dict[str, list[tuple[int, Optional[str], Optional[str]]]]:
        return {t: [(i, m, f) for i, m, f, _ in snaps] for t, snaps in self.snapshots.items()}


def _checked(lake: Lake, confirmed: int, written: list[Txn], before: Optional[Lsn]) -> Lsn:
    """The cut read now, with the slot as read a moment before (``confirmed``), checked."""
    cut = cut_of(lake.histories(), Lsn(confirmed))
    if before is not None:
        assert cut.lsn >= before, (before, cut)
    for table, snaps in lake.snapshots.items():
        holds = next(txns for i, _, _, txns in snaps if i == cut.snapshots[table])
        truth = frozenset(t for t in written if table in t.tables and t.end <= cut.lsn)
        assert holds == truth, (table, cut, sorted(t.end for t in holds),
                                sorted(t.end for t in truth))
    return cut.lsn


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_cut_holds_every_table_as_the_source_was_and_never_goes_back(data: st.DataObject
                                                                         ) -> None:
    lake = Lake()
    written: list[Txn] = []
    pending: list[Txn] = []  # written, not yet in a batch that fully landed
    wal = 100  # the source's WAL end
    last: Optional[Lsn] = None
    slot_read = lake.confirmed  # where the last cut found the slot: each reads it anew

    def read() -> None:
        # The slot as read a moment ago (the cut reads it before the tables), never before
        # what the cut before it read.
        nonlocal last, slot_read
        slot_read = data.draw(st.sampled_from([slot_read, lake.confirmed]))
        last = _checked(lake, slot_read, written, last)
    for _ in range(data.draw(st.integers(5, 30))):
        step = data.draw(st.sampled_from(["write", "write", "batch", "idle", "maintain"]))
        if step == "write":
            tables = data.draw(st.frozensets(st.sampled_from(TABLES), min_size=1))
            commit = wal + data.draw(st.integers(1, 20))
            txn = Txn(commit, commit + 8, tables)
            wal = txn.end
            written.append(txn)
            pending.append(txn)
        elif step == "batch" and pending:
            batch = pending[:data.draw(st.integers(1, len(pending)))]
            end = batch[-1].end
            order = data.draw(st.permutations(TABLES))
            killed_after = data.draw(st.one_of(st.none(), st.integers(0, len(TABLES) - 1)))
            for n, table in enumerate(order):
                if killed_after is not None and n >= killed_after:
                    break  # a kill: the rest of the batch is applied again by the next run
                mine = [t for t in batch if table in t.tables]
                if mine and lake.mark(table) < end:
                    # (a replay holds the batch's transactions from its floor: some the table
                    # may hold already, and its first commit LSN counts them all)
                    lake.commit(table, end, min(t.commit for t in mine), frozenset(mine))
                read()
            else:
                lake.confirmed = end
                del pending[:len(batch)]
        elif step == "idle" and not pending:
            lake.confirmed = wal  # a keepalive with nothing to apply: the slot moves on
        elif step == "maintain":
            table = data.draw(st.sampled_from(TABLES))
            lake.commit(table, lake.mark(table), None, frozenset())
        read()
