"""walberg against an Iceberg REST catalog (tests/rest_catalog: the REST spec over a JDBC
catalog, OAuth2 client credentials, multi-table commits all or nothing): every command, the
errors a REST user meets, and source transactions that span tables made visible at once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from conftest import as_file, make_config, walberg_cli, walberg_ok, write_pipeline
from rest_catalog import RestServer, rest_server
from shop import LINES, consistent_cut, half_transactions, make_shop, write_shop


@pytest.fixture(scope="module")
def rest(postgres: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestServer]:
    folder = tmp_path_factory.mktemp("rest")
    with rest_server(postgres, folder / "warehouse", folder / "server.log") as server:
        yield server


def _pipeline(postgres: Any, tmp_path: Path, unique: str, tables: list[str],
              catalog: dict[str, Any], **sink: Any) -> Path:
    raw = as_file(make_config(postgres, tmp_path / "wh-unused", tmp_path / "segments", unique,
                              tables))
    raw["sink"]["catalog"] = catalog
    raw["sink"].update(sink)
    return write_pipeline(raw, tmp_path / "pipeline.yaml")


def test_every_command_against_a_rest_catalog(rest: RestServer, postgres: Any, pg_conn: Any,
                                              tmp_path: Path, unique: str) -> None:
    orders, lines = make_shop(pg_conn, unique)
    path = _pipeline(postgres, tmp_path, unique, [orders, lines], rest.catalog())

    def walberg(*args: str) -> str:
        return walberg_ok("-q", *args, "-c", str(path))

    checked = walberg("check")
    assert f"rest catalog lake at {rest.uri}: authenticated" in checked
    assert "commits several tables at once (POST /v1/{prefix}/transactions/commit)" in checked
    walberg("run", "--once")
    namespace = f"ns_{unique}"
    catalog = rest.pyiceberg()  # an independent reader, through the same server
    copied = catalog.load_table(f"{namespace}.o_{unique}").metadata.current_snapshot_id
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {orders} SET total = 0 WHERE id <= 10")
        cur.execute(f"DELETE FROM {lines} WHERE order_id > 190")
        cur.execute(f"INSERT INTO {orders} VALUES (201, 'new', 1)")
    walberg("run", "--once")
    verified = walberg("verify")
    assert verified.count("[ok  ]") == 2, verified

    lake_orders = catalog.load_table(f"{namespace}.o_{unique}").scan().to_arrow()
    assert lake_orders.num_rows == 201
    assert sorted(lake_orders.column("id").to_pylist())[-1] == 201
    status = json.loads(walberg_ok("status", "--json", "-c", str(path)))
    mine = status["tables"][orders]
    assert mine["rows"] == 201 and mine["last_lsn"] is not None
    assert status["catalog"]["atomic_commits"] is True
    history = walberg("history", orders)
    assert "overwrite" in history or "append" in history
    counted = walberg("query", f"SELECT count(*) AS n FROM lake.{namespace}.l_{unique}")
    assert f"{190 * LINES}" in counted
    changed = walberg("changes", orders, "--from", str(copied), "--format", "csv")
    assert changed.count("\n") == 12, changed  # a header, ten updated orders, the new one
    walberg("maintain")
    walberg("resync", lines, "--yes")  # the table copied again: a replace through the catalog
    walberg("verify")


def test_rest_authentication_errors_say_what_was_refused(
        rest: RestServer, postgres: Any, pg_conn: Any, tmp_path: Path, unique: str) -> None:
    """A wrong secret, an unknown or expired token, a namespace the principal may not use: one
    paragraph naming the catalog, what it refused and what to check; no Java stack trace."""
    orders, _ = make_shop(pg_conn, unique)
    cases = {
        "wrong secret": (rest.catalog(credential="walberg:wrong"), "401"),
        "unknown token": ({**rest.catalog(), "credential": None, "token": "not-a-token"}, "401"),
    }
    for what, (catalog, code) in cases.items():
        folder = tmp_path / what.replace(" ", "-")
        folder.mkdir()
        path = _pipeline(postgres, folder, unique, [orders],
                         {k: v for k, v in catalog.items() if v is not None})
        for command in (["check"], ["run", "--once"]):
            done = walberg_cli(*command, "-c", str(path), timeout=240)
            out = done.stdout + done.stderr
            assert done.returncode != 0, (what, command, out)
            assert rest.uri in out and code in out, (what, command, out)
            assert "credential" in out or "token" in out, (what, command, out)
            assert "Traceback" not in out and "\tat org.apache" not in out, (what, command, out)
            assert "REQUIRES_SINGLE_PART_NAMESPACE" not in out, (what, command, out)


def test_an_expired_token_and_a_forbidden_namespace(postgres: Any, pg_conn: Any, tmp_path: Path,
                                                    unique: str) -> None:
    orders, _ = make_shop(pg_conn, unique)
    with rest_server(postgres, tmp_path / "warehouse", tmp_path / "server.log",
                     token_seconds="1", forbid=f"ns_{unique}") as server:
        token = server.token()
        time.sleep(1.5)
        expired = _pipeline(postgres, tmp_path, unique, [orders],
                            {**{k: v for k, v in server.catalog().items()
                                if k != "credential"}, "token": token})
        done = walberg_cli("check", "-c", str(expired), timeout=120)
        out = done.stdout + done.stderr
        assert done.returncode != 0 and "expired" in out and server.uri in out, out
        forbidden = tmp_path / "forbidden"
        forbidden.mkdir()
        path = _pipeline(postgres, forbidden, unique, [orders], server.catalog())
        done = walberg_cli("run", "--once", "-c", str(path), timeout=240)
        out = done.stdout + done.stderr
        assert done.returncode != 0 and "403" in out and f"ns_{unique}" in out, out
        assert "\tat org.apache" not in out, out


def test_a_reader_never_sees_half_a_source_transaction(postgres: Any, pg_conn: Any,
                                                       tmp_path: Path, unique: str) -> None:
    """Orders and their lines written in the same source transactions while walberg streams
    them into a REST catalog: every consistent cut a reader takes meanwhile holds whole
    transactions only (each table's share of a batch lands in one catalog transaction). The
    server refuses the first two multi-table commits with 409, as when another writer's commit
    lands first: nothing of them is visible, and the batch is applied again."""
    orders, lines = make_shop(pg_conn, unique)
    with rest_server(postgres, tmp_path / "warehouse", tmp_path / "server.log",
                     conflicts="2") as rest:
        _stream_and_read(rest, postgres, tmp_path, unique, orders, lines)


def _stream_and_read(rest: RestServer, postgres: Any, tmp_path: Path, unique: str,
                     orders: str, lines: str) -> None:
    path = _pipeline(postgres, tmp_path, unique, [orders, lines], rest.catalog(),
                     commit_parallelism=2)
    walberg_ok("-q", "run", "--once", "-c", str(path))
    namespace = f"ns_{unique}"
    names = f"{namespace}.o_{unique}", f"{namespace}.l_{unique}"
    catalog = rest.pyiceberg()

    stop = threading.Event()
    counts = {"transactions": 0}
    writer = threading.Thread(target=write_shop, args=(postgres.dsn, orders, lines, stop, counts))
    log = open(tmp_path / "run.log", "w")
    run = subprocess.Popen([sys.executable, "-m", "walberg.cli", "run", "-c", str(path)],
                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    cuts, snapshots = 0, set()
    try:
        writer.start()
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            first, second = consistent_cut(catalog, *names)
            problems = half_transactions(first.scan().to_arrow(), second.scan().to_arrow())
            assert not problems, (cuts, problems[:5])
            cuts += 1
            snapshots.add(first.metadata.current_snapshot_id)
    finally:
        stop.set()
        writer.join(timeout=30)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
        log.close()
    output = (tmp_path / "run.log").read_text()
    assert run.returncode == 0, output[-3000:]
    # The reader saw the lake move many times, and the commits were made together.
    assert counts["transactions"] > 100 and cuts > 10 and len(snapshots) > 5, \
        (counts, cuts, len(snapshots))
    assert "committed together in one catalog transaction" in output, output[-3000:]
    assert output.count("failed (") >= 2 and "CommitFailedException" in output, output[-3000:]
    walberg_ok("-q", "run", "--once", "-c", str(path))
    verified = walberg_ok("-q", "verify", "-c", str(path))
    assert verified.count("[ok  ]") == 2, verified


def _lsns(catalog: Any, names: tuple[str, str]) -> list[Optional[str]]:
    """The position each table's current snapshot holds (walberg.lsn)."""
    out = []
    for name in names:
        snapshot = catalog.load_table(name).current_snapshot()
        out.append(None if snapshot is None
                   else snapshot.summary.additional_properties.get("walberg.lsn"))
    return out


def test_kill_9_around_a_multi_table_commit_loses_duplicates_and_splits_nothing(
        postgres: Any, pg_conn: Any, tmp_path: Path, unique: str) -> None:
    """kill -9 while a batch's tables wait for each other, while the catalog commits them (the
    server pauses inside the commit, which completes without the client) and once it has,
    then a restart; and a commit whose outcome walberg does not learn. After each, both tables
    hold the same position (every source transaction touches both), and at the end the lake
    equals Postgres, whole transactions only."""
    orders, lines = make_shop(pg_conn, unique)
    with rest_server(postgres, tmp_path / "warehouse", tmp_path / "server.log",
                     commit_delay_ms="1500") as server:
        path = _pipeline(postgres, tmp_path, unique, [orders, lines], server.catalog())
        walberg_ok("-q", "run", "--once", "-c", str(path))
        namespace = f"ns_{unique}"
        names = f"{namespace}.o_{unique}", f"{namespace}.l_{unique}"
        catalog = server.pyiceberg()
        stop = threading.Event()
        counts = {"transactions": 0}
        writer = threading.Thread(target=write_shop,
                                  args=(postgres.dsn, orders, lines, stop, counts))
        writer.start()
        killed = []
        try:
            for point in ("group-joined:1", "group-commit:1", "group-committed:1",
                          "group-commit:3", "group-committed:3"):
                env = dict(os.environ, WALBERG_CRASH_AT=point)
                done = subprocess.run([sys.executable, "-m", "walberg.cli", "-q", "run", "-c",
                                       str(path)], env=env, capture_output=True, text=True,
                                      timeout=240)
                assert done.returncode == -9, (point, done.returncode, done.stderr[-2000:])
                killed.append(point)
                held = _lsns(catalog, names)
                assert held[0] == held[1], (point, held)
            env = dict(os.environ, WALBERG_FAIL_AT="group-committed:1")
            done = subprocess.run([sys.executable, "-m", "walberg.cli", "run", "--once", "-c",
                                   str(path)], env=env, capture_output=True, text=True,
                                  timeout=240)
            out = done.stdout + done.stderr
            assert done.returncode == 0, out[-3000:]
            # Both tables were told the catalog transaction failed; each found it had landed.
            assert out.count("had landed after all") == 2, out[-3000:]
        finally:
            stop.set()
            writer.join(timeout=30)
        walberg_ok("-q", "run", "--once", "-c", str(path))
        held = _lsns(catalog, names)
        assert held[0] == held[1] and held[0] is not None, held
        first, second = consistent_cut(catalog, *names)
        assert not half_transactions(first.scan().to_arrow(), second.scan().to_arrow())
        verified = walberg_ok("-q", "verify", "-c", str(path))
        assert verified.count("[ok  ]") == 2, verified
        assert counts["transactions"] > 100, counts


def _reachable(table: Any) -> set[str]:
    """Every file the table's metadata names (PyIceberg): metadata files, manifest lists,
    manifests, data and delete files, statistics files."""
    meta = table.metadata
    names = {table.metadata_location, *(e.metadata_file for e in meta.metadata_log)}
    names |= {s.statistics_path for s in meta.statistics}
    for snapshot in meta.snapshots:
        names.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            names.add(manifest.manifest_path)
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
                names.add(entry.data_file.file_path)
    return {n.removeprefix("file:").removeprefix("//") for n in names}


def test_the_key_index_is_a_statistics_file_that_orphan_removal_keeps(
        rest: RestServer, postgres: Any, pg_conn: Any, spark: Any, tmp_path: Path,
        unique: str) -> None:
    """On a REST catalog the key index kept in the warehouse is a Puffin file registered as
    the statistics file of the snapshot it describes: nothing under the table's location is
    unnamed by its metadata, Iceberg's orphan-file removal (older than now) keeps it, and a
    driver with no index of its own fetches it."""
    orders, lines = make_shop(pg_conn, unique)
    path = _pipeline(postgres, tmp_path, unique, [orders, lines], rest.catalog())
    walberg_ok("-q", "run", "--once", "-c", str(path))
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {orders} SET total = total + 0 WHERE id <= 20")
        cur.execute(f"DELETE FROM {lines} WHERE order_id = 7")
    walberg_ok("-q", "run", "--once", "-c", str(path))
    namespace = f"ns_{unique}"
    catalog = rest.pyiceberg()
    for name in (f"o_{unique}", f"l_{unique}"):
        table = catalog.load_table(f"{namespace}.{name}")
        current = table.metadata.current_snapshot_id
        mine = [s for s in table.metadata.statistics if "walberg-keys" in s.statistics_path]
        assert [s.snapshot_id for s in mine] == [current], (name, table.metadata.statistics)
        location = Path(table.metadata.location.removeprefix("file:").removeprefix("//"))
        # (Hadoop's local file system writes a checksum beside each file: ".<name>.crc")
        on_disk = {str(p) for p in location.rglob("*") if p.is_file()
                   and not (p.name.startswith(".") and p.name.endswith(".crc"))}
        assert not (location / "_walberg_keys").exists()
        assert on_disk <= _reachable(table), sorted(on_disk - _reachable(table))[:5]

    # Iceberg's orphan-file removal, as a catalog's server-side maintenance runs it, for every
    # file older than now (its Spark procedure refuses less than a day: the action does not).
    jvm = spark._jvm
    props = jvm.java.util.HashMap()
    for key, value in {"type": "rest", "uri": rest.uri, "warehouse": str(rest.warehouse),
                       "credential": rest.catalog()["credential"]}.items():
        props.put(key, value)
    java_catalog = jvm.org.apache.iceberg.CatalogUtil.buildIcebergCatalog(
        "orphans", props, spark._jsc.hadoopConfiguration())
    time.sleep(1)
    for name in (f"o_{unique}", f"l_{unique}"):
        table = java_catalog.loadTable(
            jvm.org.apache.iceberg.catalog.TableIdentifier.parse(f"{namespace}.{name}"))
        jvm.org.apache.iceberg.spark.actions.SparkActions.get(spark._jsparkSession) \
            .deleteOrphanFiles(table).olderThan(int(time.time() * 1000)).execute()
    # A driver on a fresh machine: no index of its own.
    shutil.rmtree(tmp_path / "segments" / "keyindex")
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {lines} SET qty = qty + 1 WHERE order_id = 9")
        cur.execute(f"UPDATE {orders} SET total = total + {LINES} WHERE id = 9")
    done = walberg_cli("run", "--once", "-c", str(path))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert out.count("fetched from the warehouse") == 2, out[-3000:]
    verified = walberg_ok("-q", "verify", "-c", str(path))
    assert verified.count("[ok  ]") == 2, verified
