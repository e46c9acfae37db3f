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

from walberg.apply.catalog.metadata import newest_version
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
    try:
        with fileio.new_input(f"{folder}/version-hint.text").open() as f:
            version: Optional[int] = int(f.read().decode().strip())
    except FileNotFoundError:
        # Missing for a moment while a commit replaces it (deleted, then the new one renamed
        # in), or the table does not exist: the metadata files the folder holds tell which.
        version = newest_version(_names_in(fileio, folder))
        if version is None:
            return None
    with fileio.new_input(f"{folder}/v{version}.metadata.json").open() as f:
        meta: dict[str, Any] = json.loads(f.read())
    return meta


def _names_in(fileio: Any, folder: str) -> list[str]:
    """The names of the files directly in ``folder`` (none if it does not exist). PyIceberg's
    FileIO has no listing; its PyArrow one hands out the file system it reads through."""
    from pyarrow.fs import FileSelector
    from pyiceberg.io.pyarrow import PyArrowFileIO

    if not isinstance(fileio, PyArrowFileIO):
        return _probed_names(fileio, folder)
    scheme, netloc, path = PyArrowFileIO.parse_location(folder)
    infos = fileio.fs_by_scheme(scheme, netloc).get_file_info(
        FileSelector(path, allow_not_found=True))
    return [info.base_name for info in infos]


def _probed_names(fileio: Any, folder: str) -> list[str]:
    """Without a listing: the metadata versions found by probing v1, v2, v4, ... then halving
    (a hadoop catalog numbers them from 1 with no gap while it keeps them all)."""
    def there(n: int) -> bool:
        return bool(fileio.new_input(f"{folder}/v{n}.metadata.json").exists())

    if not there(1):
        return []
    low, high = 1, 2
    while there(high):
        low, high = high, high * 2
    while high - low > 1:  # v<low> is there, v<high> is not
        middle = (low + high) // 2
        low, high = (middle, high) if there(middle) else (low, middle)
    return [f"v{low}.metadata.json"]


# The REST endpoint that commits several tables all or nothing (see apply.together).
TRANSACTIONS_ENDPOINT = "POST /v1/{prefix}/transactions/commit"


def probe_rest(name: str, uri: str, options: dict[str, Optional[str]],
               warehouse: Optional[str], namespace: Optional[str] = None) -> frozenset[str]:
    """Ask a REST catalog who walberg is and what it offers (its token endpoint and
    ``GET /v1/config``; with ``namespace``, whether walberg may use that namespace): the
    endpoints it offers. A refusal or no answer is an EnvironmentProblem that says what was
    refused and what to check, before Spark meets it as an unreadable error."""
    try:
        from pyiceberg.exceptions import (
            ForbiddenError,
            NoSuchNamespaceError,
            OAuthError,
            UnauthorizedError,
        )
    except ImportError:
        raise EnvironmentProblem("reading a REST catalog needs PyIceberg: "
                                 "`pip install 'pyiceberg[sql-postgres]==0.12.0'`") from None
    import requests

    how = ("sink.catalog.credential (client id:secret)" if options.get("credential")
           else "sink.catalog.token" if options.get("token")
           else "no sink.catalog.credential or token (anonymous)")
    where = f"the REST catalog {name} at {uri}"
    try:
        catalog = _catalog("rest", name, warehouse, uri, options, {})
        if namespace is not None:
            try:
                catalog.load_namespace_properties(namespace)
            except NoSuchNamespaceError:
                pass  # walberg creates it
    except OAuthError as exc:
        token_uri = options.get("oauth2_server_uri") or f"{uri.rstrip('/')}/v1/oauth/tokens"
        raise EnvironmentProblem(
            f"{where} refused walberg's credential (401 from its token endpoint {token_uri}: "
            f"{exc}). Check {how}: the client id and secret as the catalog's administrator "
            "issued them, and sink.catalog.oauth2_server_uri if the catalog takes tokens "
            "elsewhere (and sink.catalog.scope if it needs one).") from None
    except UnauthorizedError as exc:
        expired = "expired" in str(exc).lower()
        raise EnvironmentProblem(
            f"{where} refused walberg's request (401 Unauthorized: {exc}). walberg "
            f"authenticates with {how}"
            + ("; the token has expired: a fixed sink.catalog.token is never renewed, so "
               "prefer sink.catalog.credential (OAuth2 client credentials), whose tokens "
               "walberg renews." if expired else
               ": check that it is current and meant for this catalog.")) from None
    except ForbiddenError as exc:
        raise EnvironmentProblem(
            f"{where} forbids walberg's principal the namespace {namespace} (403 Forbidden: "
            f"{exc}). walberg needs to create and read that namespace and create, load and "
            f"commit to tables in it: grant the principal of {how} those privileges, or set "
            "sink.namespace to one it may use.") from None
    except requests.exceptions.RequestException as exc:
        raise EnvironmentProblem(
            f"{where} does not answer ({type(exc).__name__}: {str(exc)[:200]}). Check "
            "sink.catalog.uri and that the catalog server is up and reachable from here."
        ) from None
    return frozenset(str(e) for e in getattr(catalog, "_supported_endpoints", ()))


def commits_together(endpoints: frozenset[str], atomic_commits: bool) -> bool:
    """Whether a batch's tables commit in one catalog transaction on a REST catalog offering
    ``endpoints``, with sink.atomic_commits as given."""
    return atomic_commits and TRANSACTIONS_ENDPOINT in endpoints


def describe_rest(endpoints: frozenset[str], atomic_commits: bool) -> str:
    """What ``walberg check`` and ``status`` say of a REST catalog's multi-table commits."""
    if TRANSACTIONS_ENDPOINT not in endpoints:
        return (f"commits one table at a time (it does not offer {TRANSACTIONS_ENDPOINT}): a "
                "reader between two tables' commits may see part of a source transaction")
    if not atomic_commits:
        return (f"could commit several tables at once ({TRANSACTIONS_ENDPOINT}), but "
                "sink.atomic_commits is false: each table commits on its own")
    return (f"commits several tables at once ({TRANSACTIONS_ENDPOINT}): the tables of a "
            "batch become visible together")
