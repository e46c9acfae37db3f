"""The command line: parse, load the config, call the command's module (the pipeline for `run`,
walberg.lake for the lake's reads, walberg.ops for the operator commands), show its result
through walberg.cli.output, and turn errors into one readable paragraph and an exit code
(``--debug`` shows the stack trace). Each subcommand names its handler (``set_defaults``)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import logging
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from walberg.errors import WalbergError

if TYPE_CHECKING:
    from walberg.config import Config
    from walberg.lake.services import Lake

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
    when.add_argument("--consistent", action="store_true",
                      help="read every table of the pipeline at the newest source position "
                           "all of them hold whole: never part of a source transaction, on "
                           "any catalog (the position and snapshots go to standard error)")
    p.add_argument("--source", help="with several sources: read this one's tables "
                                    "(--consistent needs one)")
    p.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table",
                   help="table prints; csv and json (lines) go to --output or standard "
                        "output; parquet needs --output")
    p.add_argument("--output", help="file to write with --format csv|json|parquet")


Handler = Callable[[argparse.Namespace], int]
Command = Callable[..., argparse.ArgumentParser]


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

    def command(name: str, help: str, func: Handler, config: bool = True,
                json: bool = False) -> argparse.ArgumentParser:
        """A subcommand that ``func`` runs; ``config``: it takes ``-c``, ``json``: ``--json``."""
        p = sub.add_parser(name, help=help, description=help, epilog="example:\n  " + EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--debug", action="store_true", help="show stack traces on errors")
        if config:
            p.add_argument("-c", "--config", required=True, help="pipeline YAML file")
        if json:
            p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.set_defaults(func=func)
        return p

    _running_commands(command)
    _reading_commands(command)
    _operator_commands(command)
    return parser


def _running_commands(command: Command) -> None:
    run = command("run", "initial copy of the configured tables, then stream their changes",
                  _cmd_run)
    run.add_argument("--once", action="store_true",
                     help="exit 0 once everything up to the WAL position at start is in Iceberg")
    demo = command("demo", "run a self-contained demo on an embedded PostgreSQL", _cmd_demo,
                   config=False)
    demo.add_argument("--rows", type=int, default=100_000, help="rows in the employee table")
    demo.add_argument("--dir", default="walberg-demo", help="where to put the warehouse")
    init = command("init", "write a commented starter pipeline.yaml", _cmd_init, config=False)
    init.add_argument("path", nargs="?", default="pipeline.yaml", help="where to write it")


def _reading_commands(command: Command) -> None:
    query = command("query", "run Spark SQL against the lake and print the result", _cmd_query)
    query.add_argument("sql", help="the query; tables are catalog.namespace.table")
    query.add_argument("--limit", type=int, default=None,
                       help="at most this many rows (printing: default 100; files: all)")
    _reading_options(query)

    changes = command("changes", "net inserts, updates and deletes of a table between two "
                                 "points of its history (for incremental downstream jobs)",
                      _cmd_changes)
    changes.add_argument("table", help="source table (schema.table)")
    changes.add_argument("--from", dest="start", required=True,
                         help="snapshot id or timestamp to start after")
    changes.add_argument("--to", dest="end", help="snapshot id or timestamp (default: now)")
    changes.add_argument("--limit", type=int, default=None,
                         help="at most this many rows (printing: default 100; files: all)")
    changes.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table",
                         help="table prints; csv and json (lines) go to --output or "
                              "standard output; parquet needs --output")
    changes.add_argument("--output", help="file to write with --format csv|json|parquet")

    history = command("history", "snapshots of a table: time, operation, LSN, rows",
                      _cmd_history, json=True)
    history.add_argument("table", help="source table, schema.table")

    maintain = command("maintain", "compact files, apply deletes, expire snapshots, "
                                   "remove orphan files", _cmd_maintain, json=True)
    maintain.add_argument("--table", action="append", help="source table (schema.table); "
                                                           "repeat for several; default: all "
                                                           "(of every source)")


def _operator_commands(command: Command) -> None:
    command("check", "check the source, the machine and the lake before running", _cmd_check,
            json=True)
    command("status", "where each table and each source stand", _cmd_status, json=True)

    verify = command("verify", "prove each Iceberg table equals its Postgres table (row counts, "
                               "hashes over all columns, differing keys)", _cmd_verify, json=True)
    verify.add_argument("--table", action="append", help="source table (schema.table); "
                                                         "repeat for several; default: all")
    verify.add_argument("--limit", type=int, default=20,
                        help="differing keys to list per table (default 20)")
    verify.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for a running walberg to catch up (default 60)")

    resync = command("resync", "copy tables from Postgres again (after a lost slot, or to "
                               "repair a table), then catch up", _cmd_resync)
    resync.add_argument("tables", nargs="*", help="source tables (schema.table); none: all "
                                                  "tables, with a new replication slot")
    resync.add_argument("--source", help="with several sources: only this one (default: "
                                         "every source, or those that have the named tables)")
    resync.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    slot = command("slot", "create or drop the pipeline's replication slot", _cmd_slot)
    slot.add_argument("action", choices=["create", "drop"])
    slot.add_argument("--source", help="with several sources: the source whose slot it is "
                                       "(required then)")
    slot.add_argument("--yes", action="store_true", help="do not ask for confirmation")


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
    # py4j logs a failed Python callback (a MERGE run inside CommitMetadata) with both stack
    # traces at ERROR; walberg raises that failure again itself, as a message.
    logging.getLogger("py4j.clientserver").setLevel(logging.CRITICAL)


def _fail(message: str, code: int) -> int:
    width = 100
    paragraphs = [textwrap.fill(p, width, subsequent_indent="  ") for p in message.split("\n")]
    print("walberg: error: " + "\n".join(paragraphs), file=sys.stderr)
    return code


def _collect_rarely() -> None:
    """Python's cycle collector for a process that stages millions of rows: what is loaded by
    now (modules, the JVM's gateway) is left out of its collections for good, and its young
    generation is collected every 50,000 allocations, not 700. A batch makes a tuple or a
    dict for each row and value, nearly none of them in cycles, and with the defaults each
    collection walked the survivors: a third of the time decoding Debezium events went to
    it. Memory freed by reference counting, as nearly all of it is, is unaffected."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _cmd_run(args: argparse.Namespace) -> int:
    from walberg.apply.jvm.spark import start_jvm_for_file

    # The driver's JVM starts (a second or more) while the rest of walberg is imported: the one
    # last started for this pipeline file at once, else the one its settings give once read.
    memo = start_jvm_for_file(Path(args.config), args.once)
    from walberg.apply.jvm.sparkargs import start_early
    from walberg.config import load_config

    config = load_config(args.config)
    start_early(config, args.once, memo)
    from walberg.pipeline import Pipeline

    _collect_rarely()

    if config.source.kafka is not None:
        return _run_kafka(config, args.once)
    if config.sources:
        from walberg.pipeline import Pipelines

        several = Pipelines(config)
        with _stopped_by_signals(several.stop):
            try:
                reports = several.run(once=args.once)
            finally:
                several.close(exiting=True)
        for name, report in reports.items():
            logging.getLogger("walberg").info(
                "source %s stopped: %d batch(es), %d change(s) applied, lake complete up to "
                "LSN %s", name, report.batches, report.changes, report.applied_lsn)
        return 0
    pipeline = Pipeline(config)
    with _stopped_by_signals(pipeline.stop):
        try:
            report = pipeline.run(once=args.once)
        finally:
            pipeline.close(exiting=True)
    logging.getLogger("walberg").info(
        "stopped: %d batch(es), %d change(s) applied, lake complete up to LSN %s",
        report.batches, report.changes, report.applied_lsn)
    return 0


def _run_kafka(config: "Config", once: bool) -> int:
    from walberg.kafka_pipeline import KafkaPipeline
    from walberg.runtime.kafka.marks import offsets_text

    pipeline = KafkaPipeline(config)
    with _stopped_by_signals(pipeline.stop):
        try:
            report = pipeline.run(once=once)
        finally:
            pipeline.close()
    logging.getLogger("walberg").info(
        "stopped: %d batch(es), %d change(s) applied, %d dead letter(s); offsets %s",
        report.batches, report.records, report.dead_letters,
        offsets_text(report.offsets))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from walberg.cli.demo import run_demo

    return run_demo(rows=args.rows, directory=args.dir)


def _on_lake(command: Callable[[argparse.Namespace, "Lake"], int]
             ) -> Callable[[argparse.Namespace], int]:
    """A command on the lake of ``-c``, whatever kind of pipeline file it is (one Postgres
    source, several, or Kafka): the Lake is opened for it and closed (its Spark stopped, if it
    started one) however the command ends. ``--source``, where a command has it, narrows
    several sources to one."""
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from walberg.config import load_config
        from walberg.lake.services import Lake

        source = getattr(args, "source", None)
        with Lake(load_config(args.config), names=[source] if source else None) as lake:
            return command(args, lake)

    return run


@_on_lake
def _cmd_query(args: argparse.Namespace, lake: "Lake") -> int:
    from walberg.lake.query import consistent_cut, pinned
    from walberg.model import Lsn

    try:
        lsn = Lsn.parse(args.lsn) if args.lsn else None
    except ValueError as exc:
        return _fail(f"--lsn: {exc}", 2)
    def statement() -> str:
        if args.consistent:
            cut = consistent_cut(lake)
            print(cut.describe(), file=sys.stderr)
            return cut.pin(args.sql)
        return pinned(lake, args.sql, args.as_of, args.snapshot, lsn)

    return _show(args, lake, statement)


@_on_lake
def _cmd_changes(args: argparse.Namespace, lake: "Lake") -> int:
    from walberg.lake.changes import changes_sql

    return _show(args, lake, lambda: changes_sql(lake, args.table, args.start, args.end))


def _show(args: argparse.Namespace, lake: "Lake", statement: Callable[[], str]) -> int:
    """Print a query's result, or write it to --output."""
    from pathlib import Path

    from walberg.cli.output import format_table

    if args.format == "table":
        if args.output:
            return _fail("--output needs --format csv, json or parquet", 2)
        rows, names = lake.sink().query(statement(), args.limit or 100)
        print(format_table(names, rows))
        return 0
    if not args.output:
        if args.format == "parquet":
            return _fail("--format parquet needs --output PATH (it is a binary file)", 2)
        return _to_stdout(args, lake, statement())
    written = lake.sink().export(statement(), args.format, Path(args.output), args.limit)
    print(f"wrote {written:,} row(s) to {args.output}")
    return 0


def _to_stdout(args: argparse.Namespace, lake: "Lake", statement: str) -> int:
    """csv or JSON lines on standard output, for a pipe into jq, csvkit and the like: only
    what the format says goes there (Spark writes the file, walberg copies it out)."""
    import shutil
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="walberg-query-") as work:
        out = Path(work) / f"result.{args.format}"
        written = lake.sink().export(statement, args.format, out, args.limit)
        sys.stdout.flush()
        with open(out, "rb") as result:
            shutil.copyfileobj(result, sys.stdout.buffer)
        sys.stdout.buffer.flush()
    logging.getLogger("walberg").info("%d row(s) written to standard output", written)
    return 0


