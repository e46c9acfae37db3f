"""The initial copy written as the table's data files while COPY's stream is parsed: nothing
staged on disk first; a table whose rows turn out to need Spark is copied again, staged; a
COPY or a writer that fails midway leaves no file behind and does not hang."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions
import pytest

from conftest import as_file, make_config, run_once, run_once_within
from lake import duckdb_rows, hadoop_table, iceberg_rows, postgres_rows
from walberg.apply import batch
from walberg.apply.position import datafiles
from walberg.config import parse_config
from walberg.errors import SourceError
from walberg.runtime import initial_copy
from walberg.source import snapshot
from walberg.source.embedded_pg import psql_client
from walberg.source.postgres import SESSION_OPTIONS, describe_table


def _table(pg_conn: Any, name: str, rows: int) -> None:
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {name} (id bigint PRIMARY KEY, part int, amount numeric(12,2),"
                    " note text)")
        cur.execute(f"INSERT INTO {name} SELECT g, g %% 5, g / 100.0, repeat('x', g %% 50) || g "
                    "FROM generate_series(1, %s) g", (rows,))
        cur.execute(f"INSERT INTO {name} VALUES (-1, 0, 'NaN', 'not a decimal')")


def _copy_partitioned(postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
                      table: str, by: str, caplog: pytest.LogCaptureFixture) -> tuple[str, Any]:
    """Copy ``table`` partitioned by ``by`` in a --once run, its log captured: the target and
    the run's report."""
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    raw["sink"]["tables"] = {table: {"partition_by": [by]}}
    config = parse_config(raw, tmp_path)
    with caplog.at_level(logging.INFO, logger="walberg"):
        return config.target_for(table), run_once(config, spark)


def _copies(warehouse: Path, target: str) -> list[Path]:
    """The data files under the table's folder that a copy on the driver names."""
    folder = warehouse.joinpath(*target.split(".")[1:]) / "data"
    return sorted(folder.rglob("walberg-copy-*.parquet"))


