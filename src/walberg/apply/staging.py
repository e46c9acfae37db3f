"""Where Spark's executors read a batch's (or an initial copy's) staged Parquet from.

The driver stages each batch as Parquet files under ``buffer.dir``. In local mode the executors
run in the driver's JVM and read those files where they are. On a cluster they run on other
machines that do not see the driver's disk, so the driver first uploads the files through
Hadoop's FileSystem API (any scheme the session has a connector for: s3a, gs, abfs, hdfs, ...)
to the stage area, ``<stage_uri>/<pipeline>/<batch folder>/<file>``, and Spark reads them from
there. A batch's objects are removed once its commit is over (``release``). Objects of a run
that crashed are removed when the next run first stages something: the stage area of one
pipeline belongs to the process that holds its segment directory's lock, so whatever it finds
there is an orphan.

Exactly once does not depend on the stage area: what a commit applies is decided by the
segments and the marks in the tables, and each staged folder has a name of its own, so an
orphan is never read by a later batch.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from walberg.apply.jvm.calls import spark_call
from walberg.faults import crash_point

log = logging.getLogger("walberg")

# buffer.stage_uri's value for "executors read buffer.dir as it is" (local mode, or a cluster
# whose executors mount buffer.dir at the same path).
LOCAL = "local"
# Under the warehouse when buffer.stage_uri is not set and staging must leave the driver.
DEFAULT_FOLDER = "_walberg_staging"
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# `walberg verify`'s folder in buffer.dir for the source's row hashes (ops.verify).
VERIFY_FOLDER = "walberg-verify-"
# The folders made in buffer.dir for one batch (runtime.pg_stager, runtime.kafka.stager), one
# initial copy (runtime.initial_copy), a Kafka batch's dead letters (runtime.kafka.dead_letters) or
# one verify.
LOCAL_FOLDERS = ("batch-", "walberg-copy-", "walberg-dlq-", VERIFY_FOLDER)


def remove_local_leftovers(directory: Path) -> list[Path]:
    """Remove the staged folders a killed run left in ``directory`` (buffer.dir); call with the
    directory's lock held, when no batch of this process is staged yet. Their batches are
    staged again from the segments. Returns the folders removed."""
    gone = [p for p in directory.iterdir()
            if p.is_dir() and p.name.startswith(LOCAL_FOLDERS)] if directory.is_dir() else []
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return gone


def is_local_master(master: str) -> bool:
    """Whether executors share the driver's filesystem: local mode and local-cluster."""
    return master.strip().startswith("local")


def remote_scheme(uri: str) -> Optional[str]:
    """The scheme of a location other machines can reach (s3a, gs, abfs, hdfs, ...), or None
    for a local path (no scheme, or file:)."""
    match = _SCHEME.match(uri or "")
    if match is None or match.group(1).lower() == "file":
        return None
    return match.group(1).lower()


def stage_uri(master: str, configured: Optional[str], warehouse: str) -> Optional[str]:
    """Where staged files go for the executors: None when they read ``buffer.dir`` directly.

    ``configured`` (``buffer.stage_uri``) wins: a URI, or ``local``. Unset, local mode reads
    directly; a cluster stages under the warehouse when the warehouse is remote storage, and
    otherwise reads directly (a warehouse on a local path only works on a cluster whose
    machines share a mount, which then holds buffer.dir too; `walberg check` says so)."""
    if configured:
        return None if configured == LOCAL else configured.rstrip("/")
    if is_local_master(master) or remote_scheme(warehouse) is None:
        return None
    return f"{warehouse.rstrip('/')}/{DEFAULT_FOLDER}"


def pipeline_folder(name: str, identity: str) -> str:
    """The folder of one pipeline in the stage area: its readable name (the slot, the consumer
    group) and a digest of what makes it one pipeline (the source and the segment directory),
    so two pipelines sharing a stage area never clean up each other's objects."""
    digest = hashlib.sha1(identity.encode()).hexdigest()[:10]
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:60]
    return f"{readable}-{digest}"


