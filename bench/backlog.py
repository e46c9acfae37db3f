"""The user's situation, cold: `walberg run --once` as a command, on tables of growing size.

    python bench/backlog.py [--sizes 200000,2000000,10000000] [--changes 200000]
                            [--shape bigint|uuid|text|composite|days|bucket|identity|truncate|
                             months|hours|evolved|v3|bytea|array|fanin|full|cow]

Before anything is timed, the driver JVM's class-data archive is made (walberg.apply.jvm.classcache),
as a machine's first walberg run makes it in the background (the time it took is reported),
and walberg's modules are compiled to bytecode, as installing it does.
Then for each table size N, in one run, on one embedded PostgreSQL:

1. A table (its key, name text, amount numeric(12,2), n int) of N rows is copied into
   Iceberg by `walberg run --once` in a process of its own (a cold JVM), next to `COPY ... TO
   STDOUT` of the same table.
2. A no-op `walberg run --once` (nothing to apply), three times, their median: the fixed
   cost of a run (process, JVM, Spark session, catalog, slot); and the same without the
   class-data archive
   (WALBERG_CLASS_CACHE=off), what the first run on a machine pays.
3. A backlog of --changes changes is committed: half inserts of new keys, three tenths updates
   and two tenths deletes of keys drawn at random over the whole table, in transactions of
   10,000. `pg_recvlogical` drains them from a slot of its own (pgoutput, protocol 1): how
   fast the server can hand them out.
4. `walberg run --once` applies the backlog, cold (by position, see docs/how-it-works.md).
   Its time net of the no-op run is set against pg_recvlogical's: the target is 0.70 or more
   whatever N is. "Growth" is each size's batch time (stage and commit, from the run's log,
   so two start-ups' noise does not move it) over the smallest size's (the target: under 1.5x
   from 200k to 10M rows).
   --shape kafka: the same as Debezium events in a Kafka topic (bench/backlog_kafka.py);
   --shape kafka-schema: the same with each record's schema part, as Kafka Connect's JSON
   converter writes them by default, and the numeric as Debezium's default (a Connect decimal).
5. With --compare-merge: a second backlog of the same kind on the same table, applied by
   MERGE (`sink.apply_by_position: false`), the apply path before key indexes.
6. With --moved-driver: a further backlog of the same kind, applied with the table's key index
   removed from this disk, as a driver on a fresh machine meets it: the index is fetched from
   the warehouse, where it is kept beside the table (sink.key_index_in_warehouse); then one
   more, with the kept copy removed too, so the index is made anew from the lake, delete files
   and all. Each batch's time over the first backlog's (the target: at most 2x).

--warehouse s3: the warehouse on an S3-compatible server on this machine (moto, in memory;
the s3a jars as tests/test_storage.py finds them), instead of a folder on this disk.

--shape picks the table's key and layout (SHAPES): a bigint key (the default), a uuid, a text
key, a composite (tenant int, id bigint) key, a bigint key with the Iceberg table partitioned
by days(ts) over a year (or bucket(16, id), identity of a text column of 16 values,
truncate(100000, id), months(ts) or hours(ts) over a year, or days(ts) evolved to
bucket(16, id) after the copy: `evolved`), a bigint key in a format-version 3 table, a
bigint key with a bytea column (16 bytes a row) or with array columns (int[] of 3, text[] of
2, one element quoted), or a table fanned in from two databases
(`fanin`: two sources, east and west, each with half the rows and half the changes, into one
Iceberg table; pg_recvlogical drains both slots at once, as walberg reads both sources at
once); and two that keep the MERGE: no key (REPLICA IDENTITY
FULL) and a copy-on-write table.

These machines are shared and noisy: the figures that matter are the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import psycopg2
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from run import _Null, save_results, timed  # noqa: E402

from walberg.apply.catalog import storage  # noqa: E402
from walberg.apply.jvm import classcache  # noqa: E402
from walberg.apply.jvm.spark import session_archive  # noqa: E402
from walberg.source.embedded_pg import EmbeddedPostgres  # noqa: E402

TXN = 10_000  # changes per source transaction
FAN_IN = ("east", "west")  # the databases (and walberg sources) of the fanin shape

KAFKA_SHAPES = ("kafka", "kafka-schema")  # (bench/backlog_kafka.py)
# A timestamp spread over a year's days and a day's seconds, from the row number {g}.
_OVER_A_YEAR = (", timestamptz '2024-01-01 00:00:00+00' + (({g}) % 365) * interval '1 day' "
                "+ (({g}) % 86400) * interval '1 second'")
# shape: (key columns, their SQL as a function of the row number {g}, the key's column names,
# extra columns, their SQL, sink.tables layout)
SHAPES: dict[str, tuple[str, str, str, str, str, dict[str, Any]]] = {
    "bigint": ("id bigint", "{g}", "id", "", "", {}),
    "uuid": ("id uuid", "md5(({g})::text)::uuid", "id", "", "", {}),
    "text": ("id text", "'customer-' || ({g})", "id", "", "", {}),
    "composite": ("tenant int, id bigint", "({g}) % 64, {g}", "tenant, id", "", "", {}),
    "days": ("id bigint", "{g}", "id", ", ts timestamptz", _OVER_A_YEAR,
             {"partition_by": ["days(ts)"]}),
    "bucket": ("id bigint", "{g}", "id", "", "", {"partition_by": ["bucket(16, id)"]}),
    # The other transforms: identity of a text column of 16 values, truncate of the key (a
    # partition per 100,000 ids: 2 at 200k rows, 100 at 10M), months and hours of a timestamp
    # over a year (12 and 8,760 partitions; a batch's random keys touch most of them).
    "identity": ("id bigint", "{g}", "id", ", region text", ", 'region-' || (({g}) % 16)",
                 {"partition_by": ["region"]}),
    "truncate": ("id bigint", "{g}", "id", "", "", {"partition_by": ["truncate(100000, id)"]}),
    "months": ("id bigint", "{g}", "id", ", ts timestamptz", _OVER_A_YEAR,
               {"partition_by": ["months(ts)"]}),
    "hours": ("id bigint", "{g}", "id", ", ts timestamptz", _OVER_A_YEAR,
              {"partition_by": ["hours(ts)"]}),
    # Copied partitioned by days(ts); the spec then evolves to bucket(16, id) (EVOLVED) before
    # anything is timed: new rows go by the new spec, deletes reach rows of both.
    "evolved": ("id bigint", "{g}", "id", ", ts timestamptz", _OVER_A_YEAR,
                {"partition_by": ["days(ts)"]}),
    "v3": ("id bigint", "{g}", "id", "", "", {"format_version": 3}),
    # A bytea column (16 bytes a row): decoded while staging, written on the driver.
    "bytea": ("id bigint", "{g}", "id", ", digest bytea", ", decode(md5(({g})::text), 'hex')", {}),
    # Array columns (int[] of 3, text[] of 2): read into lists while staging.
    "array": ("id bigint", "{g}", "id", ", scores int[], tags text[]",
              ", ARRAY[({g}) % 100, ({g}) % 7, -1], ARRAY['tag-' || (({g}) % 10), 'x y']", {}),
    # Two sources (FAN_IN) whose tables of the same name land in one Iceberg table.
    "fanin": ("id bigint", "{g}", "id", "", "", {}),
    # No key: REPLICA IDENTITY FULL (updates and deletes find rows by their whole value).
    "full": ("id bigint", "{g}", "id", "", "", {}),
    "cow": ("id bigint", "{g}", "id", "", "", {"write_mode": "copy-on-write"}),
}
# Shapes whose table layout changes after the copy: the layout the pipeline file then gives.
EVOLVED = {"evolved": {"partition_by": ["bucket(16, id)"]}}


def walberg_once(config: Path, step: str, env: Optional[dict[str, str]] = None) -> float:
    """Seconds one `walberg run --once` takes, as a command in a process of its own. Its log
    is kept beside the config (``<name>.<step>.log``): where the time went."""
    seconds, proc = timed(lambda: subprocess.run(
        [sys.executable, "-m", "walberg.cli", "run", "-c", str(config), "--once"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env))
    config.with_suffix(f".{step}.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"walberg run --once failed:\n{proc.stderr[-3000:]}")
    return seconds


def batch_seconds(config: Path, step: str) -> float:
    """The seconds the run's batches took to stage and commit, from its log ("staged in X s,
    committed in Y s"): the apply itself, without the process's start-up and stop, so it does
    not move with them."""
    text = config.with_suffix(f".{step}.log").read_text()
    return sum(float(a) + float(b) for a, b in
               re.findall(r"staged in ([0-9.]+) s, committed in ([0-9.]+) s", text))


def write_config(dsns: dict[str, str], work: Path, name: str, by_position: bool = True,
                 shape: str = "bigint", lake: Optional[dict[str, Any]] = None,
                 evolved: bool = False) -> Path:
    """The pipeline file: one source, or with several ``dsns`` (the fanin shape) a source each,
    fanned in to one table. ``lake``: the warehouse and storage sections for object storage
    (None: a folder in ``work``). ``evolved``: the shape's layout after the copy (EVOLVED)."""
    layout = EVOLVED[shape] if evolved and shape in EVOLVED else SHAPES[shape][5]

    def source(dsn: str, slot: str) -> dict[str, Any]:
        return {"postgres": {"dsn": dsn, "slot": slot, "publication": f"pub_{name}",
                             "tables": [f"public.{name}"]}}

    raw: dict[str, Any] = {
        "sink": {"catalog": {"name": "lake", "type": "hadoop",
                             "warehouse": (lake or {}).get("warehouse",
                                                           str(work / "warehouse"))},
                 "namespace": "bench", "apply_by_position": by_position},
        "buffer": {"dir": str(work / f"segments_{name}")},
        "spark": {"master": "local[2]"},
    }
    if len(dsns) == 1:
        raw["source"] = source(next(iter(dsns.values())), f"slot_{name}")
    else:
        raw["sources"] = {each: source(dsn, f"slot_{name}_{each}") for each, dsn in dsns.items()}
        raw["sink"]["fan_in"] = True
    if layout:
        raw["sink"]["tables"] = {f"public.{name}": layout}
    if lake is not None:
        raw["storage"] = lake["storage"]
        # moto's answer to a multipart upload's completion trips the s3a connector's parser
        # (a NullPointerException in the AWS SDK), so the copy's large data files go up in one
        # PUT each on this test server.
        raw["spark"]["conf"] = {"spark.hadoop.fs.s3a.multipart.size": "1G",
                                "spark.hadoop.fs.s3a.multipart.threshold": "1G"}
    path = work / f"{name}{'' if by_position else '-merge'}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def make_table(cur: Any, name: str, rows: int, shape: str = "bigint") -> float:
    """The table of ``rows`` rows; returns the seconds `COPY ... TO STDOUT` takes to read it."""
    key, key_sql, key_names, extra, extra_sql, _ = SHAPES[shape]
    # (statements with parameters: a % of the shape's SQL is doubled for psycopg2)
    key_sql, extra_sql = key_sql.replace("%", "%%"), extra_sql.replace("%", "%%")
    primary = "" if shape == "full" else f", PRIMARY KEY ({key_names})"
    cur.execute(f"CREATE TABLE {name} ({key}, name text, amount numeric(12,2), n int{extra}"
                f"{primary})")
    if shape == "full":  # (an index, not a key, so the backlog's statements find rows fast)
        cur.execute(f"ALTER TABLE {name} REPLICA IDENTITY FULL")
        cur.execute(f"CREATE INDEX ON {name} (id)")
    cur.execute(f"INSERT INTO {name} SELECT {key_sql.format(g='g')}, 'customer ' || g, "
                f"(g %% 100000) / 100.0, g %% 1000{extra_sql.format(g='g')} "
                "FROM generate_series(1, %s) g", (rows,))
    cur.execute(f"VACUUM ANALYZE {name}")
    # The load's dirty pages written out now, not by the checkpointer during the timed runs
    # (a 10M-row load left the no-op runs after it 1.5 s slower than at 200k rows).
    cur.execute("CHECKPOINT")
    seconds, _ = timed(lambda: cur.copy_expert(f"COPY (SELECT * FROM {name}) TO STDOUT", _Null()))
    return seconds


