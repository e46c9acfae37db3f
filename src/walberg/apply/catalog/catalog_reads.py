"""A table's current metadata read through its Iceberg catalog from Python (PyIceberg), with no
JVM: for `walberg status` wherever the metadata is not a local hadoop warehouse's files.

    jdbc     PyIceberg's SQL catalog reads the same tables (iceberg_tables) in the same
             database: the current metadata location, then the file itself
    rest     PyIceberg's REST catalog
    hadoop   on object storage: version-hint.text and the metadata file, through PyIceberg's
             FileIO with the pipeline's storage.s3 settings

Hive, Glue and Nessie are not read here (None: status shows no figures for them). PyIceberg is
imported only when one of these is read.
"""

from __future__ import annotations

import json
from typing import Any, Optional
from urllib.parse import parse_qs, quote, urlsplit

from walberg.errors import EnvironmentProblem


def sqlalchemy_url(jdbc_uri: str, user: Optional[str], password: Optional[str]) -> Optional[str]:
    """The SQLAlchemy URL of a jdbc catalog's database (PostgreSQL or SQLite), else None.
    ``jdbc:postgresql://host:port/db?user=u&password=p`` (user and password also from the
    catalog's own settings) -> ``postgresql+psycopg2://u:p@host:port/db``."""
    if jdbc_uri.startswith("jdbc:sqlite:"):
        return "sqlite:///" + jdbc_uri[len("jdbc:sqlite:"):]
    if not jdbc_uri.startswith("jdbc:postgresql://"):
        return None
    parts = urlsplit(jdbc_uri[len("jdbc:"):])
    query = parse_qs(parts.query)
    user = user or next(iter(query.get("user", [])), None)
    password = password or next(iter(query.get("password", [])), None)
    auth = ""
    if user:
        auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "") + "@"
    return f"postgresql+psycopg2://{auth}{parts.netloc}{parts.path}"


def io_properties(s3: Optional[dict[str, Any]], timeout: float) -> dict[str, str]:
    """PyIceberg FileIO settings for the pipeline's storage.s3 section."""
    if s3 is None:
        return {}
    props = {"s3.connect-timeout": str(min(timeout, 5.0)), "s3.request-timeout": str(timeout)}
    for key, prop in (("endpoint", "s3.endpoint"), ("region", "s3.region"),
                      ("access_key_id", "s3.access-key-id"),
                      ("secret_access_key", "s3.secret-access-key")):
        if s3.get(key):
            props[prop] = str(s3[key])
    return props


def table_metadata(kind: str, name: str, warehouse: Optional[str], uri: Optional[str],
                   options: dict[str, Optional[str]], io: dict[str, str], namespace: str,
                   table: str) -> Optional[dict[str, Any]]:
    """The table's current metadata (the metadata file's JSON), or None when the table does
    not exist or this catalog type is not read from Python."""
    try:
        from pyiceberg.exceptions import NoSuchTableError
    except ImportError:
        raise EnvironmentProblem("reading the catalog without Spark needs PyIceberg: "
                                 "`pip install 'pyiceberg[sql-postgres]==0.12.0'`") from None
    if kind == "hadoop":
        return _hadoop_metadata(warehouse or "", io, namespace, table)
    catalog = _catalog(kind, name, warehouse, uri, options, io)
    if catalog is None:
        return None
    try:
        loaded = catalog.load_table((namespace, table))
    except NoSuchTableError:
        return None
    meta: dict[str, Any] = json.loads(loaded.metadata.model_dump_json())
    return meta


def _catalog(kind: str, name: str, warehouse: Optional[str], uri: Optional[str],
             options: dict[str, Optional[str]], io: dict[str, str]) -> Any:
    if kind == "jdbc" and uri:
        url = sqlalchemy_url(uri, options.get("user"), options.get("password"))
        if url is None:
            return None
        from pyiceberg.catalog.sql import SqlCatalog

        # Read only: never create the catalog's tables.
        return SqlCatalog(name, uri=url, init_catalog_tables="false", **io)
    if kind == "rest" and uri:
        from pyiceberg.catalog.rest import RestCatalog

        props = {k: v for k, v in (("credential", options.get("credential")),
                                   ("token", options.get("token")),
                                   ("oauth2-server-uri", options.get("oauth2_server_uri")),
                                   ("scope", options.get("scope")),
                                   ("warehouse", warehouse)) if v}
        return RestCatalog(name, uri=uri, **props, **io)
    return None


def _hadoop_metadata(warehouse: str, io: dict[str, str], namespace: str,
                     table: str) -> Optional[dict[str, Any]]:
    from pyiceberg.io import load_file_io

    folder = f"{warehouse.rstrip('/')}/{namespace}/{table}/metadata"
    fileio = load_file_io(io, folder)
    hint = fileio.new_input(f"{folder}/version-hint.text")
    if not hint.exists():
        return None
    with hint.open() as f:
        version = f.read().decode().strip()
    with fileio.new_input(f"{folder}/v{version}.metadata.json").open() as f:
        meta: dict[str, Any] = json.loads(f.read())
    return meta