def test_a_copy_is_written_as_it_is_read(pg_conn: Any, postgres: Any, spark: Any,
                                         warehouse: Path, tmp_path: Path, unique: str,
                                         caplog: pytest.LogCaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    table = f"public.{unique}"
    _table(pg_conn, table, 50_000)

    def staged(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("the copy was staged as Parquet first")
    monkeypatch.setattr(initial_copy, "csv_to_parquet", staged)
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    with caplog.at_level(logging.INFO, logger="walberg"):
        report = run_once(config, spark)
    assert report.copied[table] == 50_001  # (COPY's count: the dead letter too)
    assert "written on the driver as 1 data file(s)" in caplog.text
    expected = [r for r in postgres_rows(pg_conn, table) if r["id"] != -1]
    assert iceberg_rows(warehouse, target) == expected
    assert duckdb_rows(warehouse, target) == expected
    dead = hadoop_table(warehouse, f"{target}__dlq").scan().to_arrow().to_pylist()
    assert [(r["id"], r["_walberg_op"]) for r in dead] == [("-1", "snapshot")]
    assert "does not fit" in dead[0]["_dlq_reason"]
    assert len(_copies(warehouse, target)) == 1


def test_a_copy_into_more_partitions_than_it_keeps_files_open_is_written_on_the_driver(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the files a copy may keep open, each partition's held rows become a file of their
    own as they are let go: more, smaller files, the table exact, read by every reader."""
    table = f"public.{unique}"
    _table(pg_conn, table, 50_000)
    monkeypatch.setattr(datafiles, "MAX_OPEN_PARTITIONS", 3)
    monkeypatch.setattr(datafiles, "FANOUT_BUDGET_BYTES", 256 * 1024)  # rows let go often
    monkeypatch.setattr(batch, "CSV_BLOCK_BYTES", 256 * 1024)  # (in many parts)
    target, report = _copy_partitioned(postgres, spark, warehouse, tmp_path, unique, table,
                                       "part", caplog)
    assert "over 3 partitions" in caplog.text
    assert "staged for Spark" not in caplog.text
    assert report.copied[table] == 50_001
    expected = [r for r in postgres_rows(pg_conn, table) if r["id"] != -1]
    assert iceberg_rows(warehouse, target) == expected
    assert duckdb_rows(warehouse, target) == expected
    files = hadoop_table(warehouse, target).inspect.files().to_pylist()
    assert len(files) == len(_copies(warehouse, target)) > 5  # several a partition
    assert {f["partition"]["part"] for f in files} == set(range(5))


def test_a_copy_whose_rows_turn_out_to_need_spark_is_staged_again(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A partition value the driver cannot give Iceberg (the text Iceberg reads as a null
    partition) met midway: the files begun are removed, the stream stops, and the table is
    copied again in the same snapshot, staged, by Spark."""
    table = f"public.{unique}"
    _table(pg_conn, table, 50_000)
    with pg_conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} ADD COLUMN region text")
        cur.execute(f"UPDATE {table} SET region = 'r' || (id % 3)")
        cur.execute(f"UPDATE {table} SET region = '__HIVE_DEFAULT_PARTITION__' WHERE id = 40000")
    target, report = _copy_partitioned(postgres, spark, warehouse, tmp_path, unique, table,
                                       "region", caplog)
    assert "staged for Spark after all, because a partition value is the text " \
        "__HIVE_DEFAULT_PARTITION__" in caplog.text
    # (said once: the staged copy goes to Spark without a second try on the driver)
    assert caplog.text.count("because a partition value is the text") == 1, caplog.text
    assert report.copied[table] == 50_001
    expected = [r for r in postgres_rows(pg_conn, table) if r["id"] != -1]
    assert iceberg_rows(warehouse, target) == expected
    assert not _copies(warehouse, target)
    dead = hadoop_table(warehouse, f"{target}__dlq").scan().to_arrow().to_pylist()
    assert [r["id"] for r in dead] == ["-1"]


@pytest.mark.parametrize("fails", ["COPY", "connection", "writer at once", "writer midway"])
def test_a_copy_that_fails_midway_leaves_nothing(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """A COPY cut off after some rows (its reader saw a short stream), a COPY whose connection
    fails before it opens the pipe (its reader must not wait for it forever), or a reader that
    fails before it opens the pipe or while COPY still writes into it (COPY must not wait for
    it forever): the error is raised, no data file stays, the table holds no copy, and the
    next run copies it whole."""
    table = f"public.{unique}"
    # (midway: more than the reader's first 16 MB block, so that COPY is still writing)
    _table(pg_conn, table, 500_000 if fails == "writer midway" else 1000)
    real_tables = initial_copy.csv_tables

    def cut_copy(dsn: str, info: Any, out: Any, snapshot: Any, psql: Any) -> int:
        out.write(b"1,1,0.01,x1\n2,2,0.02,x2\n")
        raise SourceError("the initial copy was cut off (test)")

    def failing(*args: Any, **kwargs: Any) -> Any:
        tables = real_tables(*args, **kwargs)
        if fails == "writer midway":
            yield next(tables)
        raise RuntimeError("the writer failed (test)")

    real_connect = snapshot.connect

    def refused(*args: Any, **kwargs: Any) -> Any:  # (the COPY's own connection only)
        if threading.current_thread().name.startswith("copy-"):
            raise SourceError("could not connect to the source (test)")
        return real_connect(*args, **kwargs)

    if fails == "COPY":
        monkeypatch.setattr(initial_copy, "copy_table", cut_copy)
    elif fails == "connection":
        monkeypatch.setattr(snapshot, "connect", refused)
    else:
        monkeypatch.setattr(initial_copy, "csv_tables", failing)
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    target = config.target_for(table)
    with pytest.raises((SourceError, RuntimeError), match="(test)"):
        run_once_within(240, config, spark)
    assert not _copies(warehouse, target)
    assert hadoop_table(warehouse, target).current_snapshot() is None

    monkeypatch.undo()
    run_once(config, spark)
    expected = [r for r in postgres_rows(pg_conn, table) if r["id"] != -1]
    assert iceberg_rows(warehouse, target) == expected


def test_a_table_rewritten_while_an_earlier_one_is_copied_is_copied_in_a_snapshot_of_its_own(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """One snapshot serves every table of a first copy. A table rewritten after it (here by
    ALTER TABLE ... TYPE, committed while the table before it is copied) keeps its rows in a
    new file the older snapshot reads as empty, and the rewrite is not streamed: it was
    copied empty, silently. It is found under its lock and copied in a newer snapshot."""
    first, second = f"public.{unique}_a", f"public.{unique}_b"
    with pg_conn.cursor() as cur:
        for name in (first, second):
            cur.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v int)")
            cur.execute(f"INSERT INTO {name} SELECT g, g * 10 FROM generate_series(1, 50) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique,
                              [first, second]))
    # One table after the other, as a copy of more tables than sink.commit_parallelism copies
    # its later ones: the second is locked only once the first is copied.
    raw["sink"]["commit_parallelism"] = 1
    config = parse_config(raw, tmp_path)
    original = initial_copy.InitialCopy._copy_whole_in

    def rewrite_the_second_first(self: Any, info: Any, created: Any, folder: Path) -> int:
        if info.qualified_name == first:  # while the first is copied, the second is rewritten
            with pg_conn.cursor() as cur:
                cur.execute(f"ALTER TABLE {second} ALTER COLUMN v TYPE bigint")
        return original(self, info, created, folder)

    monkeypatch.setattr(initial_copy.InitialCopy, "_copy_whole_in", rewrite_the_second_first)
    with caplog.at_level(logging.WARNING, logger="walberg"):
        run_once(config, spark)
    for name in (first, second):
        assert iceberg_rows(warehouse, config.target_for(name)) == postgres_rows(pg_conn, name)
    assert f"{second} was rewritten after the copy's snapshot" in caplog.text
    monkeypatch.setattr(initial_copy.InitialCopy, "_copy_whole_in", original)
    with pg_conn.cursor() as cur:  # and the stream goes on from the newer snapshot
        cur.execute(f"INSERT INTO {second} VALUES (51, 5000000000)")
        cur.execute(f"UPDATE {second} SET v = -1 WHERE id = 3")
    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(second)) == postgres_rows(pg_conn, second)


@pytest.mark.parametrize("method,comes", [("copy", "locked"), ("jdbc", "locked"),
                                          ("jdbc", "measured")])
def test_a_copy_never_waits_for_good_behind_an_alter_that_waits_for_it(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, method: str,
        comes: str) -> None:
    """A table is locked on one connection while it is read on others (the COPY's own, or
    psql's; a chunked copy's JDBC readers). An ALTER TABLE that came in between waits for the
    first; the read then queued behind the ALTER, which waited for the copy: neither ever went
    on (nor did the application's queries on the table, queued behind the ALTER). The read now
    gives up after a short wait, the lock is let go, the ALTER goes on, and the table is copied
    in a snapshot of its own. The ALTER comes once the table is locked, or (a chunked copy)
    once its key range is measured: then the JDBC readers meet it."""
    from walberg.source import chunks

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
        cur.execute(f"INSERT INTO {table} SELECT g, g * 10 FROM generate_series(1, 50) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    if method == "jdbc":
        raw["source"]["postgres"]["initial_copy"] = {"method": "jdbc", "chunk_rows": 1000,
                                                     "parallelism": 1}
    config = parse_config(raw, tmp_path)
    altered: list[BaseException | None] = []

    def alter(conn: Any) -> None:
        try:
            with conn, conn.cursor() as cur:
                cur.execute(f"ALTER TABLE {table} ALTER COLUMN v TYPE bigint")
            altered.append(None)
        except BaseException as exc:
            altered.append(exc)
        finally:
            conn.close()

    def alter_under_the_lock() -> None:
        if not getattr(alter_under_the_lock, "started", False):
            alter_under_the_lock.started = True  # type: ignore[attr-defined]
            other = psycopg2.connect(postgres.dsn)
            pid = other.get_backend_pid()
            threading.Thread(target=alter, args=(other,), daemon=True).start()
            with psycopg2.connect(postgres.dsn) as watch, watch.cursor() as cur:
                for _ in range(600):  # until the ALTER waits for the copy's lock
                    cur.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                (pid,))
                    if cur.fetchone()[0] == "Lock" or altered:
                        break
                    threading.Event().wait(0.1)
            assert not altered, f"the ALTER did not wait for the copy's lock: {altered}"

    module, name = (initial_copy, "hold_and_check") if comes == "locked" else \
        (chunks, "table_extent")
    original = getattr(module, name)

    def then_the_alter(*args: Any) -> Any:
        done = original(*args)
        alter_under_the_lock()
        return done

    monkeypatch.setattr(module, name, then_the_alter)
    with caplog.at_level(logging.WARNING, logger="walberg"):
        run_once_within(120, config, spark)
    assert altered == [None]
    assert f"the initial copy of {table} waited {snapshot.LOCK_WAIT} behind another session's" \
        in caplog.text
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)
    monkeypatch.setattr(module, name, original)
    with pg_conn.cursor() as cur:  # and the stream goes on from the newer snapshot
        cur.execute(f"INSERT INTO {table} VALUES (51, 5000000000)")
        cur.execute(f"UPDATE {table} SET v = -1 WHERE id = 3")
    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)


