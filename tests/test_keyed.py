"""Batches applied by position (apply.position.keyed): a table with one integer key gets its updates and
deletes as position deletes found through the key index, with no MERGE over the table. Real
PostgreSQL, Spark and Iceberg; the lake is read back by PyIceberg and DuckDB."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import as_file, make_config, run_once, run_once_within
from lake import duckdb_rows, hadoop_table, iceberg_rows, postgres_rows
from walberg import faults
from walberg.apply.position import datafiles, indexes, keyed
from walberg.apply.position.keycodec import KeyCodec
from walberg.apply.position.keyindex import KeyIndex
from walberg.apply.session import java_table, quote_target
from walberg.config import parse_config
from walberg.lake.maintain import maintain
from walberg.lake.services import Lake
from walberg.pipeline import Pipeline


def _run_logged(config: Any, spark: Any, caplog: pytest.LogCaptureFixture) -> None:
    """`run --once`, with only its own log in ``caplog`` (INFO and up)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark)


def _operations(warehouse: Path, target: str) -> list[str]:
    table = hadoop_table(warehouse, target)
    out = []
    snapshot = table.current_snapshot()
    while snapshot is not None:
        out.append(snapshot.summary.operation.value)
        parent = snapshot.parent_snapshot_id
        snapshot = table.snapshot_by_id(parent) if parent is not None else None
    return out[::-1]


def _summary(warehouse: Path, target: str) -> dict[str, str]:
    snapshot = hadoop_table(warehouse, target).current_snapshot()
    assert snapshot is not None
    return dict(snapshot.summary.additional_properties)


def _points_at_its_row(directory: Path, sql_type: str, ids: list[Any], arrow: Any) -> None:
    """Each of ``ids`` is in the index in ``directory``, at the data file and position that
    hold its row."""
    codec = KeyCodec.for_types([sql_type])
    assert codec is not None
    index = KeyIndex(directory, encoding=codec.name)
    keys, checks = codec.encode([pa.array(ids, arrow)])
    by_key = dict(zip(keys.tolist(), ids, strict=True))
    hits = index.lookup(keys, checks)
    assert len(hits.keys) == len(ids)
    files = {f: pq.read_table(f.removeprefix("file:"), columns=["id"]).column("id").to_pylist()
             for f in set(hits.files)}
    for key, file, position in zip(hits.keys.tolist(), hits.files, hits.positions.tolist(),
                                   strict=True):
        assert files[file][position] == by_key[key], (file, position)


