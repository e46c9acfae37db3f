"""The command line: parse, load the config, call the pipeline, turn errors into one readable
paragraph and an exit code (``--debug`` shows the stack trace)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import textwrap
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from walberg.errors import WalbergError

if TYPE_CHECKING:
    from walberg.config import Config
    from walberg.pipeline import Pipeline

EXAMPLES = {
    "run": "walberg run -c pipeline.yaml          # copy, then stream until stopped\n"
           "  walberg run -c pipeline.yaml --once   # stop once the lake holds today's WAL",
    "demo": "walberg demo                          # embedded Postgres -> local Iceberg walk-through",
    "query": "walberg query -c pipeline.yaml \"SELECT count(*) FROM lake.public.employee\"\n"
             "  walberg query -c pipeline.yaml \"SELECT * FROM lake.public.employee\" "
             "--lsn 0/1A2B3C4 --format csv --output then.csv",
    "check": "walberg check -c pipeline.yaml         # exit 0 only when every check passes",
    "status": "walberg status -c pipeline.yaml --json",
    "maintain": "walberg maintain -c pipeline.yaml --table public.employee",
    "history": "walberg history -c pipeline.yaml public.employee",
    "changes": "walberg changes -c pipeline.yaml public.employee --from 2026-11-21T10:00:00 "
               "--format parquet --output changes.parquet",
    "resync": "walberg resync -c pipeline.yaml public.employee   # or no table: all, new slot",
    "slot": "walberg slot drop -c pipeline.yaml --yes   # several sources: --source NAME",
    "verify": "walberg verify -c pipeline.yaml --table public.employee   # exit 0 only if equal",
    "init": "walberg init pipeline.yaml                # then edit the dsn and the tables",
}

STARTER = """\
# walberg pipeline: PostgreSQL tables -> Apache Iceberg tables, kept in step.
# Every key is in docs/configuration.md. ${VAR} is read from the environment.
source:
  postgres:
    # libpq URI or key=value string; keep the password out of the file
    dsn: postgresql://app:${PGPASSWORD}@127.0.0.1:5432/app
    slot: walberg              # logical replication slot, created if missing
    publication: walberg       # created for the tables below if missing
    tables: [public.employee]  # schema.table; each needs a primary key (or replica identity)
sink:
  catalog:
    name: lake                 # the name Spark SQL uses: lake.<namespace>.<table>
    type: hadoop
    warehouse: ./warehouse     # relative to this file
  namespace: analytics         # default: the Postgres schema name
  mode: upsert                 # the Iceberg table mirrors the Postgres table
buffer:
  dir: ./segments              # local segment files (changes not yet in Iceberg)
  max_segment_bytes: 16777216  # seal a segment at this size ...
  max_interval_seconds: 5      # ... or after this long, whichever comes first
spark:
  master: "local[*]"           # or spark://host:7077
  conf: {}