class StageArea:
    """Turns staged files into a DataFrame the executors can read: the files themselves when
    ``root`` is None, else copies uploaded under ``root`` (this pipeline's folder of the stage
    area). Safe to use from several threads."""

    def __init__(self, spark: Any, root: Optional[str], owner: bool = True) -> None:
        """``owner``: this process owns ``root`` (it holds the pipeline's segment directory), so
        what is there before its first upload is an orphan to remove. A reader that runs beside
        the pipeline (`walberg verify`) passes False and a ``root`` of its own."""
        self.spark = spark
        self.root = root.rstrip("/") if root else None
        self._lock = threading.Lock()
        self._uploaded: dict[Path, str] = {}  # local file -> its object
        self._folders: dict[Path, str] = {}  # local folder -> its folder in the stage area
        self._owner = owner
        self._cleaned = not owner

    @property
    def remote(self) -> bool:
        return self.root is not None

    def read(self, files: Sequence[Path]) -> Any:
        """A DataFrame of the staged Parquet ``files``, readable by every executor."""
        paths = self.paths(files)
        return spark_call("reading staged files", lambda: self.spark.read.parquet(*paths))

    def paths(self, files: Sequence[Path]) -> list[str]:
        """Where executors read ``files`` from (uploaded first when staging leaves the driver)."""
        if self.root is None:
            return [str(f) for f in files]
        with self._lock:
            if not self._cleaned:
                self._remove(self.root, "orphans of an earlier run")
                self._cleaned = True
            self._sweep()
            return [self._upload(Path(f)) for f in files]

    def release(self, folder: Path) -> None:
        """The batch or copy staged in ``folder`` is over: remove its objects."""
        if self.root is None:
            return
        with self._lock:
            remote = self._folders.pop(Path(folder), None)
            if remote is not None:
                self._forget(Path(folder))
                self._remove(remote, f"staged objects of {folder.name}")

    def close(self) -> None:
        """A reader beside the pipeline (``owner`` False) is done: remove its own ``root``."""
        if self.root is not None and not self._owner:
            with self._lock:
                self._remove(self.root, "this reader's staging folder")

    def _sweep(self) -> None:
        """Remove the objects of folders whose local files are gone (a batch discarded without
        ``release``, a helper's temporary folder)."""
        for folder in [f for f in self._folders if not f.exists()]:
            remote = self._folders.pop(folder)
            self._forget(folder)
            self._remove(remote, f"staged objects of {folder.name}")

    def _forget(self, folder: Path) -> None:
        for local in [f for f in self._uploaded if f.parent == folder]:
            del self._uploaded[local]

    def _upload(self, local: Path) -> str:
        known = self._uploaded.get(local)
        if known is not None:
            return known
        assert self.root is not None
        folder = local.parent
        remote_folder = self._folders.get(folder)
        if remote_folder is None:
            tag = hashlib.sha1(str(folder).encode()).hexdigest()[:8]
            remote_folder = self._folders[folder] = f"{self.root}/{folder.name}-{tag}"
        target = f"{remote_folder}/{local.name}"
        jvm = self.spark._jvm
        src = jvm.org.apache.hadoop.fs.Path(local.resolve().as_uri())
        dst = jvm.org.apache.hadoop.fs.Path(target)
        fs = dst.getFileSystem(self.spark._jsc.hadoopConfiguration())
        spark_call(f"uploading the staged file {local} to {target} (buffer.stage_uri)",
                   lambda: fs.copyFromLocalFile(False, True, src, dst))
        self._uploaded[local] = target
        crash_point("staged")
        return target

    def _remove(self, uri: str, what: str) -> None:
        """Best effort: a failure is logged; what stays is removed at the next start."""
        try:
            jvm = self.spark._jvm
            path = jvm.org.apache.hadoop.fs.Path(uri)
            path.getFileSystem(self.spark._jsc.hadoopConfiguration()).delete(path, True)
        except Exception as exc:
            log.warning("could not remove %s at %s (%s); the next run removes them", what,
                        uri, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