def test_integer_key_table_applies_by_position(pg_conn: Any, postgres: Any, spark: Any,
                                               warehouse: Path, tmp_path: Path, unique: str,
                                               caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    table, text_keyed, binary = f"public.{unique}", f"public.{unique}_t", f"public.{unique}_b"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, v int, note text)")
        cur.execute(f"INSERT INTO {table} SELECT g, g, 'n' || g FROM generate_series(1, 3000) g")
        cur.execute(f"CREATE TABLE {text_keyed} (id text PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {text_keyed} SELECT 'k' || g, g FROM generate_series(1, 50) g")
        # This table's new rows are written by Spark (asked for below, as a sort order would).
        cur.execute(f"CREATE TABLE {binary} (id int PRIMARY KEY, b bytea, a int[], v int)")
        cur.execute(f"INSERT INTO {binary} SELECT g, int4send(g), ARRAY[g, -g], g "
                    "FROM generate_series(1, 100) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique,
                         [table, text_keyed, binary])
    target = config.target_for(table)
    by_driver = datafiles.why_not
    monkeypatch.setattr(datafiles, "why_not", lambda lake, tables, to, *rest: (
        "the test asks for Spark" if to == config.target_for(binary)
        else by_driver(lake, tables, to, *rest)))
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark)
    index = KeyIndex(config.index_dir / target)
    assert index.built and index.size == 3000, "the copy builds the index"
    # from the copy's rows as they were written (the copy's data files are not read back)
    assert "made from the copy's rows as they were written: 3000 keys" in caplog.text, \
        caplog.text[-2000:]
    # ... every key pointing at its row in the copy's data file (so for the text keys)
    _points_at_its_row(config.index_dir / target, "BIGINT", list(range(1, 3001)), pa.int64())
    _points_at_its_row(config.index_dir / config.target_for(text_keyed), "STRING",
                       [f"k{g}" for g in range(1, 51)], pa.string())
    caplog.clear()

    rounds = [
        # Updates and deletes at keys spread over the table, new keys, a key deleted and
        # inserted again, a key updated twice in one batch.
        [f"UPDATE {table} SET v = v + 1 WHERE id % 7 = 0",
         f"DELETE FROM {table} WHERE id % 11 = 0",
         f"INSERT INTO {table} SELECT g, g, 'new' FROM generate_series(3001, 3200) g",
         f"DELETE FROM {table} WHERE id = 5",
         f"INSERT INTO {table} VALUES (5, -5, 'back')",
         f"UPDATE {table} SET note = 'twice' WHERE id = 6",
         f"UPDATE {table} SET note = 'twice again' WHERE id = 6",
         f"UPDATE {text_keyed} SET v = -v WHERE v % 2 = 0",
         f"UPDATE {binary} SET b = int4send(-id) WHERE id % 3 = 0",
         f"DELETE FROM {binary} WHERE id % 10 = 0",
         f"INSERT INTO {binary} VALUES (500, '\\x00ff', '{{5}}', 5)"],
        # Rows the last batch wrote are changed again: their positions came from its new files.
        [f"UPDATE {table} SET v = 0 WHERE id BETWEEN 3001 AND 3100",
         f"DELETE FROM {table} WHERE id BETWEEN 3101 AND 3150",
         f"UPDATE {table} SET v = 1 WHERE id = 5"],
        # Only inserts: a row delta of added rows alone (an "append" in the history).
        [f"INSERT INTO {table} SELECT g, g, 'appended' FROM generate_series(4001, 4100) g"],
        [f"UPDATE {table} SET v = 2 WHERE id BETWEEN 4001 AND 4050 OR id % 13 = 0"],
    ]
    for statements in rounds:
        with pg_conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
        _run_logged(config, spark, caplog)
        assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
        if any("UPDATE" in s or "DELETE" in s for s in statements):
            # Staging left every column typed: the new rows became data files on the driver.
            assert f"{target} by position: " in caplog.text and \
                "added (written on the driver)" in caplog.text, caplog.text[-3000:]
        if any(binary in s for s in statements):
            assert "the test asks for Spark" in caplog.text, caplog.text[-3000:]
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)
    # Every key, those of rows the batches wrote included (their entries taken as the rows
    # were written, not read back), points at its row.
    _points_at_its_row(config.index_dir / target, "BIGINT",
                       [r["id"] for r in postgres_rows(pg_conn, table)], pa.int64())
    # The files written on the driver read the same in Spark.
    in_spark = sorted((r["id"], r["v"], r["note"]) for r in spark.table(target).collect())
    assert in_spark == [(r["id"], r["v"], r["note"]) for r in postgres_rows(pg_conn, table)]
    assert iceberg_rows(warehouse, config.target_for(text_keyed)) == \
        postgres_rows(pg_conn, text_keyed)
    assert iceberg_rows(warehouse, config.target_for(binary)) == [
        {**r, "b": bytes(r["b"])} for r in postgres_rows(pg_conn, binary)]

    operations = _operations(warehouse, target)
    # copy, 2 row deltas, an append, a row delta: no MERGE's full rewrite in between.
    assert operations[-4:] == ["overwrite", "overwrite", "append", "overwrite"], operations
    last = _summary(warehouse, target)
    assert int(last["added-position-deletes"]) > 0 and "walberg.lsn" in last, last
    assert "added-equality-deletes" not in last, "never equality deletes"
    # The rows Spark adds in a row delta are written into a staged snapshot first; the commit
    # removes it from the metadata, so every snapshot a reader lists is one walberg committed.
    assert all("wap.id" not in s.summary.additional_properties
               for t in (target, config.target_for(binary))
               for s in hadoop_table(warehouse, t).snapshots())
    assert KeyIndex(config.index_dir / target).snapshot == \
        hadoop_table(warehouse, target).current_snapshot().snapshot_id

    # An index that lost track (a crash between a commit and its update) is rebuilt from the
    # lake: here it is made to describe an older snapshot.
    stale = KeyIndex(config.index_dir / target)
    stale.snapshot = 1
    stale._save()
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET note = 'after rebuild' WHERE id % 5 = 0")
        cur.execute(f"DELETE FROM {table} WHERE id % 17 = 0")
    # A warehouse the driver cannot read itself (here made so): Spark reads the table,
    # applying its delete files, and sorts it.
    monkeypatch.setattr(indexes, "live_scan", lambda *args: None)
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark)
    monkeypatch.undo()
    assert "rebuilt from the lake (read and sorted by Spark)" in caplog.text
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)

    # After compaction (walberg maintain) the rows moved: the index follows them into the
    # files the compaction wrote, without a rebuild.
    (report,) = maintain(Lake(config, session=spark), [table])
    assert report.after.delete_files == 0
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 99 WHERE id % 3 = 0")
    _run_logged(config, spark, caplog)
    assert "followed" in caplog.text and "rebuilt" not in caplog.text, caplog.text[-2000:]
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)

    # A compaction that moved more rows than the index follows one by one: it is rebuilt from
    # the compacted files instead (here the limit is lowered below this table's size).
    maintain(Lake(config, session=spark), [table])
    monkeypatch.setattr(indexes, "FOLLOW_MAX_ROWS", 10)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 7 WHERE id % 4 = 0")
        cur.execute(f"DELETE FROM {table} WHERE id % 11 = 0")
    _run_logged(config, spark, caplog)
    assert "rebuilt from the lake (" in caplog.text and "read on the driver)" in caplog.text, \
        caplog.text[-2000:]
    assert "followed" not in caplog.text
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_another_writer_between_the_index_and_the_commit_is_never_a_second_row(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer updates a key (a merge-on-read UPDATE: a position delete and the row's
    new version) after walberg looked the key up in its index, before its row delta commits.
    The row delta, validated from the index's snapshot, fails; walberg tries the batch again
    against the new state, and the key has one row, the source's."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 200) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    indexed = KeyIndex(config.index_dir / target).snapshot
    assert indexed == hadoop_table(warehouse, target).current_snapshot().snapshot_id

    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 1000 + id WHERE id IN (7, 150)")
        cur.execute(f"DELETE FROM {table} WHERE id = 9")
    meddled: list[int] = []
    real = keyed.crash_point

    def other_writer(point: str, *args: Any, **kwargs: Any) -> None:
        if point == "row-delta" and not meddled:  # the lookup is done, the commit not yet
            spark.sql(f"UPDATE {target} SET v = -1 WHERE id IN (7, 9)")
            meddled.append(hadoop_table(warehouse, target).current_snapshot().snapshot_id)
        real(point, *args, **kwargs)

    monkeypatch.setattr(keyed, "crash_point", other_writer)
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark)
    assert meddled and meddled[0] != indexed
    other = hadoop_table(warehouse, target).snapshot_by_id(meddled[0])
    assert other is not None and other.parent_snapshot_id == indexed
    assert int(other.summary.additional_properties["added-position-deletes"]) == 2, \
        "the other writer's UPDATE deleted by position"
    expected = postgres_rows(pg_conn, table)
    assert [r["id"] for r in expected if r["id"] in (7, 9, 150)] == [7, 150]
    assert iceberg_rows(warehouse, target) == expected
    in_spark = sorted(((r["id"], r["v"]) for r in spark.table(target).collect()))
    assert in_spark == [(r["id"], r["v"]) for r in expected]
    # The first try failed validation (the other writer's files for these keys) and was made
    # again.
    assert re.search(rf"commit to {re.escape(target)} failed .*ValidationException: Found "
                     r"(new )?conflicting .*trying again", caplog.text), caplog.text[-3000:]
    assert "rebuilt from the lake" in caplog.text  # the index caught up with the other writer
    assert KeyIndex(config.index_dir / target).snapshot == \
        hadoop_table(warehouse, target).current_snapshot().snapshot_id