def commit_backlog(cur: Any, name: str, rows: int, changes: int, first_new: int,
                   shape: str = "bigint") -> int:
    """Half inserts of new keys (from ``first_new`` on), 3/10 updates and 2/10 deletes of
    random keys up to ``rows``; returns the changes Postgres made (random draws may repeat a
    key)."""
    _, key_sql, key_names, _, extra_sql, _ = SHAPES[shape]
    key_sql, extra_sql = key_sql.replace("%", "%%"), extra_sql.replace("%", "%%")
    made = 0
    inserts, updates = changes // 2, changes * 3 // 10
    deletes = changes - inserts - updates
    drawn = (f"({key_names}) IN (SELECT {key_sql.format(g='r')} FROM (SELECT 1 + "
             "(random() * %s)::bigint AS r FROM generate_series(1, %s)) drawn)")
    for lo in range(0, inserts, TXN):
        cur.execute(f"INSERT INTO {name} SELECT {key_sql.format(g='g')}, 'new ' || g, 1.00, 1"
                    f"{extra_sql.format(g='g')} FROM generate_series(%s, %s) g",
                    (first_new + lo, first_new + min(lo + TXN, inserts) - 1))
        made += cur.rowcount
    for lo in range(0, updates, TXN):
        cur.execute(f"UPDATE {name} SET amount = amount + 1, n = n + 1 WHERE {drawn}",
                    (rows - 1, min(TXN, updates - lo)))
        made += cur.rowcount
    for lo in range(0, deletes, TXN):
        cur.execute(f"DELETE FROM {name} WHERE {drawn}", (rows - 1, min(TXN, deletes - lo)))
        made += cur.rowcount
    return made


