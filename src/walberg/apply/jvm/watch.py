"""The storage watch: walberg's own deadline on Spark calls that wait for an object store.

Below a Spark call that reads or writes the warehouse sit three retry layers walberg does not
control end to end: a catalog's metadata refresh (Iceberg retries it 20 times, with waits up
to 5 s), S3A's Invoker, and the AWS SDK. Their settings (apply.catalog.storage.s3a_deadlines) make
one storage request fail fast, but not the layers above. So the watch keeps a list of the Spark
calls in flight; once one has run for ``storage.timeout_seconds``, it asks the store itself
(``S3Probe``, from Python, independent of the JVM). A store that answers means a long call,
left alone. A store that does not (or refuses the credentials) means an outage: the watch
interrupts the JVM thread of each overdue call, whose retry loops then end, and the call fails
with ``StorageUnavailable``, one paragraph naming the endpoint and what to check.

``patient``: ``walberg run`` keeps trying (the error is retryable, and a commit is tried again
within sink.commit_max_attempts); ``walberg run --once`` gives up at the first outage.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from walberg.apply.catalog.storage import Problem, S3Probe
from walberg.errors import StorageUnavailable

log = logging.getLogger("walberg")


@dataclass
class Call:
    """A Spark call in flight."""

    what: str
    started: float
    jvm_thread: Any  # the JVM thread that serves the calling Python thread (pinned threads)
    problem: Optional[Problem] = None  # set when the watch interrupted it


class StorageWatch:
    """Bounds the Spark calls that wait for an unreachable object store (see the module)."""

    def __init__(self, jvm: Any, probe: S3Probe, timeout: float) -> None:
        self.jvm = jvm
        self.probe = probe
        self.timeout = timeout
        self.patient = True
        self._lock = threading.Lock()
        self._calls: dict[int, Call] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="walberg-storage-watch",
                                        daemon=True)
        self._thread.start()

    def begin(self, what: str) -> Optional[int]:
        """A Spark call starts in this thread: a token for ``end`` (None: not watched)."""
        try:
            jvm_thread = self.jvm.java.lang.Thread.currentThread()
        except Exception:  # the JVM is gone or going: nothing to watch
            return None
        call = Call(what, time.monotonic(), jvm_thread)
        with self._lock:
            self._calls[id(call)] = call
        return id(call)

    def end(self, token: Optional[int]) -> Optional[Problem]:
        """The call is over: forget it. What the watch found if it interrupted the call; the
        JVM thread's interrupt flag is then cleared, so the thread's next call runs normally."""
        if token is None:
            return None
        with self._lock:
            call = self._calls.pop(token, None)
        if call is None or call.problem is None:
            return None
        try:
            self.jvm.java.lang.Thread.interrupted()  # this thread's JVM thread: clears it
        except Exception:
            pass
        return call.problem

    def error(self, what: str, problem: Problem) -> StorageUnavailable:
        """The error a call that met an outage fails with."""
        text = self.probe.describe(problem, self.timeout)
        # Refused credentials do not come right by waiting.
        patient = self.patient and problem.kind == "unreachable"
        return StorageUnavailable(f"{what} failed: {text}", retryable=patient)

    def diagnose(self, transient: bool) -> Optional[Problem]:
        """After a Spark call failed for the storage or the catalog (``transient``): is the
        store reachable? None if it is (the failure is something else)."""
        if not transient:
            return None
        return self.probe.check(self.timeout)

    def close(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        tick = min(1.0, self.timeout / 4)
        while not self._closed.wait(tick):
            now = time.monotonic()
            with self._lock:
                overdue = [c for c in self._calls.values()
                           if c.problem is None and now - c.started >= self.timeout]
            if not overdue:
                continue
            problem = self.probe.check(max(self.timeout / 2, 1.0))
            if problem is None:
                continue  # the store answers: a long call, not an outage
            with self._lock:
                for call in overdue:
                    if id(call) not in self._calls:
                        continue  # over meanwhile
                    call.problem = problem
                    log.warning("%s has waited %.0f s and the warehouse does not answer (%s): "
                                "interrupting it", call.what, now - call.started,
                                problem.detail)
                    try:
                        call.jvm_thread.interrupt()
                    except Exception as exc:  # the JVM is going away
                        log.debug("could not interrupt %s: %s", call.what, exc)
