"""A primary failover: walberg's failover slot, synchronised to a physical standby, survives the
primary's SIGKILL and the standby's promotion; walberg, with both hosts in its DSN, carries on
from the promoted standby without copying anything again, and the lake equals the new primary.
Without a synchronised slot it stops with the way out, and `walberg resync` repairs it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import insert_lsn, run_once, running
from lake import iceberg_rows, postgres_rows
from replica import Standby, connect, kill, start_pair, wait_synced
from walberg.config import Config, parse_config
from walberg.errors import Terminal
from walberg.lake.services import Lake
from walberg.ops.check import check
from walberg.ops.resync import plan, resync
from walberg.ops.verify import verify
from walberg.pipeline import Pipeline
from walberg.source.embedded_pg import EmbeddedPostgres


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[EmbeddedPostgres, Standby]]:
    sync_slots = getattr(request, "param", True)
    primary, standby = start_pair(sync_slots, logical_decoding_work_mem="'64kB'")
    yield primary, standby
    standby.stop()
    primary.stop()


def _config(primary: EmbeddedPostgres, standby: Standby, warehouse: Path, tmp_path: Path,
            name: str, table: str) -> Config:
    # Both hosts, as libpq takes them; only the one that accepts writes is the source.
    dsn = (f"host=127.0.0.1,127.0.0.1 port={primary.port},{standby.port} user={primary.user} "
           f"dbname={primary.database} target_session_attrs=read-write")
    raw = {
        "source": {"postgres": {"dsn": dsn, "slot": f"slot_{name}", "publication": f"pub_{name}",
                                "tables": [table], "status_interval_seconds": 1,
                                "reconnect_max_seconds": 120}},
        "sink": {"catalog": {"name": "lake", "type": "hadoop", "warehouse": str(warehouse)},
                 "namespace": f"ns_{name}"},
        "buffer": {"dir": str(tmp_path / "segments"), "max_interval_seconds": 0.5},
        "spark": {"master": "local[2]"},
    }
    return parse_config(raw, tmp_path, "test config")


def _writer(server: Any, table: str, start: int, stop: threading.Event,
            errors: list[BaseException]) -> None:
    """Mixed changes until stopped or the server dies: inserts, updates, a key change and a
    delete per round, and every tenth round a transaction large enough to be streamed."""
    try:
        conn = connect(server)
        with conn.cursor() as cur:
            i = start
            while not stop.is_set():
                i += 1
                cur.execute(f"INSERT INTO {table} VALUES ({i}, 'w{i}', 0)")
                cur.execute(f"UPDATE {table} SET n = n + 1, v = 'u{i}' WHERE id = {i - 5}")
                cur.execute(f"UPDATE {table} SET id = -id WHERE id = {i - 7}")
                cur.execute(f"DELETE FROM {table} WHERE id = {i - 9}")
                if i % 10 == 0:
                    cur.execute(f"UPDATE {table} SET n = n + 1 WHERE id BETWEEN 1 AND 2000")
                time.sleep(0.02)
    except Exception as exc:  # the primary killed under it: expected
        errors.append(exc)


def test_failover_to_a_standby_with_the_synchronised_slot(
        pair: tuple[EmbeddedPostgres, Standby], spark: Any, warehouse: Path,
        tmp_path: Path, unique: str, caplog: pytest.LogCaptureFixture) -> None:
    primary, standby = pair
    table = f"public.{unique}"
    with connect(primary).cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text, n int)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g, 0 FROM generate_series(1, 2000) g")
    config = _config(primary, standby, warehouse, tmp_path, unique, table)
    target = config.target_for(table)
    run_once(config, spark)  # the initial copy; the slot is made a failover slot
    with Lake(config, session=spark) as lake:
        [checks] = check(lake)
    failover = next(r for r in checks.results if r.name == "failover")
    assert not failover.ok and "does not hold slot" in failover.detail, failover.detail

    caplog.set_level(logging.INFO, logger="walberg")
    caplog.clear()
    pipeline = Pipeline(config, session=spark)
    stop, errors = threading.Event(), []  # type: ignore[var-annotated]
    writer = threading.Thread(target=_writer, args=(primary, table, 2000, stop, errors))
    try:
        with running(pipeline) as failures:
            writer.start()
            # The standby keeps a copy of the slot once walberg has moved it on.
            wait_synced(primary, standby, config.postgres.slot)
            with Lake(config, session=spark) as lake:
                [checks] = check(lake)
            failover = next(r for r in checks.results if r.name == "failover")
            assert failover.ok and "synchronised" in failover.detail, failover.detail
            time.sleep(3)  # batches applied meanwhile, one under way when the primary dies
            kill(primary)
            stop.set()
            writer.join(30)
            promoted = time.monotonic()
            standby.promote()
            with connect(standby).cursor() as cur:
                cur.execute(f"INSERT INTO {table} VALUES (-100000, 'after the failover', 0)")
                cur.execute(f"UPDATE {table} SET v = 'after' WHERE id BETWEEN 100 AND 120")
                cur.execute(f"DELETE FROM {table} WHERE id BETWEEN 121 AND 130")
            lsn = insert_lsn(connect(standby))
            pipeline.wait_for(lsn, timeout=150)
            took = time.monotonic() - promoted
            assert not failures, failures
    finally:
        pipeline.close()
    print(f"from the promotion to the lake holding the new primary's first commit: {took:.1f} s")
    new_primary = connect(standby)
    assert iceberg_rows(warehouse, target) == postgres_rows(new_primary, table)
    # Copied once, before the failover: not again after it.
    assert "failed over (timeline 1 -> 2)" in caplog.text
    assert "initial copy" not in caplog.text and "copying it again" not in caplog.text
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake)
    assert verdict.equal, verdict


@pytest.mark.parametrize("promoted_first", [False, True])
@pytest.mark.parametrize("pair", [False], indirect=True)
def test_failover_without_a_synchronised_slot_stops_and_resync_repairs(
        pair: tuple[EmbeddedPostgres, Standby], spark: Any, warehouse: Path,
        tmp_path: Path, unique: str, promoted_first: bool) -> None:
    """The standby promoted after the primary died, or already when walberg first looks into
    the lost connection (the DSN then reaches it at once, where the slot is missing): either
    way walberg says the source failed over, not that the slot was dropped."""
    primary, standby = pair
    table = f"public.{unique}"
    with connect(primary).cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text, n int)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g, 0 FROM generate_series(1, 100) g")
    config = _config(primary, standby, warehouse, tmp_path, unique, table)
    target = config.target_for(table)
    run_once(config, spark)
    with Lake(config, session=spark) as lake:
        [checks] = check(lake)
    failover = next(r for r in checks.results if r.name == "failover")
    assert not failover.ok and "sync_replication_slots" in failover.detail, failover.detail

    pipeline = Pipeline(config, session=spark)
    try:
        with running(pipeline) as failures:
            with connect(primary).cursor() as cur:
                cur.execute(f"UPDATE {table} SET n = 1 WHERE id <= 10")
                pipeline.wait_for(insert_lsn(connect(primary)), timeout=60)
            if promoted_first:
                standby.promote()
                kill(primary)
            else:
                kill(primary)
                standby.promote()
            with connect(standby).cursor() as cur:
                cur.execute(f"DELETE FROM {table} WHERE id > 90")
            deadline = time.monotonic() + 120
            while not failures and time.monotonic() < deadline:
                time.sleep(0.2)
            assert failures and isinstance(failures[0], Terminal), failures
            message = str(failures[0])
            assert "failed over" in message and "walberg resync" in message, message
    finally:
        pipeline.close()
    # No wrong data meanwhile: the lake still holds what it held before the failover.
    assert len(iceberg_rows(warehouse, target)) == 100
    with Lake(config, session=spark) as lake:
        resync(lake, plan(lake, []))
    run_once(config, spark)
    assert iceberg_rows(warehouse, target) == postgres_rows(connect(standby), table)


def test_a_server_without_failover_slots_works_as_before(
        spark: Any, warehouse: Path, tmp_path: Path, unique: str) -> None:
    """PostgreSQL 15 (before failover slots): the slot is an ordinary one, streaming works as
    always, and check reports the failover setting instead of requiring it."""
    debian = Path("/usr/lib/postgresql/15/bin")
    if not (debian / "postgres").exists():
        pytest.skip("Debian's PostgreSQL 15 is not installed here (.ci/run installs it)")
    with EmbeddedPostgres(bin_dir=debian) as server:
        table = f"public.{unique}"
        with connect(server).cursor() as cur:
            cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
            cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 50) g")
        raw = {
            "source": {"postgres": {"dsn": server.dsn, "slot": f"slot_{unique}",
                                    "publication": f"pub_{unique}", "tables": [table],
                                    "failover_slot": True}},
            "sink": {"catalog": {"name": "lake", "type": "hadoop", "warehouse": str(warehouse)},
                     "namespace": f"ns_{unique}"},
            "buffer": {"dir": str(tmp_path / "segments"), "max_interval_seconds": 0.5},
            "spark": {"master": "local[2]"},
        }
        config = parse_config(raw, tmp_path, "test config")
        run_once(config, spark)
        with connect(server).cursor() as cur:
            cur.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 5")
            cur.execute(f"DELETE FROM {table} WHERE id > 45")
        run_once(config, spark)
        assert iceberg_rows(warehouse, config.target_for(table)) == \
            postgres_rows(connect(server), table)
        with Lake(config, session=spark) as lake:
            [checks] = check(lake)
        failover = next(r for r in checks.results if r.name == "failover")
        assert failover.ok and "no failover slots" in failover.detail, failover.detail


@pytest.mark.parametrize("pair", [False], indirect=True)
def test_a_failover_while_walberg_was_down_is_caught_at_start(
        pair: tuple[EmbeddedPostgres, Standby], spark: Any, warehouse: Path,
        tmp_path: Path, unique: str) -> None:
    """Each commit records the source server (system identifier and timeline) its LSN belongs
    to: a walberg started after a failover to a standby without the slot stops with the way
    out instead of creating a slot and copying silently; started against another server, the
    same."""
    primary, standby = pair
    table = f"public.{unique}"
    with connect(primary).cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 20) g")
    config = _config(primary, standby, warehouse, tmp_path, unique, table)
    run_once(config, spark)
    with connect(primary).cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'streamed' WHERE id <= 5")
    run_once(config, spark)
    kill(primary)
    standby.promote()
    with pytest.raises(Terminal, match=r"failed over \(timeline 1 -> 2\).*walberg resync"):
        run_once(config, spark)
    with Lake(config, session=spark) as lake:
        resync(lake, plan(lake, []))
    with connect(standby).cursor() as cur:
        cur.execute(f"DELETE FROM {table} WHERE id > 15")
    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(table)) == \
        postgres_rows(connect(standby), table)
    # Another server behind the pipeline's address: stopped, nothing written.
    with EmbeddedPostgres() as other:
        with connect(other).cursor() as cur:
            cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        moved = config.model_copy(update={"source": config.source.model_copy(update={
            "postgres": config.postgres.model_copy(update={"dsn": other.dsn})})})
        with pytest.raises(Terminal, match="another PostgreSQL server"):
            run_once(moved, spark)