@pytest.mark.parametrize("expire", [False, True])
def test_a_compaction_the_commit_landed_on_is_not_taken_for_the_index(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, expire: bool) -> None:
    """Another writer compacts the table after walberg looked its batch up, before the commit.
    The batch deletes nothing (new rows alone: an append), so Iceberg puts the commit on top
    of the compaction; the index, which knows the files from before it, is not taken as the
    new snapshot's (a later update would delete the row from a file no longer in the table,
    and the key would have two rows). ``expire``: in the next batch (a row delta) the other
    writer compacts again and then expires every snapshot but its own, the index's among
    them: the commit, validated from it, fails, and is tried again once the index has caught
    up with the table."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 200) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    compacted: list[int] = []
    real = keyed.crash_point
    catalog, namespace, name = target.split(".")

    def other_writer(expiring: bool) -> Any:
        def compaction(point: str, *args: Any, **kwargs: Any) -> None:
            if point == "row-delta" and not compacted:  # looked up, not yet committed
                spark.sql(f"CALL {catalog}.system.rewrite_data_files(table => "
                          f"'{namespace}.{name}', options => map('rewrite-all', 'true'))")
                if expiring:
                    spark.sql(f"CALL {catalog}.system.expire_snapshots(table => "
                              f"'{namespace}.{name}', older_than => TIMESTAMP '2999-01-01', "
                              "retain_last => 1)")
                compacted.append(hadoop_table(warehouse, target).current_snapshot().snapshot_id)
            real(point, *args, **kwargs)
        return compaction

    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (1001, 1)")
        cur.execute(f"UPDATE {table} SET v = 2 WHERE id = 1001")
    monkeypatch.setattr(keyed, "crash_point", other_writer(False))
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark)
    monkeypatch.undo()
    assert compacted
    landed = hadoop_table(warehouse, target).current_snapshot()
    assert landed.parent_snapshot_id == compacted[0]  # (the commit went on top of it)
    assert landed.summary.operation.value == "append"
    assert "another writer committed between the key index's snapshot" in caplog.text
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = -5 WHERE id = 5")
        cur.execute(f"DELETE FROM {table} WHERE id = 6")
    if expire:
        compacted.clear()
        caplog.clear()
        monkeypatch.setattr(keyed, "crash_point", other_writer(True))
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark)
    monkeypatch.undo()
    if expire:
        assert compacted
        assert len(hadoop_table(warehouse, target).snapshots()) == 2
        assert re.search(rf"commit to {re.escape(target)} failed .*trying again",
                         caplog.text), caplog.text[-3000:]
        # (the index was read again at the table's snapshot, then took the batch)
        assert KeyIndex(config.index_dir / target).snapshot == \
            hadoop_table(warehouse, target).current_snapshot().snapshot_id
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_a_row_delta_that_landed_though_its_commit_failed_keeps_its_files(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The row delta's commit lands, then fails as an unknown outcome does (a timeout after the
    catalog's swap): its files stay (the table refers to them now), the retry finds the
    commit landed, and the table reads as the source."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 100) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = -v WHERE id <= 10")
        cur.execute(f"INSERT INTO {table} VALUES (500, 500)")
    monkeypatch.setattr(faults, "_FAIL", ("row-delta", 1))
    monkeypatch.setattr(faults, "_fails", {})
    run_once(config, spark)
    assert faults._FAIL is None  # the failure point was passed
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert spark.table(target).count() == 101
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 0 WHERE id IN (1, 500)")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_deletes_in_a_null_partition_and_a_null_texts_are_apart(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """A table partitioned by a text column holding NULL in some rows and the text 'null' in
    others: one batch deletes a row of each; each partition gets its own delete file (one
    delete file of the first partition held both, so the other row stayed, twice after an
    update)."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, region text, v int)")
        cur.execute(f"INSERT INTO {table} SELECT g, CASE g % 3 WHEN 0 THEN NULL WHEN 1 THEN "
                    "'null' ELSE 'eu' END, g FROM generate_series(1, 30) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["sink"]["tables"] = {table: {"partition_by": ["region"]}}
    config = parse_config(raw, tmp_path)
    target = config.target_for(table)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = -v WHERE id IN (3, 4)")  # NULL, 'null'
        cur.execute(f"DELETE FROM {table} WHERE id IN (6, 7)")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert sorted((r["id"], r["v"]) for r in spark.table(target).collect()) == \
        sorted((r["id"], r["v"]) for r in postgres_rows(pg_conn, table))


def _normal(value: Any) -> Any:
    """One form for a value read from Postgres or from the lake."""
    import datetime as dt
    import uuid as uuid_

    if isinstance(value, uuid_.UUID):
        return str(value)
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.timezone.utc).replace(tzinfo=None)
    return value


