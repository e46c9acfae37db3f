"""Keeping a table cheap to read: compacting data files (applying position deletes), dropping
dangling deletes, rewriting manifests, expiring old snapshots and removing orphan files, through
Iceberg's Spark actions. Every commit that replaces files carries the table's progress marks."""

from __future__ import annotations

from typing import Any

from walberg.apply.jvm.spark import spark_call
from walberg.apply.session import LakeSession, quote_target
from walberg.apply.snapshots import Snapshots


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
        rewrite = marked(actions.rewriteDataFiles(table()))
        for key, value in options.items():
            rewrite = rewrite.option(key, value)
        result = spark_call(f"compacting {target}", rewrite.execute)
        # Position deletes whose data files were just rewritten are void now: drop them.
        spark_call(f"dropping applied delete files of {target}",
                   marked(actions.rewritePositionDeletes(table()).option("rewrite-all", "true"))
                   .execute)
        spark_call(f"rewriting the manifests of {target}",
                   marked(actions.rewriteManifests(table())).execute)
        expired = spark_call(
            f"expiring snapshots of {target}",
            actions.expireSnapshots(table()).expireOlderThan(expire_older_than_ms)
            .retainLast(retain_last).execute)
        orphans = spark_call(
            f"removing orphan files of {target}",
            actions.deleteOrphanFiles(table()).olderThan(orphans_older_than_ms).execute)
        after = self.snapshots.files(target)
        return {
            "table": target, "before": before, "after": after,
            "rewritten_data_files": int(result.rewrittenDataFilesCount()),
            "added_data_files": int(result.addedDataFilesCount()),
            "expired_snapshots": int(expired.deletedManifestListsCount()),
            "orphan_files_removed": sum(1 for _ in orphans.orphanFileLocations()),
        }