def noop_runs(config: Path) -> dict[str, Any]:
    """The fixed cost of a run: three no-op `walberg run --once` runs (nothing to apply) and
    their median (one cold start varies by a second or more on a shared machine, and the net
    apply time is a difference of two of them); and one without the class-data archive, a
    machine's first run (or WALBERG_CLASS_CACHE=off)."""
    noops = sorted(walberg_once(config, f"noop{i}") for i in range(3))
    bare = walberg_once(config, "noop-bare", {**os.environ, "WALBERG_CLASS_CACHE": "off"})
    return {"noop_run_once_s": noops[1], "noop_runs_s": noops,
            "noop_without_class_archive_s": bare}


def recvlogical(server: EmbeddedPostgres, slots: dict[str, str], publication: str,
                end_lsn: str) -> float:
    """Seconds ``pg_recvlogical`` takes to drain each of ``slots`` (dsn: slot), all at once."""
    def drain() -> list[subprocess.CompletedProcess[str]]:
        procs = [subprocess.Popen(
            [str(server.bin_dir / "pg_recvlogical"), "-d", dsn, "--slot", slot, "--start",
             "-o", "proto_version=1", "-o", f"publication_names={publication}",
             "--endpos", end_lsn, "-f", "/dev/null", "--no-loop"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for dsn, slot in slots.items()]
        errs = [p.communicate()[1] for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, "", e)
                for p, e in zip(procs, errs, strict=True)]
    seconds, done = timed(drain)
    for proc in done:
        if proc.returncode != 0:
            raise SystemExit(f"pg_recvlogical failed: {proc.stderr}")
    return seconds


def databases(server: EmbeddedPostgres, cur: Any, shape: str) -> dict[str, tuple[str, Any]]:
    """Source name -> (dsn, cursor): the server's own database, or for the fanin shape a
    database each for FAN_IN (made here)."""
    if shape != "fanin":
        return {"pg": (server.dsn, cur)}
    dbs = {}
    for each in FAN_IN:
        cur.execute(f"CREATE DATABASE bench_{each}")
        dsn = server.dsn.rsplit("/", 1)[0] + f"/bench_{each}"
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        dbs[each] = (dsn, conn.cursor())
    return dbs


def one_size(dbs: dict[str, tuple[str, Any]], server: EmbeddedPostgres, work: Path, rows: int,
             changes: int, compare_merge: bool, shape: str = "bigint",
             moved: bool = False, lake: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    name = f"backlog_{shape}_{rows}"
    dsns = {each: dsn for each, (dsn, _) in dbs.items()}
    curs = [c for _, c in dbs.values()]
    # Each source holds its share of the rows and of the changes (one source: all of them).
    share_rows, share_changes = rows // len(curs), changes // len(curs)
    copy_to_stdout_s = sum(make_table(c, name, share_rows, shape) for c in curs)
    config = write_config(dsns, work, name, shape=shape, lake=lake)
    copy_s = walberg_once(config, "copy")
    if shape in EVOLVED:
        # The pipeline file's new layout: the next run evolves the table's partition spec.
        config = write_config(dsns, work, name, shape=shape, lake=lake, evolved=True)
        walberg_once(config, "evolve")
    fixed = noop_runs(config)
    noop_s = fixed["noop_run_once_s"]
    # (slot names are the server's: one each)
    recv = {each: f"recv_{name}" if len(curs) == 1 else f"recv_{name}_{each}" for each in dbs}
    for each, (_, c) in dbs.items():
        c.execute(f"CREATE PUBLICATION recv_{name} FOR TABLE {name}")
        c.execute(f"SELECT pg_create_logical_replication_slot('{recv[each]}', 'pgoutput')")

    def backlog(first_new: int) -> int:
        return sum(commit_backlog(c, name, share_rows, share_changes, first_new, shape)
                   for c in curs)

    made = backlog(rows + 1)
    curs[0].execute("SELECT pg_current_wal_insert_lsn()::text")
    end_lsn = curs[0].fetchone()[0]
    recv_s = recvlogical(server, {dsns[each]: slot for each, slot in recv.items()},
                         f"recv_{name}", end_lsn)
    for each, (_, c) in dbs.items():
        c.execute(f"SELECT pg_drop_replication_slot('{recv[each]}')")
    apply_s = walberg_once(config, "apply")
    net_s = max(apply_s - noop_s, 1e-3)
    merge: dict[str, Any] = {}
    if compare_merge:
        # The same kind of backlog on the same table (a few percent larger now), applied by
        # MERGE (sink.apply_by_position: false): what the apply cost before, in this run.
        more = backlog(2 * rows + 1)
        merge_s = walberg_once(write_config(dsns, work, name, by_position=False,
                                            shape=shape, lake=lake, evolved=True), "merge")
        merge = {"merge_run_once_s": merge_s, "merge_changes": more,
                 "merge_net_s": max(merge_s - noop_s, 1e-3),
                 "merge_batch_s": batch_seconds(config.with_name(f"{name}-merge.yaml"), "merge")}
    if moved:
        # The driver moves to a fresh machine: a backlog of the same kind, applied with no key
        # index on this disk; it is fetched from the warehouse. Then again with the copy kept
        # in the warehouse removed too: made anew from the lake, delete files and all.
        for n, step in enumerate(("moved", "moved_unkept"), start=3):
            more = backlog(n * rows + 1)
            for index in (work / f"segments_{name}").glob("**/keyindex"):
                shutil.rmtree(index)
            if step == "moved_unkept":
                remove_lake(work, lake, f"{name}/_walberg_keys")
            walberg_once(config, step)
            text = config.with_suffix(f".{step}.log").read_text()
            found = [(f"rebuilt from the lake ({how})", seconds) for how, seconds in re.findall(
                r"rebuilt from the lake \((.*?)\): \d+ keys, in ([0-9.]+) s", text)]
            found += [("fetched from the warehouse", seconds) for seconds in re.findall(
                r"fetched from the warehouse \(snapshot -?\d+, \d+ keys\) in ([0-9.]+) s", text)]
            merge[step] = {"changes": more, "batch_s": batch_seconds(config, step),
                           "index_s": sum(float(f[1]) for f in found) if found else None,
                           "how": "; ".join(f[0] for f in found) if found else None}
    result = {
        "rows": rows, "changes": made, "sources": len(curs),
        "copy": {"walberg_run_once_s": copy_s, "copy_to_stdout_s": copy_to_stdout_s,
                 "walberg_rows_per_s": rows / copy_s,
                 "ratio": copy_to_stdout_s / copy_s},
        **fixed,
        "apply_run_once_s": apply_s, "apply_net_s": net_s,
        "apply_batch_s": batch_seconds(config, "apply"),
        "pg_recvlogical_s": recv_s, "baseline_s": recv_s,
        "walberg_changes_per_s": made / net_s, "pg_recvlogical_changes_per_s": made / recv_s,
        "ratio": recv_s / net_s, **merge,
    }
    # Only the logs are kept: the table's files, segments and key index go (1 GB at 50M rows),
    # and its slots, which would hold the WAL of the next sizes' loads.
    for each, (_, c) in dbs.items():
        slot = f"slot_{name}" if len(curs) == 1 else f"slot_{name}_{each}"
        c.execute(f"SELECT pg_drop_replication_slot('{slot}')")
        c.execute(f"DROP TABLE {name}")
    remove_lake(work, lake, name)
    shutil.rmtree(work / f"segments_{name}", ignore_errors=True)
    return result


def remove_lake(work: Path, lake: Optional[dict[str, Any]], folder: str) -> None:
    """Remove a folder of the bench namespace from the warehouse (on this disk or the S3
    server)."""
    if lake is None:
        shutil.rmtree(work / "warehouse" / "bench" / folder, ignore_errors=True)
        return
    s3 = lake["client"]
    names = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket="bench", Prefix=f"warehouse/bench/{folder}/") for o in page.get("Contents", [])]
    for lo in range(0, len(names), 1000):
        s3.delete_objects(Bucket="bench", Delete={"Objects": [{"Key": k}
                                                             for k in names[lo:lo + 1000]]})