# metrics: {port: 9187}        # Prometheus /metrics
# maintenance: {every: 1h, snapshot_retention: 7d, retain_last: 10}
"""


def _reading_options(p: argparse.ArgumentParser) -> None:
    when = p.add_mutually_exclusive_group()
    when.add_argument("--as-of", help="read the pipeline's tables as of this timestamp "
                                      "('2026-11-21 10:00:00', UTC)")
    when.add_argument("--snapshot", type=int, help="read the table that has this Iceberg "
                                                   "snapshot id as of it")
    when.add_argument("--lsn", help="read the pipeline's tables as they held the source at "
                                    "this Postgres LSN (e.g. 0/1A2B3C4)")
    p.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table",
                   help="table prints; csv, json (lines) and parquet need --output")
    p.add_argument("--output", help="file to write with --format csv|json|parquet")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="walberg",
        description="Stream PostgreSQL tables into Apache Iceberg tables, exactly once, with Spark.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  " + "\n  ".join(EXAMPLES.values()),
    )
    parser.add_argument("--debug", action="store_true", help="show stack traces on errors")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    parser.add_argument("--log-format", choices=["text", "json"], default="text",
                        help="json: one JSON object per log line, for log shippers")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog="example:\n  " + EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--debug", action="store_true", help="show stack traces on errors")
        return p

    run = command("run", "initial copy of the configured tables, then stream their changes")
    run.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    run.add_argument("--once", action="store_true",
                     help="exit 0 once everything up to the WAL position at start is in Iceberg")

    demo = command("demo", "run a self-contained demo on an embedded PostgreSQL")
    demo.add_argument("--rows", type=int, default=100_000, help="rows in the employee table")
    demo.add_argument("--dir", default="walberg-demo", help="where to put the warehouse")

    query = command("query", "run Spark SQL against the lake and print the result")
    query.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    query.add_argument("sql", help="the query; tables are catalog.namespace.table")
    query.add_argument("--limit", type=int, default=None,
                       help="at most this many rows (printing: default 100; files: all)")
    _reading_options(query)

    changes = command("changes", "net inserts, updates and deletes of a table between two "
                                 "points of its history (for incremental downstream jobs)")
    changes.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    changes.add_argument("table", help="source table (schema.table)")
    changes.add_argument("--from", dest="start", required=True,
                         help="snapshot id or timestamp to start after")
    changes.add_argument("--to", dest="end", help="snapshot id or timestamp (default: now)")
    changes.add_argument("--limit", type=int, default=None,
                         help="at most this many rows (printing: default 100; files: all)")
    changes.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table",
                         help="table prints; csv, json (lines) and parquet need --output")
    changes.add_argument("--output", help="file to write with --format csv|json|parquet")

    check = command("check", "check the source, the machine and the lake before running")
    check.add_argument("-c", "--config", required=True, help="pipeline YAML file")

    status = command("status", "where each table and the replication slot stand")
    status.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    status.add_argument("--json", action="store_true", help="print JSON instead of text")

    maintain = command("maintain", "compact files, apply deletes, expire snapshots, "
                                   "remove orphan files")
    maintain.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    maintain.add_argument("--table", action="append", help="source table (schema.table); "
                                                           "repeat for several; default: all "
                                                           "(of every source)")

    verify = command("verify", "prove each Iceberg table equals its Postgres table (row counts, "
                               "hashes over all columns, differing keys)")
    verify.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    verify.add_argument("--table", action="append", help="source table (schema.table); "
                                                         "repeat for several; default: all")
    verify.add_argument("--limit", type=int, default=20,
                        help="differing keys to list per table (default 20)")
    verify.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for a running walberg to catch up (default 60)")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")

    resync = command("resync", "copy tables from Postgres again (after a lost slot, or to "
                               "repair a table), then catch up")
    resync.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    resync.add_argument("tables", nargs="*", help="source tables (schema.table); none: all "
                                                  "tables, with a new replication slot")
    resync.add_argument("--source", help="with several sources: only this one (default: "
                                         "every source, or those that have the named tables)")
    resync.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    slot = command("slot", "create or drop the pipeline's replication slot")
    slot.add_argument("action", choices=["create", "drop"])
    slot.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    slot.add_argument("--source", help="with several sources: the source whose slot it is "
                                       "(required then)")
    slot.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    init = command("init", "write a commented starter pipeline.yaml")
    init.add_argument("path", nargs="?", default="pipeline.yaml", help="where to write it")

    history = command("history", "snapshots of a table: time, operation, LSN, rows")
    history.add_argument("-c", "--config", required=True, help="pipeline YAML file")
    history.add_argument("table", help="source table, schema.table")
    return parser


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json

        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(quiet: bool, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, handlers=[handler])
    for noisy in ("py4j", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _fail(message: str, code: int) -> int:
    width = 100
    paragraphs = [textwrap.fill(p, width, subsequent_indent="  ") for p in message.split("\n")]
    print("walberg: error: " + "\n".join(paragraphs), file=sys.stderr)
    return code


def _cmd_run(args: argparse.Namespace) -> int:
    from walberg.config import load_config
    from walberg.pipeline import Pipeline

    config = load_config(args.config)
    if config.source.kafka is not None:
        return _run_kafka(config, args.once)
    if config.sources:
        from walberg.pipeline import Pipelines

        several = Pipelines(config)
        previous = _on_signals(lambda: several.stop())
        try:
            reports = several.run(once=args.once)
        finally:
            several.close()
            _restore_signals(previous)
        for name, report in reports.items():
            logging.getLogger("walberg").info(
                "source %s stopped: %d batch(es), %d change(s) applied, lake complete up to "
                "LSN %s", name, report.batches, report.changes, report.applied_lsn)
        return 0
    pipeline = Pipeline(config)
    previous = _on_signals(lambda: pipeline.stop())
    try:
        report = pipeline.run(once=args.once)
    finally:
        pipeline.close()
        _restore_signals(previous)
    logging.getLogger("walberg").info(
        "stopped: %d batch(es), %d change(s) applied, lake complete up to LSN %s",
        report.batches, report.changes, report.applied_lsn)
    return 0


def _run_kafka(config: "Config", once: bool) -> int:
    from walberg.kafka_pipeline import KafkaPipeline

    pipeline = KafkaPipeline(config)
    previous = _on_signals(lambda: pipeline.stop())
    try:
        report = pipeline.run(once=once)
    finally:
        pipeline.close()
        _restore_signals(previous)
    logging.getLogger("walberg").info(
        "stopped: %d batch(es), %d change(s) applied, %d dead letter(s); offsets %s",
        report.batches, report.records, report.dead_letters,
        ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(report.offsets.items())) or "-")
    return 0


@contextmanager
def _opened(args: argparse.Namespace) -> Iterator["Pipeline"]:
    """The pipeline of ``-c``, closed (and its Spark stopped) however the command ends."""
    from walberg.config import load_config
    from walberg.pipeline import Pipeline

    pipeline = Pipeline(load_config(args.config))
    try:
        yield pipeline
    finally:
        pipeline.close()


def _cmd_query(args: argparse.Namespace) -> int:
    from walberg.model import Lsn

    try:
        lsn = Lsn.parse(args.lsn) if args.lsn else None
    except ValueError as exc:
        return _fail(f"--lsn: {exc}", 2)
    when = {"as_of": args.as_of, "snapshot": args.snapshot, "lsn": lsn}
    with _opened(args) as pipeline:
        return _show(args, lambda: pipeline.pinned(args.sql, **when), pipeline)


def _cmd_changes(args: argparse.Namespace) -> int:
    with _opened(args) as pipeline:
        return _show(args, lambda: pipeline.changes_sql(args.table, args.start, args.end),
                     pipeline)


def _show(args: argparse.Namespace, statement: Callable[[], str], pipeline: "Pipeline") -> int:
    """Print a query's result, or write it to --output."""
    from pathlib import Path

    if args.format == "table":
        if args.output:
            return _fail("--output needs --format csv, json or parquet", 2)
        rows, names = pipeline.query(statement(), args.limit or 100)
        print(format_table(names, rows))
        return 0
    if not args.output:
        return _fail(f"--format {args.format} needs --output PATH", 2)
    written = pipeline.export(statement(), args.format, Path(args.output), args.limit)
    print(f"wrote {written:,} row(s) to {args.output}")
    return 0


