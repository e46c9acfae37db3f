"""Session-wide fixtures: one real PostgreSQL (logical replication on) and one real local Spark
with the Iceberg catalog, started once for the whole test session."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg2
import pytest
import yaml

from walberg.apply.initial.jdbc import driver_jar
from walberg.apply.jvm.spark import build_session, stop_session
from walberg.config import Config, parse_config
from walberg.model import Lsn
from walberg.pipeline import Pipeline
from walberg.source.embedded_pg import EmbeddedPostgres

CATALOG = "lake"
_names = itertools.count(1)


@pytest.fixture(scope="session")
def postgres() -> Iterator[EmbeddedPostgres]:
    # Its own temp dir: pytest's are private to root, and the server may run as another user.
    # Prepared transactions on: the two-phase commit tests PREPARE on this server.
    server = EmbeddedPostgres(settings={"max_prepared_transactions": "10"})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def warehouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warehouse")


@pytest.fixture(scope="session")
def spark(warehouse: Path) -> Iterator[Any]:
    # With the PostgreSQL JDBC driver, for the parallel initial copy's tests.
    session = build_session("local[2]", CATALOG, str(warehouse), {}, {}, app_name="walberg-tests",
                            jars=[driver_jar()])
    yield session
    stop_session(session)


@pytest.fixture
def subscriber(postgres: EmbeddedPostgres) -> Iterator[Any]:
    """``subscriber(name, publications, ddl, ...)``: a PostgreSQL subscriber of the test server
    (see tests/subscriber.py), dropped when the test ends."""
    from subscriber import Subscriber

    made: list[Subscriber] = []

    def make(name: str, publications: list[str], ddl: str, **options: Any) -> Subscriber:
        made.append(Subscriber(postgres, name, publications, ddl, **options))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.fixture
def pg_conn(postgres: EmbeddedPostgres) -> Iterator[Any]:
    conn = psycopg2.connect(postgres.dsn)
    conn.autocommit = True
    yield conn
    conn.close()


@pytest.fixture
def unique() -> str:
    """A name no other test uses: for tables, slots, publications and namespaces."""
    return f"t{os.getpid() % 1000}_{next(_names)}"


def as_file(config: Config) -> dict[str, Any]:
    """``config`` as its pipeline file holds it: a dict to change, then to give to
    ``parse_config`` or ``write_pipeline``."""
    return config.model_dump(mode="json", exclude={"base_dir"})


def write_pipeline(config: Config | dict[str, Any], path: Path) -> Path:
    """``config`` (or what ``as_file`` gave, changed) written as a pipeline file at ``path``."""
    path.write_text(yaml.safe_dump(as_file(config) if isinstance(config, Config) else config))
    return path


def make_config(postgres: EmbeddedPostgres, warehouse: Path, segments: Path, name: str,
                tables: list[str], **buffer: Any) -> Config:
    raw = {
        "source": {"postgres": {"dsn": postgres.dsn, "slot": f"slot_{name}",
                                "publication": f"pub_{name}", "tables": tables,
                                "status_interval_seconds": 1}},
        "sink": {"catalog": {"name": CATALOG, "type": "hadoop", "warehouse": str(warehouse)},
                 "namespace": f"ns_{name}"},
        "buffer": {"dir": str(segments), "max_interval_seconds": 0.5, **buffer},
        "spark": {"master": "local[2]"},
    }
    return parse_config(raw, segments.parent, "test config")


@pytest.fixture(autouse=True)
def _drop_finished_slots(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the server: drop the replication slots nothing streams from any
    more (each test makes its own), so a long session never runs out of slots or keeps WAL."""
    yield
    if "postgres" not in request.fixturenames:
        return
    server = request.getfixturevalue("postgres")
    try:
        conn = psycopg2.connect(server.dsn)
    except psycopg2.Error:
        return  # a test that stopped the server has its own cleanup to do
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT slot_name, database FROM pg_replication_slots WHERE NOT active")
        slots = cur.fetchall()
    conn.close()
    for slot, database in slots:
        try:
            other = psycopg2.connect(server.dsn.rsplit("/", 1)[0] + f"/{database}")
        except psycopg2.Error:
            continue
        other.autocommit = True
        try:
            with other.cursor() as cur:
                cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        except psycopg2.Error:
            pass  # taken again meanwhile, or gone
        finally:
            other.close()


