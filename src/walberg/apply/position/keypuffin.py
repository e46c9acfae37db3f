"""A table's key index as one Puffin file registered in the table's metadata as the statistics
file of the snapshot it describes: for catalogs that own their storage (a REST catalog), whose
orphan-file removal deletes every file no metadata names, so the plain files of
``keystore``'s folder would be lost there (and a driver on a fresh machine would read every
key again).

The file (Puffin, Iceberg's format for statistics): the magic ``PFA1``, then a blob per file of
the index (``walberg-key-index-file``; its name and raw size among the blob's properties; a
base's columns turned into differences between neighbours with their bytes grouped by
significance, then zstd, as ``keystore`` packs them; other files zstd), then the index's manifest
(``walberg-key-index-manifest``, JSON), then the footer: the magic, a JSON payload that lists the
blobs (type, snapshot, offset, length, properties), the payload's length (4 bytes, little
endian), 4 bytes of flags (0: not compressed) and the magic again.

Registered with ``UpdateStatistics`` in a metadata commit of its own, which also drops the
registration of the previous state (its file is deleted after): one file a table (a source, when
several fan in), named by the metadata, kept by every orphan-file removal, removed with the
snapshot it describes when that expires. The registration lists no blobs (the file's own footer
does): readers that know only Iceberg's own blob types (PyIceberg 0.12 refuses a table whose
metadata names another) read the table as before and find no statistics to use. Fetched by
reading the footer, then each blob (a ranged read), in threads.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa

MAGIC = b"PFA1"
FILE_BLOB = "walberg-key-index-file"
MANIFEST_BLOB = "walberg-key-index-manifest"
SOURCE_PROPERTY = "walberg.source"
_TRAILER = struct.Struct("<i4s")  # payload length, flags


def encode(name: str, raw: bytes, column: Optional[np.dtype]) -> bytes:
    """One file of the index as its blob's bytes (``column``: a base column's type)."""
    from walberg.apply.position.keystore import _planes

    if column is not None:
        values = np.frombuffer(raw, dtype=column)
        raw = _planes(np.diff(values, prepend=column.type(0)))
    return bytes(pa.compress(raw, codec="zstd", asbytes=True))


def decode(body: bytes, size: int, column: Optional[np.dtype]) -> bytes:
    from walberg.apply.position.keystore import _unplanes

    raw = pa.decompress(body, decompressed_size=size, codec="zstd", asbytes=True)
    if len(raw) != size:
        raise ValueError("a blob of the key index is not the size its properties say")
    if column is not None:
        raw = np.cumsum(_unplanes(raw, column), dtype=column).tobytes()
    return bytes(raw)


def write(out: Any, held: Path, manifest: dict[str, Any], sizes: dict[str, int], snapshot: int,
          sequence: int, source: Optional[str]) -> tuple[int, int, list[list[Any]]]:
    """Write the index (its files in ``held``, of ``sizes``; ``manifest``) to the stream
    ``out`` as one Puffin file; (file size, footer size, the blobs as ``setStatistics`` takes
    them: [type, sequence number, properties])."""
    from walberg.apply.position.keystore import _column

    tag = {SOURCE_PROPERTY: source} if source else {}
    blobs: list[dict[str, Any]] = []
    at = len(MAGIC)
    out.write(MAGIC)

    def add(kind: str, body: bytes, properties: dict[str, str]) -> None:
        nonlocal at
        out.write(body)
        blobs.append({"type": kind, "fields": [], "snapshot-id": snapshot,
                      "sequence-number": sequence, "offset": at, "length": len(body),
                      "properties": {**properties, **tag}})
        at += len(body)

    for name, size in sizes.items():
        body = encode(name, (held / name).read_bytes(), _column(name))
        add(FILE_BLOB, body, {"name": name, "size": str(size)})
    add(MANIFEST_BLOB, json.dumps(manifest).encode(), {})
    payload = json.dumps({"blobs": blobs, "properties": {"created-by": "walberg"}}).encode()
    footer = MAGIC + payload + _TRAILER.pack(len(payload), b"\0\0\0\0") + MAGIC
    out.write(footer)
    return at + len(footer), len(footer), [[b["type"], sequence, b["properties"]]
                                           for b in blobs]


def read(source: Any, directory: Path, threads: int = 8) -> dict[str, Any]:
    """Read a Puffin file written by ``write`` (``source``: a random-access Arrow file) into
    ``directory``: its files, and its manifest (returned, not written)."""
    from walberg.apply.position.keystore import _column

    size = source.size()
    tail = source.read_at(len(MAGIC) + _TRAILER.size, size - len(MAGIC) - _TRAILER.size)
    length, flags = _TRAILER.unpack(tail[:_TRAILER.size])
    if tail[_TRAILER.size:] != MAGIC or flags[0] & 1:
        raise ValueError("not a Puffin file walberg wrote (magic or flags)")
    payload = json.loads(source.read_at(length, size - len(MAGIC) - _TRAILER.size - length))
    files = [b for b in payload["blobs"] if b["type"] == FILE_BLOB]
    [kept] = [b for b in payload["blobs"] if b["type"] == MANIFEST_BLOB]

    def one(blob: dict[str, Any]) -> None:
        name, raw_size = blob["properties"]["name"], int(blob["properties"]["size"])
        body = source.read_at(int(blob["length"]), int(blob["offset"]))
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(decode(body, raw_size, _column(name)))

    with ThreadPoolExecutor(threads, thread_name_prefix="walberg-fetch") as pool:
        for done in [pool.submit(one, b) for b in files]:
            done.result()
    manifest: dict[str, Any] = json.loads(
        source.read_at(int(kept["length"]), int(kept["offset"])))
    return manifest


def ours(entries: list[list[Any]], source: Optional[str]) -> list[tuple[int, str]]:
    """Of a table's statistics files (``Batch.statistics``: [snapshot, path, blobs]),
    walberg's key indexes of ``source``, by their file names: (snapshot, path)."""
    prefix = f"walberg-keys-{source or '_one'}-"
    return [(int(snapshot), str(path)) for snapshot, path, _ in entries
            if str(path).rpartition("/")[2].startswith(prefix)]


def name_for(snapshot: int, source: Optional[str]) -> str:
    """The file name of a kept index (under the table's metadata folder)."""
    return f"walberg-keys-{source or '_one'}-{snapshot}-{os.urandom(6).hex()}.puffin"
