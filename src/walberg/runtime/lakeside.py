"""What every pipeline does on the lake side, whatever its source: the Spark session built from
the pipeline file, an Iceberg commit tried again when the storage or the catalog fails, and the
metrics of a commit."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from walberg import metrics
from walberg.apply import staging
from walberg.apply.catalog import storage
from walberg.apply.catalog.catalog_reads import probe_rest
from walberg.apply.iceberg import IcebergSink
from walberg.apply.jvm.calls import storage_watch, watch_storage
from walberg.apply.jvm.spark import build_session, stop_session
from walberg.apply.jvm.sparkargs import session_args
from walberg.apply.jvm.watch import StorageWatch
from walberg.buffer.store import SegmentStore
from walberg.config import Config
from walberg.config_sink import Sink
from walberg.errors import ApplyError, StorageUnavailable, WalbergError

log = logging.getLogger("walberg")


def open_session(config: Config) -> Any:
    """A SparkSession with the pipeline's catalog, storage and Spark settings."""
    check_catalog(config)
    args = session_args(config)
    session = build_session(*args[:5], jars=args.jars, short_lived=not _patient)
    probe = _probe(config)
    watch = None if probe is None else StorageWatch(session._jvm, probe,
                                                    config.storage.timeout_seconds)
    if watch is not None:
        watch.patient = _patient
    watch_storage(watch)
    return session


def check_catalog(config: Config) -> frozenset[str]:
    """A REST catalog takes walberg's credential and lets it use sink.namespace, else an
    error that says what was refused (Spark would only say the catalog is not there); the
    endpoints it offers (empty for other catalog types)."""
    cat = config.sink.catalog
    if cat.type != "rest" or not cat.uri:
        return frozenset()
    return probe_rest(cat.name, cat.uri, cat.options(), config.warehouse, config.sink.namespace)


def _probe(config: Config) -> Optional[storage.S3Probe]:
    s3 = config.storage.s3
    return storage.probe_for(None if s3 is None else s3.model_dump(), config.warehouse)


# Whether a storage outage is waited out (``walberg run``) or ends the run (``--once``):
# what the storage watch of a session opened later is told. A session opened for a ``--once``
# run also starts its JVM for a short life (spark.short_lived_options).
_patient = True


def ready_storage(config: Config, once: bool, stop: threading.Event) -> None:
    """At the start of a run: how the storage watch treats an outage (``once``: give up), and
    whether the warehouse answers (``check_storage``)."""
    global _patient
    _patient = not once
    watch = storage_watch()
    if watch is not None:
        watch.patient = _patient
    check_storage(config, not once, stop)


def check_storage(config: Config, patient: bool, stop: threading.Event) -> None:
    """Before the first storage call of a run: the warehouse's object store answers and takes
    walberg's credentials, else a StorageUnavailable that names the endpoint. ``patient``
    (``walberg run``): an unreachable store is asked again, with the commit's backoff, up to
    sink.commit_max_attempts times; otherwise (``--once``) it is given
    storage.timeout_seconds. Refused credentials fail at once. Nothing to check for a local
    warehouse."""
    probe = _probe(config)
    if probe is None:
        return
    timeout = config.storage.timeout_seconds
    attempts = config.sink.commit_max_attempts if patient else 1
    delay = 0.1
    for attempt in range(1, attempts + 1):
        problem = probe.check(timeout)
        if problem is None:
            return
        text = probe.describe(problem, timeout)
        if problem.kind != "unreachable" or attempt == attempts or stop.is_set():
            raise StorageUnavailable(text)
        log.warning("%s Trying again in %.1f s (attempt %d of %d, sink.commit_max_attempts).",
                    text, delay, attempt + 1, attempts)
        stop.wait(delay)
        delay = min(delay * 2, config.sink.commit_max_backoff_seconds)


def stage_root(config: Config, session: Any) -> Optional[str]:
    """This pipeline's folder of the stage area its batches and copies reach the executors
    through (None: they read buffer.dir; see ``apply.staging``), for the session's master."""
    area = staging.stage_uri(session.sparkContext.master, config.buffer.stage_uri,
                             config.warehouse)
    if area is None:
        return None
    if config.source.kafka is not None:
        kafka = config.source.kafka
        name, identity = kafka.group_id, f"kafka|{kafka.bootstrap_servers}|{kafka.group_id}"
    else:
        pg = config.postgres
        name, identity = pg.slot, f"postgres|{pg.dsn}|{pg.slot}"
    folder = staging.pipeline_folder(name, f"{identity}|{config.segment_dir}")
    return f"{area}/{folder}"


def release(store: Optional[SegmentStore], session: Any, exiting: bool = False) -> None:
    """Close a pipeline's segment store and stop the Spark session it built (None: a session
    the caller owns, left running; ``exiting``: see ``stop_session``)."""
    if store is not None:
        store.close()
    stop_session(session, exiting)


def commit_with_retries(sink_cfg: Sink, stop: threading.Event, sink: IcebergSink, source: str,
                        target: str, commit: Callable[[], None], landed: Callable[[], bool],
                        upto: str, held: str) -> None:
    """Run ``commit``; when it fails for the storage or the catalog (I/O, a conflicting
    writer), try again after 100 ms, 200 ms, 400 ms, ... (at most
    ``sink.commit_max_backoff_seconds``), ``sink.commit_max_attempts`` times in all. A commit
    whose outcome is unknown is looked up in the table first (``landed``): if it is there, done.
    ``upto`` names what the commit covers (``LSN 0/1A``), ``held`` what the table held before."""
    delay = 0.1
    for attempt in range(1, sink_cfg.commit_max_attempts + 1):
        try:
            commit()
            return
        except ApplyError as exc:
            if not exc.retryable:
                raise
            sink.forget(target)
            try:
                done = landed()
            except ApplyError:
                done = False
            if done:
                log.info("the failed commit to %s had landed after all (it holds %s)", target,
                         upto)
                return
            if attempt == sink_cfg.commit_max_attempts or stop.is_set():
                raise ApplyError(
                    f"could not commit {source}'s changes up to {upto} to {target} after "
                    f"{attempt} attempt(s): {exc} Nothing past {held} is marked applied and "
                    "the segments are kept: fix the warehouse or catalog and run walberg "
                    "again, it resumes there.") from exc
            metrics.COMMIT_RETRIES.labels(source).inc()
            log.warning("commit to %s failed (%s); trying again in %.1f s (attempt %d of %d)",
                        target, exc, delay, attempt + 1, sink_cfg.commit_max_attempts)
            stop.wait(delay)
            delay = min(delay * 2, sink_cfg.commit_max_backoff_seconds)


def count_files(sink: IcebergSink, source: str, target: str) -> None:
    """Bytes and files the table's last commit added, into the metrics (never fails)."""
    try:
        added = sink.last_commit(target)
    except WalbergError as exc:  # metrics must never fail a batch
        log.debug("could not read the last commit of %s for metrics: %s", source, exc)
        return
    metrics.BYTES_WRITTEN.labels(source).inc(added["bytes"])
    metrics.FILES_CREATED.labels(source, "data").inc(added["data_files"])
    metrics.FILES_CREATED.labels(source, "delete").inc(added["delete_files"])
