"""Iceberg catalogs: from the pipeline file's sink.catalog to the Spark catalog properties
(``spark.sql.catalog.<name>.*``) and the extra jars a catalog type needs.

    hadoop   a warehouse directory (or object-store path); metadata files name the versions
    jdbc     tables iceberg_tables / iceberg_namespace_properties in a database (here
             PostgreSQL); PyIceberg's SQL catalog reads the same layout
    rest     an Iceberg REST catalog (Polaris, Lakekeeper, Tabular, Nessie's REST API, ...)
    hive     a Hive metastore (thrift://...)
    glue     AWS Glue (needs iceberg-aws-bundle on spark.jars)
    nessie   Nessie's own API (a branch as ``ref``)
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Optional

from walberg.errors import EnvironmentProblem

TYPES = ("hadoop", "jdbc", "rest", "hive", "glue", "nessie")

# The PyPI package that ships the PostgreSQL JDBC driver (a dependency of walberg), and the
# driver's place inside it; read from the package's file list, without importing it.
PG_JDBC_PACKAGE = "wbjdbc"
PG_JDBC_DIR = "wbjdbc/resources/maven/postgresql"
# Where Debian's libpostgresql-jdbc-java puts it: used when the package is missing.
PG_JDBC_JARS = (Path("/usr/share/java/postgresql.jar"),)


def packaged_jdbc_driver() -> Optional[Path]:
    """The PostgreSQL JDBC driver jar that the wbjdbc package installed, if it did."""
    try:
        dist = importlib.metadata.distribution(PG_JDBC_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    jars = sorted(Path(str(dist.locate_file(f))) for f in dist.files or []
                  if str(f).startswith(PG_JDBC_DIR) and str(f).endswith(".jar"))
    return jars[-1] if jars and jars[-1].is_file() else None


def jdbc_driver(purpose: str = "the jdbc catalog") -> Path:
    """The PostgreSQL JDBC driver jar (for the jdbc catalog, or the parallel initial copy):
    WALBERG_JDBC_DRIVER if set, else the one pip installed with walberg, else Debian's."""
    override = os.environ.get("WALBERG_JDBC_DRIVER")
    if override:
        if Path(override).is_file():
            return Path(override)
        raise EnvironmentProblem(
            f"WALBERG_JDBC_DRIVER names {override}, which is not a file. Point it at a "
            "postgresql-<version>.jar, or unset it to use the driver installed with walberg.")
    packaged = packaged_jdbc_driver()
    if packaged is not None:
        return packaged
    for candidate in PG_JDBC_JARS:
        if candidate.is_file():
            return candidate
    raise EnvironmentProblem(
        f"{purpose} needs the PostgreSQL JDBC driver, which comes with walberg from the PyPI "
        f"package {PG_JDBC_PACKAGE}, but that is not installed here. Run `pip install "
        f"{PG_JDBC_PACKAGE}==2.4.0` in walberg's environment (or point WALBERG_JDBC_DRIVER at "
        "a postgresql-<version>.jar).")


def describe_jdbc_driver() -> str:
    """Which PostgreSQL JDBC driver walberg uses and where it comes from, for ``walberg check``."""
    jar = jdbc_driver()
    if os.environ.get("WALBERG_JDBC_DRIVER"):
        origin = "WALBERG_JDBC_DRIVER"
    elif jar == packaged_jdbc_driver():
        origin = f"PyPI package {PG_JDBC_PACKAGE}"
    else:
        origin = "a system package"
    return f"PostgreSQL JDBC driver {jar} (from {origin})"


def spark_properties(kind: str, warehouse: Optional[str], uri: Optional[str] = None,
                     options: Optional[dict[str, Optional[str]]] = None,
                     extra: Optional[dict[str, str]] = None,
                     spark_jars: str = "") -> tuple[dict[str, str], list[str]]:
    """Catalog properties (without the ``spark.sql.catalog.<name>.`` prefix) and extra jars.

    ``options``: the typed settings of sink.catalog (credential, token, oauth2_server_uri,
    region, catalog_id, ref, user, password), mapped to each type's property names; ``extra``:
    sink.catalog.properties, passed through last."""
    opts: dict[str, str] = {k: v for k, v in (options or {}).items() if v is not None}
    props: dict[str, str] = {}
    jars: list[str] = []

    def need_uri(example: str) -> str:
        if not uri:
            raise EnvironmentProblem(f"sink.catalog.type {kind} needs sink.catalog.uri "
                                     f"(for example {example})")
        return uri

    if kind == "hadoop":
        props["type"] = "hadoop"
    elif kind == "jdbc":
        props.update({"type": "jdbc", "uri": need_uri("jdbc:postgresql://host:5432/catalog")})
        if "user" in opts:
            props["jdbc.user"] = opts["user"]
        if "password" in opts:
            props["jdbc.password"] = opts["password"]
        if props["uri"].startswith("jdbc:postgresql:"):
            jars.append(str(jdbc_driver()))
    elif kind == "rest":
        props.update({"type": "rest", "uri": need_uri("https://catalog.example.com/api/catalog")})
        for key, prop in (("credential", "credential"), ("token", "token"),
                          ("oauth2_server_uri", "oauth2-server-uri"), ("scope", "scope")):
            if key in opts:
                props[prop] = opts[key]
    elif kind == "hive":
        props.update({"type": "hive", "uri": need_uri("thrift://metastore:9083")})
    elif kind == "glue":
        if "iceberg-aws" not in spark_jars:
            raise EnvironmentProblem(
                "sink.catalog.type glue needs Iceberg's AWS bundle, which this installation "
                "does not ship: add the path of iceberg-aws-bundle-1.10.2.jar (Maven: "
                "org.apache.iceberg:iceberg-aws-bundle) to spark.conf spark.jars.")
        props.update({"catalog-impl": "org.apache.iceberg.aws.glue.GlueCatalog",
                      "io-impl": "org.apache.iceberg.aws.s3.S3FileIO"})
        if "region" in opts:
            props["client.region"] = opts["region"]
        if "catalog_id" in opts:
            props["glue.id"] = opts["catalog_id"]
    elif kind == "nessie":
        props.update({"type": "nessie", "uri": need_uri("http://nessie:19120/api/v2"),
                      "ref": opts.get("ref", "main")})
    else:
        raise EnvironmentProblem(f"unknown catalog type {kind}: use one of {', '.join(TYPES)}")
    if warehouse:
        props["warehouse"] = warehouse
    props.update(extra or {})
    return props, jars
