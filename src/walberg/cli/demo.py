"""`walberg demo`: an embedded PostgreSQL, an employee table, and a walk through insert, update
and delete, showing what the Iceberg table holds after each step."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from walberg.cli.output import format_table, history_table
from walberg.config import Config, parse_config
from walberg.lake.history import history
from walberg.lake.services import Lake
from walberg.model import Lsn
from walberg.pipeline import Pipeline
from walberg.source import postgres as pg
from walberg.source.embedded_pg import EmbeddedPostgres

TABLE = "public.employee"


def _say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


class _Running:
    """The demo's pipeline, running in a thread while the demo changes the table."""

    def __init__(self, config: Config) -> None:
        self.pipeline = Pipeline(config)
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="walberg-demo-run", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.pipeline.run()
        except BaseException as exc:
            self.failure.append(exc)

    def settle(self, conn: Any) -> None:
        """Wait until the lake holds every change committed so far."""
        lsn = pg.current_wal_lsn(conn)
        deadline = time.monotonic() + 300
        while self.pipeline.applied_lsn < lsn:
            if self.failure:
                raise self.failure[0]
            if time.monotonic() > deadline:
                raise TimeoutError("the lake did not catch up within 300 s")
            time.sleep(0.1)

    def stop(self) -> None:
        self.pipeline.stop()
        self.thread.join(timeout=60)
        if self.failure:
            raise self.failure[0]

    def close(self) -> None:
        self.pipeline.stop()
        self.thread.join(timeout=60)
        self.pipeline.close()


def run_demo(rows: int = 100_000, directory: str = "walberg-demo") -> int:
    base = Path(directory).resolve()
    base.mkdir(parents=True, exist_ok=True)
    server = EmbeddedPostgres()
    running: Optional[_Running] = None
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)
    logging.getLogger("walberg").setLevel(logging.WARNING)
    try:
        _say("starting an embedded PostgreSQL (logical replication on)")
        server.start()
        conn = pg.connect(server.dsn)
        _make_table(conn, rows)
        print(f"   {server.dsn}: table employee with {rows:,} rows")
        config = _write_config(server.dsn, base)
        target = config.target_for(TABLE)

        _say(f"walberg run: initial copy into {target}, then streaming (Spark local mode)")
        started = time.monotonic()
        running = _Running(config)
        running.settle(conn)
        print(f"   copied and caught up in {time.monotonic() - started:.1f} s")
        _walk_through(running, conn, target, rows)
        conn.close()
        running.stop()
        _say("done")
        print(f"   warehouse: {config.warehouse}")
        print("   query it:  walberg query -c "
              f"{base / 'pipeline.yaml'} \"SELECT * FROM {target} ORDER BY id DESC LIMIT 10\"")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", flush=True)
        return 130
    finally:
        if running is not None:
            running.close()
        server.stop()
        signal.signal(signal.SIGTERM, previous)


def _make_table(conn: Any, rows: int) -> None:
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE employee (id serial PRIMARY KEY, name varchar, "
                    "salary decimal(10,2))")
        cur.execute("INSERT INTO employee (name, salary) SELECT 'employee ' || g, "
                    "round((30000 + random() * 70000)::numeric, 2) "
                    "FROM generate_series(1, %s) g", (rows,))


def _write_config(dsn: str, base: Path) -> Config:
    """The demo's pipeline file, written to ``base`` (for `walberg query` afterwards)."""
    config = {
        "source": {"postgres": {"dsn": dsn, "slot": "walberg",
                                "publication": "walberg", "tables": [TABLE]}},
        "sink": {"catalog": {"name": "lake", "type": "hadoop", "warehouse": "./warehouse"},
                 "namespace": "analytics", "mode": "upsert"},
        "buffer": {"dir": "./segments", "max_segment_bytes": 16777216,
                   "max_interval_seconds": 1},
        "spark": {"master": "local[2]", "conf": {}},
    }
    (base / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return parse_config(config, base, "the demo configuration")


def _walk_through(running: _Running, conn: Any, target: str, rows: int) -> None:
    """Insert, update and delete, each followed by what the lake holds."""
    sink = running.pipeline.sink

    def report(where: str) -> None:
        print(f"   rows in {target}: {sink.count(target):,}")
        if where:
            picked, names = sink.query(
                f"SELECT id, name, salary, _walberg_lsn FROM {target} WHERE {where} "
                "ORDER BY id", 20)
            print("   " + format_table(names, [
                (*r[:3], str(Lsn(r[3]))) for r in picked]).replace("\n", "\n   "))

    def step(title: str, statement: str) -> None:
        _say(title)
        with conn.cursor() as cur:
            cur.execute(statement)
        running.settle(conn)
        report(new_ids)

    report("")
    new_ids = f"id > {rows}"
    step("INSERT 5 rows", "INSERT INTO employee (name, salary) VALUES ('Ada', 91000.00), "
                          "('Grace', 88000.50), ('Edsger', 79000.25), ('Barbara', 99000.00), "
                          "('Ken', 65000.75)")
    step("UPDATE their salaries (+10%)",
         f"UPDATE employee SET salary = round(salary * 1.10, 2) WHERE {new_ids}")
    step("DELETE two of them", f"DELETE FROM employee WHERE id IN ({rows + 2}, {rows + 4})")

    _say(f"snapshot history of {target}")
    with Lake(running.pipeline.config, session=running.pipeline.session()) as lake:
        snapshots = history(lake, TABLE)
    print("   " + history_table(snapshots).replace("\n", "\n   "))
