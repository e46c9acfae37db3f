"""PostgreSQL's own logical-replication subscriber, the reference for what a replica of a
publication holds: tests compare the lake with what it holds after the same statements."""

from __future__ import annotations

import time
from typing import Any

import psycopg2

from lake import postgres_rows
from walberg.model import Lsn


class Subscriber:
    """A PostgreSQL logical-replication subscriber of ``publications``, in a database of its own
    on the same server (its slot made beforehand: a subscription cannot create a slot on its
    own server). ``options``: more of the subscription's options (``streaming = on``, ...);
    ``two_phase`` makes its slot decode prepared transactions at PREPARE, as a subscription
    with ``two_phase = true`` needs."""

    def __init__(self, postgres: Any, name: str, publications: list[str], ddl: str,
                 options: str = "", two_phase: bool = False) -> None:
        self.postgres, self.name = postgres, name
        self.dsn = postgres.dsn.rsplit("/", 1)[0] + f"/{name}"
        admin = psycopg2.connect(postgres.dsn)
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)",
                        (name, two_phase))
        admin.close()
        self.conn = psycopg2.connect(self.dsn)
        self.conn.autocommit = True
        extra = f", {options}" if options else ""
        with self.conn.cursor() as cur:
            cur.execute(ddl)
            cur.execute(f"CREATE SUBSCRIPTION {name} CONNECTION %s PUBLICATION "
                        f"{', '.join(publications)} WITH (create_slot = false, slot_name = %s"
                        f"{extra})", (postgres.dsn, name))

    def execute(self, statement: str) -> None:
        """Run DDL on the subscriber's side (PostgreSQL does not replicate it)."""
        with self.conn.cursor() as cur:
            cur.execute(statement)

    def caught_up(self, lsn: Lsn, timeout: float = 60.0) -> None:
        """Wait until every table is synchronised and the subscriber has applied up to ``lsn``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM pg_subscription_rel WHERE srsubstate <> 'r'")
                syncing = cur.fetchone()[0]
                cur.execute("SELECT coalesce(max(latest_end_lsn)::text, '0/0') "
                            "FROM pg_stat_subscription")
                applied = Lsn.parse(cur.fetchone()[0])
            if not syncing and applied >= lsn:
                return
            time.sleep(0.2)
        raise AssertionError(f"subscriber {self.name} did not catch up to {lsn}")

    def rows(self, table: str, key: str = "id") -> list[dict[str, Any]]:
        return postgres_rows(self.conn, table, key)

    def close(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute(f"DROP SUBSCRIPTION {self.name}")  # drops its slot on the publisher too
        self.conn.close()
        admin = psycopg2.connect(self.postgres.dsn)
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {self.name} WITH (FORCE)")
        admin.close()
