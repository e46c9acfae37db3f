"""Reading what a table's snapshots say: the progress marks walberg's commits carry (the LSN of
each source, Kafka offsets, the marks of a chunked initial copy), the table's history, what its
last commit added, and its files. Reads only; nothing here commits."""

from __future__ import annotations

import json
from typing import Any, Optional

from walberg.apply.jvm.calls import spark_call
from walberg.apply.session import (
    COPY_PREFIX,
    LSN_PROPERTY,
    OFFSET_PROPERTY,
    SERVER_PROPERTY,
    LakeSession,
    find_java_table,
    java_table,
    quote_target,
)
from walberg.model import Lsn


class Snapshots:
    """The snapshot history of the tables one sink writes, read for this sink's source."""

    def __init__(self, lake: LakeSession) -> None:
        self.lake = lake

    def committed_lsn(self, target: str) -> Optional[Lsn]:
        """The LSN covered by walberg's commits in the table's current history (the highest:
        a maintenance commit may carry an older one), or None when walberg has never committed
        to it (the initial copy is still owed). Read from the snapshots' summaries through
        Iceberg's API: table metadata only, no Spark job (this is asked at every start)."""
        return self.committed_marks(target)[0]

    def committed_server(self, target: str) -> Optional[str]:
        """The source server (``<system identifier>/<timeline>``) of walberg's newest commit to
        the table that names one, or None."""
        return self.committed_marks(target)[1]

    def committed_marks(self, target: str) -> tuple[Optional[Lsn], Optional[str]]:
        """``committed_lsn`` and ``committed_server`` from one read of the table's history
        (a start asks both of every table)."""
        from walberg.apply.jvm.helper import batch_helper

        def read() -> tuple[Optional[Lsn], Optional[str]]:
            table = find_java_table(self.lake.spark, target)
            if table is None:
                return None, None
            lsns, server = json.loads(batch_helper(self.lake.spark).marks(
                table, self.lake.lsn_property, self.lake.server_property))
            return highest_marks(lsns, server)

        return spark_call(f"reading the snapshot history of {target}", read)

    def iceberg_table(self, target: str) -> Any:
        """``target`` as an Iceberg Java table, refreshed (metadata on the driver only)."""
        return java_table(self.lake.spark, target)

    def current_ancestry(self, target: str) -> list[dict[str, str]]:
        """The summary of the table's current snapshot and of each of its ancestors still held,
        newest first (what the ``history`` metadata table calls the current ancestors), read
        from the table's metadata on the driver in one call: no Spark job."""
        from walberg.apply.jvm.helper import batch_helper

        table = self.iceberg_table(target)
        return [{str(k): str(v) for k, v in summary.items()}
                for summary in json.loads(batch_helper(self.lake.spark).ancestry(table))]

    def lineage(self, target: str) -> list[tuple[int, Optional[str]]]:
        """The table's current snapshot and its ancestors still held, oldest first: (snapshot
        id, this source's LSN mark or None), read afresh from the table's metadata in one
        call."""
        return [(snapshot, mark) for snapshot, mark, _ in self.spans(target)]

    def spans(self, target: str) -> list[tuple[int, Optional[str], Optional[str]]]:
        """``lineage`` with each snapshot's ``walberg.from-lsn`` (or None): what each streamed
        commit says of the positions its parent holds the table at (see FROM_PROPERTY)."""
        from walberg.apply.jvm.helper import batch_helper

        def read() -> list[tuple[int, Optional[str], Optional[str]]]:
            table = self.iceberg_table(target)
            found = json.loads(batch_helper(self.lake.spark).lineage(
                table, self.lake.lsn_property, self.lake.from_property))
            return [(int(i), None if v is None else str(v), None if f is None else str(f))
                    for i, v, f in found]

        return spark_call(f"reading the snapshot history of {target}", read)

    def lsn_marks(self, target: str) -> dict[str, str]:
        """Every source's LSN and Kafka offset in the table's current history (the highest of
        each) and the source server its LSN belongs to (the newest), so a maintenance commit
        can carry them all: expiring old snapshots then loses none (without the server, a
        failover's check of the lake against the new primary was skipped)."""
        best: dict[str, int] = {}
        servers: dict[str, str] = {}
        for summary in spark_call(f"reading the snapshot history of {target}",
                                  lambda: self.current_ancestry(target)):
            for key, text in summary.items():
                if key.startswith(OFFSET_PROPERTY + "."):
                    value = int(text)
                elif key == LSN_PROPERTY or key.startswith(LSN_PROPERTY + "."):
                    value = Lsn.parse(text)
                elif key == SERVER_PROPERTY or key.startswith(SERVER_PROPERTY + "."):
                    servers.setdefault(key, text)  # the newest (newest first)
                    continue
                else:
                    continue
                best[key] = max(best.get(key, value), value)
        return {**servers, **{k: (str(Lsn(v)) if k.startswith(LSN_PROPERTY) else str(v))
                              for k, v in best.items()}}

    def committed_offsets(self, target: str) -> dict[tuple[str, int], int]:
        """The next Kafka offset of each (topic, partition) the table's current history
        covers (empty for a table walberg has not committed Kafka records to)."""
        if not self.lake.table_exists(target):
            return {}
        out: dict[tuple[str, int], int] = {}
        prefix = OFFSET_PROPERTY + "."
        for key, value in self.lsn_marks(target).items():
            if key.startswith(prefix):
                topic, _, partition = key[len(prefix):].rpartition(".")
                out[(topic, int(partition))] = int(value)
        return out

    def copy_marks(self, target: str) -> list[dict[str, str]]:
        """The walberg.copy.* marks of the table's current history since the start of its last
        chunked copy, oldest first (empty when no chunked copy was started); in a table
        several sources fan in to, this sink's source's only (``walberg.copy.source``)."""
        if not self.lake.table_exists(target):
            return []
        t = quote_target(target)
        rows = self.lake.sql(
            f"reading the snapshot history of {target}",
            f"SELECT s.summary AS summary FROM {t}.snapshots s "
            f"JOIN {t}.history h ON s.snapshot_id = h.snapshot_id "
            f"WHERE h.is_current_ancestor ORDER BY s.committed_at, s.snapshot_id").collect()
        marks: list[dict[str, str]] = []
        for r in rows:
            summary = {k: v for k, v in (r["summary"] or {}).items() if k.startswith(COPY_PREFIX)}
            if summary.get(COPY_PREFIX + "source") != self.lake.source:
                continue  # another source's copy into a table they share (or none)
            summary.pop(COPY_PREFIX + "source", None)
            if summary.get(COPY_PREFIX + "first"):
                marks = []
            if summary:
                marks.append(summary)
        return marks

    def last_commit(self, target: str) -> dict[str, int]:
        """What the table's current snapshot added: bytes, data files and delete files (from
        its summary; Iceberg metadata only)."""
        from walberg.apply.jvm.helper import batch_helper

        kept = self.lake.last_summaries.pop(target, None)

        def read() -> dict[str, int]:
            # (one round trip: py4j iterates a Java map in three an entry)
            summary = kept if kept is not None else json.loads(
                batch_helper(self.lake.spark).summary(self.iceberg_table(target)))
            return {"bytes": int(summary.get("added-files-size", 0)),
                    "data_files": int(summary.get("added-data-files", 0)),
                    "delete_files": int(summary.get("added-delete-files", 0))
                    + int(summary.get("added-dvs", 0)),
                    "records": int(summary.get("added-records", 0))}

        return spark_call(f"reading the last commit of {target}", read)

    def last_commit_records(self, target: str) -> int:
        """Records the table's latest commit added."""
        return self.last_commit(target).get("records", 0)

    def history(self, target: str) -> list[dict[str, Any]]:
        """Every snapshot the table made current, oldest first, with this source's LSN and the
        records it added and deleted."""
        t = quote_target(target)
        rows = self.lake.sql(
            f"reading the history of {target}",
            f"SELECT h.made_current_at, s.snapshot_id, s.operation, h.is_current_ancestor, "
            f"s.summary['{self.lake.lsn_property}'] AS lsn, s.summary['added-records'] AS added, "
            f"s.summary['deleted-records'] AS deleted, "
            f"s.summary['added-position-deletes'] AS pos_deletes "
            f"FROM {t}.history h JOIN {t}.snapshots s ON s.snapshot_id = h.snapshot_id "
            f"ORDER BY h.made_current_at",
        ).collect()
        return [r.asDict() for r in rows]

    def files(self, target: str) -> dict[str, int]:
        """Data and delete files of the current snapshot, their bytes, and the snapshot count:
        from the table's metadata on the driver (the running totals each snapshot's summary
        keeps), or the files metadata table when a writer left them out."""
        table = spark_call(f"reading the metadata of {target}",
                           lambda: self.iceberg_table(target))
        snaps = sum(1 for _ in table.snapshots())
        current = table.currentSnapshot()
        if current is None:
            return {"data_files": 0, "delete_files": 0, "bytes": 0, "snapshots": snaps}
        summary = current.summary()
        totals = [summary.get(k) for k in ("total-data-files", "total-delete-files",
                                            "total-files-size")]
        if all(v is not None for v in totals):
            data, deletes, size = (int(v) for v in totals)
            return {"data_files": data, "delete_files": deletes, "bytes": size,
                    "snapshots": snaps}
        t = quote_target(target)
        rows = self.lake.sql(
            f"listing the files of {target}",
            f"SELECT content, count(*) AS n, coalesce(sum(file_size_in_bytes), 0) AS b "
            f"FROM {t}.files GROUP BY content").collect()
        by = {r["content"]: (int(r["n"]), int(r["b"])) for r in rows}
        snaps = self.lake.sql(f"counting snapshots of {target}",
                              f"SELECT count(*) AS n FROM {t}.snapshots").collect()[0]["n"]
        return {"data_files": by.get(0, (0, 0))[0],
                "delete_files": by.get(1, (0, 0))[0] + by.get(2, (0, 0))[0],
                "bytes": sum(b for _, b in by.values()), "snapshots": int(snaps)}

    def count(self, target: str) -> int:
        """The table's rows (a Spark job over the current snapshot)."""
        return int(self.lake.sql(f"counting {target}",
                                 f"SELECT count(*) AS n FROM {quote_target(target)}")
                   .collect()[0]["n"])


def highest_marks(lsns: list[str], server: Optional[str]) -> tuple[Optional[Lsn], Optional[str]]:
    """``committed_marks`` from what ``Batch.marks`` says: the highest LSN mark of the history
    (a maintenance commit may carry an older one than the commit before it), and the server."""
    return max((Lsn.parse(x) for x in lsns), default=None), server