def _rows_equal(pg_conn: Any, warehouse: Path, table: str, target: str, spark: Any) -> None:
    with pg_conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {table}")
        names = [d[0] for d in cur.description]
        source = sorted(tuple(_normal(v) for v in row) for row in cur.fetchall())
    for reader, rows in (("PyIceberg", iceberg_rows(warehouse, target, key=names[0])),
                         ("DuckDB", duckdb_rows(warehouse, target, key=names[0]))):
        lake = sorted(tuple(_normal(r[n]) for n in names) for r in rows)
        assert lake == source, f"{reader} reads {target} unlike its source"
    in_spark = sorted(tuple(_normal(r[n]) for n in names) for r in spark.table(target).collect())
    assert in_spark == source


KEY_SHAPES = {
    # name: (columns, the rows' SELECT over g, a key change)
    "uuid": ("id uuid PRIMARY KEY, v int, note text",
             "md5(g::text)::uuid, g, 'n' || g",
             "UPDATE {t} SET id = md5('moved' || id::text)::uuid WHERE v % 97 = 0"),
    "text": ("id text PRIMARY KEY, v int, note text", "'key-' || g, g, 'n' || g",
             "UPDATE {t} SET id = id || '-moved' WHERE v % 97 = 0"),
    "int_bigint": ("tenant int, id bigint, v int, note text, PRIMARY KEY (tenant, id)",
                   "g % 7, g, g, 'n' || g",
                   "UPDATE {t} SET tenant = tenant + 100 WHERE v % 97 = 0"),
    "text_bigint": ("tenant text, id bigint, v int, note text, PRIMARY KEY (tenant, id)",
                    "'t' || (g % 5), g, g, 'n' || g",
                    "UPDATE {t} SET tenant = 'moved' WHERE v % 97 = 0"),
    "bigint_ts": ("id bigint, at timestamptz, v int, note text, PRIMARY KEY (id, at)",
                  "g, timestamptz '2024-01-01 00:00:00+00' + g * interval '1 minute', g, "
                  "'n' || g", "UPDATE {t} SET at = at + interval '1 second' WHERE v % 97 = 0"),
}


