"""The command line as a person meets it: help, readable errors, exit codes, and the demo."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import walberg_cli
from walberg.cli import main


def test_help_lists_commands_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in ("run", "demo", "query", "walberg run -c pipeline.yaml --once"):
        assert word in out


def test_config_error_is_one_paragraph_and_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("source: {postgres: {dsn: 'postgresql://x@127.0.0.1:1/db', tables: [t]}}\n"
                   "sink: {catalog: {warehouse: ./w}, mood: happy}\n")
    proc = walberg_cli("run", "-c", str(cfg))
    assert proc.returncode == 2
    assert "sink.mood: unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_postgres_names_the_server_without_password(tmp_path: Path) -> None:
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("source: {postgres: {dsn: 'postgresql://app:hunter2@127.0.0.1:9/db', "
                   "tables: [t]}}\nsink: {catalog: {warehouse: ./w}}\n")
    proc = walberg_cli("run", "-c", str(cfg))
    assert proc.returncode == 2
    assert "cannot connect to PostgreSQL at postgresql://app:***@127.0.0.1:9/db" in proc.stderr
    assert "hunter2" not in proc.stderr
    assert "Traceback" not in proc.stderr


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_demo_walks_through_and_cleans_up(tmp_path: Path) -> None:
    spark_log = tmp_path / "spark.log"
    env = {**os.environ, "WALBERG_SPARK_LOG": str(spark_log)}
    env.pop("XDG_RUNTIME_DIR", None)
    proc = walberg_cli("demo", "--rows", "2000", "--dir", str(tmp_path / "demo"), timeout=600,
                       env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # walberg's output is walberg's: no Spark banner, no JVM log lines, no library warnings;
    # the JVM's log is in its file.
    assert proc.stderr == ""
    assert "Setting default log level" not in proc.stdout
    assert spark_log.is_file()
    out = proc.stdout
    assert "rows in lake.analytics.employee: 2,000" in out
    assert "rows in lake.analytics.employee: 2,005" in out
    assert "rows in lake.analytics.employee: 2,003" in out
    assert "Ada" in out and "100100.00" in out  # 91000.00 * 1.10 after the update
    assert "snapshot history" in out and "walberg.lsn" in out
    assert "query it:  walberg query -c" in out
    assert (tmp_path / "demo" / "warehouse" / "analytics" / "employee" / "metadata").is_dir()


def test_demo_ctrl_c_stops_its_server(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "walberg.cli", "demo", "--rows", "1000",
                             "--dir", str(tmp_path / "demo")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    port = 0
    for line in proc.stdout:
        found = re.search(r"@127\.0\.0\.1:(\d+)/app: table employee", line)
        if found:
            port = int(found.group(1))
            break
    assert port and _accepting(port), "the demo's server should be running now"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted: cleaning up" in out
    deadline = time.monotonic() + 30
    while _accepting(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _accepting(port), "the demo left its PostgreSQL running"


def test_init_writes_a_starter_config_that_loads(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from walberg.config import load_config

    target = tmp_path / "pipeline.yaml"
    assert main(["init", str(target)]) == 0
    monkeypatch.setenv("PGPASSWORD", "x")
    config = load_config(target)
    assert config.source.postgres.tables == ["public.employee"]
    assert main(["init", str(target)]) == 2  # never overwrites


def test_json_log_lines(tmp_path: Path) -> None:
    import json

    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("source: {postgres: {dsn: 'postgresql://x@127.0.0.1:9/db', tables: [t], "
                   "reconnect_max_seconds: 0}}\nsink: {catalog: {warehouse: ./w}}\n")
    proc = walberg_cli("--log-format", "json", "run", "-c", str(cfg))
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "message"} <= set(e) for e in lines)


def test_a_server_without_logical_wal_is_refused_with_the_fix(tmp_path: Path) -> None:
    from walberg.source.embedded_pg import EmbeddedPostgres

    with EmbeddedPostgres(settings={"wal_level": "replica"}) as server:
        cfg = tmp_path / "pipeline.yaml"
        cfg.write_text(f"source: {{postgres: {{dsn: '{server.dsn}', tables: [t]}}}}\n"
                       "sink: {catalog: {warehouse: ./w}}\n")
        proc = walberg_cli("run", "-c", str(cfg))
    assert proc.returncode == 2, proc.stderr
    assert "wal_level=replica" in proc.stderr
    assert "ALTER SYSTEM SET wal_level = logical" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_table_and_incomplete_publication_are_refused_with_the_fix(
        tmp_path: Path, postgres: Any, pg_conn: Any, unique: str) -> None:
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {unique} (id int PRIMARY KEY)")
        cur.execute(f"CREATE TABLE {unique}_b (id int PRIMARY KEY)")
        cur.execute(f"CREATE PUBLICATION pub_{unique} FOR TABLE {unique}")
    cfg = tmp_path / "pipeline.yaml"

    def run(tables: str) -> subprocess.CompletedProcess[str]:
        cfg.write_text(f"source: {{postgres: {{dsn: '{postgres.dsn}', tables: [{tables}], "
                       f"publication: pub_{unique}, slot: s_{unique}}}}}\n"
                       "sink: {catalog: {warehouse: ./w}}\n")
        return walberg_cli("run", "-c", str(cfg))

    proc = run(f"{unique}_nope")
    assert proc.returncode == 2 and f"table public.{unique}_nope" in proc.stderr
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = run(f"{unique}, {unique}_b")
    assert proc.returncode == 2, proc.stderr
    assert "ALTER PUBLICATION" in proc.stderr and f"{unique}_b" in proc.stderr


@pytest.mark.parametrize("command, said", [
    (["verify"], "verify compares the lake with a database source; this pipeline reads Kafka"),
    (["resync", "--yes"], "resync copies tables from a database source again; this pipeline "
                          "reads Kafka"),
    (["slot", "drop", "--yes"], "a replication slot belongs to a database source; this "
                                "pipeline reads Kafka"),
])
def test_database_commands_on_a_kafka_pipeline_say_so_in_one_line(
        tmp_path: Path, command: list[str], said: str) -> None:
    cfg = tmp_path / "kafka.yaml"
    cfg.write_text("source: {kafka: {bootstrap_servers: '127.0.0.1:9', topics: [srv.public.t]}}\n"
                   "sink: {catalog: {warehouse: ./w}}\n")
    proc = walberg_cli(command[0], "-c", str(cfg), *command[1:], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"walberg: error: {said}"]


def test_the_command_line_and_the_demo_do_not_import_each_other() -> None:
    done = subprocess.run([sys.executable, "-c", "import sys, walberg.cli.demo; "
                           "print('walberg.cli.main' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
