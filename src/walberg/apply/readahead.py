"""Work made ahead of its consumer in a thread of its own."""

from __future__ import annotations

import threading
from queue import Full, Queue
from typing import Any, Generator, Iterator, TypeVar

T = TypeVar("T")


def ahead(items: Iterator[T], name: str, depth: int = 2) -> Generator[T, None, None]:
    """``items``, made in a thread of their own up to ``depth`` ahead of the consumer: work
    that leaves the GIL (Arrow, numpy, Parquet) on both sides overlaps, such as reading and
    encoding a file's keys while the ones before are sorted, or parsing a copy's next block
    while the one before is written. A consumer that stops early stops the thread (once the
    item it is making is made); an error in it is raised to the consumer."""
    done = object()
    queue: Queue[Any] = Queue(depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        """Hand ``item`` over, unless the consumer has stopped (then a full queue would never
        drain: False)."""
        while not stop.is_set():
            try:
                queue.put(item, timeout=0.1)
                return True
            except Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(done)
        except BaseException as exc:  # handed to the consumer
            put(exc)

    thread = threading.Thread(target=produce, name=f"walberg-ahead-{name}", daemon=True)
    thread.start()
    try:
        while True:
            item = queue.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # a consumer that stopped early: the producer stops too
        thread.join()