def test_every_key_shape_applies_by_position(pg_conn: Any, postgres: Any, spark: Any,
                                             warehouse: Path, tmp_path: Path, unique: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """uuid, text and composite keys (with text, with a timestamp) get their updates, deletes
    and key changes by position, through an index of their own encoding (apply.position.keycodec); it
    is rebuilt by Spark from a table with delete files, and follows a compaction. Every reader
    sees the source's rows."""
    tables = {shape: f"public.{unique}_{shape}" for shape in KEY_SHAPES}
    with pg_conn.cursor() as cur:
        for shape, (columns, select, _) in KEY_SHAPES.items():
            cur.execute(f"CREATE TABLE {tables[shape]} ({columns})")
            cur.execute(f"INSERT INTO {tables[shape]} SELECT {select} "
                        "FROM generate_series(1, 2000) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique,
                         list(tables.values()))
    targets = {shape: config.target_for(t) for shape, t in tables.items()}
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once(config, spark)
    for target in targets.values():
        # (the copy's rows went to the index as they were written: the first round's updates
        # and deletes find their rows through it)
        assert f"key index of {target} made from the copy's rows as they were written: 2000 " \
               "keys" in caplog.text, caplog.text[-3000:]

    rounds = [
        ["UPDATE {t} SET v = v + 1 WHERE v % 7 = 0", "DELETE FROM {t} WHERE v % 11 = 0",
         "{key_change}"],
        ["UPDATE {t} SET note = 'again' WHERE v % 5 = 0", "DELETE FROM {t} WHERE v % 13 = 0"],
    ]
    for statements in rounds:
        with pg_conn.cursor() as cur:
            for shape, table in tables.items():
                for statement in statements:
                    cur.execute(statement.replace("{key_change}", KEY_SHAPES[shape][2])
                                .format(t=table))
        _run_logged(config, spark, caplog)
        for shape, target in targets.items():
            assert f"{target} by position: " in caplog.text and \
                "added (written on the driver)" in caplog.text, (shape, caplog.text[-3000:])
            _rows_equal(pg_conn, warehouse, tables[shape], target, spark)

    # The index lost track: rebuilt by Spark from a table with delete files, sorted here.
    for target in targets.values():
        manifest = config.index_dir / target / "manifest.json"
        stale = json.loads(manifest.read_text())
        stale["snapshot"] = 1
        manifest.write_text(json.dumps(stale))
    with pg_conn.cursor() as cur:
        for table in tables.values():
            cur.execute(f"UPDATE {table} SET v = -v WHERE v % 3 = 0")
    _run_logged(config, spark, caplog)
    # The tables have delete files by now: the driver reads the key columns less the deletes.
    assert len(re.findall(r"rebuilt from the lake \(\d+ data file\(s\) and [1-9]\d* delete "
                          r"file\(s\) read on the driver\)", caplog.text)) == len(targets), \
        caplog.text[-3000:]
    for shape, target in targets.items():
        _rows_equal(pg_conn, warehouse, tables[shape], target, spark)

    # A compaction moves every row: the index follows it into the new files.
    maintain(Lake(config, session=spark), list(tables.values()))
    with pg_conn.cursor() as cur:
        for table in tables.values():
            cur.execute(f"UPDATE {table} SET note = 'compacted' WHERE v % 4 = 0")
            cur.execute(f"DELETE FROM {table} WHERE v % 9 = 0")
    _run_logged(config, spark, caplog)
    assert caplog.text.count("followed") == len(targets), caplog.text[-3000:]
    for shape, target in targets.items():
        assert _operations(warehouse, target)[-1] == "overwrite"
        assert "added-equality-deletes" not in _summary(warehouse, target)
        _rows_equal(pg_conn, warehouse, tables[shape], target, spark)



PARTITIONINGS = {
    "days": ["days(at)"],
    "bucket": ["bucket(8, id)", "years(at)"],
    "hours": ["region", "truncate(2, note)", "hours(at)"],
}


def test_partitioned_tables_apply_by_position(pg_conn: Any, postgres: Any, spark: Any,
                                              warehouse: Path, tmp_path: Path, unique: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Iceberg-partitioned tables (identity, bucket, truncate, years, days, hours; months after
    the spec evolves) get their deletes by position, a position-delete file per partition of
    the rows they delete; a table whose spec evolved has deletes in the old spec's partitions
    and the new. Every reader sees the source's rows."""
    tables = {name: f"public.{unique}_{name}" for name in PARTITIONINGS}
    with pg_conn.cursor() as cur:
        for table in tables.values():
            cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, at timestamptz, "
                        "region text, note text, v int)")
            # Over 40 days; the hours table over six hours (a partition an hour).
            span = "(g % 6) * interval '1 hour'" if table == tables["hours"] else \
                "(g % 40) * interval '1 day' + g * interval '1 minute'"
            cur.execute(f"INSERT INTO {table} SELECT g, timestamptz '2024-01-01 00:00:00+00' "
                        f"+ {span}, 'r' || (g % 3), 'n' || (g % 50), g "
                        "FROM generate_series(1, 600) g")
    base = make_config(postgres, warehouse, tmp_path / "segments", unique, list(tables.values()))

    def configured(partitionings: dict[str, list[str]]) -> Any:
        raw = as_file(base)
        raw["sink"]["tables"] = {tables[n]: {"partition_by": p} for n, p in partitionings.items()}
        return parse_config(raw, tmp_path)

    config = configured(PARTITIONINGS)
    targets = {name: config.target_for(t) for name, t in tables.items()}
    _run_logged(config, spark, caplog)
    for target in targets.values():  # the copy too, a file per partition
        assert f"initial copy of {target}: written on the driver" in caplog.text, \
            caplog.text[-3000:]
    rounds = [
        ["UPDATE {t} SET v = v + 1 WHERE id % 7 = 0", "DELETE FROM {t} WHERE id % 11 = 0",
         "INSERT INTO {t} SELECT g, timestamptz '2025-06-01 00:00:00+00' + (g % 5) * interval "
         "'1 hour', 'r9', 'new', g FROM generate_series(5001, 5100) g"],
        # rows moved to another partition by an update, rows the last batch wrote changed
        ["UPDATE {t} SET at = at + interval '40 days', region = 'moved' WHERE id % 113 = 0",
         "UPDATE {t} SET note = 'again' WHERE id BETWEEN 5001 AND 5050"],
    ]
    for statements in rounds:
        with pg_conn.cursor() as cur:
            for table in tables.values():
                for statement in statements:
                    cur.execute(statement.format(t=table))
        _run_logged(config, spark, caplog)
        for name, target in targets.items():
            # New rows in their partitions, written on the driver.
            assert re.search(rf"{re.escape(target)} by position: \d+ deleted, \d+ added "
                             r"\(written on the driver\)", caplog.text), (name, caplog.text[-3000:])
            _rows_equal(pg_conn, warehouse, tables[name], target, spark)
            _partitions_hold_their_rows(spark, target)
    for target in targets.values():
        lake = hadoop_table(warehouse, target)
        deletes = [(f["spec_id"], str(f["partition"])) for f in lake.inspect.files().to_pylist()
                   if f["content"] == 1]
        # Two row deltas, each a delete file per partition it deletes in.
        assert len(set(deletes)) > 1 and max(deletes.count(d) for d in deletes) <= 2, deletes
        last = _summary(warehouse, target)
        assert int(lake.current_snapshot().summary["added-delete-files"]) > 1
        assert "added-equality-deletes" not in last

    # The spec evolves: new rows go by the new spec, deletes reach rows of both.
    config = configured({**PARTITIONINGS, "days": ["months(at)"]})
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {tables['days']} SELECT g, now(), 'r1', 'late', g "
                    "FROM generate_series(6001, 6050) g")
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {tables['days']} SET v = -v WHERE id % 5 = 0 OR id > 6040")
    _run_logged(config, spark, caplog)
    assert f"{targets['days']} by position: " in caplog.text, caplog.text[-3000:]
    lake = hadoop_table(warehouse, targets["days"])
    assert len(lake.specs()) > 1
    specs = {f["spec_id"] for f in lake.inspect.files().to_pylist() if f["content"] == 1}
    assert len(specs) == 2, specs
    _rows_equal(pg_conn, warehouse, tables["days"], targets["days"], spark)