def object_storage(work: Path) -> tuple[Any, dict[str, Any]]:
    """An S3-compatible server (moto) on this machine with a bucket for the warehouse: the
    server's process, and the pipeline file's warehouse and storage sections for it."""
    import boto3
    from staging import moto

    proc, endpoint = moto(work)
    keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)
    client.create_bucket(Bucket="bench")
    return proc, {"warehouse": "s3a://bench/warehouse", "client": client,
                  "storage": {"s3": {"endpoint": endpoint, "region": "us-east-1",
                                     "path_style_access": True,
                                     "access_key_id": keys["aws_access_key_id"],
                                     "secret_access_key": keys["aws_secret_access_key"]}}}


def bytecode() -> None:
    """walberg's modules compiled to bytecode before anything is timed, as installing a package
    compiles them (pip does): run from a source tree on a machine that sets
    PYTHONDONTWRITEBYTECODE (this project's machines do), every `walberg` process would compile
    all of walberg's source as it starts (0.1-0.15 CPU-seconds), which no installed walberg
    does. Asked of the walberg the timed commands import (the same interpreter and path)."""
    subprocess.run([sys.executable, "-c", "import compileall, pathlib, walberg; "
                    "compileall.compile_dir(str(pathlib.Path(walberg.__file__).parent), quiet=1)"],
                   check=True)


