"""The source's replication slots outside the stream: their state (confirmed position, WAL
kept, failover), dropping one, what a slot's creation waits for, and whether a standby is
ready to take over the slot (failover). psycopg2 lives only in source/."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import psycopg2
import psycopg2.extensions

from walberg.errors import SlotLost, SourceError, Transient
from walberg.model import Lsn
from walberg.source.postgres import connect, redact, server_version

log = logging.getLogger("walberg")


@dataclass(frozen=True)
class SlotState:
    name: str
    plugin: str
    confirmed_flush: Lsn
    restart_lsn: Lsn
    wal_status: Optional[str]
    active_pid: Optional[int]
    # A failover slot (PostgreSQL 17+), synchronised to standbys; None before 17.
    failover: Optional[bool] = None
    # WAL the server may still write before it invalidates the slot (max_slot_wal_keep_size);
    # None when unlimited.
    safe_wal_size: Optional[int] = None


def supports_failover_slots(conn: Any) -> bool:
    """Failover slots (synchronised to physical standbys) exist from PostgreSQL 17 on."""
    return server_version(conn) >= 170000


def slot_state(conn: Any, slot: str) -> Optional[SlotState]:
    failover = "failover" if supports_failover_slots(conn) else "NULL::bool"
    with conn.cursor() as cur:
        cur.execute(
            f"""SELECT plugin, confirmed_flush_lsn::text, restart_lsn::text, wal_status,
                       active_pid, database = current_database(), {failover}, safe_wal_size
                FROM pg_replication_slots WHERE slot_name = %s""",
            (slot,),
        )
        row = cur.fetchone()
    if row is None:
        return None
    plugin, flush, restart, wal_status, pid, same_db, is_failover, safe = row
    if plugin != "pgoutput" or not same_db:
        raise SourceError(
            f"replication slot {slot} (source.postgres.slot) exists but is not a pgoutput slot "
            "of this database. Choose another slot name, or drop it with "
            f"SELECT pg_drop_replication_slot('{slot}');"
        )
    if wal_status == "lost":
        raise SlotLost(
            f"replication slot {slot} was invalidated by the server: WAL it needed was removed "
            "(see max_slot_wal_keep_size), so the changes since its position are gone. Run "
            "`walberg resync -c <pipeline.yaml>`: it drops the slot, creates it anew and copies "
            "every table again (each Iceberg table is overwritten in one commit; its history "
            "stays for time travel)."
        )
    return SlotState(slot, plugin, Lsn.parse(flush) if flush else Lsn(0),
                     Lsn.parse(restart) if restart else Lsn(0), wal_status, pid, is_failover,
                     None if safe is None else int(safe))


def drop_slot(conn: Any, slot: str) -> bool:
    """Drop a replication slot; True if it existed. Refused while a process streams from it."""
    with conn.cursor() as cur:
        cur.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        row = cur.fetchone()
        if row is None:
            return False
        if row[0] is not None:
            raise SourceError(
                f"replication slot {slot} is in use by {describe_backend(conn, row[0])}; stop "
                "the walberg that streams from it first.")
        cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    return True


def describe_backend(conn: Any, pid: int) -> str:
    """Who is behind a server process, for messages: application, client address, since when."""
    with conn.cursor() as cur:
        cur.execute("SELECT application_name, client_addr::text, backend_start::text "
                    "FROM pg_stat_activity WHERE pid = %s", (pid,))
        row = cur.fetchone()
    if row is None:
        return f"server process {pid}"
    app, addr, since = row
    return f"{_backend(pid, app, addr)}, connected since {since}"


def _backend(pid: int, app: Optional[str], addr: Optional[str]) -> str:
    """A server process as messages name it: its application and client."""
    return (f"server process {pid} for application {app or '(unnamed)'} from "
            f"{addr or 'a local socket'}")


def slot_wait(conn: Any, walsender: int) -> str:
    """What the creation of a logical slot by server process ``walsender`` waits for, for a
    message: the server starts decoding from a point where no transaction that wrote is
    running, so it waits for every one running when it began (and for prepared ones) to end."""
    with conn.cursor() as cur:
        cur.execute("SELECT pid, usename, application_name, host(client_addr), state, "
                    "date_trunc('second', xact_start)::text, "
                    "extract(epoch FROM now() - xact_start)::bigint, left(query, 60) "
                    "FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND pid <> %s "
                    "ORDER BY xact_start LIMIT 5", (walsender,))
        running = cur.fetchall()
        cur.execute("SELECT gid, date_trunc('second', prepared)::text FROM pg_prepared_xacts "
                    "ORDER BY prepared LIMIT 5")
        prepared = cur.fetchall()
    seen = [f"{_backend(pid, app, addr)} (role {user}: {state or 'state hidden'}, in a "
            f"transaction since {since}, {age} s ago; last statement: "
            f"{' '.join((query or '').split())})"
            for pid, user, app, addr, state, since, age, query in running]
    seen += [f"prepared transaction '{gid}' (since {since}): COMMIT PREPARED or ROLLBACK "
             "PREPARED ends it" for gid, since in prepared]
    if not seen:
        return ("no transaction with writes is visible to walberg's role (another role's "
                "sessions show only to members of pg_read_all_stats)")
    return ("; ".join(seen) + ". It goes on once they commit or roll back; "
            "SELECT pg_terminate_backend(pid) ends a session that is left idle in a transaction")


def report_slot_wait(dsn: str, slot: str, walsender: int, done: threading.Event,
                     patience: float = 5.0, every: float = 30.0) -> None:
    """Until ``done`` is set: after ``patience`` seconds, then every ``every`` seconds, log
    what the creation of ``slot`` is waiting for (see ``slot_wait``); a run that seems to
    hang at its start says why."""
    if done.wait(patience):
        return
    started = time.monotonic() - patience
    try:
        conn = connect(dsn)
    except (SourceError, Transient):
        return
    try:
        while not done.is_set():
            try:
                waits = slot_wait(conn, walsender)
            except psycopg2.Error:
                return
            log.warning("creating replication slot %s has waited %.0f s for transactions "
                        "running on the source to end (logical decoding starts where none "
                        "that wrote is running): %s", slot, time.monotonic() - started, waits)
            done.wait(every)
    finally:
        conn.close()


def other_hosts(dsn: str, conn: Any) -> list[str]:
    """The DSNs of the hosts ``dsn`` names besides the one ``conn`` reached (libpq's several
    hosts, ``host=a,b port=1,2``): the standbys a failover would promote, one DSN each."""
    params = psycopg2.extensions.parse_dsn(dsn)
    hosts = (params.get("host") or "").split(",")
    ports = (params.get("port") or "5432").split(",")
    if len(hosts) < 2:
        return []
    if len(ports) == 1:
        ports = ports * len(hosts)
    with conn.cursor() as cur:
        cur.execute("SELECT inet_server_port()")
        here = str(cur.fetchone()[0])
    params.pop("target_session_attrs", None)
    return [psycopg2.extensions.make_dsn(**{**params, "host": h, "port": port})
            for h, port in zip(hosts, ports, strict=True) if port != here]


def failover_readiness(conn: Any, dsn: str, slot: str) -> tuple[list[str], list[str]]:
    """Whether a failover to a standby would keep walberg's slot: (what is in place, what is
    missing, each with the setting to change). PostgreSQL 17+: the slot is a failover slot,
    the primary's synchronized_standby_slots names the standbys' slots (so that no change
    reaches walberg before the standbys have it), and each standby ``dsn`` names besides the
    primary has sync_replication_slots and hot_standby_feedback on and holds a synchronised
    copy of the slot."""
    good: list[str] = []
    missing: list[str] = []
    state = slot_state(conn, slot)
    if state is None:
        good.append(f"slot {slot} will be created as a failover slot")
    elif state.failover:
        good.append(f"slot {slot} is a failover slot")
    else:
        missing.append(f"slot {slot} is not a failover slot: walberg run makes it one at start "
                       "(unless source.postgres.failover_slot is false)")
    with conn.cursor() as cur:
        cur.execute("SHOW synchronized_standby_slots")
        waits_for = cur.fetchone()[0]
        cur.execute("SELECT count(*) FROM pg_stat_replication")
        standbys = int(cur.fetchone()[0])
    if waits_for:
        names = [n.strip() for n in waits_for.split(",") if n.strip()]
        with conn.cursor() as cur:
            cur.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' "
                        "AND slot_name = ANY(%s)", (names,))
            present = {r[0] for r in cur.fetchall()}
        absent = [n for n in names if n not in present]
        if absent:
            missing.append(f"synchronized_standby_slots names {', '.join(absent)}, which this "
                           "server does not have as a physical slot: logical decoding waits "
                           "for it, so walberg receives nothing. A promoted standby keeps the "
                           "old primary's setting: clear it there, or name its own standbys' "
                           "slots.")
        else:
            good.append(f"synchronized_standby_slots = '{waits_for}'")
    elif standbys:
        missing.append("the primary's synchronized_standby_slots is empty: walberg may read "
                       "changes a standby does not have yet, which a failover loses. Run ALTER "
                       "SYSTEM SET synchronized_standby_slots = '<the standbys' physical slots>'; "
                       "SELECT pg_reload_conf();")
    for other in other_hosts(dsn, conn):
        where = redact(other)
        try:
            standby = connect(other)
        except Transient as exc:
            missing.append(f"standby {where}: cannot connect ({exc})")
            continue
        try:
            with standby.cursor() as cur:
                cur.execute("SELECT pg_is_in_recovery()")
                if not cur.fetchone()[0]:
                    missing.append(f"{where} is not a standby (it accepts writes)")
                    continue
                cur.execute("SELECT name, setting FROM pg_settings WHERE name IN "
                            "('sync_replication_slots', 'hot_standby_feedback')")
                settings = dict(cur.fetchall())
                for name in ("sync_replication_slots", "hot_standby_feedback"):
                    if settings.get(name) != "on":
                        missing.append(f"standby {where}: {name} is off. Run ALTER SYSTEM SET "
                                       f"{name} = on; SELECT pg_reload_conf(); (and a "
                                       "primary_conninfo with dbname, a primary_slot_name)")
                cur.execute("SELECT synced FROM pg_replication_slots WHERE slot_name = %s "
                            "AND NOT temporary", (slot,))
                row = cur.fetchone()
            if row is not None and row[0]:
                good.append(f"standby {where} holds slot {slot}, synchronised")
            elif not missing:
                missing.append(f"standby {where} does not hold slot {slot} yet (its slot "
                               "synchronisation copies it once the primary's slot has moved on)")
        finally:
            standby.close()
    return good, missing