def _partitions_hold_their_rows(spark: Any, target: str) -> None:
    """Each row of the table's current spec's files is in the partition Iceberg's own
    transforms give it (through Spark's ``system`` functions)."""
    name = quote_target(target)
    table = java_table(spark, target)
    spec = table.spec()
    checks = []
    for field in spec.fields():
        column = str(table.schema().findField(field.sourceId()).name())
        kind, _, arg = str(field.transform()).partition("[")
        call = column if kind == "identity" else \
            f"lake.system.{kind}s({column})" if not arg else \
            f"lake.system.{kind}({arg.rstrip(']')}, {column})"
        checks.append(f"NOT (_partition.{field.name()} <=> {call})")
    if not checks:
        return  # unpartitioned
    spark.sql(f"REFRESH TABLE {name}")
    wrong = spark.sql(f"SELECT count(*) AS n FROM {name} WHERE _spec_id = {spec.specId()} AND "
                      f"({' OR '.join(checks)})").collect()[0]["n"]
    assert wrong == 0, (target, checks)


def test_format_3_tables_get_deletion_vectors_by_position(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A format-version 3 table gets its deletes as deletion vectors written on the driver, one
    per data file, each merged with that file's earlier one (which the commit removes); a
    partitioned one as well. Spark, PyIceberg and DuckDB read them; `walberg maintain`
    compacts them away and the index follows."""
    tables = {"plain": f"public.{unique}_plain", "days": f"public.{unique}_days"}
    with pg_conn.cursor() as cur:
        for table in tables.values():
            cur.execute(f"CREATE TABLE {table} (id uuid PRIMARY KEY, at timestamptz, v int)")
            cur.execute(f"INSERT INTO {table} SELECT md5(g::text)::uuid, timestamptz "
                        "'2024-01-01 00:00:00+00' + (g % 20) * interval '1 day', g "
                        "FROM generate_series(1, 3000) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique,
                              list(tables.values())))
    raw["sink"]["format_version"] = 3
    raw["sink"]["tables"] = {tables["days"]: {"partition_by": ["days(at)"]}}
    config = parse_config(raw, tmp_path)
    targets = {name: config.target_for(t) for name, t in tables.items()}
    run_once(config, spark)
    rounds = ["UPDATE {t} SET v = -v WHERE v % 7 = 0", "DELETE FROM {t} WHERE v % 11 = 0",
              "UPDATE {t} SET v = v + 1000000 WHERE v % 5 = 0"]
    for statement in rounds:
        with pg_conn.cursor() as cur:
            for table in tables.values():
                cur.execute(statement.format(t=table))
        _run_logged(config, spark, caplog)
        for name, target in targets.items():
            # New rows in their partitions, written on the driver.
            assert re.search(rf"{re.escape(target)} by position: \d+ deleted, \d+ added "
                             r"\(written on the driver\)", caplog.text), (name, caplog.text[-3000:])
            _rows_equal(pg_conn, warehouse, tables[name], target, spark)
            _partitions_hold_their_rows(spark, target)
            vectors = spark.sql(f"SELECT file_format, referenced_data_file FROM {target}.files "
                                "WHERE content = 1").collect()
            assert vectors and all(f["file_format"] == "PUFFIN" for f in vectors)
            # One live deletion vector per data file: each new one replaced the earlier.
            referenced = [f["referenced_data_file"] for f in vectors]
            assert len(referenced) == len(set(referenced)), name
    last = hadoop_table(warehouse, targets["plain"]).current_snapshot().summary
    assert int(last["removed-delete-files"]) > 0, "the earlier vectors were replaced"

    maintain(Lake(config, session=spark), list(tables.values()))
    with pg_conn.cursor() as cur:
        for table in tables.values():
            cur.execute(f"UPDATE {table} SET v = 0 WHERE v % 3 = 0")
    _run_logged(config, spark, caplog)
    for name, target in targets.items():
        assert f"{target} by position: " in caplog.text, (name, caplog.text[-3000:])
        _rows_equal(pg_conn, warehouse, tables[name], target, spark)


def test_a_driver_on_another_machine_fetches_the_index_kept_in_the_warehouse(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The key index is kept beside its table (``_walberg_keys``), versioned by the snapshot
    it describes, only the newest; `walberg maintain` leaves it there; a driver with no index
    on its disk fetches it (and follows the compaction since) instead of reading the table's
    keys back; without it, or with sink.key_index_in_warehouse off, the keys are read."""
    import os
    import shutil
    import time

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id uuid PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {table} SELECT md5(g::text)::uuid, g "
                    "FROM generate_series(1, 3000) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["maintenance"] = {"orphan_retention": "1h"}
    config = parse_config(raw, tmp_path)
    target = config.target_for(table)
    kept = warehouse / target.split(".", 1)[1].replace(".", "/") / "_walberg_keys" / "_one"

    def manifests() -> list[str]:
        return sorted(p.name for p in kept.glob("snapshot-*.json"))

    def current() -> int:
        snapshot = hadoop_table(warehouse, target).current_snapshot()
        assert snapshot is not None
        return snapshot.snapshot_id

    run_once(config, spark)
    assert manifests() == [f"snapshot-{current()}.json"], "kept after the copy"
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = -v WHERE v % 3 = 0")
        cur.execute(f"DELETE FROM {table} WHERE v % 7 = 0")
    _run_logged(config, spark, caplog)
    assert "kept in the warehouse at snapshot" in caplog.text, caplog.text[-2000:]
    assert manifests() == [f"snapshot-{current()}.json"], "only the newest state is kept"

    # Orphan removal leaves the kept index alone (even old), and removes a real orphan.
    long_ago = time.time() - 2 * 86400
    for path in [*kept.rglob("*"), kept]:
        os.utime(path, (long_ago, long_ago))
    decoy = kept.parent.parent / "data" / "orphan.parquet"
    decoy.write_bytes(b"not referenced")
    os.utime(decoy, (long_ago, long_ago))
    before = sorted(p.relative_to(kept) for p in kept.rglob("*"))
    (report,) = maintain(Lake(config, session=spark), [table])
    assert report.orphan_files_removed >= 1 and not decoy.exists()
    assert sorted(p.relative_to(kept) for p in kept.rglob("*")) == before

    # A fresh driver: no index on this disk. It is fetched (hard links from the warehouse on
    # this disk) as the run starts, before the batch needs it, as a run that opens its session
    # with a batch on its way does, and follows the compaction; nothing reads the table's keys.
    shutil.rmtree(config.index_dir)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 0 WHERE v % 5 = 0")
        cur.execute(f"DELETE FROM {table} WHERE v % 11 = 0")
        cur.execute(f"INSERT INTO {table} SELECT md5(g::text)::uuid, g "
                    "FROM generate_series(5001, 5100) g")
    pipeline = Pipeline(config, session=spark)
    caplog.clear()
    try:
        with caplog.at_level(logging.INFO, logger="walberg"):
            pipeline.sink.warm([target])
            pipeline.run(once=True)
    finally:
        pipeline.close()
    assert "fetched from the warehouse" in caplog.text and "followed" in caplog.text, \
        caplog.text[-3000:]
    assert any(r.threadName.startswith("walberg-prefetch") and "fetched from the warehouse"
               in r.getMessage() for r in caplog.records), "fetched ahead, in its thread"
    assert "rebuilt" not in caplog.text and "MERGE" not in caplog.text, caplog.text[-3000:]
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    assert duckdb_rows(warehouse, target) == postgres_rows(pg_conn, table)

    # Not kept (the setting off): a fresh driver reads the keys back.
    raw["sink"]["key_index_in_warehouse"] = False
    config = parse_config(raw, tmp_path)
    shutil.rmtree(config.index_dir)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 1 WHERE v % 4 = 0")
    _run_logged(config, spark, caplog)
    assert "rebuilt from the lake" in caplog.text and "fetched" not in caplog.text, \
        caplog.text[-3000:]
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_a_small_tables_index_is_kept_at_most_once_a_minute_and_as_the_run_ends(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Keeping an index in the warehouse costs the driver the same few milliseconds whatever
    its size: an index of under SMALL_INDEX_KEYS keys is kept after a run's first commit, then
    at most once a minute, and its newest state as the run ends (not after every batch).

    And batches no larger than a segment, transactions that straddle segments: a segment that
    ends with the start of a transaction after one the lake holds was taken for a whole batch
    ending at the lake's position, every time, and the run never applied anything more (a
    `--once` run never ended)."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 3000) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    # (small segments and batches: one run applies the three transactions below as several
    # batches)
    raw["buffer"].update({"max_segment_bytes": 64 * 1024, "max_batch_bytes": 64 * 1024})
    config = parse_config(raw, tmp_path)
    target = config.target_for(table)
    kept = warehouse / target.split(".", 1)[1].replace(".", "/") / "_walberg_keys" / "_one"
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        for step in range(3):
            cur.execute(f"UPDATE {table} SET v = v + {step + 1}")
            pg_conn.commit()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="walberg"):
        run_once_within(180, config, spark)
    batches = [r for r in caplog.records if r.getMessage().startswith("batch of")]
    keeps = [r for r in caplog.records
             if r.getMessage().startswith(f"key index of {target} kept in the warehouse")]
    assert len(batches) >= 3, [r.getMessage() for r in batches]
    # The first commit's (unless the last one's replaced it before it was kept) and the last
    # one's, not one a batch.
    assert 1 <= len(keeps) <= 2, [r.getMessage() for r in keeps]
    snapshot = hadoop_table(warehouse, target).current_snapshot()
    assert snapshot is not None
    assert sorted(p.name for p in kept.glob("snapshot-*.json")) == \
        [f"snapshot-{snapshot.snapshot_id}.json"]
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)


