"""The tables of a batch made visible at once: one catalog transaction for all their commits.

A source transaction that writes an order and its lines is one fact; committed table by table,
a reader between the commits sees an order without its lines. An Iceberg REST catalog that
offers ``POST /v1/{prefix}/transactions/commit`` commits several tables all or nothing. Here
each table's share of a batch is applied as before, side by side in threads of its own, up to
the point where its Iceberg transaction would commit (``commit_row_delta``); there it joins the
batch's ``CommitGroup`` and waits. When every table of the batch has joined (or left: nothing
to commit, stopped by a schema change, or applied another way), the last to arrive commits all
the joined transactions in one catalog call, each table's share still carrying its
``walberg.lsn``; every waiting table then goes on as if its own commit had just landed, or
fails with the group's failure.

A failed group commit (409: a requirement no longer holds because another writer committed to
one of the tables) fails every member's commit alike; each tries again through its own retry
loop (``commit_with_retries``) and joins the next round. A member that fails for good ends the
round for all: nothing of the round is committed. Members waiting for the others do not hold
one of the batch's working places (``work``), so the width of the work stays
``sink.commit_parallelism`` however many tables wait.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

from walberg.apply.catalog.catalog_reads import TRANSACTIONS_ENDPOINT
from walberg.apply.jvm.calls import spark_call
from walberg.errors import ApplyError
from walberg.faults import crash_point, failure_point

log = logging.getLogger("walberg")

_current = threading.local()


class CatalogTransactions:
    """The catalog's side: a client of the REST catalog that commits several tables' Iceberg
    transactions at once (built from the Spark catalog's own settings, once per sink)."""

    def __init__(self, spark: Any, catalog: str, properties: dict[str, str]) -> None:
        """``properties``: the Spark catalog's (without ``spark.sql.catalog.<name>.``)."""
        from walberg.apply.jvm.helper import batch_helper

        self.spark = spark
        self.catalog = catalog
        self.supported = True  # until the catalog says otherwise
        props = spark._jvm.java.util.HashMap()
        for key, value in properties.items():
            props.put(key, value)
        helper = batch_helper(spark)
        self._helper = helper
        self._client = spark_call(
            f"connecting to the REST catalog {catalog} for multi-table commits",
            lambda: helper.restCatalog(f"{catalog}-transactions", props,
                                       spark._jsc.hadoopConfiguration()))

    def commit(self, targets: Sequence[str], transactions: Sequence[Any]) -> None:
        """Commit each of ``transactions`` (Iceberg transactions of ``targets``, catalog-qualified
        names) in one catalog transaction; a catalog without the endpoint gets them one by one
        (said once in the log, and ``supported`` turns false)."""
        names = self.spark._jvm.java.util.ArrayList()
        txns = self.spark._jvm.java.util.ArrayList()
        for target, txn in zip(targets, transactions, strict=True):
            names.add(target.split(".", 1)[1])
            txns.add(txn)
        what = (f"committing {len(targets)} tables in one catalog transaction "
                f"({', '.join(targets[:3])}{', ...' if len(targets) > 3 else ''})")
        if self.supported:
            outcome = spark_call(what, lambda: self._helper.commitTogether(self._client, names,
                                                                          txns))
            if outcome == "unsupported":
                self.supported = False
                log.warning(
                    "the REST catalog %s does not offer %s: the tables of a batch are "
                    "committed one by one (a reader between their commits may see one table "
                    "of a source transaction without the other; `walberg query --consistent` "
                    "reads a consistent cut)", self.catalog, TRANSACTIONS_ENDPOINT)
            else:
                return
        for target, txn in zip(targets, transactions, strict=True):
            spark_call(f"committing to {target}", txn.commitTransaction)


class CommitGroup:
    """The tables of one batch, committed together (see the module's text)."""

    def __init__(self, catalog: CatalogTransactions, members: Sequence[str],
                 work: threading.Semaphore) -> None:
        self._catalog = catalog
        self._cond = threading.Condition()
        self._active = set(members)  # tables neither finished nor failed
        self._joined: dict[str, Any] = {}  # this round: table -> its Iceberg transaction
        self._targets: dict[str, str] = {}
        self._round = 0
        self._outcomes: dict[int, Optional[BaseException]] = {}
        self._failure: Optional[BaseException] = None
        self.work = work
        self.rounds = 0  # group commits made
        self.committed = 0  # tables they committed

    def commit(self, table: str, target: str, txn: Any) -> None:
        """``table``'s Iceberg transaction ``txn`` (to ``target``), committed with the other
        tables': returns once the round committed, or raises its failure."""
        waited = False
        with self._cond:
            if self._failure is not None:
                raise _not_committed(target, self._failure)
            self._joined[table] = txn
            self._targets[table] = target
            mine = self._round
            if set(self._joined) >= self._active:
                self._run_round()
            else:
                # (a kill here: some tables of the batch joined, the others still working)
                crash_point("group-joined")
                self.work.release()  # (waiting holds no working place)
                waited = True
                while mine not in self._outcomes:
                    self._cond.wait()
            outcome = self._outcomes[mine]
        if waited:
            self.work.acquire()
        if outcome is not None:
            raise _not_committed(target, outcome)

    def leave(self, table: str, failure: Optional[BaseException] = None) -> None:
        """``table`` is done with this batch: committed, nothing to commit together, or failed
        (``failure``: the round under way commits nothing)."""
        with self._cond:
            self._active.discard(table)
            if failure is not None and self._failure is None:
                self._failure = failure
                if self._joined:
                    self._end_round(failure)
            elif self._joined and set(self._joined) >= self._active:
                self._run_round()

    def _run_round(self) -> None:
        """Commit every joined transaction (in the condition's lock, by the last to arrive)."""
        tables = sorted(self._joined)
        failure: Optional[BaseException] = None
        try:
            # (a kill half a second on: while the catalog commits)
            crash_point("group-commit", delay=0.5)
            self._catalog.commit([self._targets[t] for t in tables],
                                 [self._joined[t] for t in tables])
            self.rounds += 1
            self.committed += len(tables)
            # (a kill here: every table of the round committed, none told yet)
            crash_point("group-committed")
            failure_point("group-committed")
        except BaseException as exc:
            failure = exc
        self._end_round(failure)

    def _end_round(self, failure: Optional[BaseException]) -> None:
        self._outcomes[self._round] = failure
        self._round += 1
        self._joined.clear()
        self._cond.notify_all()


def _not_committed(target: str, cause: BaseException) -> ApplyError:
    retryable = isinstance(cause, ApplyError) and cause.retryable
    error = ApplyError(f"the commit to {target} was to land with the batch's other tables in one "
                       f"catalog transaction, which failed: {cause}", retryable)
    error.__cause__ = cause
    return error


@contextmanager
def member_of(group: Optional[CommitGroup], table: str) -> Iterator[None]:
    """In this thread, ``table``'s share of a batch joins ``group`` when it commits (None: it
    commits alone); the table leaves the group when the block ends."""
    if group is None:
        yield
        return
    _current.group = group
    _current.table = table
    group.work.acquire()
    failure: Optional[BaseException] = None
    try:
        yield
    except BaseException as exc:
        failure = exc
        raise
    finally:
        _current.group = None
        group.work.release()
        group.leave(table, failure)


def joined_group() -> Optional[tuple[CommitGroup, str]]:
    """The group this thread's table commits with, and the table, if any."""
    group = getattr(_current, "group", None)
    return None if group is None else (group, _current.table)
