"""The progress marks of a Kafka pipeline's commits: each commit of a table records the next
offset of every partition of the table's topic that its batch read
(``walberg.offset.<topic>.<partition>``); in mode both, what the changelog beside a table holds
tells a replay which of the batch's records it has already."""

from __future__ import annotations

from typing import Mapping, Optional

from walberg.apply.iceberg import OFFSET_PROPERTY, IcebergSink
from walberg.model import Lsn
from walberg.runtime.applier import Batch, Partition
from walberg.runtime.state import RunState

# A log line names this many partitions at most, then how many more: at hundreds of topics
# every start, batch and stop line was kilobytes long (`walberg status` lists them all).
SHOWN = 8


def offsets_text(offsets: Mapping[Partition, int]) -> str:
    """``topic[partition]@offset, ...``: the first ``SHOWN`` partitions, then how many more."""
    items = [f"{t}[{p}]@{'earliest' if o < 0 else o}" for (t, p), o in sorted(offsets.items())]
    more = f" and {len(items) - SHOWN} more partition(s)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more if items else "-"


class OffsetMarks:
    """A Kafka commit records the next offset of each partition of the table's topic."""

    def __init__(self, state: RunState, topics: dict[str, str]) -> None:
        self.state = state
        self.topics = topics  # table name -> topic
        # The changelog beside a table in mode both: the next offset of each partition it
        # holds (it commits before its table, so it may hold more than the table).
        self.changelog: dict[str, dict[Partition, int]] = {}

    def _of(self, table: str, batch: Batch) -> dict[Partition, int]:
        topic = self.topics.get(table)
        return {tp: o for tp, o in batch.offsets.items() if topic is None or tp[0] == topic}

    def marks(self, table: str, batch: Batch) -> Optional[dict[str, str]]:
        return {f"{OFFSET_PROPERTY}.{t}.{p}": str(o) for (t, p), o in self._of(table, batch).items()}

    def landed(self, sink: IcebergSink, table: str, target: str, batch: Batch) -> bool:
        held = sink.committed_offsets(target)
        return all(held.get(tp, -1) >= o for tp, o in self._of(table, batch).items())

    def upto(self, table: str, batch: Batch) -> str:
        return f"offsets {offsets_text(self._of(table, batch) if table else batch.offsets)}"

    def held(self, table: str) -> str:
        topic = self.topics.get(table)
        held = {tp: o for tp, o in self.state.lake_offsets().items() if tp[0] == topic}
        return f"offsets {offsets_text(held)}"

    def record(self, table: str, batch: Batch) -> None:
        self.state.advance_offsets(self._of(table, batch), lake=True)

    def in_changelog(self, table: str, batch: Batch) -> tuple[Optional[Lsn], list[tuple[int, int]]]:
        """The seq ranges of the batch's records below the offsets the changelog holds: a
        replay after its commit landed and the table's did not (they are a run of records at
        the batch's start, so mostly one range)."""
        held = self.changelog.get(table)
        if not held:
            return None, []
        topic = self.topics.get(table)
        skip: list[tuple[int, int]] = []
        before = False  # whether the record before (of this topic) is skipped too
        for seq, t, p, o in batch.records:
            if t != topic:
                continue
            if o >= held.get((t, p), 0):
                before = False
            elif before:
                skip[-1] = (skip[-1][0], seq)
            else:
                skip.append((seq - 1, seq))  # a record's changes take seq - 1 and seq
                before = True
        return None, skip

    def changelog_holds(self, table: str, batch: Batch) -> None:
        held = self.changelog.setdefault(table, {})
        for tp, o in self._of(table, batch).items():
            held[tp] = max(held.get(tp, 0), o)

    def read_changelog(self, sink: IcebergSink, table: str, changelog: str) -> None:
        topic = self.topics.get(table)
        self.changelog[table] = {tp: o for tp, o in sink.committed_offsets(changelog).items()
                                 if tp[0] == topic}
