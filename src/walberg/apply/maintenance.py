"""Keeping a table cheap to read: compacting data files (applying position deletes), dropping
dangling deletes, rewriting manifests, expiring old snapshots and removing orphan files, through
Iceberg's Spark actions (expiry of a history up to DRIVER_EXPIRY_SNAPSHOTS long on the driver).
Every commit that replaces files carries the table's progress marks."""

from __future__ import annotations

import time
from typing import Any

from walberg.apply.jvm.calls import spark_call
from walberg.apply.session import LakeSession, quote_target
from walberg.apply.snapshots import Snapshots

# Up to this many snapshots, expiry runs on the driver (Iceberg's core ExpireSnapshots), above
# it as a Spark action.
DRIVER_EXPIRY_SNAPSHOTS = 1000


class Maintenance:
    """Iceberg's maintenance actions on the tables one sink writes."""

    def __init__(self, lake: LakeSession, snapshots: Snapshots) -> None:
        self.lake = lake
        self.snapshots = snapshots

    def maintain(self, target: str, target_file_size: int, expire_older_than_ms: int,
                 retain_last: int, orphans_older_than_ms: int) -> dict[str, Any]:
        """Compact data files (applying position deletes), drop dangling deletes, rewrite
        manifests, expire old snapshots and remove orphan files. Commits that replace files
        carry the table's walberg.lsn, so what the lake holds stays known after expiry."""
        before = self.snapshots.files(target)
        marks = self.snapshots.lsn_marks(target)
        jvm = self.lake.spark._jvm
        jspark = self.lake.spark._jsparkSession
        # The actions look up helper catalogs through the JVM thread's active session, which a
        # py4j thread other than the one that built the session does not have.
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(jspark)
        actions = jvm.org.apache.iceberg.spark.actions.SparkActions.get(jspark)

        def table() -> Any:  # reloaded for each action: each one commits a new version
            return jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(jspark, quote_target(target))

        def marked(action: Any) -> Any:
            for key, value in marks.items():
                action = action.snapshotProperty(key, value)
            return action

        options = {"target-file-size-bytes": str(target_file_size), "min-input-files": "2",
                   "delete-file-threshold": "1", "remove-dangling-deletes": "true",
                   "partial-progress.enabled": "false"}
        took: dict[str, float] = {}

        def step(name: str, what: str, fn: Any) -> Any:
            started = time.monotonic()
            try:
                return spark_call(f"{what} {target}", fn)
            finally:
                took[name] = round(time.monotonic() - started, 2)

        rewrite = marked(actions.rewriteDataFiles(table()))
        for key, value in options.items():
            rewrite = rewrite.option(key, value)
        result = step("compact", "compacting", rewrite.execute)
        # Each step below is skipped when the table's metadata (read on the driver) shows it
        # has nothing to do: each is a Spark job or more, and a table's commits wait for its
        # maintenance.
        now = table()
        now.refresh()
        if _total(now, "total-delete-files"):
            # Position deletes whose data files were just rewritten are void now: drop them.
            step("deletes", "dropping applied delete files of",
                 marked(actions.rewritePositionDeletes(now).option("rewrite-all", "true"))
                 .execute)
        if _manifests(now) > 1:
            step("manifests", "rewriting the manifests of",
                 marked(actions.rewriteManifests(table())).execute)
        expired_count = 0
        kept = sum(1 for _ in now.snapshots())
        if kept > DRIVER_EXPIRY_SNAPSHOTS:
            # A long history: the Spark action reads the expired snapshots' manifests on the
            # executors.
            expired = step("expire", "expiring snapshots of",
                           actions.expireSnapshots(table()).expireOlderThan(expire_older_than_ms)
                           .retainLast(retain_last).execute)
            expired_count = int(expired.deletedManifestListsCount())
        elif kept > retain_last:
            # Iceberg's own expiry on the driver: 0.2-0.4 s for up to 200 snapshots of a small
            # table where the Spark action took 4.7-10 s (its jobs' overhead).
            def expire() -> int:
                current = table()
                current.refresh()
                ids = {int(s.snapshotId()) for s in current.snapshots()}
                current.expireSnapshots().expireOlderThan(expire_older_than_ms) \
                    .retainLast(retain_last).commit()
                current.refresh()
                return len(ids - {int(s.snapshotId()) for s in current.snapshots()})

            expired_count = step("expire", "expiring snapshots of", expire)
        orphans = step("orphans", "removing orphan files of",
                       actions.deleteOrphanFiles(table()).olderThan(orphans_older_than_ms)
                       .execute)
        after = self.snapshots.files(target)
        return {
            "table": target, "before": before, "after": after,
            "rewritten_data_files": int(result.rewrittenDataFilesCount()),
            "added_data_files": int(result.addedDataFilesCount()),
            "expired_snapshots": expired_count,
            "orphan_files_removed": sum(1 for _ in orphans.orphanFileLocations()),
            "seconds": took,
        }


def _total(table: Any, key: str) -> int:
    """A running total from the table's current snapshot summary (0 without a snapshot)."""
    current = table.currentSnapshot()
    value = None if current is None else current.summary().get(key)
    return int(value) if value is not None else 0


def _manifests(table: Any) -> int:
    """The manifests of the table's current snapshot."""
    current = table.currentSnapshot()
    return 0 if current is None else int(current.allManifests(table.io()).size())