def _each_source(args: argparse.Namespace) -> Iterator[tuple[Optional[str], "Pipeline"]]:
    """The pipeline of ``-c``, or one per source when the file has several (no Spark)."""
    from walberg.config import load_config
    from walberg.pipeline import Pipeline

    config = load_config(args.config)
    names: list[Optional[str]] = list(config.sources) or [None]
    for name in names:
        pipeline = Pipeline(config.for_source(name) if name else config)
        try:
            yield name, pipeline
        finally:
            pipeline.close()


def _cmd_check(args: argparse.Namespace) -> int:
    from walberg.config import load_config

    failed = total = 0
    config = load_config(args.config)
    if config.source.kafka is not None:
        from walberg.kafka_pipeline import KafkaPipeline

        sources: Iterator[tuple[Optional[str], Any]] = iter([(None, KafkaPipeline(config))])
    else:
        sources = _each_source(args)
    for name, pipeline in sources:
        if name:
            print(f"source {name}:")
        results = pipeline.check()
        for r in results:
            mark = "ok  " if r.ok else "FAIL"
            print(f"[{mark}] {r.name}: {r.detail}")
        failed += sum(1 for r in results if not r.ok)
        total += len(results)
    print(f"{total - failed} of {total} checks passed")
    return 0 if not failed else 1


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    statuses = {name: pipeline.status() for name, pipeline in _each_source(args)}
    if args.json:
        print(json.dumps(statuses[None] if None in statuses else statuses, indent=2))
        return 0
    for name, status in statuses.items():
        if name:
            print(f"source {name}:")
        _print_status(status)
    return 0


def _print_status(status: dict[str, Any]) -> None:
    p = status["pipeline"]
    running = f"running (pid {p['pid']})" if p["running"] else "not running"
    print(f"walberg: {running}; {p['pending_segments']} sealed segment(s) pending, "
          f"{p['pending_bytes']:,} bytes in {p['segment_dir']}")
    rows = [(name, t["iceberg_table"], t["last_lsn"] or "-", t["last_commit_at"] or "-",
             "-" if t["rows"] is None else f"{t['rows']:,}", t["data_files"] or 0,
             t["delete_files"] or 0, t["snapshot_id"] or "-")
            for name, t in status["tables"].items()]
    print(format_table(["source", "iceberg table", "lsn", "committed at", "rows", "files",
                        "delete files", "snapshot"], rows))
    slot = status["slot"] or {}
    if "error" in slot:
        print(f"slot: {slot['error']}")
    elif slot.get("missing"):
        print(f"slot {slot['name']}: does not exist yet (created by the first run)")
    else:
        print(f"slot {slot['name']}: confirmed {slot['confirmed_flush_lsn']}, server at "
              f"{slot['server_wal_lsn']}, lag {slot['lag_bytes']:,} bytes, retains "
              f"{slot['retained_wal_bytes']:,} bytes of WAL ({slot['wal_status']})")


