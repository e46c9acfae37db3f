"""The pipeline: the only module that knows all three stages. It wires them and owns no loop
of its own: a reader (``runtime.pg_reader``) writes the replication stream to segment files,
the applier (``runtime.applier``) commits sealed segments to Iceberg, and the lake's services
(query, history, maintain, verify, status) read what they hold.

    source (replication stream, initial copy) -> buffer (segment files) -> apply (Spark/Iceberg)

Delivery contract. The replication slot delivers at least once; walberg makes replays harmless:
- every Iceberg commit carries the LSN it covers (``walberg.lsn``), atomically with the data;
- a transaction is applied to a table only if it committed after that table's LSN;
- the slot's confirmed flush position only advances to what every table holds in Iceberg;
- segments are removed only once what they hold is in Iceberg.
So a crash at any point is followed by a run that ends with each table equal to its source.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from walberg import metrics
from walberg.apply import staging
from walberg.apply.iceberg import IcebergSink
from walberg.apply.types import TypeMap
from walberg.buffer.store import SegmentStore
from walberg.config import Config, load_config
from walberg.errors import ConfigError, TablesParked, Terminal
from walberg.lake.maintain import maintain_on_schedule, written_beside
from walberg.model import Lsn
from walberg.runtime.applier import Applier
from walberg.runtime.initial_copy import InitialCopy
from walberg.runtime.lakeside import open_session, ready_storage, release, stage_root
from walberg.runtime.parking import Parking
from walberg.runtime.pg_reader import PgReader
from walberg.runtime.pg_stager import PgStager
from walberg.runtime.pg_stream import Relations
from walberg.runtime.state import RunState
from walberg.runtime.tables import PgTables

log = logging.getLogger("walberg")


@dataclass
class RunReport:
    copied: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    changes: int = 0
    applied_lsn: Lsn = Lsn(0)


class Pipeline:
    """Keeps the configured Iceberg tables in step with their Postgres tables."""

    # How long a run waits for a replication slot that another process still streams from.
    slot_wait_seconds = 15.0

    def __init__(self, config: Config, session: Any = None,
                 shared_with: Optional["Pipeline"] = None) -> None:
        """``session``: an existing SparkSession with the sink catalog configured (walberg then
        leaves it running on close); ``shared_with``: another source's pipeline whose session
        this one uses, once that one has it (see ``Pipelines``); by default walberg builds and
        owns one."""
        self.config = config
        self._owns_session = session is None and shared_with is None
        self._shared_with = shared_with
        # Called with the sink once the session this pipeline builds is open, before anyone
        # uses it (``Pipelines`` creates the namespaces of every source's tables there).
        self.on_open: Optional[Callable[[IcebergSink], None]] = None
        self.pg = config.postgres
        self.types = TypeMap(config.sink.numeric_default, frozenset(config.sink.text_types))
        self._tables = PgTables(config, lambda: self.sink, self.types,
                                lambda: self._state.release_source.set())
        self.tables = self._tables.tables  # (the same list: follow_publication adds to it)
        self.targets = self._tables.targets
        self.changelogs = self._tables.changelogs
        self._recopy: set[str] = set()  # tables `resync` copies again
        self.report = RunReport()
        self._session: Any = session
        # One of several sources fanning in to shared tables: its rows are tagged.
        self.source_name = config.source_name
        self._tag = config.source_name if config.sink.fan_in else None
        self._sink: Optional[IcebergSink] = (
            IcebergSink(session, self.types, self._tag, stage_root(config, session),
                        config.index_dir, config.sink.key_index_in_warehouse,
                        config.sink.index_in_metadata)
            if session is not None else None)
        self._store: Optional[SegmentStore] = None
        self._state = RunState()
        self._run_error: Optional[BaseException] = None
        # The session this pipeline builds, opened in a thread of its own at the start of a
        # run (the JVM starts while the segments are recovered and the source is met).
        self._opening: Optional[Future[Any]] = None
        self._opened_early = False
        self._active_in: set[int] = set()  # threads the early session was made active in
        self._session_lock = threading.Lock()

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Pipeline":
        return cls(load_config(path))

    # ---- wiring ------------------------------------------------------------------------------

    def _open_early(self) -> None:
        """Start opening the Spark session in a thread, if this pipeline builds its own and
        has not yet."""
        if self._shared_with is not None:
            self._shared_with._open_early()
            return
        with self._session_lock:
            if self._session is not None or self._opening is not None:
                return
            opening: Future[Any] = Future()

            def run() -> None:
                try:
                    opening.set_result(open_session(self.config))
                except BaseException as exc:  # given to whoever needs the session
                    opening.set_exception(exc)

            self._opening = opening
            threading.Thread(target=run, name="walberg-session", daemon=True).start()

    def session(self) -> Any:
        if self._shared_with is not None:
            # (asked of the owner each time: it makes its session active in each thread)
            shared = self._shared_with.session()
            with self._session_lock:
                if self._session is None:
                    self._session = shared
                    self._open_sink()
            return shared
        with self._session_lock:
            opened = self._session is None
            session = self._session_now()
            if self._opened_early and threading.get_ident() not in self._active_in:
                # A session built in another thread is not the active one of this thread's
                # JVM peer, and Spark would resolve `lake.ns.table` against its default
                # catalog: made active here, once per thread.
                session._jvm.org.apache.spark.sql.SparkSession.setActiveSession(
                    session._jsparkSession)
                self._active_in.add(threading.get_ident())
            if opened and self.on_open is not None:
                assert self._sink is not None
                self.on_open(self._sink)
            return session

    def _session_now(self) -> Any:
        if self._session is None:
            opening, self._opening = self._opening, None
            self._opened_early = opening is not None
            self._session = opening.result() if opening is not None else \
                open_session(self.config)
            self._open_sink()
        return self._session

    def _open_sink(self) -> None:
        self._sink = IcebergSink(self._session, self.types, self._tag,
                                 stage_root(self.config, self._session), self.config.index_dir,
                                 self.config.sink.key_index_in_warehouse,
                                 self.config.sink.index_in_metadata)
        if self._state.staging_early.is_set():
            # A batch is coming: its commit's code loads meanwhile, and a driver that moved
            # fetches the tables' key indexes.
            self._sink.warm(list(self.targets.values()))

    @property
    def sink(self) -> IcebergSink:
        self.session()
        assert self._sink is not None
        return self._sink

    @property
    def committed(self) -> dict[str, Lsn]:
        """What each table holds in the lake, as far as this run knows."""
        return self._state.committed()

    @property
    def halted(self) -> dict[str, str]:
        """Tables stopped by a change Iceberg cannot follow, with why."""
        return self._state.halted()

    def stop(self) -> None:
        """Ask a running ``run`` to stop after the current step (safe from signal handlers)."""
        self._state.request_stop()

    def close(self, exiting: bool = False) -> None:
        """``exiting``: the process ends next (the CLI), so the JVM need not be stopped
        gracefully (see ``apply.jvm.spark.stop_session``)."""
        if self._opening is not None:  # opened early, never used: stopped all the same
            try:
                self.session()
            except BaseException:
                pass
        self._tables.close()
        if self._sink is not None:
            self._sink.close()
        release(self._store, self._session if self._owns_session else None, exiting)
        self._store = None
        if self._owns_session:
            self._session = self._sink = None

    @property
    def applied_lsn(self) -> Lsn:
        """Every configured table holds every change that committed before this position."""
        return self._state.applied

    def wait_for(self, lsn: Lsn, timeout: float = 120.0) -> None:
        """Block until the lake holds everything that committed before ``lsn``."""
        deadline = time.monotonic() + timeout
        while self._state.applied < lsn:
            for error in (self._state.error, self._run_error):
                if error is not None:
                    raise error
            if time.monotonic() > deadline:
                raise Terminal(f"the lake did not reach LSN {lsn} within {timeout:.0f} s "
                               f"(it holds up to {self._state.applied})")
            time.sleep(0.05)

    def copy_again(self, tables: set[str]) -> None:
        """Have the next ``run`` copy these tables again (``walberg resync``; see
        walberg.ops.resync), replacing their Iceberg tables' rows in one commit each."""
        self._recopy = set(tables)

    # ---- run ---------------------------------------------------------------------------------

    def run(self, once: bool = False) -> RunReport:
        """Initial copy where owed, then stream. With ``once``, return as soon as everything up
        to the WAL position current at the start is committed to Iceberg."""
        try:
            return self._run(once)
        except BaseException as exc:
            self._run_error = exc  # for wait_for() in another thread
            raise

    def _run(self, once: bool) -> RunReport:
        """Wire the reader, the applier and the lake for one run: what earlier runs left in
        sealed segments is applied first, then the reader streams (main thread) while the
        applier commits (its own thread)."""
        if self.config.metrics.port:
            metrics.serve(self.config.metrics.port, self.config.metrics.host)
        state = self._state
        ready_storage(self.config, once, state.stop)
        self._open_early()
        relations = Relations()
        store = SegmentStore(self.config.segment_dir, self.config.buffer.max_segment_bytes,
                             preamble=relations.preamble)
        self._store = store
        log.info("segments: %s", store.recover())
        staging.remove_local_leftovers(self.config.segment_dir)
        copier = InitialCopy(self.config, self._tables, state, self.report, self.session,
                             lambda: self.sink)
        parking = Parking(self.config, state, self._tables.targets, lambda: self.sink)
        stager = PgStager(self.config, store, state, self._tables, lambda: self.sink,
                          copier.adopt, self.report, parking.park)
        for segment in store.sealed():
            state.sealed(segment.seq, stager.scan(segment))
        applier = Applier(self.config, store, state, stager, self._tables, lambda: self.sink,
                          lambda: maintain_on_schedule(
                              self.sink, self.config.maintenance,
                              written_beside(self.config, self.targets), state.stop),
                          parking)
        reader = PgReader(self.config, store, state, self._tables, copier, relations,
                          self._recopy, self.slot_wait_seconds, stager.start_early, parking)

        try:
            started = reader.start_with_retries(once)
            if started is None:  # stopped while the source was unreachable
                self.report.applied_lsn = state.applied
                return self.report
            stream, target = started

            thread: Optional[threading.Thread] = None
            try:
                # Whatever is in sealed segments (from an earlier run, or streamed while the
                # lake was checked, and perhaps staged then too) goes first.
                applier.apply_ready(drain=True)
                state.advance_applied(min(state.committed().values()))

                thread = threading.Thread(target=applier.loop, name="walberg-apply",
                                          daemon=True)
                thread.start()
                reader.stream(stream, target)
            finally:
                state.request_stop()
                if thread is not None:
                    thread.join()
                reader.close()
        finally:
            stager.discard_early()  # (a start that failed before the batch was taken)
        if state.error is not None:
            raise state.error
        self.report.applied_lsn = state.confirmable()
        halted = state.halted()
        if halted:
            raise TablesParked(halted, self.report)
        return self.report

