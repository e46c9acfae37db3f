"""``apply.readahead.ahead``: items made in a thread ahead of their consumer, in order, errors
raised to the consumer, and a consumer that stops early never left waiting for the thread."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

from walberg.apply.readahead import ahead


def test_items_in_order_and_errors_raised() -> None:
    assert list(ahead(iter(range(10)), "t")) == list(range(10))

    def failing() -> Iterator[int]:
        yield 1
        raise RuntimeError("made badly")

    with pytest.raises(RuntimeError, match="made badly"):
        list(ahead(failing(), "t"))


@pytest.mark.parametrize("last", ["end", "error"])
def test_a_consumer_that_stops_while_the_queue_is_full_is_not_kept_waiting(last: str) -> None:
    """The thread finishes (or fails) after the consumer has stopped with the queue full: its
    last word has nowhere to go and must not block it, or the consumer's close waits forever."""
    def items() -> Iterator[int]:
        yield from range(3)
        time.sleep(0.3)  # (the consumer has stopped by now; the queue holds two items)
        if last == "error":
            raise RuntimeError("after the consumer stopped")

    made = ahead(items(), "t")
    assert next(made) == 0
    time.sleep(0.1)
    closing = threading.Thread(target=made.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "the consumer's close waited for the thread forever"
