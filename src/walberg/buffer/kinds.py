"""The frame kinds this walberg writes into segment files, in one place, and the refusal of any
other: a kind not listed here was written by a newer walberg, and what it holds cannot be
applied by this one (skipping it would leave its changes out of the lake without a word).

The segment store reads payloads of no kind; the stages that write a kind read it back
(``runtime.pg_stager``, ``runtime.kafka.frames``)."""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

from walberg.buffer.segment import KIND_PREAMBLE_END
from walberg.errors import Terminal


class FrameKind(IntEnum):
    """A frame's ``kind`` byte. Numbers are for good: a new kind takes a new number."""

    PGOUTPUT = 0  # a pgoutput message as the server sent it
    PREAMBLE = 1  # a Relation message repeated at the start of a segment (self-contained files)
    KAFKA_RECORD = 2  # one consumed Kafka record (written by walberg before run frames)
    KAFKA_RUN = 3  # a run of consumed Kafka records
    # Kafka offsets that hold no record (transaction markers, aborted records), up to where
    # the consumer reached a partition's end
    KAFKA_PAST = 4
    PREAMBLE_END = KIND_PREAMBLE_END  # the segment store's own: where a preamble ends


KNOWN = frozenset(int(k) for k in FrameKind)


def refuse_foreign(path: Path, kind: int, pipeline: str) -> Terminal:
    """The error for a frame of a kind another kind of pipeline writes (``pipeline``: the kind
    that reads this one, "Postgres" or "Kafka"): two pipelines were given one buffer.dir."""
    return Terminal(
        f"the segment file {path} holds a frame of kind {kind} ({FrameKind(kind).name}), "
        f"which a {pipeline} pipeline never writes: buffer.dir {path.parent} belongs to "
        "another pipeline. Give each pipeline its own buffer.dir")


class UnknownFrameKind(Terminal):
    """A segment file holds a frame of a kind this walberg does not know."""


def refuse_unknown(path: Path, kind: int, offset: int) -> UnknownFrameKind:
    """The error for a frame of a kind this walberg does not know, with the ways out."""
    return UnknownFrameKind(
        f"the segment file {path} holds a frame of kind {kind} (at byte offset {offset}), "
        f"which this walberg does not know (it knows kinds "
        f"{', '.join(str(k) for k in sorted(KNOWN))}): a newer walberg wrote it, and this one "
        "would leave its changes out of the lake. Run the walberg version that wrote it until "
        "the segments are applied (`walberg run --once`), then this one; or, to go on with "
        f"this version, delete this file and every segment file in {path.parent} numbered "
        "above it: walberg reads those changes again from the source (the replication slot, "
        "or the Kafka offsets the lake holds), as long as the source still has them.")