def test_a_new_primary_key_never_reads_the_old_key_s_index(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A table whose key becomes another column of the same type (a new primary key): its key
    index, on this disk or kept in the warehouse, holds the old key's values, which would find
    other rows (a wrong row deleted, the updated one left twice). It is made anew instead."""
    import shutil

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        # order_no runs the other way over the same values as id: an old index would answer.
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, order_no int NOT NULL, v int)")
        cur.execute(f"INSERT INTO {table} SELECT g, 201 - g, 0 FROM generate_series(1, 200) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} DROP CONSTRAINT {unique}_pkey, "
                    "ADD PRIMARY KEY (order_no)")
        cur.execute(f"UPDATE {table} SET v = 1 WHERE order_no BETWEEN 10 AND 19")
        cur.execute(f"DELETE FROM {table} WHERE order_no BETWEEN 30 AND 34")
    _run_logged(config, spark, caplog)
    assert "rebuilt from the lake" in caplog.text, caplog.text[-3000:]
    assert iceberg_rows(warehouse, target, key="order_no") == \
        postgres_rows(pg_conn, table, key="order_no")

    # The key goes back to id; a driver with no index here finds the kept one made for
    # order_no, and makes its own.
    shutil.rmtree(config.index_dir)
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} DROP CONSTRAINT {unique}_pkey, ADD PRIMARY KEY (id)")
        cur.execute(f"UPDATE {table} SET v = 2 WHERE id BETWEEN 50 AND 59")
        cur.execute(f"DELETE FROM {table} WHERE id BETWEEN 60 AND 64")
    _run_logged(config, spark, caplog)
    assert "rebuilt from the lake" in caplog.text, caplog.text[-3000:]
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)

    # Rows appended, then the key column renamed: the index is made again, reading the data
    # files' key columns by field id (the files written before hold the old name).
    with pg_conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} SELECT g, 1000 + g, 0 FROM generate_series(300, 310) g")
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} RENAME id TO uid")
        cur.execute(f"UPDATE {table} SET v = 3 WHERE uid BETWEEN 300 AND 305 OR uid < 5")
    run_once(config, spark)
    assert iceberg_rows(warehouse, target, key="uid") == postgres_rows(pg_conn, table, key="uid")


def test_a_table_made_again_never_reads_the_old_table_s_index(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The Iceberg table is dropped and walberg copies it again: another table (its own
    table-uuid). The old table's key index is put back in its place, its snapshot id made the
    new table's (as if two ids had met by chance): read, it would delete rows by position in
    data files the new table does not have. It is made anew instead. So is an index of the
    right table that the older walberg wrote (no table recorded), once."""
    import shutil

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 200) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    run_once(config, spark)
    directory = config.index_dir / target
    shutil.copytree(directory, tmp_path / "old-index")
    old_uuid = hadoop_table(warehouse, target).metadata.table_uuid

    spark.sql(f"DROP TABLE {quote_target(target)}")
    run_once(config, spark)  # copied again
    made_again = hadoop_table(warehouse, target)
    assert made_again.metadata.table_uuid != old_uuid
    shutil.rmtree(directory)
    shutil.copytree(tmp_path / "old-index", directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["snapshot"] = made_again.current_snapshot().snapshot_id
    (directory / "manifest.json").write_text(json.dumps(manifest))

    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = -v WHERE id BETWEEN 90 AND 110")
        cur.execute(f"DELETE FROM {table} WHERE id = 150")
    _run_logged(config, spark, caplog)
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
    # (from the lake, or the copy the new table's index keeps in the warehouse)
    assert re.search("rebuilt from the lake|fetched from the warehouse", caplog.text), \
        caplog.text[-3000:]

    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest.pop("table") == str(made_again.metadata.table_uuid)
    (directory / "manifest.json").write_text(json.dumps(manifest))  # as the older walberg
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 0 WHERE id BETWEEN 100 AND 120")
    _run_logged(config, spark, caplog)
    assert re.search("rebuilt from the lake|fetched from the warehouse", caplog.text), \
        caplog.text[-3000:]
    assert iceberg_rows(warehouse, target) == postgres_rows(pg_conn, table)