def insert_lsn(conn: Any) -> Lsn:
    """The server's current WAL insert position: every transaction committed so far on this
    connection's server ends before it (what ``wait_for`` waits for)."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        return Lsn.parse(cur.fetchone()[0])


def walberg_cli(*args: str, timeout: float = 300, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The walberg command line in a subprocess of this Python, output captured, stdin not a
    terminal (so confirmations need --yes)."""
    return subprocess.run([sys.executable, "-m", "walberg.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL)


def walberg_ok(*args: str, timeout: float = 300, cwd: Path | None = None) -> str:
    """``walberg_cli`` that must exit 0 (else the output's tail is the failure); its stdout."""
    done = walberg_cli(*args, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def run_once(config: Config, spark: Any, kind: Any = Pipeline) -> Any:
    """`walberg run --once` in this process, on the test session's Spark; returns its report.
    ``kind``: the pipeline class (the Kafka source's is KafkaPipeline)."""
    pipeline = kind(config, session=spark)
    try:
        return pipeline.run(once=True)
    finally:
        pipeline.close()


def run_once_within(seconds: float, config: Config, spark: Any, kind: Any = Pipeline) -> Any:
    """``run_once``, in a thread: a run that has not ended within ``seconds`` is stopped and
    fails the test (a hang, not a slow run, at any sensible limit)."""
    pipeline = kind(config, session=spark)
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(pipeline.run(once=True))
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run, name="test-once", daemon=True)
    runner.start()
    runner.join(timeout=seconds)
    hung = runner.is_alive()
    if hung:
        pipeline.stop()
        runner.join(timeout=60)
    pipeline.close()
    assert not hung, f"the --once run did not end within {seconds:.0f} s"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


@contextmanager
def running(pipeline: Pipeline) -> Iterator[list[BaseException]]:
    """Run ``pipeline`` (streaming, until stopped) in a thread for the ``with`` block; yields
    the list its failure lands in. Leaving the block stops, joins and closes it."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            pipeline.run()
        except BaseException as exc:
            failures.append(exc)

    runner = threading.Thread(target=run, name="test-pipeline", daemon=True)
    runner.start()
    try:
        yield failures
    finally:
        pipeline.stop()
        runner.join(timeout=60)
        pipeline.close()


def jdbc_catalog(postgres: EmbeddedPostgres, warehouse: str) -> dict[str, Any]:
    """A pipeline file's ``sink.catalog``: a jdbc catalog in the test PostgreSQL."""
    return {"name": "lake", "type": "jdbc", "warehouse": warehouse,
            "uri": f"jdbc:postgresql://127.0.0.1:{postgres.port}/{postgres.database}",
            "user": postgres.user}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30) -> None:
    """Wait until something listens on ``port`` on loopback."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port} after {timeout:.0f} s")


@contextmanager
def writing(postgres: EmbeddedPostgres, step: Callable[[Any, int], None],
            pause: float = 0.01) -> Iterator[None]:
    """For the ``with`` block, a writer thread on a connection of its own (autocommit) runs
    ``step(cursor, i)`` for i = 1, 2, ... with ``pause`` seconds between; leaving the block stops
    it, and a failure of the writer fails the test there."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            conn = psycopg2.connect(postgres.dsn)
            conn.autocommit = True
            i = 0
            with conn.cursor() as cur:
                while not stop.is_set():
                    i += 1
                    step(cur, i)
                    time.sleep(pause)
            conn.close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=write, name="test-writer", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors, errors


def _chattr(flag: str, path: Path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True, capture_output=True)


@pytest.fixture
def immutable() -> Iterator[Any]:
    """``immutable(path)`` makes a directory unwritable, even for root, until the test ends or
    ``immutable.release()``."""
    held: list[Path] = []

    class Control:
        def __call__(self, path: Path) -> None:
            try:
                _chattr("+i", path)
            except (OSError, subprocess.CalledProcessError) as exc:
                pytest.skip(f"chattr +i is not possible here: {exc}")
            held.append(path)

        def release(self) -> None:
            while held:
                _chattr("-i", held.pop())

    control = Control()
    try:
        yield control
    finally:
        control.release()
