"""Puffin, Iceberg's file format for statistics: blobs of bytes, then a footer that lists them.

    Magic Blob_1 ... Blob_n Footer
    Footer = Magic FooterPayload FooterPayloadSize Flags Magic

``Magic`` is ``PFA1``; the payload is JSON (``{"blobs": [...], "properties": {...}}``, each blob
its type, fields, snapshot-id, sequence-number, offset, length and properties); its size is 4
bytes little endian; the flags 4 bytes (bit 0 of the first: the payload is LZ4-compressed,
never set here). Written and read through Arrow streams, so on this disk or object storage
alike; a reader reads the footer, then each blob it wants by a ranged read.
"""

from __future__ import annotations

import json
import struct
from typing import Any

MAGIC = b"PFA1"
_TRAILER = struct.Struct("<i4s")  # payload size, flags


def write(out: Any, blobs: list[tuple[str, bytes, dict[str, str]]], snapshot: int,
          sequence: int) -> tuple[int, int]:
    """Write ``blobs`` ((type, bytes, properties) each) for ``snapshot`` (of sequence number
    ``sequence``) to the stream ``out`` as one Puffin file; (file size, footer size)."""
    listed: list[dict[str, Any]] = []
    at = len(MAGIC)
    out.write(MAGIC)
    for kind, body, properties in blobs:
        out.write(body)
        listed.append({"type": kind, "fields": [], "snapshot-id": snapshot,
                       "sequence-number": sequence, "offset": at, "length": len(body),
                       "properties": properties})
        at += len(body)
    payload = json.dumps({"blobs": listed, "properties": {"created-by": "walberg"}}).encode()
    footer = MAGIC + payload + _TRAILER.pack(len(payload), b"\0\0\0\0") + MAGIC
    out.write(footer)
    return at + len(footer), len(footer)


def blobs(source: Any) -> list[dict[str, Any]]:
    """The blobs a Puffin file lists (``source``: a random-access Arrow file)."""
    size = source.size()
    fixed = len(MAGIC) + _TRAILER.size
    tail = source.read_at(fixed, size - fixed)
    length, flags = _TRAILER.unpack(tail[:_TRAILER.size])
    if tail[_TRAILER.size:] != MAGIC or flags[0] & 1:
        raise ValueError("not a Puffin file with a plain footer (its magic or flags)")
    listed: list[dict[str, Any]] = json.loads(source.read_at(length, size - fixed - length))["blobs"]
    return listed


def blob(source: Any, listed: dict[str, Any]) -> bytes:
    """One blob's bytes, as ``blobs`` lists it."""
    return bytes(source.read_at(int(listed["length"]), int(listed["offset"])))
