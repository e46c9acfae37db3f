"""A primary and a physical standby of it, both embedded PostgreSQL servers on loopback, with
logical slots synchronised to the standby (PostgreSQL 17+): for the failover tests."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

import psycopg2

from walberg.source.embedded_pg import EmbeddedPostgres


class Standby(EmbeddedPostgres):
    """A physical standby of ``primary`` made by pg_basebackup, streaming through the physical
    slot ``slot``; with ``sync_slots`` its slot synchronisation worker keeps failover slots in
    step with the primary's."""

    def __init__(self, primary: EmbeddedPostgres, slot: str, sync_slots: bool = True) -> None:
        super().__init__()
        self.primary, self.slot, self.sync_slots = primary, slot, sync_slots

    def start(self) -> "Standby":
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._make_readable()
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(str(self.bin_dir / "pg_basebackup"), "-h", "127.0.0.1", "-p",
                      str(self.primary.port), "-U", self.primary.user, "-D", str(self.data_dir),
                      "-R", "-X", "stream", "-S", self.slot, "-c", "fast", "--no-sync")
            # -R writes primary_conninfo into postgresql.auto.conf: what follows there wins.
            with open(self.data_dir / "postgresql.auto.conf", "a") as conf:
                conf.write(f"\nport = {self.port}\n"
                           f"unix_socket_directories = '{self.data_dir}'\n"
                           f"primary_conninfo = 'host=127.0.0.1 port={self.primary.port} "
                           f"user={self.primary.user} dbname={self.primary.database}'\n"
                           f"primary_slot_name = '{self.slot}'\n"
                           "hot_standby_feedback = on\n"
                           # The primary's setting names its own standby's slot; promoted,
                           # this server has no standby of its own to wait for.
                           "synchronized_standby_slots = ''\n"
                           f"sync_replication_slots = {'on' if self.sync_slots else 'off'}\n")
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l",
                  str(self.base_dir / "server.log"), "-w", "-t", "60", "start")
        self._started = True
        self._wait_ready()
        return self

    def promote(self) -> None:
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-w", "promote")

    def synced_slot(self, name: str) -> Optional[tuple[bool, Optional[str]]]:
        """(synced, confirmed flush) of the standby's copy of slot ``name``, once it is kept
        (no longer temporary); None before."""
        conn = psycopg2.connect(self.dsn)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT synced, confirmed_flush_lsn::text FROM pg_replication_slots "
                            "WHERE slot_name = %s AND NOT temporary", (name,))
                row = cur.fetchone()
            return None if row is None else (bool(row[0]), row[1])
        finally:
            conn.close()


def start_pair(sync_slots: bool = True, **settings: str) -> tuple[EmbeddedPostgres, Standby]:
    """A primary whose logical walsenders wait for the standby (synchronized_standby_slots),
    and its standby."""
    primary = EmbeddedPostgres(settings={"synchronized_standby_slots": "'standby1'",
                                         **settings}).start()
    conn = psycopg2.connect(primary.dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_create_physical_replication_slot('standby1')")
    conn.close()
    return primary, Standby(primary, "standby1", sync_slots).start()


def wait_synced(primary: EmbeddedPostgres, standby: Standby, slot: str,
                timeout: float = 90) -> None:
    """Wait until the standby keeps a synchronised copy of ``slot``. The copy is kept once the
    primary's slot has moved past what the standby can keep (its catalog horizon): a running-
    transactions record written now and then lets the primary's slot advance while idle."""
    conn = psycopg2.connect(primary.dsn)
    conn.autocommit = True
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if standby.synced_slot(slot) is not None:
                return
            with conn.cursor() as cur:
                cur.execute("SELECT pg_log_standby_snapshot()")
            time.sleep(0.5)
    finally:
        conn.close()
    raise AssertionError(f"the standby did not synchronise slot {slot} in {timeout:.0f} s")


def kill(server: EmbeddedPostgres) -> None:
    """SIGKILL the postmaster (its backends die with it): a crash, no shutdown checkpoint."""
    pid = int((server.data_dir / "postmaster.pid").read_text().splitlines()[0])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    server._started = False


def connect(server: EmbeddedPostgres) -> Any:
    conn = psycopg2.connect(server.dsn)
    conn.autocommit = True
    return conn
