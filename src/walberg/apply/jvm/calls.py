"""Calling into Spark: a Java failure turned into an ApplyError that says what was attempted
(and whether it may pass), and the storage watch that puts a deadline on calls waiting for an
object store (apply.jvm.watch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

from walberg.errors import ApplyError

if TYPE_CHECKING:
    from walberg.apply.jvm.watch import StorageWatch

T = TypeVar("T")


def java_message(exc: BaseException) -> str:
    """The first useful line of a (Java) exception, without the stack trace."""
    java_exc = getattr(exc, "java_exception", None)
    if java_exc is not None:
        try:
            cause = java_exc
            while cause.getCause() is not None:
                cause = cause.getCause()
            text = f"{cause.getClass().getName()}: {cause.getMessage()}"
            return text.splitlines()[0]
        except Exception:  # py4j may be gone while failing; fall back to the Python text
            pass
    desc = getattr(exc, "desc", None) or str(exc)
    lines = [ln for ln in str(desc).splitlines() if ln.strip()]
    return lines[0].strip() if lines else type(exc).__name__


# Java exceptions (by simple class name, anywhere in the cause chain) that come from the storage
# or the catalog and may pass: a commit that failed for one of them is worth retrying.
_TRANSIENT = ("IOException", "UncheckedIOException", "RuntimeIOException", "FileSystemException",
              "AccessDeniedException", "FileNotFoundException", "NoSuchFileException",
              "CommitFailedException", "CommitStateUnknownException", "ConnectException",
              "SocketTimeoutException", "ServiceUnavailableException")


def java_causes(exc: BaseException) -> Iterator[Any]:
    """The Java exceptions behind ``exc`` and the exceptions it was raised from (``raise ...
    from``), each followed by its causes (at most 20 of each)."""
    at: Optional[BaseException] = exc
    while at is not None:
        # (a Py4JJavaError's; pyspark's own converted exceptions, IllegalArgumentException and
        # the like, keep theirs as _origin)
        cause = getattr(at, "java_exception", None) or getattr(at, "_origin", None)
        seen = 0
        while cause is not None and seen < 20:
            yield cause
            cause, seen = cause.getCause(), seen + 1
        at = at.__cause__


def _transient(exc: BaseException) -> bool:
    try:
        for cause in java_causes(exc):
            name = cause.getClass().getSimpleName()
            if name in _TRANSIENT:
                return True
            # Another writer (a compaction, say) committed first and changed files this commit
            # depends on: done again against the new state, the batch applies cleanly.
            if name == "ValidationException" and any(
                    word in str(cause.getMessage() or "")
                    for word in ("conflicting", "Missing required files", "missing data files")):
                return True
            # The snapshot a row delta validates from was expired meanwhile (a maintenance by
            # another source of a shared table, or `walberg maintain` from another process):
            # done again once the key index has caught up with the table, it applies cleanly.
            if name in ("IllegalArgumentException", "ValidationException") and any(
                    word in str(cause.getMessage() or "")
                    for word in ("is not an ancestor of", "Cannot determine history between")):
                return True
    except Exception:
        return False
    return False


# The storage watch of this process's session (apply.jvm.watch), when its warehouse is on S3.
_watch: Optional["StorageWatch"] = None


def watch_storage(watch: Optional["StorageWatch"]) -> None:
    """Have every ``spark_call`` watched by ``watch`` (None: by none)."""
    global _watch
    if _watch is not None and _watch is not watch:
        _watch.close()
    _watch = watch


def storage_watch() -> Optional["StorageWatch"]:
    return _watch


def spark_call(what: str, fn: Callable[[], T]) -> T:
    """Run a Spark call; a Java failure becomes an ApplyError that says what was attempted,
    and one for an object store that does not answer a StorageUnavailable (see apply.jvm.watch)."""
    watch = _watch
    token = watch.begin(what) if watch is not None else None
    try:
        return fn()
    except ApplyError:
        raise
    except Exception as exc:
        if type(exc).__module__.startswith(("pyspark", "py4j")):
            transient = _transient(exc)
            if watch is not None:
                interrupted = watch.end(token)
                token = None
                problem = interrupted or watch.diagnose(transient)
                if problem is not None:
                    raise watch.error(what, problem) from exc
            raise ApplyError(f"{what} failed: {java_message(exc)}", transient) from exc
        raise
    finally:
        if watch is not None and token is not None:
            watch.end(token)
