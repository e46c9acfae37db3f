"""Several sources in one pipeline: two PostgreSQL databases whose `orders` tables fan in to one
Iceberg table, each row tagged with its source, each source exactly once by its own LSN; and
the commands that act on a pipeline (maintain, resync, slot) going through every source."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import psycopg2
from prometheus_client import REGISTRY

from conftest import insert_lsn, running, walberg_cli, write_pipeline
from lake import duckdb_rows, hadoop_table
from walberg.config import parse_config
from walberg.errors import TablesParked
from walberg.lake.services import Lake
from walberg.ops.resync import resync
from walberg.ops.verify import verify
from walberg.pipeline import Pipelines


def _databases(pg_conn: Any, postgres: Any, unique: str, names: tuple[str, str],
               tables: dict[str, list[str]]) -> tuple[dict[str, str], dict[str, Any]]:
    """One database per source on the test server (the first is the server's own), each with
    ``tables[name]`` (id int key, v text) holding ids 1-20; their dsns and open connections by
    source name."""
    dsns, conns = {}, {}
    for i, name in enumerate(names):
        dsn = postgres.dsn
        if i:
            with pg_conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE {unique}_db{i + 1}")
            dsn = postgres.dsn.rsplit("/", 1)[0] + f"/{unique}_db{i + 1}"
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            for table in tables[name]:
                cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
                cur.execute(f"INSERT INTO {table} SELECT g, '{name}' || g "
                            "FROM generate_series(1, 20) g")  # the same ids in both
        dsns[name], conns[name] = dsn, conn
    return dsns, conns


def _source_rows(conns: dict[str, Any], table: str) -> list[tuple[str, int, str]]:
    """(source, id, v) of every row of ``table`` in each source's database, sorted."""
    rows = []
    for name, conn in conns.items():
        with conn.cursor() as cur:
            cur.execute(f"SELECT id, v FROM {table}")
            rows += [(name, i, v) for i, v in cur.fetchall()]
    return sorted(rows)


def _raw(dsns: dict[str, str], tables: dict[str, list[str]], unique: str, warehouse: Path,
         tmp_path: Path) -> dict[str, Any]:
    return {
        "sources": {name: {"postgres": {"dsn": dsn, "tables": tables[name],
                                        "slot": f"s_{name}_{unique}",
                                        "publication": f"p_{unique}",
                                        "status_interval_seconds": 1}}
                    for name, dsn in dsns.items()},
        "sink": {"catalog": {"name": "lake", "warehouse": str(warehouse)},
                 "namespace": f"ns_{unique}"},
        "buffer": {"dir": str(tmp_path / "segments"), "max_interval_seconds": 0.5},
    }


def _run(config: Any, spark: Any) -> None:
    several = Pipelines(config, session=spark)
    try:
        several.run(once=True)
    finally:
        several.close()


def test_two_databases_fan_in_to_one_table(pg_conn: Any, postgres: Any, spark: Any,
                                           warehouse: Path, tmp_path: Path,
                                           unique: str) -> None:
    dsns, conns = _databases(pg_conn, postgres, unique, ("east", "west"),
                             {"east": [unique], "west": [unique]})
    raw = _raw(dsns, {"east": [unique], "west": [unique]}, unique, warehouse, tmp_path)
    config = parse_config(raw, tmp_path)
    target = config.for_source("east").target_for(f"public.{unique}")
    assert target == config.for_source("west").target_for(f"public.{unique}")

    _run(config, spark)
    with conns["east"].cursor() as cur:
        cur.execute(f"UPDATE {unique} SET v = 'changed' WHERE id <= 5")
        cur.execute(f"DELETE FROM {unique} WHERE id > 18")
    with conns["west"].cursor() as cur:
        cur.execute(f"INSERT INTO {unique} VALUES (100, 'only west')")
        cur.execute(f"TRUNCATE {unique}")
        cur.execute(f"INSERT INTO {unique} VALUES (1, 'after truncate')")
    _run(config, spark)
    # Each source has gauges of its own: one source does not overwrite the other's.
    for name in ("east", "west"):
        assert REGISTRY.get_sample_value("walberg_pending_segment_bytes",
                                         {"source": name}) == 0.0, name

    table = hadoop_table(warehouse, target)
    got = sorted((r["_walberg_source"], r["id"], r["v"])
                 for r in table.scan().to_arrow().to_pylist())
    assert got == _source_rows(conns, unique)
    assert sorted((r["id"], r["v"]) for r in duckdb_rows(warehouse, target, key="id")) == \
        sorted((i, v) for _, i, v in _source_rows(conns, unique))
    summaries = [s.summary.additional_properties for s in table.snapshots()]
    assert any("walberg.lsn.east" in s for s in summaries)
    assert any("walberg.lsn.west" in s for s in summaries)
    assert [f.name for f in table.spec().fields][0] == "_walberg_source"

    with Lake(config, session=spark) as lake:
        verdicts = verify(lake)
    assert [(v.source, v.equal) for v in verdicts] == [
        (f"east:public.{unique}", True), (f"west:public.{unique}", True)]
    for conn in conns.values():
        conn.close()
    # status (and check) go through every source, without Spark.
    path = write_pipeline(raw, tmp_path / "pipeline.yaml")
    done = walberg_cli("status", "-c", str(path), "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert sorted(status) == ["east", "west"]
    for name in ("east", "west"):
        table_status = status[name]["tables"][f"public.{unique}"]
        assert table_status["iceberg_table"] == target and table_status["last_lsn"]
        # (its rows are the shared table's, every source's: said so, not passed off as its own)
        assert table_status["shared"] is True
        assert status[name]["slot"]["name"] == f"s_{name}_{unique}"


def _files(warehouse: Path, target: str) -> tuple[int, int]:
    """Data files and delete files of a table's current snapshot, as PyIceberg plans them."""
    tasks = list(hadoop_table(warehouse, target).scan().plan_files())
    return len(tasks), len({d.file_path for t in tasks for d in t.delete_files})


def _marks(warehouse: Path, target: str) -> dict[str, str]:
    """Each source's walberg.lsn.<source> in the table's remaining snapshots (the highest:
    where a restart of that source resumes)."""
    marks: dict[str, str] = {}
    for snap in hadoop_table(warehouse, target).snapshots():
        for key, value in snap.summary.additional_properties.items():
            if key.startswith("walberg.lsn.") and int(value.replace("/", ""), 16) > int(
                    marks.get(key, "0/0").replace("/", ""), 16):
                marks[key] = value
    return marks


def _lake(warehouse: Path, target: str) -> list[tuple[str, int, str, int]]:
    """(source, id, v, _walberg_lsn) of every row of a table."""
    return sorted((r["_walberg_source"], r["id"], r["v"], r["_walberg_lsn"])
                  for r in hadoop_table(warehouse, target).scan().to_arrow().to_pylist())


def _slot_exists(pg_conn: Any, slot: str) -> bool:
    with pg_conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        return cur.fetchone() is not None


def test_maintain_resync_and_slot_go_through_every_source(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    shared, only_a, only_b = unique, f"{unique}_a", f"{unique}_b"
    tables = {"a": [shared, only_a], "b": [shared, only_b]}
    dsns, conns = _databases(pg_conn, postgres, unique, ("a", "b"), tables)
    raw = _raw(dsns, tables, unique, warehouse, tmp_path)
    # Expire every snapshot the maintenance does not need: the LSN marks must survive that.
    raw["maintenance"] = {"snapshot_retention": "0s", "retain_last": 1}
    config = parse_config(raw, tmp_path)
    targets = {t: config.for_source(s).target_for(f"public.{t}")
               for s, mine in tables.items() for t in mine}
    assert len(set(targets.values())) == 3  # the shared table fans in

    # The copy, then small commits: several data and delete files in each source's partition.
    _run(config, spark)
    for round_ in range(3):
        for name, conn in conns.items():
            with conn.cursor() as cur:
                for table in tables[name]:
                    cur.execute(f"INSERT INTO {table} VALUES ({100 + round_}, 'r{round_}')")
                    cur.execute(f"UPDATE {table} SET v = 'u{round_}' WHERE id = {round_ + 1}")
        _run(config, spark)
    before = {t: _files(warehouse, target) for t, target in targets.items()}
    rows = {t: _lake(warehouse, target) for t, target in targets.items()}
    marks = {t: _marks(warehouse, target) for t, target in targets.items()}
    assert sorted(marks[shared]) == ["walberg.lsn.a", "walberg.lsn.b"]
    for table, (data_files, delete_files) in before.items():
        assert data_files >= 4 and delete_files >= 1, (table, data_files, delete_files)

    path = write_pipeline(raw, tmp_path / "pipeline.yaml")
    done = walberg_cli("maintain", "-c", str(path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    maintained = [line.split()[0] for line in done.stdout.splitlines()[2:-1]]
    assert sorted(maintained) == sorted(targets.values())  # every table, the shared one once
    for table, target in targets.items():
        data_files, delete_files = _files(warehouse, target)
        assert data_files < before[table][0] and delete_files == 0, (table, data_files)
        assert _lake(warehouse, target) == rows[table]  # the data is unchanged
        # Both sources' marks stay, at the same LSNs, though their snapshots expired: only
        # maintenance's own commits (newer than the expiry cut-off) are left to carry them.
        assert _marks(warehouse, target) == marks[table]
        assert {s.summary.operation.value for s in
                hadoop_table(warehouse, target).snapshots()} == {"replace"}

    # A restart of both sources after maintenance neither copies again nor re-applies (in
    # this process: the commands around it start JVMs enough).
    several = Pipelines(config, session=spark)
    try:
        reports = several.run(once=True)
    finally:
        several.close()
    assert {n: (r.copied, r.batches, r.changes) for n, r in reports.items()} == {
        "a": ({}, 0, 0), "b": ({}, 0, 0)}
    assert {t: _lake(warehouse, target) for t, target in targets.items()} == rows

    # resync --source b copies b's tables again (a fresh _walberg_lsn on each of b's rows) and
    # leaves a's rows, slot and tables as they were.
    a_slot = raw["sources"]["a"]["postgres"]["slot"]
    with pg_conn.cursor() as cur:
        cur.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    "WHERE slot_name = %s", (a_slot,))
        a_flush = cur.fetchone()[0]
    done = walberg_cli("resync", "-c", str(path), "--source", "b", "--yes")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "source b: copied" in done.stdout and "source a" not in done.stdout
    for table in (shared, only_b):
        after = _lake(warehouse, targets[table])
        assert [r[:3] for r in after] == [r[:3] for r in rows[table]]
        old_b = max(r[3] for r in rows[table] if r[0] == "b")
        assert all(r[3] > old_b for r in after if r[0] == "b"), table
        assert [r for r in after if r[0] == "a"] == [r for r in rows[table] if r[0] == "a"]
    assert _lake(warehouse, targets[only_a]) == rows[only_a]
    with pg_conn.cursor() as cur:
        cur.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    "WHERE slot_name = %s", (a_slot,))
        assert cur.fetchone()[0] == a_flush

    # A source name the file does not have: exit 2, naming the ones it has (before any Spark).
    for command in (["resync", "--yes"], ["slot", "drop", "--yes"]):
        done = walberg_cli(*command, "-c", str(path), "--source", "c", timeout=60)
        said = " ".join(done.stderr.split())
        assert done.returncode == 2 and "its sources are a, b" in said, said
    # slot without --source refuses: each source has a slot, and dropping both is costly.
    slots = [raw["sources"][n]["postgres"]["slot"] for n in ("a", "b")]
    done = walberg_cli("slot", "drop", "-c", str(path), "--yes", timeout=60)
    said = " ".join(done.stderr.split())  # the message is wrapped for the terminal
    assert done.returncode == 2 and "several sources (a, b)" in said, said
    assert "--source NAME" in said and all(_slot_exists(pg_conn, s) for s in slots)
    done = walberg_cli("slot", "drop", "-c", str(path), "--source", "b", "--yes", timeout=60)
    assert done.returncode == 0 and f"dropped replication slot {slots[1]}" in done.stdout
    assert _slot_exists(pg_conn, slots[0]) and not _slot_exists(pg_conn, slots[1])
    for conn in conns.values():
        conn.close()


def test_fan_in_sources_apply_by_position_each_to_its_own_rows(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: Any) -> None:
    """Two sources with the same keys fan in to one table: each applies its batches by
    position through an index of its own rows (its partition), so an update or delete of key
    7 in one never touches the other's key 7; each follows the other's commits without a
    rebuild, and a compaction."""
    import logging

    from walberg.lake.maintain import maintain

    dsns, conns = _databases(pg_conn, postgres, unique, ("east", "west"),
                             {"east": [unique], "west": [unique]})
    config = parse_config(_raw(dsns, {"east": [unique], "west": [unique]}, unique, warehouse,
                               tmp_path), tmp_path)
    target = config.for_source("east").target_for(f"public.{unique}")

    def lake() -> list[tuple[str, int, str]]:
        table = hadoop_table(warehouse, target)
        return sorted((r["_walberg_source"], r["id"], r["v"])
                      for r in table.scan().to_arrow().to_pylist())

    with caplog.at_level(logging.INFO, logger="walberg"):
        _run(config, spark)
    # Each source's copy written on the driver, into its own partition, the other's kept.
    assert len(re.findall(rf"initial copy of {re.escape(target)}: written on the driver",
                          caplog.text)) == 2, caplog.text[-4000:]
    assert lake() == _source_rows(conns, unique)
    rounds = [
        {"east": [f"UPDATE {unique} SET v = 'east changed' WHERE id <= 10",
                  f"DELETE FROM {unique} WHERE id >= 15"],
         "west": [f"UPDATE {unique} SET v = 'west changed' WHERE id BETWEEN 5 AND 12",
                  f"INSERT INTO {unique} SELECT g, 'west new' FROM generate_series(100, 110) g"]},
        {"west": [f"DELETE FROM {unique} WHERE id <= 3 OR id = 105"],
         "east": [f"UPDATE {unique} SET v = 'east again' WHERE id IN (1, 7, 12)"]},
    ]
    for n, statements in enumerate(rounds):
        if n == 1:
            maintain(Lake(config, session=spark), [f"public.{unique}"])
        for name, sqls in statements.items():
            with conns[name].cursor() as cur:
                for sql in sqls:
                    cur.execute(sql)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="walberg"):
            _run(config, spark)
        assert len(re.findall(rf"{re.escape(target)} by position: \d+ deleted, \d+ added "
                              r"\(written on the driver\)", caplog.text)) == 2, \
            caplog.text[-4000:]
        assert "rebuilt from the lake" not in caplog.text, caplog.text[-4000:]
        assert lake() == _source_rows(conns, unique)
    assert sorted((r["id"], r["v"]) for r in duckdb_rows(warehouse, target, key="id")) == \
        sorted((i, v) for _, i, v in _source_rows(conns, unique))
    for name in ("east", "west"):
        assert (tmp_path / "segments" / name / "keyindex").is_dir()
    # Each source's index is kept in the warehouse in a folder of its own; on a fresh driver
    # each fetches its own and goes on by position.
    kept = warehouse / target.split(".", 1)[1].replace(".", "/") / "_walberg_keys"
    assert sorted(p.name for p in kept.iterdir()) == ["east", "west"]
    for name in ("east", "west"):
        shutil.rmtree(tmp_path / "segments" / name / "keyindex")
    for name, sql in (("east", f"UPDATE {unique} SET v = 'east moved' WHERE id IN (2, 9)"),
                      ("west", f"DELETE FROM {unique} WHERE id = 9")):
        with conns[name].cursor() as cur:
            cur.execute(sql)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="walberg"):
        _run(config, spark)
    assert len(re.findall(rf"key index of {re.escape(target)} fetched from the warehouse",
                          caplog.text)) == 2, caplog.text[-4000:]
    assert "rebuilt from the lake" not in caplog.text, caplog.text[-4000:]
    assert lake() == _source_rows(conns, unique)
    for conn in conns.values():
        conn.close()


def test_fan_in_sources_maintain_their_shared_table_on_schedule_without_failing(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Two sources fan in to one table, each run with `maintenance.every`: both appliers'
    schedules come due together. The table is maintained once a period between them, never
    beside the other's commits, and the run goes on with every row right (each maintaining it
    by itself made two compactions of one table race, and the loser ended the run)."""
    dsns, conns = _databases(pg_conn, postgres, unique, ("east", "west"),
                             {"east": [unique], "west": [unique]})
    raw = _raw(dsns, {"east": [unique], "west": [unique]}, unique, warehouse, tmp_path)
    raw["maintenance"] = {"every": "1s", "snapshot_retention": "0s", "retain_last": 2}
    config = parse_config(raw, tmp_path)
    target = config.for_source("east").target_for(f"public.{unique}")
    several = Pipelines(config, session=spark)
    replaced = 0
    with running(several) as failures:  # type: ignore[arg-type]
        for i in range(1, 4):
            for name, conn in conns.items():
                with conn.cursor() as cur:
                    cur.execute(f"UPDATE {unique} SET v = '{name} {i}' WHERE id IN ({i}, {i + 5})")
                    cur.execute(f"INSERT INTO {unique} VALUES ({100 + i}, '{name} new')")
            for name, conn in conns.items():
                several.pipelines[name].wait_for(insert_lsn(conn), timeout=120)
            assert not failures, failures
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not failures:
            replaced = sum(1 for s in hadoop_table(warehouse, target).snapshots()
                           if s.summary is not None and s.summary.operation.value == "replace")
            if replaced:
                break
            time.sleep(0.5)
    assert not failures, failures
    assert replaced, "no compaction was kept in the table's history"
    assert _lake_rows(warehouse, target) == _source_rows(conns, unique)


def _lake_rows(warehouse: Path, target: str) -> list[tuple[str, int, str]]:
    """(source, id, v) of every row of a fan-in table, sorted."""
    rows = hadoop_table(warehouse, target).scan().to_arrow().to_pylist()
    return sorted((r["_walberg_source"], r["id"], r["v"]) for r in rows)


def test_fan_in_copies_keep_each_sources_dead_letters(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Both sources' copies have a row the Iceberg type cannot hold (NaN in a decimal): each
    goes to the shared dead-letter table with its source, and one source's copy replacing its
    own earlier dead letters leaves the other's (it deleted every copy's dead letters)."""
    dsns, conns = _databases(pg_conn, postgres, unique, ("east", "west"),
                             {"east": [unique], "west": [unique]})
    for name, conn in conns.items():
        with conn.cursor() as cur:
            cur.execute(f"ALTER TABLE {unique} ADD COLUMN amount numeric(8,2)")
            cur.execute(f"UPDATE {unique} SET amount = 'NaN' WHERE id = %s",
                        (1 if name == "east" else 2,))
    config = parse_config(_raw(dsns, {"east": [unique], "west": [unique]}, unique, warehouse,
                               tmp_path), tmp_path)
    target = config.for_source("east").target_for(f"public.{unique}")

    def dead() -> list[tuple[str, str, str]]:
        rows = hadoop_table(warehouse, target + "__dlq").scan().to_arrow().to_pylist()
        return sorted((d["_walberg_source"], d["id"], d["_walberg_op"]) for d in rows)

    _run(config, spark)
    both = [("east", "1", "snapshot"), ("west", "2", "snapshot")]
    assert dead() == both
    assert len(_lake_rows(warehouse, target)) == 38
    # One source's table copied again replaces that source's copy dead letters only.
    with Lake(config, session=spark) as lake:
        east = next(s for s in lake.sources if s.name == "east")
        resync(lake, [(east, [f"public.{unique}"])])
    assert dead() == both
    for conn in conns.values():
        conn.close()


# Per source: keys deleted, then keys moved (old, new) of rows with a TOASTed text, while the
# copies are cut short after keys 1-2000: copied to beyond, copied to not copied (a key freed
# before), not copied to below. The sources differ: a resume that touched the other source's
# rows would show.
MOVES = {"east": ((7, 2500, 3300), ((3, 5000), (15, 2500), (3499, -1))),
         "west": ((8, 2600, 3400), ((5, 5001), (17, 2600), (3501, -1)))}


def test_fan_in_chunked_copies_cut_short_together_resume_each_from_its_own_marks(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """Both sources copy by jdbc in chunks into the shared table and are killed together, each
    after two chunks of four; meanwhile both change (keys of rows with a TOASTed text moved
    across the copied ranges too, the text left as it was).
    Each resumes from its own chunks (not the other's) and the table ends as the union of the
    sources, nothing twice."""
    names = ("east", "west")
    dsns, conns = _databases(pg_conn, postgres, unique, names, {n: [unique] for n in names})
    for name, conn in conns.items():
        with conn.cursor() as cur:
            cur.execute(f"INSERT INTO {unique} SELECT g, '{name}' || g "
                        "FROM generate_series(21, 4000) g")
            cur.execute(f"ANALYZE {unique}")
    raw = _raw(dsns, {n: [unique] for n in names}, unique, warehouse, tmp_path)
    for source in raw["sources"].values():
        source["postgres"]["initial_copy"] = {"method": "jdbc", "chunk_rows": 1000,
                                              "parallelism": 1}
    config = parse_config(raw, tmp_path)
    target = config.for_source("east").target_for(f"public.{unique}")
    path = write_pipeline(raw, tmp_path / "pipeline.yaml")

    def copy_marks() -> dict[str, list[dict[str, str]]]:
        marks: dict[str, list[dict[str, str]]] = {n: [] for n in names}
        for snap in hadoop_table(warehouse, target).snapshots():
            summary = snap.summary.additional_properties
            if "walberg.copy.span" in summary:
                marks[summary["walberg.copy.source"]].append(summary)
        return marks

    for name, conn in conns.items():
        with conn.cursor() as cur:
            for old, _ in MOVES[name][1]:
                cur.execute(f"UPDATE {unique} SET v = (SELECT string_agg(md5(g::text || {old}),"
                            f" '') FROM generate_series(1, 400) g) WHERE id = {old}")
    killed = walberg_cli("-q", "run", "-c", str(path), "--once",
                         env={**os.environ, "WALBERG_CRASH_AT": "chunk:2@east+west",
                              "PYTHONUNBUFFERED": "1"})
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]
    assert {n: len(m) for n, m in copy_marks().items()} == {"east": 2, "west": 2}

    for name, conn in conns.items():
        gone, moves = MOVES[name]
        with conn.cursor() as cur:
            cur.execute(f"UPDATE {unique} SET v = v || '+' WHERE id % 4 = 0")
            cur.execute(f"DELETE FROM {unique} WHERE id IN {gone}")
            for old, new in moves:  # the TOASTed text left as it was
                cur.execute(f"UPDATE {unique} SET id = {new} WHERE id = {old}")
            cur.execute(f"INSERT INTO {unique} VALUES (5050, '{name} new')")
    _run(config, spark)
    assert _lake_rows(warehouse, target) == _source_rows(conns, unique)
    for name, marks in copy_marks().items():
        assert [m.get("walberg.copy.first") for m in marks].count("true") == 1, name
        spans = [m["walberg.copy.span"].split(":") for m in marks]
        for point in (-1, 1, 2000, 2001, 4000, 5001):  # each key range of each source copied once
            assert sum(1 for _, lo, hi in spans if (not lo or int(lo) <= point)
                       and (not hi or point < int(hi))) == 1, (name, point, spans)

    # The stream goes on from where each resumed copy ended.
    for name, conn in conns.items():
        with conn.cursor() as cur:
            cur.execute(f"UPDATE {unique} SET v = 'later' WHERE id IN (-1, 2500)")
            cur.execute(f"INSERT INTO {unique} VALUES (6060, '{name} later')")
    _run(config, spark)
    assert _lake_rows(warehouse, target) == _source_rows(conns, unique)
    for conn in conns.values():
        conn.close()


def test_a_parked_table_of_one_source_stops_neither_its_other_tables_nor_the_other_source(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path,
        unique: str) -> None:
    """A source whose run ends with a table parked (see runtime.parking) has applied its other
    tables; the other sources are not stopped for it, and the run ends parked, the table named
    with its source."""
    keyless = f"{unique}_k"
    tables = {"east": [unique, keyless], "west": [unique]}
    dsns, conns = _databases(pg_conn, postgres, unique, ("east", "west"), tables)
    config = parse_config(_raw(dsns, tables, unique, warehouse, tmp_path), tmp_path)
    _run(config, spark)
    with conns["east"].cursor() as cur:
        cur.execute(f"ALTER TABLE {keyless} REPLICA IDENTITY NOTHING")
        cur.execute(f"INSERT INTO {keyless} VALUES (100, 'held')")
        cur.execute(f"UPDATE {unique} SET v = 'east changed' WHERE id <= 3")
    with conns["west"].cursor() as cur:
        cur.execute(f"INSERT INTO {unique} VALUES (100, 'only west')")
        cur.execute(f"DELETE FROM {unique} WHERE id > 15")

    several = Pipelines(config, session=spark)
    try:
        several.run(once=True)
        raise AssertionError("the run did not say a table is parked")
    except TablesParked as exc:
        assert set(exc.parked) == {f"east:public.{keyless}"}, exc.parked
        assert "REPLICA IDENTITY NOTHING" in exc.parked[f"east:public.{keyless}"]
    finally:
        several.close()
    target = config.for_source("east").target_for(f"public.{unique}")
    got = sorted((r["_walberg_source"], r["id"], r["v"])
                 for r in hadoop_table(warehouse, target).scan().to_arrow().to_pylist())
    assert got == _source_rows(conns, unique)  # both sources' changes, east's among them
    for conn in conns.values():
        conn.close()
