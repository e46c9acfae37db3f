"""An Iceberg REST catalog server for tests (``RestCatalogServer.java`` beside this file): the
REST spec over Iceberg's JDBC catalog in the test PostgreSQL, with OAuth2 client credentials and
all-or-nothing multi-table commits. Compiled once per source version against the Iceberg jar
walberg ships, run in a JVM of its own."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from conftest import free_port, wait_port
from walberg.apply.catalog.catalogs import jdbc_driver
from walberg.apply.jvm.java import find_java, iceberg_jar
from walberg.apply.jvm.launch import spark_home

SOURCE = Path(__file__).with_name("RestCatalogServer.java")
CLIENT_ID, CLIENT_SECRET = "walberg", "s3cret"


def _classpath() -> str:
    return os.pathsep.join([str(iceberg_jar()), str(spark_home() / "jars" / "*"),
                            str(jdbc_driver())])


def _compiled(java: Path) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + str(iceberg_jar()).encode()).hexdigest()[:16]
    out = Path("/tmp") / f"walberg-rest-catalog-{digest}"
    if not (out / "RestCatalogServer.class").exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(java.parent / "javac"), "-nowarn", "-cp", _classpath(), "-d", str(out),
                        str(SOURCE)], check=True, capture_output=True)
    return out


class RestServer:
    """A running server: its URI, and what a pipeline file's ``sink.catalog`` needs."""

    def __init__(self, uri: str, warehouse: Path) -> None:
        self.uri = uri
        self.warehouse = warehouse

    def catalog(self, credential: Optional[str] = None, **extra: Any) -> dict[str, Any]:
        """A pipeline file's ``sink.catalog`` for this server (client credentials)."""
        return {"name": "lake", "type": "rest", "uri": self.uri,
                "warehouse": str(self.warehouse),
                "credential": credential or f"{CLIENT_ID}:{CLIENT_SECRET}", **extra}

    def token(self) -> str:
        """A fresh bearer token, from the token endpoint."""
        form = urllib.parse.urlencode({"grant_type": "client_credentials", "client_id": CLIENT_ID,
                                       "client_secret": CLIENT_SECRET}).encode()
        with urllib.request.urlopen(f"{self.uri}/v1/oauth/tokens", form, timeout=10) as r:
            return str(json.loads(r.read())["access_token"])

    def pyiceberg(self) -> Any:
        """A PyIceberg catalog of this server (an independent reader)."""
        from pyiceberg.catalog.rest import RestCatalog

        return RestCatalog("lake", uri=self.uri, credential=f"{CLIENT_ID}:{CLIENT_SECRET}",
                           warehouse=str(self.warehouse))


@contextmanager
def rest_server(postgres: Any, warehouse: Path, log: Path,
                **options: str) -> Iterator[RestServer]:
    """A REST catalog server over a JDBC catalog in ``postgres`` (its own catalog name, so it
    shares no table with a jdbc catalog test), living as long as the context. ``options``:
    token_seconds, forbid (namespaces, comma-separated), transactions ("false": no
    transaction endpoint, as older servers), commit_delay_ms (a pause inside each multi-table
    commit), conflicts (how many multi-table commits to refuse first with 409)."""
    java = find_java()
    classes = _compiled(java)
    port = free_port()
    args = [f"{k.replace('_', '-')}={v}" for k, v in options.items()]
    args.append(f"clients={CLIENT_ID}:{CLIENT_SECRET}")
    jdbc = f"jdbc:postgresql://127.0.0.1:{postgres.port}/{postgres.database}"
    proc = subprocess.Popen(
        [str(java), "-Xmx256m", "-cp", os.pathsep.join([str(classes), _classpath()]),
         "RestCatalogServer", str(port), jdbc, postgres.user, f"file://{warehouse}", *args],
        stdout=open(log, "a"), stderr=subprocess.STDOUT)
    try:
        wait_port(port, timeout=60)
        yield RestServer(f"http://127.0.0.1:{port}", warehouse)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