def _tricky_table(pg_conn: Any, name: str) -> None:
    """Values whose text depends on the session's settings or on CSV's quoting rules."""
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, t text, ts timestamptz, "
                    "d date, f float8, b bytea, i interval)")
        cur.execute(f"INSERT INTO {name} VALUES "
                    "(1, NULL, '2024-03-01 12:00:00+05', '2024-03-01', 0.1, '\\x00ff', "
                    "'1 day 2 hours'), "
                    "(2, '', NULL, NULL, 1e-300, NULL, NULL), "
                    "(3, E'two\\nlines, \"quoted\" and ünïcode', '1999-12-31 23:59:59.999999+00', "
                    "'0044-03-15 BC', 'NaN', '', '-3 months')")


def test_a_copy_goes_through_psql_when_psycopg2_connected_in_the_clear(
        pg_conn: Any, postgres: Any, tmp_path: Path, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's server has no TLS, so psql copies: the bytes psycopg2 writes (the session's
    settings and CSV's quoting the same), in the snapshot it is given, the row count left to
    the reader; WALBERG_COPY_CLIENT=psycopg2 keeps psycopg2."""
    table = f"public.{unique}"
    _tricky_table(pg_conn, table)
    info = describe_table(pg_conn, table)
    held = psycopg2.connect(postgres.dsn)
    try:
        held.set_session(isolation_level="REPEATABLE READ", readonly=True)
        with held.cursor() as cur:
            cur.execute("SELECT pg_export_snapshot()")
            exported = cur.fetchone()[0]
        with pg_conn.cursor() as cur:  # after the snapshot: not in the copy
            cur.execute(f"INSERT INTO {table} (id, t) VALUES (4, 'later')")
        psql = psql_client()
        with open(tmp_path / "psql.csv", "wb") as out:
            by_psql = snapshot.copy_table(postgres.dsn, info, out, exported, psql)
        monkeypatch.setenv("WALBERG_COPY_CLIENT", "psycopg2")
        with open(tmp_path / "driver.csv", "wb") as out:
            by_driver = snapshot.copy_table(postgres.dsn, info, out, exported, psql)
    finally:
        held.close()
    assert by_psql is None and by_driver == 3
    sent = (tmp_path / "psql.csv").read_bytes()
    assert sent == (tmp_path / "driver.csv").read_bytes()
    assert b"later" not in sent and b'""' in sent and b"+00" in sent and b"\\x00ff" in sent
    assert sent.count(b"\n") == 4  # three rows, one of two lines


def test_psql_that_cannot_connect_leaves_the_copy_to_psycopg2_and_a_failed_copy_is_said(
        pg_conn: Any, postgres: Any, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """psql refused a connection, or that cannot be run at all, writes nothing (psycopg2 then
    copies, a warning says why); a COPY that fails in psql is an error for people: the table,
    the server's reason, what to do, not psql's own prefixes."""
    table = f"public.{unique}"
    _tricky_table(pg_conn, table)
    info = describe_table(pg_conn, table)
    psql = psql_client()
    assert psql is not None
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    query = f"COPY (SELECT * FROM {table}) TO STDOUT WITH (FORMAT csv)"
    with open(tmp_path / "none.csv", "wb") as out, \
            caplog.at_level(logging.WARNING, logger="walberg"):
        dsn = f"host=127.0.0.1 port={closed} dbname=app"
        assert not snapshot._copy_by_psql(psql, dsn, query, out, None, info)
    assert (tmp_path / "none.csv").read_bytes() == b""
    assert f"the initial copy of {table} goes through psycopg2, as will the others this run: " \
        "psql could not connect" in caplog.text
    # A psql that cannot be run at all (not there, not executable here): psycopg2 copies.
    with open(tmp_path / "driver.csv", "wb") as out:
        assert snapshot.copy_table(postgres.dsn, info, out, None, tmp_path / "no-psql") == 3
    assert (tmp_path / "driver.csv").read_bytes().count(b"\n") == 4
    assert "cannot be run" in caplog.text
    # Said once a run, not once a table: the next copy goes straight to psycopg2.
    caplog.clear()
    with open(tmp_path / "again.csv", "wb") as out:
        assert snapshot.copy_table(postgres.dsn, info, out, None, tmp_path / "no-psql") == 3
    assert "cannot be run" not in caplog.text
    with pytest.raises(SourceError, match=f"initial copy of {table} failed: snapshot "
                                          '"00000003-0000001B-1" does not exist.*run walberg '
                                          "again") as failed, \
            open(tmp_path / "gone.csv", "wb") as out:
        snapshot._copy_by_psql(psql, postgres.dsn, query, out, "00000003-0000001B-1", info)
    assert "psql:" not in str(failed.value)


@pytest.mark.parametrize("dsn", ["postgresql://walberg:s3cret@db.example.com:6543/app",
                                 "host=db.example.com port=6543 user=walberg password=s3cret "
                                 "dbname=app options='-c work_mem=64MB'"])
def test_psql_gets_the_password_in_its_environment_not_on_its_command_line(dsn: str) -> None:
    """A process's command line is readable by every user of the machine (ps, /proc); its
    environment only by its own."""
    command, env = snapshot.psql_invocation(Path("/opt/pg/bin/psql"), dsn)
    line = " ".join(command)
    assert "s3cret" not in line and env["PGPASSWORD"] == "s3cret"
    conninfo = psycopg2.extensions.parse_dsn(command[-1])
    assert conninfo["host"] == "db.example.com" and conninfo["port"] == "6543"
    assert conninfo["sslmode"] == "disable" and conninfo["application_name"] == "walberg"
    assert conninfo["options"].endswith(SESSION_OPTIONS)
    assert ("work_mem" in conninfo["options"]) == ("work_mem" in dsn)