def _cmd_verify(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from walberg.config import load_config

    config = load_config(args.config)
    if config.source.kafka is not None:
        return _run_kafka(config, args.once)
    if config.sources:
        from walberg.pipeline import Pipelines

        several = Pipelines(config)
        try:
            verdicts = several.verify(args.table, args.limit, args.wait)
        finally:
            several.close()
    else:
        with _opened(args) as pipeline:
            verdicts = pipeline.verify(args.table, args.limit, args.wait)
    if args.json:
        print(json.dumps([dataclasses.asdict(v) for v in verdicts], indent=2))
    for v in verdicts if not args.json else []:
        mark = "ok  " if v.equal else "DIFF"
        print(f"[{mark}] {v.source} -> {v.target}: source {v.source_rows:,} rows (at LSN "
              f"{v.source_lsn}), lake {v.lake_rows:,} rows (up to LSN {v.lake_lsn or '-'})")
        if v.note:
            print(f"       {v.note}")
        for d in v.differences:
            key = ", ".join(f"{k}={val}" for k, val in d["key"].items())
            print(f"       {key}: {d['problem']}")
    return 0 if all(v.equal for v in verdicts) else 1


def _confirm(args: argparse.Namespace, question: str) -> bool:
    """Ask on a terminal; elsewhere only --yes confirms."""
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print(f"{question} Not on a terminal: pass --yes to confirm.", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def _chosen_sources(config: "Config", source: Optional[str]) -> Optional[list[str]]:
    """The sources a command acts on: None for a file with one source (``source:``), else
    the one ``--source`` names or, without it, all of them. A name the file does not have is
    an error that lists the ones it has."""
    if source is not None:
        config.for_source(source)  # raises ConfigError, naming the sources there are
        return [source]
    return list(config.sources) or None


def _cmd_resync(args: argparse.Namespace) -> int:
    from walberg.config import load_config

    config = load_config(args.config)
    tables = [t if "." in t else f"public.{t}" for t in args.tables] or None
    names = _chosen_sources(config, args.source)
    if names is not None:
        return _resync_sources(args, config, names, tables)
    what = (", ".join(f"{t} -> {config.target_for(t)}" for t in tables) if tables else
            f"every table, after dropping replication slot {config.postgres.slot}")
    if not _confirm(args, f"This copies {what} from Postgres again, replacing the Iceberg "
                          "table's rows (its history stays for time travel)."):
        return 1
    with _opened(args) as pipeline:
        report = pipeline.resync(tables)
    copied = ", ".join(f"{t}: {n:,} rows" for t, n in report.copied.items())
    print(f"copied {copied}; the lake is complete up to LSN {report.applied_lsn}")
    return 0


def _resync_sources(args: argparse.Namespace, config: "Config", names: list[str],
                    tables: Optional[list[str]]) -> int:
    """``resync`` in a file with several sources: each chosen source that has the tables."""
    from walberg.pipeline import Pipelines

    plan = config.tables_by_source(tables, names)  # before asking: a wrong name fails first
    what = "; ".join(
        f"from source {name}: " + (
            ", ".join(f"{t} -> {config.for_source(name).target_for(t)}" for t in mine) if mine
            else "every table, after dropping replication slot "
                 f"{config.for_source(name).postgres.slot}")
        for name, mine in plan.items())
    if not _confirm(args, f"This copies {what} from Postgres again, replacing those rows of the "
                          "Iceberg tables (their history stays for time travel)."):
        return 1
    several = Pipelines(config, names=list(plan))
    try:
        reports = several.resync(tables)
    finally:
        several.close()
    for name, report in reports.items():
        copied = ", ".join(f"{t}: {n:,} rows" for t, n in report.copied.items())
        print(f"source {name}: copied {copied}; the lake is complete up to LSN "
              f"{report.applied_lsn}")
    return 0


def _cmd_slot(args: argparse.Namespace) -> int:
    from walberg.config import load_config
    from walberg.source import postgres as pg
    from walberg.source.stream import ReplicationStream

    config = load_config(args.config)
    if config.sources and args.source is None:
        # Each source has its own slot; acting on all of them unasked (dropping several
        # slots, and so copying several databases again) is too easy a mistake.
        return _fail(f"{args.config} has several sources ({', '.join(config.sources)}), each "
                     f"with its own replication slot: name one with --source NAME", 2)
    if args.source is not None:
        config = config.for_source(args.source)  # a name it does not have: ConfigError
    src = config.postgres
    if args.action == "drop":
        if not _confirm(args, f"Dropping replication slot {src.slot} frees the WAL it holds; "
                              "the next walberg run creates it anew and copies every table."):
            return 1
        conn = pg.connect(src.dsn)
        try:
            dropped = pg.drop_slot(conn, src.slot)
        finally:
            conn.close()
        print(f"dropped replication slot {src.slot}" if dropped else
              f"replication slot {src.slot} does not exist")
        return 0
    conn = pg.connect(src.dsn)
    try:
        exists = pg.slot_state(conn, src.slot) is not None
    finally:
        conn.close()
    if exists:
        print(f"replication slot {src.slot} exists already")
        return 0
    stream = ReplicationStream(src.dsn, src.slot, src.publication)
    stream.open()
    try:
        created = stream.create_slot()
    finally:
        stream.close()
    print(f"created replication slot {created.name} at {created.consistent_point}; the first "
          "walberg run copies the tables that the lake does not hold yet")
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    from pathlib import Path

    path = Path(args.path)
    if path.exists():
        return _fail(f"{path} exists already; walberg init does not overwrite files. Pass "
                     "another path, or remove it first.", 2)
    path.write_text(STARTER)
    print(f"wrote {path}: set source.postgres.dsn and tables, then `walberg check -c {path}`")
    return 0


def _cmd_maintain(args: argparse.Namespace) -> int:
    from walberg.config import load_config

    config = load_config(args.config)
    if config.sources:
        from walberg.pipeline import Pipelines

        several = Pipelines(config)
        try:
            reports = several.maintain(args.table)
        finally:
            several.close()
    else:
        with _opened(args) as pipeline:
            reports = pipeline.maintain(args.table)
    rows = [(r["table"], f"{r['before']['data_files']} -> {r['after']['data_files']}",
             f"{r['before']['delete_files']} -> {r['after']['delete_files']}",
             f"{r['before']['snapshots']} -> {r['after']['snapshots']}",
             f"{r['before']['bytes']:,} -> {r['after']['bytes']:,}", r["seconds"])
            for r in reports]
    print(format_table(["table", "data files", "delete files", "snapshots", "bytes", "seconds"],
                       rows))
    return 0


def _cmd_history(args: argparse.Namespace) -> int:
    with _opened(args) as pipeline:
        history = pipeline.history(args.table)
    print(format_table(
        ["committed at", "snapshot", "operation", "walberg.lsn", "rows added", "rows deleted"],
        [(h["made_current_at"], h["snapshot_id"], h["operation"], h["lsn"] or "-",
          h["added"] or 0, h["pos_deletes"] or h["deleted"] or 0) for h in history]))
    return 0


def format_table(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[("NULL" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    line = "  ".join(n.ljust(w) for n, w in zip(names, widths, strict=False))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def _on_signals(handler: Callable[[], None]) -> dict[int, Any]:
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        logging.getLogger("walberg").info("signal %d: stopping after the current step", signum)
        handler()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    return previous


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, h in previous.items():
        signal.signal(sig, h)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(args.quiet, args.log_format)
    if args.debug:  # the JVM's own log on the terminal too, not only in its file
        os.environ.setdefault("WALBERG_SPARK_LOG", "-")
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "demo":
            from walberg.demo import run_demo

            return run_demo(rows=args.rows, directory=args.dir)
        if args.command == "query":
            return _cmd_query(args)
        if args.command == "check":
            return _cmd_check(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "init":
            return _cmd_init(args)
        if args.command == "maintain":
            return _cmd_maintain(args)
        if args.command == "history":
            return _cmd_history(args)
        if args.command == "verify":
            return _cmd_verify(args)
        if args.command == "changes":
            return _cmd_changes(args)
        if args.command == "resync":
            return _cmd_resync(args)
        if args.command == "slot":
            return _cmd_slot(args)
        raise AssertionError(args.command)
    except WalbergError as exc:
        if args.debug:
            raise
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