@_on_lake
def _cmd_check(args: argparse.Namespace, lake: "Lake") -> int:
    from walberg.cli.output import by_source, checks_text, emit
    from walberg.ops.check import check

    results = check(lake)
    emit(results, args.json, checks_text, by_source)
    return 0 if all(r.ok for group in results for r in group.results) else 1


@_on_lake
def _cmd_status(args: argparse.Namespace, lake: "Lake") -> int:
    from walberg.cli.output import by_source, emit, status_text
    from walberg.ops.status import status

    emit(status(lake), args.json, status_text, by_source)
    return 0


@_on_lake
def _cmd_verify(args: argparse.Namespace, lake: "Lake") -> int:
    from walberg.cli.output import emit, verdicts_text
    from walberg.ops.verify import verify

    verdicts = verify(lake, args.table, args.limit, args.wait)
    emit(verdicts, args.json, verdicts_text)
    return 0 if all(v.equal for v in verdicts) else 1


@_on_lake
def _cmd_maintain(args: argparse.Namespace, lake: "Lake") -> int:
    from walberg.cli.output import emit, maintenance_table
    from walberg.lake.maintain import maintain

    emit(maintain(lake, args.table), args.json, maintenance_table)
    return 0


@_on_lake
def _cmd_history(args: argparse.Namespace, lake: "Lake") -> int:
    from walberg.cli.output import emit, history_table
    from walberg.lake.history import history

    emit(history(lake, args.table), args.json, history_table)
    return 0