__all__ = ["Pipeline", "Pipelines", "RunReport"]


class Pipelines:
    """A pipeline file with several ``sources``: one ``Pipeline`` per source (its own slot,
    publication and segment directory), one Spark session, run side by side. Tables of the same
    name fan in to one Iceberg table (``sink.fan_in``), each source's rows tagged with
    ``_walberg_source`` and recorded exactly once by its own ``walberg.lsn.<source>``."""

    def __init__(self, config: Config, session: Any = None,
                 names: Optional[list[str]] = None) -> None:
        """``names``: the sources to open (default: all of them)."""
        if not config.sources:
            raise ConfigError("this pipeline file has one source; use Pipeline")
        self.config = config
        names = names or list(config.sources)
        # The first source's pipeline owns the session; it opens while each source recovers
        # its segments and meets its database, as one source's does.
        first = Pipeline(config.for_source(names[0]), session=session)
        self.pipelines = {names[0]: first}
        for name in names[1:]:
            self.pipelines[name] = Pipeline(config.for_source(name), shared_with=first)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Pipelines":
        return cls(load_config(path))

    def run(self, once: bool = False) -> dict[str, RunReport]:
        """Run every source's pipeline; if one fails, the others are stopped and its error
        raised."""
        reports: dict[str, RunReport] = {}
        failures: list[BaseException] = []
        first = next(iter(self.pipelines.values()))
        ready_storage(self.config, once, first._state.stop)
        if first._session is not None:  # (a session given)
            self._namespaces(first.sink)
        else:
            first.on_open = self._namespaces

        parked: dict[str, str] = {}

        def run_one(name: str, pipeline: Pipeline) -> None:
            try:
                reports[name] = pipeline.run(once=once)
            except TablesParked as exc:  # (its other tables were applied: the others go on)
                parked.update({f"{name}:{t}": why for t, why in exc.parked.items()})
                if isinstance(exc.report, RunReport):
                    reports[name] = exc.report
            except BaseException as exc:
                failures.append(exc)
                self.stop()

        threads = [threading.Thread(target=run_one, args=(n, p), name=f"walberg-{n}")
                   for n, p in self.pipelines.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        if parked:
            raise TablesParked(parked, reports)
        return reports

    def _namespaces(self, sink: IcebergSink) -> None:
        """The namespaces of every source's tables, created once, as the session opens and
        before any source uses it: created by each source's first table, they would race in
        the catalog."""
        wanted = {tuple(t.split(".")[:2]) for p in self.pipelines.values()
                  for t in [*p.targets.values(), *p.changelogs.values()]}
        for catalog, namespace in sorted(wanted):
            sink.tables.ensure_namespace(catalog, namespace)

    def stop(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.stop()

    def close(self, exiting: bool = False) -> None:
        """``exiting``: as ``Pipeline.close``'s."""
        # The first pipeline owns the Spark session (when it built it): closed last.
        for pipeline in reversed(list(self.pipelines.values())):
            pipeline.close(exiting)