def class_archive(jars: list[str]) -> dict[str, Any]:
    """The driver JVM's class-data archive (walberg.apply.jvm.classcache) of sessions with
    ``jars`` (a storage's), made before anything is timed, as a machine's first walberg run
    would have made it in the background."""
    archive = session_archive(jars)
    if archive is None:
        return {"path": None}
    had = classcache.usable(archive)
    seconds, ready = timed(lambda: classcache.make_now(archive, jars))
    print(f"class-data archive: {archive} ({'there already' if had else f'made in {seconds:.0f} s'})",
          flush=True)
    if not ready:
        raise SystemExit(f"the class-data archive could not be made: see {archive.with_suffix('.log')}")
    return {"path": str(archive), "made_s": None if had else seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="200000,2000000,10000000")
    ap.add_argument("--changes", type=int, default=200_000)
    ap.add_argument("--compare-merge", action="store_true",
                    help="also apply a second backlog by MERGE (the apply before key indexes)")
    ap.add_argument("--moved-driver", action="store_true",
                    help="also apply a further backlog with no key index on this disk, as a "
                         "driver on a fresh machine does")
    ap.add_argument("--warehouse", choices=["local", "s3"], default="local",
                    help="the warehouse in a folder on this disk, or on an S3-compatible "
                         "server on this machine (moto)")
    ap.add_argument("--shape", choices=sorted([*SHAPES, *KAFKA_SHAPES]), default="bigint",
                    help="the table's key and layout (see SHAPES)")
    ap.add_argument("--out", default=None,
                    help="default: bench/results/backlog.json (backlog-<shape>.json for a shape "
                         "other than bigint)")
    args = ap.parse_args()
    if args.out is None:
        suffix = "" if args.shape == "bigint" else f"-{args.shape}"
        args.out = str(ROOT / "bench" / "results" / f"backlog{suffix}.json")
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="walberg-backlog-"))
    if args.shape in KAFKA_SHAPES:
        import backlog_kafka

        tansu, servers = backlog_kafka.broker(work)
    else:
        server = EmbeddedPostgres().start()
    moto, lake = object_storage(work) if args.warehouse == "s3" else (None, None)
    bytecode()
    results: dict[str, Any] = {"changes": args.changes, "cores": os.cpu_count(), "sizes": [],
                               "shape": args.shape, "warehouse": args.warehouse,
                               "class_archive": class_archive(
                                   storage.spark_settings(s3={})[1] if lake else [])}
    started = time.monotonic()
    try:
        if args.shape in KAFKA_SHAPES:
            if args.compare_merge or args.moved_driver:
                raise SystemExit("--compare-merge and --moved-driver are for the Postgres shapes")
            for rows in sizes:
                results["sizes"].append(backlog_kafka.one_size(
                    servers, work, rows, args.changes, walberg_once, noop_runs, batch_seconds,
                    schema=args.shape == "kafka-schema"))
                print(f"  {rows:>11,} rows done ({time.monotonic() - started:.0f} s)", flush=True)
        else:
            conn = psycopg2.connect(server.dsn)
            conn.autocommit = True
            dbs = databases(server, conn.cursor(), args.shape)
            for rows in sizes:
                results["sizes"].append(one_size(dbs, server, work, rows, args.changes,
                                                   args.compare_merge, args.shape,
                                                   args.moved_driver, lake))
                print(f"  {rows:>11,} rows done ({time.monotonic() - started:.0f} s)",
                      flush=True)
    finally:
        if args.shape in KAFKA_SHAPES:
            tansu.kill()
        else:
            server.stop()
        if moto is not None:
            moto.terminate()
    # Growth is taken from the batches' own time (the net time carries two start-ups' noise).
    base = results["sizes"][0]
    for each in results["sizes"]:
        each["growth"] = each["apply_batch_s"] / base["apply_batch_s"]
        if args.compare_merge:
            each["merge_growth"] = each["merge_batch_s"] / base["merge_batch_s"]
    out = save_results(results, args.out)
    print(f"\ncold `walberg run --once` backlog of {args.changes:,} random-key changes, "
          f"{args.shape} table, {results['cores']} cores")
    print("(baseline: " + ("a consumer draining the same records from the topic; the copy's, "
                           "the table's records" if args.shape in KAFKA_SHAPES else
                           "pg_recvlogical draining the same changes; the copy's, "
                           "COPY ... TO STDOUT") + ")")
    print(f"{'table rows':>12} {'no-op run':>10} {'(3 runs)':>10} {'(no archive)':>12} "
          f"{'apply run':>10} {'apply net':>10} "
          f"{'baseline':>12} {'ratio':>6} {'growth':>7} {'copy rows/s':>12} {'copy ratio':>11}")
    for s in results["sizes"]:
        runs = "-".join(f"{x:.1f}" for x in (s["noop_runs_s"][0], s["noop_runs_s"][-1]))
        print(f"{s['rows']:>12,} {s['noop_run_once_s']:>9.1f}s {runs:>10} "
              f"{s['noop_without_class_archive_s']:>11.1f}s {s['apply_run_once_s']:>9.1f}s "
              f"{s['apply_net_s']:>9.1f}s "
              f"{s['baseline_s']:>11.1f}s {s['ratio']:>6.2f} {s['growth']:>6.2f}x "
              f"{s['copy']['walberg_rows_per_s']:>12,.0f} {s['copy']['ratio']:>11.2f}")
    if args.compare_merge:
        print("\nthe same kind of backlog applied by MERGE (sink.apply_by_position: false):")
        print("(each batch's stage + commit time, from the run's log)")
        print(f"{'table rows':>12} {'by position':>12} {'growth':>7} {'by MERGE':>9} {'growth':>7} "
              f"{'MERGE / position':>17}")
        for s in results["sizes"]:
            print(f"{s['rows']:>12,} {s['apply_batch_s']:>11.1f}s {s['growth']:>6.2f}x "
                  f"{s['merge_batch_s']:>8.1f}s {s['merge_growth']:>6.2f}x "
                  f"{s['merge_batch_s'] / s['apply_batch_s']:>17.2f}")
    if args.moved_driver:
        print("\nfurther backlogs applied by a driver on a fresh machine (no key index here), "
              "the index kept in the warehouse, then not:")
        print(f"{'table rows':>12} {'warm batch':>11} {'first batch':>12} {'of it, index':>13} "
              f"{'first / warm':>13}  index")
        for s in results["sizes"]:
            for step in ("moved", "moved_unkept"):
                m = s[step]
                print(f"{s['rows']:>12,} {s['apply_batch_s']:>10.1f}s {m['batch_s']:>11.1f}s "
                      f"{m['index_s'] or 0:>12.1f}s {m['batch_s'] / s['apply_batch_s']:>13.2f}  "
                      f"{m['how']}")
    print(f"results: {out}; each run's log: {work}/*.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
