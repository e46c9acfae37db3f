"""walberg's errors. Every error a user can see says what happened, where, and what to do.

``Transient`` errors (a dropped connection, a conflicting commit) are retried with backoff;
``Terminal`` errors stop the pipeline with the message as it is.
"""

from __future__ import annotations


class WalbergError(Exception):
    """Base of every error walberg raises on purpose. ``str(err)`` is the message for people."""

    exit_code = 1


class Transient(WalbergError):
    """Worth retrying: the same call may succeed later."""


class Terminal(WalbergError):
    """Retrying will not help; a person has to act."""


class ConfigError(Terminal):
    """The configuration is wrong: the message names the key and the fix."""

    exit_code = 2


class SourceError(Terminal):
    """Postgres refused something or is set up in a way walberg cannot use."""

    exit_code = 2


class SlotLost(SourceError):
    """The replication slot was invalidated by the server (the WAL it needed was removed)."""


class DecodeError(Terminal):
    """A replication message could not be decoded."""


class SegmentCorrupt(Terminal):
    """A sealed segment file failed its checksum."""


class ApplyError(Terminal):
    """Spark or Iceberg could not apply a batch. ``retryable``: the cause was the storage or
    the catalog (I/O, a conflicting commit), not the data or the statement."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class EnvironmentProblem(Terminal):
    """Something walberg needs on this machine (JVM, jar) is missing or broken."""

    exit_code = 2


class StorageUnavailable(ApplyError):
    """The warehouse's object store did not answer, or refused walberg's credentials, within
    storage.timeout_seconds. ``retryable``: walberg is to keep trying (``walberg run``), not
    to give up (``--once``, or refused credentials)."""


class TablesParked(Terminal):
    """A run ended with tables parked (see walberg.runtime.parking): every other table was
    applied. Exit code 3, so that a scheduler tells it from a run that applied nothing."""

    exit_code = 3

    def __init__(self, parked: dict[str, str], report: object = None) -> None:
        self.parked = dict(parked)
        self.report = report  # the run's report (what the other tables got)
        names = ", ".join(sorted(parked))
        super().__init__(
            f"{len(parked)} table(s) parked, every other table applied: {names}. "
            + " ".join(f"[{t}] {why}" for t, why in sorted(parked.items()))
            + " A parked table's changes are held for it (the replication slot keeps them, so "
            "WAL accumulates on the source until it is resolved); `walberg status` lists it. "
            "`walberg resync -c <pipeline file> TABLE` copies it afresh and ends the park.")
