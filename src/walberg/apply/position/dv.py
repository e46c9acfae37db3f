"""Deletion vectors of format-version 3 tables, written on the driver: the rows of one data file
that are deleted, as a roaring bitmap of their positions, a ``deletion-vector-v1`` blob in a
Puffin file (Iceberg's table spec and Puffin spec).

A data file has at most one deletion vector. A new one for a file that has one already holds
the old positions and the new (the caller reads the old blob and merges), and the commit
removes the old one in the same row delta.

A blob: its length (4 bytes, big-endian; the magic and the vector), the magic D1 D3 39 64, the
vector (a 64-bit roaring bitmap in the portable format: the number of 32-bit bitmaps, 8 bytes
little-endian, then each one's high 32 bits, 4 bytes little-endian, and the 32-bit bitmap in
roaring's portable serialization), and the CRC-32 of the magic and the vector (4 bytes,
big-endian). A Puffin file: the magic PFA1, the blobs, and a footer (PFA1, a JSON payload
naming each blob's offset, length, data file and cardinality, the payload's length as 4 bytes
little-endian, 4 bytes of flags, PFA1).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from pyroaring import BitMap

PUFFIN_MAGIC = b"PFA1"
DV_MAGIC = bytes([0xD1, 0xD3, 0x39, 0x64])
DV_TYPE = "deletion-vector-v1"
ROW_POSITION_FIELD = 2147483645  # Iceberg's reserved field id of a row's position (_pos)


@dataclass(frozen=True)
class Blob:
    """One deletion vector as written into a Puffin file."""

    data_file: str
    offset: int
    length: int
    cardinality: int


def encode(positions: BitMap | np.ndarray) -> bytes:
    """The ``deletion-vector-v1`` blob of ``positions`` (rows of one data file: under 2^32
    each, as a Parquet file never holds more rows)."""
    bitmap = positions if isinstance(positions, BitMap) else bitmap_of(positions)
    bitmap.run_optimize()
    vector = struct.pack("<Q", 1 if len(bitmap) else 0)
    if len(bitmap):
        vector += struct.pack("<I", 0) + bitmap.serialize()
    body = DV_MAGIC + vector
    return struct.pack(">I", len(body)) + body + struct.pack(">I", zlib.crc32(body))


def decode(blob: bytes) -> BitMap:
    """The positions of a ``deletion-vector-v1`` blob (checked: length, magic, CRC)."""
    if len(blob) < 12:
        raise ValueError("a deletion vector shorter than its envelope")
    (length,) = struct.unpack(">I", blob[:4])
    body = blob[4:4 + length]
    if len(body) != length or body[:4] != DV_MAGIC:
        raise ValueError("not a deletion-vector-v1 blob (length or magic)")
    (crc,) = struct.unpack(">I", blob[4 + length:8 + length])
    if crc != zlib.crc32(body):
        raise ValueError("a deletion vector whose CRC does not match")
    vector = body[4:]
    (count,) = struct.unpack("<Q", vector[:8])
    if count == 0:
        return BitMap()
    (high,) = struct.unpack("<I", vector[8:12])
    if count != 1 or high:  # a data file of over 2^32 rows: never written
        raise ValueError("a deletion vector with positions past 2^32 in one data file")
    return BitMap.deserialize(vector[12:])


def bitmap_of(positions: np.ndarray) -> BitMap:
    """Row positions of one data file as a bitmap."""
    values = np.asarray(positions, dtype=np.int64)
    if len(values) and (int(values.min()) < 0 or int(values.max()) >= 1 << 32):
        raise ValueError("a row position outside 0..2^32")
    return BitMap(values.astype(np.uint32))


def write_puffin(path: Path, vectors: Sequence[tuple[str, bytes, int]], created_by: str
                 ) -> list[Blob]:
    """Write the blobs ``vectors`` ((data file, blob, cardinality) each) as one Puffin file at
    ``path``; return where each blob landed."""
    blobs: list[Blob] = []
    with open(path, "wb") as out:
        out.write(PUFFIN_MAGIC)
        at = len(PUFFIN_MAGIC)
        for data_file, blob, cardinality in vectors:
            out.write(blob)
            blobs.append(Blob(data_file, at, len(blob), cardinality))
            at += len(blob)
        footer = json.dumps({
            "blobs": [{"type": DV_TYPE, "fields": [ROW_POSITION_FIELD], "snapshot-id": -1,
                       "sequence-number": -1, "offset": b.offset, "length": b.length,
                       "properties": {"referenced-data-file": b.data_file,
                                      "cardinality": str(b.cardinality)}} for b in blobs],
            "properties": {"created-by": created_by}}).encode()
        out.write(PUFFIN_MAGIC + footer + struct.pack("<I", len(footer)) + bytes(4)
                  + PUFFIN_MAGIC)
    return blobs
