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

from walberg.config import parse_config
from walberg.embedded_pg import EmbeddedPostgres
from walberg.lake.history import history
from walberg.lake.services import Lake
from walberg.model import Lsn
from walberg.output import format_table, history_table
from walberg.pipeline import Pipeline
from walberg.source import postgres as pg

TABLE = "public.employee"


def _say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run_demo(rows: int = 100_000, directory: str = "walberg-demo") -> int:
    base = Path(directory).resolve()
    base.mkdir(parents=True, exist_ok=True)
    server = EmbeddedPostgres()
    pipeline: Optional[Pipeline] = None
    runner: Optional[threading.Thread] = None
    failure: list[BaseException] = []
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    logging.getLogger("walberg").setLevel(logging.WARNING)
    try:
        _say("starting an embedded PostgreSQL (logical replication on)")
        server.start()
        conn = pg.connect(server.dsn)
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE employee (id serial PRIMARY KEY, name varchar, "
                        "salary decimal(10,2))")
            cur.execute("INSERT INTO employee (name, salary) SELECT 'employee ' || g, "
                        "round((30000 + random() * 70000)::numeric, 2) "
                        "FROM generate_series(1, %s) g", (rows,))
        print(f"   {server.dsn}: table employee with {rows:,} rows")

        config = {
            "source": {"postgres": {"dsn": server.dsn, "slot": "walberg",
                                    "publication": "walberg", "tables": [TABLE]}},
            "sink": {"catalog": {"name": "lake", "type": "hadoop", "warehouse": "./warehouse"},
                     "namespace": "analytics", "mode": "upsert"},
            "buffer": {"dir": "./segments", "max_segment_bytes": 16777216,
                       "max_interval_seconds": 1},
            "spark": {"master": "local[2]", "conf": {}},
        }
        (base / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        cfg = parse_config(config, base, "the demo configuration")
        target = cfg.target_for(TABLE)
        pipeline = Pipeline(cfg)

        _say(f"walberg run: initial copy into {target}, then streaming (Spark local mode)")
        started = time.monotonic()

        def run() -> None:
            try:
                assert pipeline is not None
                pipeline.run()
            except BaseException as exc:
                failure.append(exc)

        runner = threading.Thread(target=run, name="walberg-demo-run", daemon=True)
        runner.start()

        def settle() -> None:
            assert pipeline is not None
            lsn = pg.current_wal_lsn(conn)
            deadline = time.monotonic() + 300
            while pipeline.applied_lsn < lsn:
                if failure:
                    raise failure[0]
                if time.monotonic() > deadline:
                    raise TimeoutError("the lake did not catch up within 300 s")
                time.sleep(0.1)

        settle()
        print(f"   copied and caught up in {time.monotonic() - started:.1f} s")
        show = pipeline.sink

        def report(where: str) -> None:
            n = show.count(target)
            print(f"   rows in {target}: {n:,}")
            if where:
                picked, names = show.query(
                    f"SELECT id, name, salary, _walberg_lsn FROM {target} WHERE {where} "
                    "ORDER BY id", 20)
                print("   " + format_table(names, [
                    (*r[:3], str(Lsn(r[3]))) for r in picked]).replace("\n", "\n   "))

        report("")
        new_ids = f"id > {rows}"
        _say("INSERT 5 rows")
        with conn.cursor() as cur:
            cur.execute("INSERT INTO employee (name, salary) VALUES ('Ada', 91000.00), "
                        "('Grace', 88000.50), ('Edsger', 79000.25), ('Barbara', 99000.00), "
                        "('Ken', 65000.75)")
        settle()
        report(new_ids)

        _say("UPDATE their salaries (+10%)")
        with conn.cursor() as cur:
            cur.execute(f"UPDATE employee SET salary = round(salary * 1.10, 2) WHERE {new_ids}")
        settle()
        report(new_ids)

        _say("DELETE two of them")
        with conn.cursor() as cur:
            cur.execute(f"DELETE FROM employee WHERE id IN ({rows + 2}, {rows + 4})")
        settle()
        report(new_ids)

        _say(f"snapshot history of {target}")
        with Lake(cfg, session=pipeline.session()) as lake:
            snapshots = history(lake, TABLE)
        print("   " + history_table(snapshots).replace("\n", "\n   "))
        conn.close()
        pipeline.stop()
        runner.join(timeout=60)
        if failure:
            raise failure[0]
        _say("done")
        print(f"   warehouse: {cfg.warehouse}")
        print("   query it:  walberg query -c "
              f"{base / 'pipeline.yaml'} \"SELECT * FROM {target} ORDER BY id DESC LIMIT 10\"")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", flush=True)
        return 130
    finally:
        if pipeline is not None:
            pipeline.stop()
            if runner is not None:
                runner.join(timeout=60)
            pipeline.close()
        server.stop()
        signal.signal(signal.SIGTERM, previous)
