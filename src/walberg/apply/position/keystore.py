"""A table's key index kept in the warehouse too, beside the table, versioned by the snapshot it
describes: a driver that starts on a fresh machine (Kubernetes, EMR) fetches it instead of
reading every key of the table back (see ``indexes.KeyIndexes.index``).

Where: ``<table location>/_walberg_keys/<source>/`` (``_one`` with one source). Iceberg's orphan
file removal (``walberg maintain``) leaves names that begin with ``_`` alone, and a table whose
folder is removed takes it along.

What: the index's files as ``keyindex`` has them on local disk (a base of four flat columns and
small delta runs, each written once and never changed) and, written last, ``snapshot-<id>.json``,
the index's manifest, which names them. On object storage each file is sent in pieces of 4 MiB
(``<name>.<n>``: each one PUT, and a fetch reads them side by side), each compressed (zstd),
a base's columns first turned into differences between neighbours with their bytes grouped by
significance: sorted keys and mostly ascending positions shrink to a few bytes an entry, one
integer key's to almost nothing. In a warehouse on this machine's disk the files are hard links.

When: after each change of the index (a batch's commit, a copy, a rebuild; a small or
registered index at most once a minute and as the run ends, see ``indexes.KEEP_EVERY_S``), by a
thread of its own, from hard links taken at once (the index moves on meanwhile): only the
newest waiting state of a table is kept. A run waits for it before it ends (``close``). A
crash in between leaves the folder at an older snapshot, or with files no manifest names
(removed by the next keep): a manifest only names files written before it.

Registered (a REST catalog, which may own the storage and remove every file no metadata
names): one Puffin file in the table's metadata folder (``apply.catalog.puffin``): a blob per
file of the index (``walberg-key-index-file``, its name and raw size among the blob's
properties, packed as the pieces are), then the manifest (``walberg-key-index-manifest``);
registered with ``UpdateStatistics`` as the statistics file of the snapshot it describes, in
one metadata commit that drops the previous registration (whose file is deleted after). The
registration lists no blobs (the file's footer does): PyIceberg 0.12 refuses to load a table
whose metadata names a blob type it does not know. Fetched from the table's statistics files.

Fetched: only when this disk has no index for the table, and only a manifest of the same table
(its table-uuid) whose snapshot is the table's current one or one the index follows to it
(appends and compactions since; the caller says which). Anything else, or any failure, and the
index is read from the lake as before: the copy in the warehouse saves time, never decides what
is right.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
from pyarrow import fs as pafs

from walberg.apply.catalog import puffin
from walberg.apply.position.entries import local_path
from walberg.apply.position.keyindex import MANIFEST, made_for
from walberg.apply.position.lakekeys import s3_path
from walberg.faults import crash_point

log = logging.getLogger("walberg")

FOLDER = "_walberg_keys"
PIECE = 4 << 20  # bytes of a file in one object on object storage (a multiple of 8)
FETCHES = 8  # pieces read at once
_SNAPSHOT = re.compile(r"snapshot-(-?\d+)\.json")
_COLUMNS: dict[str, np.dtype] = {"keys": np.dtype(np.int64), "checks": np.dtype(np.int64),
                                 "files": np.dtype(np.int32), "positions": np.dtype(np.int64)}


@dataclass(frozen=True)
class Place:
    """Where one table's index is kept: a folder on an Arrow file system; or, ``registered``,
    one Puffin file in the table's metadata folder named by the table's metadata (see the
    module docstring)."""

    fs: Any
    folder: str
    local: bool  # this machine's disk: the files are hard links, not packed
    registered: bool = False
    source: Optional[str] = None  # the fan-in source whose index it is
    scheme: str = "file:"  # how the table's metadata names a path of this place

    def path(self, name: str) -> str:
        return f"{self.folder}/{name}"

    def output(self, name: str) -> Any:
        """A stream writing the object ``name`` (one PUT on object storage)."""
        if isinstance(self.fs, pafs.LocalFileSystem):  # (object storage has no folders to make)
            self.fs.create_dir(self.path(name).rpartition("/")[0], recursive=True)
        return self.fs.open_output_stream(self.path(name))


def place_of(location: str, source: Optional[str], s3: Callable[[], Any],
             registered: bool = False) -> Optional[Place]:
    """The place for the index of the table at ``location`` (``source``: the fan-in source
    whose index it is; ``registered``: a Puffin file the table's metadata names), or None where
    the driver cannot write (neither this disk nor S3)."""
    where = "metadata" if registered else f"{FOLDER}/{source or '_one'}"
    local = local_path(location)
    if local is not None:
        return Place(pafs.LocalFileSystem(), str(local / where), True, registered, source)
    path = s3_path(location)
    return None if path is None else Place(s3(), f"{path.rstrip('/')}/{where}", False,
                                           registered, source,
                                           location.partition("://")[0] + "://")


@dataclass(frozen=True)
class Registry:
    """A registered place's side in the table's metadata: ``listed(target)``, walberg's
    registered indexes of the place's source, (snapshot, path), oldest first;
    ``register(target, snapshot, path, size, footer size, blobs, replaced snapshots)``; and
    ``sequence(target, snapshot)``, the snapshot's sequence number."""

    listed: Callable[[str, Optional[str]], list[tuple[int, str]]]
    register: Callable[..., None]
    sequence: Callable[[str, int], int]


def _names(manifest: dict[str, Any], directory: Path) -> list[str]:
    """The files of the index in ``directory`` that its manifest names, relative to it (a
    base's checks are not written when they are all 0)."""
    names = list(manifest["deltas"])
    if manifest.get("base"):
        for column in _COLUMNS:
            name = f"{manifest['base']}/{column}"
            if column != "checks" or (directory / name).exists():
                names.append(name)
    return names


@dataclass
class _Keep:
    target: str
    place: Place
    manifest: dict[str, Any]
    held: Path  # hard links to the files the manifest names, as they were when asked


class KeyStore:
    """Keeps indexes in the warehouse (one thread, newest state first) and fetches them."""

    def __init__(self, registry: Optional[Registry] = None) -> None:
        """``registry``: for places that are registered in the table's metadata."""
        self._registry = registry
        self._lock = threading.Lock()
        self._wanted: dict[str, _Keep] = {}  # by place folder: the newest state to keep
        self._worker: Optional[threading.Thread] = None
        self._idle = threading.Event()
        self._idle.set()

    # ---- keeping ----------------------------------------------------------------------------

    def keep(self, target: str, place: Place, directory: Path, scratch_root: Path) -> None:
        """Keep the index in ``directory``, as its manifest says now, at ``place``: in the
        background; a state of the same table still waiting is dropped for this one."""
        manifest = json.loads((directory / MANIFEST).read_text())
        manifest["kept"] = {name: (directory / name).stat().st_size
                            for name in _names(manifest, directory)}
        held = Path(tempfile.mkdtemp(prefix="keep-", dir=scratch_root))
        try:
            for name in manifest["kept"]:
                (held / name).parent.mkdir(parents=True, exist_ok=True)
                os.link(directory / name, held / name)
        except OSError:
            shutil.rmtree(held, ignore_errors=True)
            raise
        with self._lock:
            dropped = self._wanted.pop(place.folder, None)
            self._wanted[place.folder] = _Keep(target, place, manifest, held)
            self._idle.clear()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="walberg-keystore",
                                                daemon=True)
                self._worker.start()
        if dropped is not None:
            shutil.rmtree(dropped.held, ignore_errors=True)

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._wanted:
                    self._worker = None
                    self._idle.set()
                    return
                folder = next(iter(self._wanted))
                job = self._wanted.pop(folder)
            started = time.monotonic()
            try:
                sent = self._keep_now(job)
                if sent is None:
                    continue
                log.info("key index of %s kept in the warehouse at snapshot %s (%d file(s), "
                         "%.1f MB sent) in %.2f s", job.target, job.manifest["snapshot"],
                         sent[0], sent[1] / 1e6, time.monotonic() - started)
            except Exception as exc:
                log.warning("key index of %s: not kept in the warehouse (%s); a driver on "
                            "another machine reads the table's keys instead", job.target, exc)
            finally:
                shutil.rmtree(job.held, ignore_errors=True)

    def _keep_now(self, job: _Keep) -> Optional[tuple[int, int]]:
        """Send the files the folder lacks, then the manifest, then remove what it no longer
        needs; (files sent, bytes sent), or None if it was all there."""
        place, manifest = job.place, job.manifest
        if place.registered:
            return self._register(job)
        there = _listing(place)
        packed = not place.local
        wanted = {name: _objects(name, size, packed) for name, size in manifest["kept"].items()}
        missing = [(name, objects) for name, objects in wanted.items()
                   if not set(objects) <= there]
        kept = f"snapshot-{manifest['snapshot']}.json"
        keep = {o.split("/")[0] for objects in wanted.values() for o in objects} | {kept}
        stale = sorted({n.split("/")[0] for n in there} - keep)
        if not missing and not stale and kept in there:
            return None  # kept already (a run that starts where the last one ended)
        sent = [len(missing), 0]
        if place.local:
            for name, _ in missing:
                target = Path(place.path(name))
                target.parent.mkdir(parents=True, exist_ok=True)
                _link(job.held / name, target)
                sent[1] += target.stat().st_size
        else:
            with ThreadPoolExecutor(4, thread_name_prefix="walberg-keep") as pool:
                sent[1] = sum(pool.map(
                    lambda piece: _send(job.held / piece[0], place, piece[0], piece[1]),
                    [(name, n) for name, objects in missing for n in range(len(objects))]))
        crash_point("key-store")  # the files there, the manifest naming them not yet
        body = json.dumps({**manifest, "packed": packed}).encode()
        if place.local:
            partial = Path(place.path(f".{kept}.partial"))
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_bytes(body)
            os.replace(partial, place.path(kept))
        else:
            with place.output(kept) as out:
                out.write(body)
        for old in stale:
            info = place.fs.get_file_info(place.path(old))
            if info.type == pafs.FileType.Directory:
                place.fs.delete_dir(place.path(old))
            elif info.type == pafs.FileType.File:
                place.fs.delete_file(place.path(old))
        return sent[0], sent[1]

    def _register(self, job: _Keep) -> Optional[tuple[int, int]]:
        """Write the index as one Puffin file in the table's metadata folder and register it
        as the statistics file of its snapshot, dropping the registration (and the file) of
        the state it replaces; (1, bytes) or None if that snapshot is registered already."""
        assert self._registry is not None
        place, manifest = job.place, job.manifest
        snapshot = int(manifest["snapshot"])
        before = self._registry.listed(job.target, place.source)
        if any(s == snapshot for s, _ in before):
            return None
        body = json.dumps({k: v for k, v in manifest.items() if k != "kept"}).encode()
        tag = {SOURCE_PROPERTY: place.source} if place.source else {}
        blobs = [(FILE_BLOB, _packed((job.held / name).read_bytes(), name),
                  {"name": name, "size": str(size), **tag})
                 for name, size in manifest["kept"].items()]
        blobs.append((MANIFEST_BLOB, body, dict(tag)))
        path = place.path(f"walberg-keys-{place.source or '_one'}-{snapshot}-"
                          f"{os.urandom(6).hex()}.puffin")
        with place.output(path.rpartition("/")[2]) as out:
            size, footer = puffin.write(out, blobs, snapshot,
                                        self._registry.sequence(job.target, snapshot))
        crash_point("key-store")  # the file there, the metadata naming it not yet
        try:
            # (the registration names no blobs: see the module docstring)
            self._registry.register(job.target, snapshot, _uri(place, path), size, footer,
                                    [], [s for s, _ in before])
        except BaseException:
            place.fs.delete_file(path)
            raise
        for _, old in before:
            try:
                place.fs.delete_file(_fs_path(place, old))
            except OSError:
                pass  # (gone already: an expiry of its snapshot took it)
        _drop_folder(place)
        return 1, size

    def close(self, timeout: float = 300.0) -> None:
        """Wait for the states asked to be kept (at most ``timeout`` seconds)."""
        if not self._idle.wait(timeout):
            log.warning("key indexes not kept in the warehouse within %.0f s; left behind",
                        timeout)

    # ---- fetching ---------------------------------------------------------------------------

    def _fetch_registered(self, place: Place, directory: Path, encoding: Optional[str],
                          keys: Optional[Sequence[str]], table: Optional[str],
                          usable: Callable[[int], bool], target: str) -> Optional[int]:
        assert self._registry is not None
        for snapshot, path in reversed(self._registry.listed(target, place.source)):
            if not usable(snapshot):
                continue
            with place.fs.open_input_file(_fs_path(place, path)) as source:
                listed = puffin.blobs(source)
                [kept] = [b for b in listed if b["type"] == MANIFEST_BLOB]
                manifest = json.loads(puffin.blob(source, kept))
                if not made_for(manifest, encoding, keys, table):
                    return None
                _filled(directory, manifest,
                        functools.partial(_unpuffin, source, listed, directory))
            return snapshot
        return None

    def fetch(self, place: Place, directory: Path, encoding: Optional[str],
              keys: Optional[Sequence[str]], table: Optional[str],
              usable: Callable[[int], bool], target: str = "") -> Optional[int]:
        """Bring into ``directory`` (holding no index) the newest kept index whose snapshot is
        ``usable`` and made with ``encoding`` for the key columns ``keys`` (None: any) of the
        table whose table-uuid is ``table`` (None: any); its snapshot, or None (nothing to
        fetch)."""
        if place.registered:
            return self._fetch_registered(place, directory, encoding, keys, table, usable,
                                          target)
        infos = place.fs.get_file_info(pafs.FileSelector(place.folder, allow_not_found=True))
        found = sorted((int(m.group(1)) for m in (_SNAPSHOT.fullmatch(i.base_name)
                                                  for i in infos) if m), reverse=True)
        for snapshot in found:
            if not usable(snapshot):
                continue
            with place.fs.open_input_stream(place.path(f"snapshot-{snapshot}.json")) as source:
                manifest = json.loads(source.read().decode())
            if not made_for(manifest, encoding, keys, table):
                return None
            packed = bool(manifest.pop("packed", False))
            sizes: dict[str, int] = manifest.pop("kept")

            _filled(directory, manifest,
                    functools.partial(_receive_all, place, directory, sizes, packed))
            return snapshot
        return None


