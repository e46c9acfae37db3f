"""Crash points and failure points for the fault-injection tests.

``WALBERG_CRASH_AT=name:n`` makes the process kill itself with SIGKILL (exactly what `kill -9`
does: no cleanup, no flush) the n-th time it passes the named point, so a test can crash walberg
at a precise moment instead of at a random one. Without the variable (always, outside tests)
each point is one comparison.

Points: ``segment-write`` (a frame appended, not yet sealed), ``seal`` (a segment sealed, not
yet applied), ``decode`` (a chunk of changes decoded while staging), ``commit`` (half a second
into a table's Spark commit, on a timer), ``staged`` (a staged file uploaded to the stage area
for a cluster's executors, the commit that reads it not yet made), ``committed`` (a batch
committed to Iceberg, its segments not yet removed and the slot not yet told), ``lake-check``
(a second into a restart's check of the lake, while the stream already fills segments),
``reshaped`` (a table copied again took the source's columns, its copy not yet made),
``copy-files``, ``row-delta`` and ``indexed`` (see apply.initial.files and apply.position.keyed),
``key-store`` (a key index's files sent to the warehouse, its manifest not yet; see
apply.position.keystore), ``chunk`` (a chunk of a jdbc initial copy committed) and ``copied`` (a
table's initial copy committed, the stream not yet started); with a REST catalog's multi-table
commits (apply.together): ``group-joined`` (a table of a batch waits for the others to join
its catalog transaction), ``group-commit`` (half a second into that transaction's commit, on a
timer) and ``group-committed`` (every table of it committed, none told yet).

``WALBERG_CRASH_AT=name:n@a+b`` counts the passes of each of the sources ``a`` and ``b`` (several
fanned in to one pipeline) apart: a source that has passed n times waits there, and the process
dies once every source named has, so that their copies are cut short together.

``WALBERG_FAIL_AT=name:n`` (or ``_FAIL`` set by a test in its own process) makes the n-th pass of
a failure point raise what a commit whose outcome is unknown raises (Iceberg's
CommitStateUnknownException through the sink): a retryable ``ApplyError``, the work before it
done. Points: ``changelog`` (a mode-both changelog's append landed, its table's commit not yet
made), ``dead-letters`` (a batch's dead letters written, no table's commit made yet; a Postgres
batch's: its table's),
``row-delta`` (a batch's row delta landed in the table), ``group-committed`` (a catalog
transaction of several tables landed).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

from walberg.errors import ApplyError


def _target(setting: str) -> Optional[tuple[str, int]]:
    name, _, count = setting.partition(":")
    return (name, int(count or 1)) if name else None


_CRASH, _, _EACH = os.environ.get("WALBERG_CRASH_AT", "").partition("@")
_TARGET: Optional[tuple[str, int]] = _target(_CRASH)
_SOURCES = frozenset(_EACH.split("+")) if _EACH else frozenset()
_hits: dict[str, int] = {}
_arrived: set[str] = set()
_lock = threading.Lock()
_FAIL: Optional[tuple[str, int]] = _target(os.environ.get("WALBERG_FAIL_AT", ""))
_fails: dict[str, int] = {}


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_point(name: str, delay: float = 0.0, source: Optional[str] = None) -> None:
    """Die here (or ``delay`` seconds from here, whatever runs then) on the configured hit.
    ``source``: which of several sources passes (see ``@`` above)."""
    if _TARGET is None or _TARGET[0] != name:
        return
    if _SOURCES:
        if source not in _SOURCES:
            return
        with _lock:
            _hits[source] = _hits.get(source, 0) + 1
            if _hits[source] < _TARGET[1]:
                return
            _arrived.add(source)
            last = _arrived == _SOURCES
        if not last:
            threading.Event().wait()  # until the last source gets here and kills the process
        _kill()
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] < _TARGET[1]:
        return
    if delay:
        threading.Timer(delay, _kill).start()
    else:
        _kill()


def failure_point(name: str) -> None:
    """Raise a commit's unknown outcome here on the configured pass (then never again)."""
    global _FAIL
    if _FAIL is None or _FAIL[0] != name:
        return
    _fails[name] = _fails.get(name, 0) + 1
    if _fails[name] < _FAIL[1]:
        return
    _FAIL = None
    raise ApplyError(f"injected failure at {name}: the commit's outcome is unknown "
                     "(CommitStateUnknownException)", retryable=True)