def _confirm(args: argparse.Namespace, question: str) -> bool:
    """Ask on a terminal; elsewhere only --yes confirms."""
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print(f"{question} Not on a terminal: pass --yes to confirm.", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


@_on_lake
def _cmd_resync(args: argparse.Namespace, lake: "Lake") -> int:
    from walberg.ops import resync

    chosen = resync.plan(lake, args.tables)  # before asking: a wrong name fails first
    if not _confirm(args, f"This copies {resync.describe(chosen)} from Postgres again, "
                          "replacing those rows of the Iceberg tables (their history stays "
                          "for time travel)."):
        return 1
    for name, report in resync.resync(lake, chosen).items():
        copied = ", ".join(f"{t}: {n:,} rows" for t, n in report.copied.items())
        print((f"source {name}: " if name else "") + f"copied {copied}; the lake is complete "
              f"up to LSN {report.applied_lsn}")
    return 0


def _cmd_slot(args: argparse.Namespace) -> int:
    from walberg.config import load_config
    from walberg.ops.slot import create_slot, drop_slot, slot_source

    config = slot_source(load_config(args.config), args.source, args.config)
    slot = config.postgres.slot
    if args.action == "drop":
        if not _confirm(args, f"Dropping replication slot {slot} frees the WAL it holds; "
                              "the next walberg run creates it anew and copies every table."):
            return 1
        print(f"dropped replication slot {slot}" if drop_slot(config) else
              f"replication slot {slot} does not exist")
        return 0
    created = create_slot(config)
    if created is None:
        print(f"replication slot {slot} exists already")
        return 0
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


@contextlib.contextmanager
def _stopped_by_signals(handler: Callable[[], None]) -> Iterator[None]:
    """SIGINT and SIGTERM call ``handler`` (a pipeline's stop) inside the block; their handlers
    before it are back after."""
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        logging.getLogger("walberg").info("signal %d: stopping after the current step", signum)
        handler()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for number, was in previous.items():
            signal.signal(number, was)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(args.quiet, args.log_format)
    if args.debug:  # the JVM's own log on the terminal too, not only in its file
        os.environ.setdefault("WALBERG_SPARK_LOG", "-")
    try:
        return int(args.func(args))
    except WalbergError as exc:
        if args.debug:
            raise
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
