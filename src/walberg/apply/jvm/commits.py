"""Commits through Spark: one at a time per table in this process, and snapshot summary
properties (the progress marks) carried in the same commit as a Spark SQL write's data."""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


_commit_locks: dict[str, threading.Lock] = {}
_commit_locks_guard = threading.Lock()


def one_commit_at_a_time(target: str, fn: Callable[[], T]) -> T:
    """``fn`` (a commit to ``target``), while no other thread of this process commits to it.
    Sources fanning in to one table commit from threads of one JVM; a Hadoop catalog renames
    each commit's metadata file under Iceberg's in-JVM lock, and a commit that meets it there
    tries again only every 5 s (the lock's default interval, which its catalog does not let
    a setting change): two sources' batches finishing together cost the second 5-6 s. Here
    the second waits only for the first, then Iceberg retries it at once on the new
    metadata."""
    with _commit_locks_guard:
        lock = _commit_locks.setdefault(target, threading.Lock())
    with lock:
        return fn()


def with_commit_properties(session: Any, properties: dict[str, str], fn: Callable[[], None]) -> None:
    """Run ``fn`` (Spark SQL that commits to Iceberg, such as MERGE INTO) so that its snapshot
    carries ``properties`` in its summary, in the same commit as the data."""
    from pyspark.java_gateway import ensure_callback_server_started

    gateway = session.sparkContext._gateway
    ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]
    jvm = session._jvm
    errors: list[BaseException] = []

    class _Callable:
        def call(self) -> None:
            try:
                fn()
            except BaseException as exc:  # re-raised below, in this thread, with its type
                errors.append(exc)
                raise
            return None

        class Java:
            implements = ["java.util.concurrent.Callable"]

    props = jvm.java.util.HashMap()
    for key, value in properties.items():
        props.put(key, value)
    exc_class = jvm.java.lang.Class.forName("java.lang.Exception")
    try:
        jvm.org.apache.iceberg.spark.CommitMetadata.withCommitProperties(props, _Callable(), exc_class)
    except Exception:
        if errors:
            raise errors[0] from None
        raise
