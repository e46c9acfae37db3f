"""Reads of the lake that need no JVM: a hadoop table's history from its metadata file says
what Iceberg's own ``history`` and ``snapshots`` metadata tables say (read by Spark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from walberg.apply.catalog.metadata import read_hadoop_history, summarize


def test_history_from_the_metadata_file_equals_sparks(spark: Any, warehouse: Path,
                                                      unique: str) -> None:
    target = f"lake.hist_{unique}.t"
    spark.sql(f"CREATE TABLE {target} (id bigint, v string) USING iceberg "
              "TBLPROPERTIES ('format-version'='2', 'write.delete.mode'='merge-on-read')")
    spark.range(1, 101).selectExpr("id", "'a' AS v").write.option(
        "snapshot-property.walberg.lsn", "0/10").mode("append").saveAsTable(target)
    spark.sql(f"DELETE FROM {target} WHERE id <= 10")
    spark.range(101, 111).selectExpr("id", "'b' AS v").write.option(
        "snapshot-property.walberg.lsn", "0/20").mode("append").saveAsTable(target)
    first = spark.sql(f"SELECT snapshot_id FROM {target}.history ORDER BY made_current_at") \
        .collect()[0][0]
    spark.sql(f"CALL lake.system.rollback_to_snapshot('hist_{unique}.t', {first})")
    spark.range(200, 205).selectExpr("id", "'c' AS v").writeTo(target).append()

    expected = [r.asDict() for r in spark.sql(
        f"SELECT h.made_current_at, s.snapshot_id, s.operation, h.is_current_ancestor, "
        f"s.summary['walberg.lsn'] AS lsn, s.summary['added-records'] AS added, "
        f"s.summary['deleted-records'] AS deleted, "
        f"s.summary['added-position-deletes'] AS pos_deletes "
        f"FROM {target}.history h JOIN {target}.snapshots s ON s.snapshot_id = h.snapshot_id "
        f"ORDER BY h.made_current_at").collect()]
    got = read_hadoop_history(warehouse, f"hist_{unique}", "t")
    assert got is not None and len(got) == 5
    # Spark renders made_current_at in the JVM's zone; compare the instants' order and the rest.
    for row in (*expected, *got):
        row.pop("made_current_at")
    assert got == expected
    assert [r["is_current_ancestor"] for r in got] == [True, False, False, True, True]
    assert read_hadoop_history(warehouse, f"hist_{unique}", "missing") is None


def test_history_needs_no_jvm_and_query_pipes_json_and_csv(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """`walberg history` on a local hadoop warehouse answers from the metadata file: it runs
    with no Java anywhere. `walberg query --format json|csv` without --output writes only the
    result to standard output, ready for a pipe."""
    import csv
    import io
    import json
    import os

    from conftest import make_config, run_once, walberg_cli, write_pipeline

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, name text)")
        cur.execute(f"INSERT INTO {table} VALUES (1, 'a'), (2, 'b'), (3, 'c, \"quoted\"')")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    run_once(config, spark)
    path = tmp_path / "pipeline.yaml"
    write_pipeline(config, path)

    no_java = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    no_java["PATH"] = ""
    done = walberg_cli("history", "-c", str(path), table, "--json", env=no_java)
    assert done.returncode == 0, done.stderr
    [snapshot] = json.loads(done.stdout)
    assert snapshot["added"] == 3 and snapshot["lsn"]

    target = config.target_for(table)
    statement = f"SELECT id, name FROM {target} ORDER BY id"
    done = walberg_cli("-q", "query", "-c", str(path), statement, "--format", "json")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [
        {"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": 'c, "quoted"'}]
    done = walberg_cli("-q", "query", "-c", str(path), statement, "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert list(csv.reader(io.StringIO(done.stdout))) == [
        ["id", "name"], ["1", "a"], ["2", "b"], ["3", 'c, "quoted"']]


def test_the_summary_holds_the_highest_lsn_of_the_history_and_when_it_was_committed() -> None:
    """A maintenance commit that raced a walberg commit carries the older LSN it read; the
    run resumes from the highest (apply.snapshots), and `walberg status` says the same."""
    def snap(sid: int, parent: Any, ms: int, **summary: str) -> dict[str, Any]:
        return {"snapshot-id": sid, "parent-snapshot-id": parent, "timestamp-ms": ms,
                "summary": {"operation": "append", **summary}}

    meta = {"current-snapshot-id": 4, "snapshots": [
        snap(1, None, 100, **{"walberg.lsn": "0/10"}),
        snap(2, 1, 200, **{"walberg.lsn": "0/30"}),  # a batch
        snap(3, 2, 300, **{"walberg.lsn": "0/20"}),  # compaction, with the LSN it read
        snap(4, 3, 400, **{"walberg.lsn": "0/20"})]}
    got = summarize(meta)
    assert (got.walberg_lsn, got.walberg_committed_at_ms, got.snapshot_id) == ("0/30", 200, 4)
    # The same LSN carried on by a later snapshot: committed when it first appeared.
    meta["snapshots"][2]["summary"]["walberg.lsn"] = "0/30"
    meta["snapshots"][3]["summary"]["walberg.lsn"] = "0/30"
    assert summarize(meta).walberg_committed_at_ms == 200


def test_a_table_read_while_a_commit_replaces_its_version_hint(spark: Any, warehouse: Path,
                                                               unique: str) -> None:
    """A hadoop catalog's commit deletes ``version-hint.text`` and then renames the new one in.
    `walberg status` and `history` reading in between must still see the table, at its newest
    metadata version (as Iceberg's own reader does), not say it does not exist or fail."""
    from pyiceberg.io import load_file_io

    from walberg.apply.catalog import catalog_reads
    from walberg.apply.catalog.metadata import read_hadoop_table

    namespace = f"hint_{unique}"
    target = f"lake.{namespace}.t"
    spark.sql(f"CREATE TABLE {target} (id bigint) USING iceberg")
    for start in (1, 11, 21):
        spark.range(start, start + 10).write.option(
            "snapshot-property.walberg.lsn", f"0/{start}").mode("append").saveAsTable(target)
    meta_dir = warehouse / namespace / "t" / "metadata"
    with_hint = (read_hadoop_table(warehouse, namespace, "t"),
                 read_hadoop_history(warehouse, namespace, "t"),
                 catalog_reads.table_metadata("hadoop", "lake", str(warehouse), None, {}, {},
                                              namespace, "t"))
    assert with_hint[0] is not None and with_hint[0].records == 30
    assert with_hint[0].walberg_lsn == "0/21" and with_hint[1] and with_hint[2]

    (meta_dir / "version-hint.text").unlink()  # the moment inside a commit
    assert (read_hadoop_table(warehouse, namespace, "t"),
            read_hadoop_history(warehouse, namespace, "t"),
            catalog_reads.table_metadata("hadoop", "lake", str(warehouse), None, {}, {},
                                         namespace, "t")) == with_hint
    # Where the file system cannot be listed, the versions are probed.
    newest = max(int(p.name[1:].split(".")[0]) for p in meta_dir.glob("v*.metadata.json"))
    assert catalog_reads._probed_names(load_file_io({}, str(meta_dir)), str(meta_dir)) == [
        f"v{newest}.metadata.json"]

    # A table that does not exist is still none.
    assert read_hadoop_table(warehouse, namespace, "absent") is None
    assert catalog_reads.table_metadata("hadoop", "lake", str(warehouse), None, {}, {},
                                        namespace, "absent") is None
    assert catalog_reads._probed_names(load_file_io({}, str(meta_dir)),
                                       str(meta_dir.parent.parent / "absent")) == []
