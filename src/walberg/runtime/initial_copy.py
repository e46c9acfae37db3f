"""A Postgres table's first copy into the lake, inside a snapshot exported by a replication
slot: one COPY stream staged as Parquet and loaded in one commit, or (``initial_copy.method:
jdbc``) Spark reading the table in chunks over JDBC, each chunk a commit, resumable. Also a
table that joins the publication while walberg runs (``follow_publication``)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from walberg import metrics
from walberg.apply.batch import DeadLetters, csv_tables, csv_to_parquet
from walberg.apply.iceberg import COPY_PREFIX, IcebergSink
from walberg.apply.initial import jdbc
from walberg.apply.jvm.calls import spark_call
from walberg.apply.session import side_by_side
from walberg.apply.types import TextPrep
from walberg.config import Config
from walberg.errors import ApplyError
from walberg.faults import crash_point
from walberg.model import Lsn, Relation
from walberg.progress import CopyProgress
from walberg.runtime.state import RunState
from walberg.runtime.tables import PgTables, count_dead
from walberg.source import chunks
from walberg.source import postgres as pg
from walberg.source.chunks import Span
from walberg.source.embedded_pg import psql_client
from walberg.source.snapshot import CopyBlocked, copy_table, hold_and_check, in_snapshot
from walberg.source.stream import CreatedSlot, ReplicationStream

log = logging.getLogger("walberg")


class InitialCopy:
    """Copies tables owed a copy and marks each with the LSN the stream goes on from."""

    def __init__(self, config: Config, tables: PgTables, state: RunState, report: Any,
                 session: Callable[[], Any], sink: Callable[[], IcebergSink]) -> None:
        self.config = config
        self.pg = config.postgres
        self.tables = tables
        self.state = state
        self.report = report
        self._session = session
        self._sink = sink

    @property
    def sink(self) -> IcebergSink:
        return self._sink()

    def copy(self, infos: list[pg.TableInfo], created: Optional[CreatedSlot],
             slot_flushed: Optional[Lsn] = None) -> None:
        """Copy tables inside a snapshot exported by a replication slot: the slot's own when it
        was just created, else a temporary slot's. Either way the copy is marked with the slot's
        consistent point, and the stream applies exactly the transactions after it.
        ``slot_flushed``: where the existing slot resumes (None: the slot is new), which tells
        whether a chunked copy cut short can resume."""
        temp: Optional[ReplicationStream] = None
        if created is None:
            temp = ReplicationStream(self.pg.dsn, self.pg.slot, self.pg.publication)
            temp.open()
            created = temp.create_slot(name=f"{self.pg.slot}_copy_{id(self) % 100000}",
                                       temporary=True)
        infos = self._as_of(infos, created)
        workdir = Path(tempfile.mkdtemp(prefix="walberg-copy-", dir=self.config.segment_dir))
        rewritten: list[pg.TableInfo] = []
        try:
            def one(n: int, info: pg.TableInfo) -> None:
                started = time.monotonic()
                source = info.qualified_name
                # Locked until its copy is committed: no rewrite while it is read.
                with in_snapshot(self.pg.dsn, created.snapshot_name) as held:
                    moved = hold_and_check(held, info)
                    if moved:
                        log.warning("%s was rewritten after the copy's snapshot (%s: ALTER "
                                    "TABLE ... TYPE, VACUUM FULL, CLUSTER or TRUNCATE), which "
                                    "reads it as empty: it is copied in a snapshot of its own",
                                    source, ", ".join(moved))
                        rewritten.append(info)
                        return
                    # A table copied again may have other columns by now (a resync after a
                    # stop).
                    reshaped = self.tables.reshape(source, info)
                    if reshaped:
                        crash_point("reshaped")  # (its schema committed, its copy not yet)
                    try:
                        if self._chunked(info):
                            # (a copy cut short under the old columns is not resumed under
                            # the new)
                            rows, point = self._copy_chunked(
                                info, created,
                                slot_flushed if temp is not None and not reshaped else None)
                        else:
                            rows = self._copy_whole_in(info, created, workdir / f"t{n}")
                            point = created.consistent_point
                    except (CopyBlocked, ApplyError) as exc:
                        if not isinstance(exc, CopyBlocked) and \
                                "due to lock timeout" not in str(exc):
                            raise
                        # Let go of the lock (leaving this block), so the other session goes
                        # on; then copied as a rewritten table is.
                        log.warning("%s. It is copied in a snapshot of its own once that "
                                    "session is through", CopyBlocked(source))
                        rewritten.append(info)
                        return
                self.state.set_committed(source, point)
                crash_point("copied", source=self.config.source_name)
                self.report.copied[source] = rows
                metrics.COPIED_ROWS.labels(source).inc(rows)
                metrics.COMMITTED_LSN.labels(source).set(int(point))
                log.info("initial copy of %s -> %s: %d rows in %.1f s (at LSN %s)", source,
                         self.tables.targets[source], rows, time.monotonic() - started, point)
            # Whole tables side by side (sink.commit_parallelism at once: a small table's copy is
            # mostly round trips and a commit of its own); a JDBC copy in chunks is parallel
            # within the table, one table at a time.
            width = 1 if self.pg.initial_copy.method == "jdbc" else \
                self.config.sink.commit_parallelism
            side_by_side(one, list(enumerate(infos)), width)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            self.sink.release_staged(workdir)
            if temp is not None:
                temp.close()
        if rewritten:
            # A temporary slot's snapshot, newer than the rewrite: those tables' changes count
            # from its position (as for a table that joins the publication).
            self.copy(rewritten, None)

    def _as_of(self, infos: list[pg.TableInfo], created: CreatedSlot) -> list[pg.TableInfo]:
        """The tables as the copy's snapshot has them. They were described before the slot
        existed; an ALTER TABLE committed in between is in the snapshot's rows, and the stream
        (which starts after it) may never mention it: copied with the columns read earlier, an
        added column would be missing from the lake until the table's next change, and its
        values lost."""
        with in_snapshot(self.pg.dsn, created.snapshot_name) as conn:
            described = pg.describe_tables(conn, [i.qualified_name for i in infos],
                                           self.pg.publications)
            now = [described[i.qualified_name] for i in infos]
            changed = {n.qualified_name: n for n, i in zip(now, infos, strict=True)
                       if n.columns != i.columns}
            for info in changed.values():
                pg.require_key(info)
            if changed:
                self.tables.learn_types(conn, changed)
        for source, info in changed.items():
            log.info("%s changed its columns before the copy's snapshot: copied as %s", source,
                     ", ".join(c.name for c in info.columns))
        return now

    def adopt(self, rel: Relation) -> None:
        """A table added to the publication while walberg runs: copy it inside a temporary
        slot's snapshot; its changes count from that snapshot's position on."""
        table = rel.qualified_name
        conn = pg.connect(self.pg.dsn)
        try:
            if table not in pg.published_tables(conn, self.pg.publication):
                return
            info = pg.describe_table(conn, table, self.pg.publications)
            pg.require_key(info)
            self.tables.add(table)
            self.tables.learn_types(conn, {table: info})
        finally:
            conn.close()
        log.info("%s joined publication %s: copying it", table, self.pg.publication)
        self.tables.ensure(table, info)
        self.copy([info], None)

    def _copy_whole_in(self, info: pg.TableInfo, created: CreatedSlot, folder: Path) -> int:
        """``_copy_whole`` staged in a folder of the table's own, removed (with what was sent
        to the stage area for it) once the table is copied: a copy of many tables never holds
        more than one table's staged files on disk or in the stage area."""
        folder.mkdir()
        try:
            return self._copy_whole(info, created, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            self.sink.release_staged(folder)

    def _copy_whole(self, info: pg.TableInfo, created: CreatedSlot, workdir: Path) -> int:
        """The default copy: one COPY stream, loaded in one commit marked with the slot's
        consistent point (and appended to the changelog, if any). Written as the table's data
        files as it is read where the table allows (``_copy_direct``), else staged as local
        Parquet first. Returns the rows copied."""
        source = info.qualified_name
        target = self.tables.targets[source]
        changelog = self.tables.changelogs.get(source)
        prep = self.tables.prep(source, info.columns)
        if changelog is None and self.sink.copy_here(target, info.columns,
                                                     prep.staged_types(len(info.columns))):
            rows = self._copy_direct(info, created, workdir, prep)
            if rows is not None:
                return rows
        parquet = workdir / f"{source}.parquet"
        dead = DeadLetters(workdir / f"dlq-{source}.parquet", len(info.columns))
        with self._copy_stream(info, workdir, created.snapshot_name) as stream:
            csv_to_parquet(stream.path, len(info.columns), parquet, prep,
                           (dead, int(created.consistent_point)), stream.copied)
        dead.close()
        self._dead_letters(info, dead, created.consistent_point)
        if changelog is not None:
            self.sink.append_copy(changelog, info.columns, [parquet], created.consistent_point)
            self.tables.changelog_held[source] = created.consistent_point
        if changelog != target:
            # (without a changelog the driver's path was weighed above, and said why not)
            self.sink.load_copy(target, info.columns, [parquet], created.consistent_point,
                                on_driver=changelog is not None)
        return stream.rows

    def _copy_direct(self, info: pg.TableInfo, created: CreatedSlot, workdir: Path,
                     prep: TextPrep) -> Optional[int]:
        """The copy written as the table's data files while COPY's stream is parsed, nothing
        staged on disk first; None if the rows turn out to need Spark (nothing is kept then,
        and the caller copies again, staged). Returns the rows copied."""
        source = info.qualified_name
        target = self.tables.targets[source]
        point = created.consistent_point
        dead = DeadLetters(workdir / f"dlq-{source}.parquet", len(info.columns))
        written = None
        try:
            with self._copy_stream(info, workdir, created.snapshot_name) as stream:
                parts = csv_tables(stream.path, len(info.columns), prep, (dead, int(point)),
                                   stream.copied)
                try:
                    written = self.sink.write_copy_parts(target, info.columns, parts, point,
                                                         workdir)
                finally:
                    parts.close()  # (stops reading COPY's stream, if it was cut short)
                stream.abandoned = written is None
            dead.close()
            if written is None:
                dead.path.unlink(missing_ok=True)
                return None
            # Dead letters first: if the copy itself then fails, the next copy replaces them.
            self._dead_letters(info, dead, point)
        except BaseException:
            dead.close()
            if written is not None:
                written.discard()
            raise
        self.sink.commit_copy(written, info.columns, point)
        return stream.rows

    def _dead_letters(self, info: pg.TableInfo, dead: DeadLetters, point: Lsn) -> None:
        """Write the copy's dead letters (if any) to the table's dead-letter table."""
        source = info.qualified_name
        target = self.tables.targets[source]
        dropped = self.sink.write_dead_letters(target, info.columns, dead.path, point,
                                               snapshot=True) if dead.rows else 0
        count_dead(self.sink, source, target, dropped)

    def _chunked(self, info: pg.TableInfo) -> bool:
        """Whether this table's copy is read by Spark over JDBC in chunks."""
        if self.pg.initial_copy.method != "jdbc":
            return False
        source = info.qualified_name
        why = None
        if self.config.layout_for(source).mode != "upsert":
            why = "its sink mode keeps a changelog"
        elif any(self.tables.types.spark_type(c, source).array_dims for c in info.columns):
            why = "it has array columns"
        if why:
            log.info("initial copy of %s: through COPY, not jdbc, because %s", source, why)
            return False
        return True

    def _resume_point(self, info: pg.TableInfo, key: Optional[str],
                      slot_flushed: Optional[Lsn]) -> Optional[_Resume]:
        """What a chunked copy cut short left to resume from, if it can be resumed."""
        source, target = info.qualified_name, self.tables.targets[info.qualified_name]
        if key is None or slot_flushed is None:
            return None
        history = self.sink.copy_marks(target)
        if (not history or history[0].get(COPY_PREFIX + "key") != key
                or not history[0].get(COPY_PREFIX + "first")
                or not history[0].get(COPY_PREFIX + "xmin")):
            # (without its first chunk's snapshot, expired by a maintenance since, the spans
            # committed are not all known: the copy starts anew rather than read some twice;
            # so does a copy whose first chunk did not record its snapshot's xmin, made by an
            # older walberg)
            return None
        start = Lsn.parse(history[0][COPY_PREFIX + "point"])
        if start < slot_flushed:
            return None
        done = [Span.decode(m[COPY_PREFIX + "span"]) for m in history
                if COPY_PREFIX + "span" in m]
        if not chunks.remaining(done):
            # That copy finished (`walberg resync` of the table, or a copy owed again after it
            # was cut short): this one starts anew, it is no resume with nothing left to read.
            return None
        log.info("resuming the initial copy of %s: %d chunk(s) were committed (from LSN %s); "
                 "the rows changed since and the rest are read now", source, len(done), start)
        return _Resume(start, int(history[0][COPY_PREFIX + "xmin"]), done)

    def _copy_chunked(self, info: pg.TableInfo, created: CreatedSlot,
                      slot_flushed: Optional[Lsn]) -> tuple[int, Lsn]:
        """The parallel initial copy: Spark reads the table over JDBC in chunks, each a commit
        recording the span it covers (``walberg.copy.*``); the last also carries the LSN mark.

        Resuming: a copy cut by key ranges that an interruption left unfinished goes on with
        the spans not yet committed, read in this (newer) snapshot, provided the slot still
        starts at or before the copy's start (``slot_flushed``). Before them, the spans
        committed are brought to this snapshot (``_refresh``), so the table is then exactly
        as this snapshot has it and is marked with its LSN: the stream goes on from there, as
        after any copy. Returns the rows copied and the LSN the table is marked with."""
        source, target = info.qualified_name, self.tables.targets[info.qualified_name]
        settings = self.pg.initial_copy
        key = chunks.range_key(info)
        kind = "key" if key else "ctid"
        point = created.consistent_point
        resume = self._resume_point(info, key, slot_flushed)
        with in_snapshot(self.pg.dsn, created.snapshot_name, source) as conn, \
                conn.cursor() as cur:
            extent = chunks.table_extent(cur, info, key)
            xmin = resume.xmin if resume is not None else chunks.snapshot_xmin(cur)
        done = resume.done if resume is not None else []
        todo = chunks.remaining(done) if key else [Span(kind, None, None)]
        parallel = settings.parallelism or int(self._session().sparkContext.defaultParallelism)
        plan = chunks.plan_chunks(extent, info.estimated_rows, settings.chunk_rows, parallel,
                                  kind, todo)
        init = chunks.session_init(created.snapshot_name)
        progress = CopyProgress(source, info.estimated_rows)
        gauge = metrics.COPY_PROGRESS.labels(source)
        common = {COPY_PREFIX + "point": str(point if resume is None else resume.start),
                  COPY_PREFIX + "key": key or ""}
        rows = dead = 0
        if resume is not None:
            assert key is not None
            rows, dead = self._refresh(info, key, resume, extent, parallel, init, point, common)
        for n, chunk in enumerate(plan):
            started = time.monotonic()
            df = self._read(info, [chunks.text_query(info, part, key) for part in chunk.parts],
                            init)
            last = n == len(plan) - 1
            marks = {**common, COPY_PREFIX + "span": chunk.span.encode()}
            first = not done and n == 0
            if first:
                marks[COPY_PREFIX + "first"] = "true"
                marks[COPY_PREFIX + "xmin"] = str(xmin)
            added, bad = self.sink.load_chunk(
                target, info.columns, df, point, marks, first=first, done=last,
                dead_span=(key, chunk.span.lo, chunk.span.hi) if key else None)
            crash_point("chunk", source=self.config.source_name)
            rows, dead = rows + added, dead + bad
            progress.update(rows)
            if info.estimated_rows:
                gauge.set(min(rows / info.estimated_rows, 0.99))
            log.info("initial copy of %s: chunk %d of %d (%s) -> %d rows in %.1f s", source,
                     n + 1, len(plan), chunk.span.encode(), added, time.monotonic() - started)
        progress.done(rows)
        gauge.set(1)
        count_dead(self.sink, source, target, dead)
        return rows, point

    def _refresh(self, info: pg.TableInfo, key: str, resume: _Resume, extent: tuple[int, int],
                 parallel: int, init: str, point: Lsn, marks: dict[str, str]) -> tuple[int, int]:
        """Bring the spans a resumed copy committed before (as its first snapshot had them) to
        this snapshot: their rows inserted or updated since (at or after the first snapshot's
        xmin) replace what the lake holds under their keys, and the lake's rows whose key is
        gone from there leave it. Replaying the changes in between instead cannot be done
        right: the stream does not carry a TOASTed value an UPDATE left untouched, and the
        row a key change moved has it nowhere in the lake when it moved from a span read in
        this snapshot. Returns the rows and dead letters written."""
        target = self.tables.targets[info.qualified_name]
        started = time.monotonic()
        copied = chunks.covered(resume.done)
        # (cut for parallel readers; the cut leaves out spans now wholly outside the table's
        # keys, and if that is all of them the reads still need a query each)
        pieces = chunks.cut(copied, extent[0], extent[1], parallel, "key") or copied
        kept = self._read(info, [chunks.kept_keys_query(info, s, key, resume.xmin)
                                 for s in pieces], init)
        self.sink.drop_changed(target, key, [(s.lo, s.hi) for s in copied], kept)
        changed = self._read(info, [chunks.text_query(info, s, key, resume.xmin)
                                    for s in pieces], init)
        added, bad = self.sink.load_chunk(target, info.columns, changed, point, marks,
                                          first=False, done=False, dead_span=None)
        log.info("initial copy of %s: %d row(s) of the %d chunk(s) committed before were "
                 "written since, read again in %.1f s", info.qualified_name, added + bad,
                 len(resume.done), time.monotonic() - started)
        return added, bad

    def _read(self, info: pg.TableInfo, queries: list[str], init: str) -> Any:
        """The rows ``queries`` return, read by Spark over JDBC, one partition each."""
        url, props = chunks.jdbc_target(self.pg.dsn)
        return spark_call(f"reading {info.qualified_name} over JDBC", lambda: jdbc.read_text(
            self._session(), url, props, queries, init, self.pg.initial_copy.fetch_size))

    def catchup_after_resume(self, source: str) -> None:
        """A table whose copy an older walberg resumed (marked with the copy's start, the rows
        read later already holding part of the stream's replay) merges the stream's inserts by
        key until the stream passes the snapshot the copy finished in."""
        if self.pg.initial_copy.method != "jdbc":
            return
        marks = self.sink.copy_marks(self.tables.targets[source])
        value = marks[-1].get(COPY_PREFIX + "catchup") if marks else None
        committed = self.state.committed_at(source)
        if value is not None and committed is not None and Lsn.parse(value) > committed:
            self.state.set_catchup(source, Lsn.parse(value))

    @contextlib.contextmanager
    def _copy_stream(self, info: pg.TableInfo, workdir: Path,
                     snapshot: str) -> Iterator[_CopyStream]:
        """COPY the table through a named pipe, read by the caller inside the block: Postgres
        renders rows while they are parsed, and no CSV file ever lands on disk. A failed COPY
        raises when the block ends, unless the block raised first (its error is the one
        said) or the caller stopped reading on purpose (``abandoned``)."""
        progress = CopyProgress(info.qualified_name, info.estimated_rows)
        gauge = metrics.COPY_PROGRESS.labels(info.qualified_name)
        gauge.set(0)

        def copied(rows: int) -> None:
            stream.read = rows
            progress.update(rows)
            if info.estimated_rows:
                gauge.set(min(rows / info.estimated_rows, 0.99))

        stream = _CopyStream(workdir / f"{info.qualified_name}.csv", copied)
        os.mkfifo(stream.path, 0o600)
        failure: list[BaseException] = []

        def produce() -> None:
            try:
                # The pipe opened first (once its reader comes): whatever fails after, closing
                # it ends the reader's stream; a failure before it was open would leave a
                # reader that came later waiting for a writer for good.
                with open(stream.path, "wb", buffering=1 << 20) as out:
                    stream.sent = copy_table(self.pg.dsn, info, out, snapshot, psql_client())
            except BaseException as exc:
                failure.append(exc)
                # A reader still waiting for the pipe to open sees it end; one that has gone
                # needs nothing (and a blocking open would wait for it forever).
                try:
                    os.close(os.open(stream.path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass

        producer = threading.Thread(target=produce, name=f"copy-{info.qualified_name}")
        producer.start()
        try:
            yield stream
        finally:
            while producer.is_alive():
                # COPY waiting for a reader that will not come (the caller failed before it
                # read, or stopped reading): a reader that comes and goes at once ends its wait
                # (its next write fails).
                try:
                    os.close(os.open(stream.path, os.O_RDONLY | os.O_NONBLOCK))
                except OSError:
                    pass
                producer.join(0.1)
            stream.path.unlink(missing_ok=True)
        if stream.abandoned:
            return
        if failure:
            raise failure[0]
        progress.done(stream.rows)
        gauge.set(1)


@dataclass(frozen=True)
class _Resume:
    """A chunked copy cut short, to be resumed."""

    start: Lsn  # the LSN its first chunk's snapshot was taken at
    xmin: int  # that snapshot's xmin (see ``chunks.snapshot_xmin``)
    done: list[Span]  # the key spans its chunks committed


@dataclass
class _CopyStream:
    """A table's COPY as the reader of ``_copy_stream`` meets it."""

    path: Path  # the named pipe COPY writes CSV into
    copied: Callable[[int], None]  # to be told the rows read so far
    sent: Optional[int] = None  # the rows COPY sent, if its client said (psql does not)
    read: int = 0  # the rows read
    abandoned: bool = False  # the reader stopped reading on purpose

    @property
    def rows(self) -> int:
        """The rows copied, once the block has ended."""
        return self.read if self.sent is None else self.sent
