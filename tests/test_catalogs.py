"""Catalog types: the Spark settings each one gets, and the jdbc catalog end to end (in the test
PostgreSQL, read back with PyIceberg's SQL catalog, which shares its layout)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from conftest import as_file, jdbc_catalog, make_config, walberg_ok, write_pipeline
from lake import postgres_rows
from walberg.apply.catalog import catalog_reads, catalogs
from walberg.config import parse_config
from walberg.errors import ConfigError, EnvironmentProblem


def _catalog(**catalog: Any) -> Any:
    raw = {"source": {"postgres": {"dsn": "postgresql://x@h/db", "tables": ["public.t"]}},
           "sink": {"catalog": catalog}}
    return parse_config(raw, Path(".")).sink.catalog


def _props(_jars: str = "", **catalog: Any) -> tuple[dict[str, str], list[str]]:
    cat = _catalog(**catalog)
    return catalogs.spark_properties(cat.type, cat.warehouse, cat.uri, cat.options(),
                                     cat.properties, _jars)


def test_each_catalog_type_gets_its_spark_settings() -> None:
    assert _props(type="hadoop", warehouse="/wh")[0] == {"type": "hadoop", "warehouse": "/wh"}
    rest, jars = _props(type="rest", uri="https://cat/api", credential="id:secret",
                        oauth2_server_uri="https://auth/token", scope="catalog",
                        warehouse="prod", properties={"header.X-Tenant": "a"})
    assert rest == {"type": "rest", "uri": "https://cat/api", "credential": "id:secret",
                    "oauth2-server-uri": "https://auth/token", "scope": "catalog",
                    "warehouse": "prod", "header.X-Tenant": "a"} and jars == []
    assert _props(type="rest", uri="https://cat/api", token="t0k")[0]["token"] == "t0k"
    assert _props(type="hive", uri="thrift://ms:9083", warehouse="s3a://b/wh")[0] == {
        "type": "hive", "uri": "thrift://ms:9083", "warehouse": "s3a://b/wh"}
    nessie = _props(type="nessie", uri="http://nessie:19120/api/v2", warehouse="/wh")[0]
    assert nessie["type"] == "nessie" and nessie["ref"] == "main"
    with pytest.raises(EnvironmentProblem, match="iceberg-aws-bundle"):
        _props(type="glue", warehouse="s3://b/wh", region="eu-west-1")
    glue = _props(type="glue", warehouse="s3://b/wh", region="eu-west-1", catalog_id="123",
                  _jars="/jars/iceberg-aws-bundle-1.10.2.jar")[0]
    assert glue["catalog-impl"] == "org.apache.iceberg.aws.glue.GlueCatalog"
    assert (glue["client.region"], glue["glue.id"]) == ("eu-west-1", "123")
    jdbc, jars = _props(type="jdbc", uri="jdbc:postgresql://h/cat", user="u", password="p",
                        warehouse="/wh")
    assert jdbc == {"type": "jdbc", "uri": "jdbc:postgresql://h/cat", "jdbc.user": "u",
                    "jdbc.password": "p", "warehouse": "/wh"}
    assert jars and jars[0].endswith(".jar")
    for bad, message in [({"type": "rest"}, "needs a uri"), ({"type": "jdbc", "uri": "x"},
                                                              "needs a warehouse"),
                         ({"type": "iceberg"}, "type")]:
        with pytest.raises(ConfigError, match=message):
            _catalog(**bad)
    assert "secret" not in repr(_catalog(type="rest", uri="u", credential="id:secret"))


def test_jdbc_uri_as_pyiceberg_reads_it() -> None:
    url = catalog_reads.sqlalchemy_url
    assert url("jdbc:postgresql://db:5432/lake", "walberg", "p@ss") == \
        "postgresql+psycopg2://walberg:p%40ss@db:5432/lake"
    assert url("jdbc:postgresql://db/lake?user=u&password=pw&ssl=true", None, None) == \
        "postgresql+psycopg2://u:pw@db/lake"
    assert url("jdbc:sqlite:/var/lake.db", None, None) == "sqlite:////var/lake.db"
    assert url("jdbc:mysql://db/lake", "u", None) is None


def test_jdbc_catalog_end_to_end(pg_conn: Any, postgres: Any, warehouse: Path, tmp_path: Path,
                                 unique: str) -> None:
    # The driver comes with walberg from PyPI: no system package, no skip.
    driver = catalogs.jdbc_driver()
    assert driver == catalogs.packaged_jdbc_driver() and "site-packages" in str(driver)
    with zipfile.ZipFile(driver) as jar:
        jar.getinfo("org/postgresql/Driver.class")
    from pyiceberg.catalog.sql import SqlCatalog

    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text, n numeric(8,2))")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g, g / 4.0 "
                    "FROM generate_series(1, 50) g")
    raw = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    wh = tmp_path / "jdbc-warehouse"
    raw["sink"]["catalog"] = jdbc_catalog(postgres, str(wh))
    path = tmp_path / "pipeline.yaml"
    write_pipeline(raw, path)

    def walberg(*args: str) -> str:
        return walberg_ok("-q", *args, "-c", str(path))

    checked = walberg("check")
    assert "catalog database postgresql://" in checked
    assert f"PostgreSQL JDBC driver {driver} (from PyPI package wbjdbc)" in checked
    assert not wh.exists()  # check creates nothing
    walberg("run", "--once")
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 10")
        cur.execute(f"DELETE FROM {table} WHERE id > 45")
        cur.execute("SELECT count(*) FROM iceberg_tables WHERE catalog_name = 'lake'")
        assert cur.fetchone()[0] >= 1  # the catalog lives in Postgres
    walberg("run", "--once")
    walberg("verify")

    catalog = SqlCatalog("lake", uri=f"postgresql+psycopg2://{postgres.user}@127.0.0.1:"
                                     f"{postgres.port}/{postgres.database}",
                         warehouse=f"file://{wh}")
    namespace = raw["sink"]["namespace"]
    rows = catalog.load_table(f"{namespace}.{unique}").scan().to_arrow().to_pylist()
    rows = sorted(({k: v for k, v in r.items() if not k.startswith("_walberg_")} for r in rows),
                  key=lambda r: r["id"])
    assert rows == postgres_rows(pg_conn, table)


def test_jdbc_fan_in_first_run_and_status(pg_conn: Any, postgres: Any, warehouse: Path,
                                          tmp_path: Path, unique: str) -> None:
    """Two sources fanning in to one table on a jdbc catalog: their first run creates the
    namespace and the shared table once (the catalog's check-then-insert would otherwise race
    between the two sources), and `status` reads LSN and rows through the catalog, no JVM."""
    table = f"public.{unique}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 30) g")
    one = as_file(make_config(postgres, warehouse, tmp_path / "segments", unique, [table]))
    source = one.pop("source")
    sources = {}
    for name in ("east", "west"):
        pg = dict(source["postgres"], slot=f"slot_{unique}_{name}",
                  publication=f"pub_{unique}_{name}")
        sources[name] = {"postgres": pg}
    raw = {**one, "sources": sources}
    wh = tmp_path / "jdbc-warehouse"
    raw["sink"]["catalog"] = jdbc_catalog(postgres, str(wh))
    path = tmp_path / "pipeline.yaml"
    write_pipeline(raw, path)

    walberg_ok("-q", "run", "--once", "-c", str(path))

    namespace = raw["sink"]["namespace"]
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("lake", uri=f"postgresql+psycopg2://{postgres.user}@127.0.0.1:"
                                     f"{postgres.port}/{postgres.database}")
    lake = catalog.load_table(f"{namespace}.{unique}")
    rows = lake.scan().to_arrow().to_pylist()
    assert sorted((r["_walberg_source"], r["id"], r["v"]) for r in rows) == sorted(
        (s, r["id"], r["v"]) for s in ("east", "west") for r in postgres_rows(pg_conn, table))
    by_source = json.loads(walberg_ok("status", "--json", "-c", str(path)))
    assert set(by_source) == {"east", "west"}
    for name, s in by_source.items():
        mine = s["tables"][table]
        assert mine["iceberg_table"] == f"lake.{namespace}.{unique}"
        assert mine["rows"] == 60 and mine["data_files"] >= 2
        assert mine["last_lsn"] is not None and mine["last_commit_at"] is not None
        marks = [snap.summary.additional_properties.get(f"walberg.lsn.{name}")
                 for snap in lake.snapshots()]
        assert mine["last_lsn"] == [m for m in marks if m][-1]