FILE_BLOB = "walberg-key-index-file"
MANIFEST_BLOB = "walberg-key-index-manifest"
SOURCE_PROPERTY = "walberg.source"


def registered_indexes(entries: list[list[Any]], source: Optional[str]) -> list[tuple[int, str]]:
    """Of a table's statistics files (``Batch.statistics``: [snapshot, path, blobs]),
    walberg's key indexes of ``source``, by their file names: (snapshot, path)."""
    prefix = f"walberg-keys-{source or '_one'}-"
    return [(int(snapshot), str(path)) for snapshot, path, _ in entries
            if str(path).rpartition("/")[2].startswith(prefix)]


def _filled(directory: Path, manifest: dict[str, Any], fill: Callable[[], None]) -> None:
    """``directory`` made anew, its files brought by ``fill``, then ``manifest`` written last
    (an index is whole once its manifest is there); nothing left if any of it fails."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        fill()
        partial = directory / f"{MANIFEST}.partial"
        partial.write_text(json.dumps(manifest))
        os.replace(partial, directory / MANIFEST)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _receive_all(place: Place, directory: Path, sizes: dict[str, int], packed: bool) -> None:
    """The files of a kept index (``sizes``) into ``directory``, their pieces side by side."""
    for name, size in sizes.items():  # (each piece is written in its place)
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        with open(directory / name, "wb") as out:
            out.truncate(size)
    with ThreadPoolExecutor(FETCHES, thread_name_prefix="walberg-fetch") as pool:
        for done in [pool.submit(_receive, place, name, directory / name, packed, n, size)
                     for name, size in sizes.items()
                     for n in range(len(_objects(name, size, packed)))]:
            done.result()


def _unpuffin(source: Any, listed: list[dict[str, Any]], directory: Path) -> None:
    """The files of a registered index (its Puffin file's blobs ``listed``) into
    ``directory``, read side by side."""
    def one(found: dict[str, Any]) -> None:
        name, size = found["properties"]["name"], int(found["properties"]["size"])
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(_unpacked(puffin.blob(source, found), size, name))

    with ThreadPoolExecutor(FETCHES, thread_name_prefix="walberg-fetch") as pool:
        for done in [pool.submit(one, b) for b in listed if b["type"] == FILE_BLOB]:
            done.result()


def _uri(place: Place, path: str) -> str:
    """The location the table's metadata names for ``path`` on the place's file system."""
    return f"{place.scheme}{path}"


def _fs_path(place: Place, location: str) -> str:
    """A location the table's metadata names, as a path on the place's file system."""
    if place.local:
        return str(local_path(location))
    found = s3_path(location)
    return found if found is not None else location


def _drop_folder(place: Place) -> None:
    """The folder an older walberg kept the index in beside the table (no metadata names it),
    removed once the index is registered."""
    table = place.folder.rpartition("/")[0]
    old = f"{table}/{FOLDER}/{place.source or '_one'}"
    try:
        if place.fs.get_file_info(old).type == pafs.FileType.Directory:
            place.fs.delete_dir(old)
    except OSError:
        pass


def _listing(place: Place) -> set[str]:
    """The names of the files (and folders) under the place, relative to it."""
    infos = place.fs.get_file_info(pafs.FileSelector(place.folder, allow_not_found=True,
                                                     recursive=True))
    prefix = len(place.folder.rstrip("/")) + 1
    return {i.path[prefix:] for i in infos}


def _column(name: str) -> Optional[np.dtype]:
    """The type of a base column's entries, or None for another file (a delta run)."""
    folder, _, column = name.rpartition("/")
    return _COLUMNS.get(column) if folder.startswith("base-") else None


def _objects(name: str, size: int, packed: bool) -> list[str]:
    """The objects a file of ``size`` bytes is kept as: itself, or its pieces when packed."""
    if not packed:
        return [name]
    return [f"{name}.{n}" for n in range(max(1, -(-size // PIECE)))]


def _send(local: Path, place: Place, name: str, n: int) -> int:
    """Write piece ``n`` of one file to object storage, packed (see the module docstring);
    the bytes sent."""
    with open(local, "rb") as source:
        source.seek(n * PIECE)
        body = _packed(source.read(PIECE), name)
    with place.output(f"{name}.{n}") as out:
        out.write(body)
    return len(body)


def _receive(place: Place, name: str, local: Path, packed: bool, n: int, size: int) -> None:
    """Read piece ``n`` of one kept file (of ``size`` bytes) into its place in ``local``; not
    packed, the file is on this disk (``Place.local``) and is linked whole."""
    if not packed:
        local.unlink()
        _link(Path(place.path(name)), local)
        return
    with place.fs.open_input_stream(place.path(f"{name}.{n}")) as source:
        raw = _unpacked(source.read(), min(PIECE, size - n * PIECE), name)
    fd = os.open(local, os.O_WRONLY)
    try:
        os.pwrite(fd, raw, n * PIECE)
    finally:
        os.close(fd)


def _packed(raw: bytes, name: str) -> bytes:
    """Bytes of the index file ``name`` as the warehouse keeps them: a base column's values as
    differences between neighbours with their bytes grouped by significance, then zstd."""
    dtype = _column(name)
    if dtype is not None:
        raw = _planes(np.diff(np.frombuffer(raw, dtype=dtype), prepend=dtype.type(0)))
    return bytes(pa.compress(raw, codec="zstd", asbytes=True))


def _unpacked(body: bytes, length: int, name: str) -> bytes:
    """``_packed``'s inverse, for ``length`` bytes of the file ``name``."""
    raw = pa.decompress(body, decompressed_size=length, codec="zstd", asbytes=True)
    if len(raw) != length:
        raise ValueError(f"{name} in the warehouse is not the size its manifest says")
    dtype = _column(name)
    if dtype is not None:
        return bytes(np.cumsum(_unplanes(raw, dtype), dtype=dtype).tobytes())
    return bytes(raw)


def _link(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` (the index never changes a file in place, so a
    link is a copy), or a copy on another file system."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _planes(values: np.ndarray) -> bytes:
    """The values' bytes grouped by significance: every lowest byte, then every next one..."""
    width = values.dtype.itemsize
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, width).T).tobytes()


def _unplanes(block: bytes, dtype: np.dtype) -> np.ndarray:
    width = dtype.itemsize
    planes = np.frombuffer(block, np.uint8).reshape(width, -1)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(-1)
