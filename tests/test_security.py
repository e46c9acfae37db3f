"""Security: a least-privilege role, secrets that never leak, TLS with certificate checks, and
identifiers that are names, never SQL."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest

from conftest import as_file, make_config, run_once
from lake import iceberg_rows, postgres_rows
from walberg.cli.output import plain
from walberg.config import parse_config
from walberg.errors import WalbergError
from walberg.lake.services import Lake
from walberg.ops.check import check
from walberg.ops.status import status as status_of
from walberg.ops.verify import verify

SECRET = "S3cr3t-Pa55-do-not-print"


def _with_dsn(config: Any, dsn: str) -> Any:
    raw = as_file(config)
    raw["source"]["postgres"]["dsn"] = dsn
    return parse_config(raw, config.base_dir)


def test_least_privilege_role_and_secrets_never_leak(
        pg_conn: Any, postgres: Any, spark: Any, warehouse: Path, tmp_path: Path, unique: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    table, role = f"public.{unique}", f"{unique}_reader"
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        cur.execute(f"INSERT INTO {table} SELECT g, 'v' FROM generate_series(1, 20) g")
        # The documented minimum: LOGIN REPLICATION, SELECT on the tables, and a publication
        # made by the tables' owner.
        cur.execute(f"CREATE ROLE {role} LOGIN REPLICATION PASSWORD '{SECRET}'")
        cur.execute(f"GRANT SELECT ON {table} TO {role}")
        cur.execute(f"CREATE PUBLICATION {config.source.postgres.publication} FOR TABLE {table} "
                    "WITH (publish_via_partition_root = true)")
        cur.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (role,))
        assert cur.fetchone()[0] is False
    monkeypatch.setenv("WALBERG_TEST_PASSWORD", SECRET)
    raw = as_file(config)
    raw["source"]["postgres"]["dsn"] = (f"postgresql://{role}:${{WALBERG_TEST_PASSWORD}}"
                                        f"@127.0.0.1:{postgres.port}/{postgres.database}")
    config = parse_config(raw, tmp_path)
    caplog.set_level(logging.DEBUG)
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f"UPDATE {table} SET v = 'u' WHERE id <= 5")
    run_once(config, spark)
    assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(pg_conn, table)

    with Lake(config, session=spark) as lake:
        [checks] = check(lake)
        status = json.dumps(plain(status_of(lake)))
        [verdict] = verify(lake)
    assert all(c.ok for c in checks.results), [c for c in checks.results if not c.ok]
    assert verdict.equal
    # A wrong port: the error names the server, not the password.
    broken = _with_dsn(config, config.source.postgres.dsn.replace(str(postgres.port), "1"))
    with pytest.raises(WalbergError) as failed:
        run_once(broken, spark)
    texts = {"logs": caplog.text, "status": status, "checks": repr(checks),
             "error": str(failed.value), "metrics": generate_latest(REGISTRY).decode(),
             "config repr": repr(config)}
    leaked = [where for where, text in texts.items() if SECRET in text]
    assert leaked == [], f"the password appears in: {leaked}"
    assert "127.0.0.1:1" in str(failed.value)


def _make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=walberg test CA", "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.crt")
    return directory / "ca.crt", directory / "server.crt", directory / "server.key"


DEBIAN_PG = Path("/usr/lib/postgresql/15/bin")


def test_tls_with_verify_full(spark: Any, warehouse: Path, tmp_path: Path, unique: str,
                              caplog: pytest.LogCaptureFixture) -> None:
    """Against a server with TLS on (Debian's PostgreSQL: the embedded build has no SSL), with a
    certificate made here and signed by a CA made here. The initial copy keeps to psycopg2
    (psql, which copies over connections in the clear, has no TLS)."""
    import psycopg2

    from walberg.source.embedded_pg import EmbeddedPostgres

    if shutil.which("openssl") is None or not (DEBIAN_PG / "postgres").exists():
        pytest.skip("needs openssl and Debian's postgresql-15 (see .ci/run)")
    certs = _fresh(tmp_path / "certs")
    ca, cert, key = _make_certificates(certs)
    server = EmbeddedPostgres(bin_dir=DEBIAN_PG)
    for f in (cert, key):  # the server reads them as its own user, the key only if private
        shutil.copy(f, server.base_dir / f.name)
        os.chmod(server.base_dir / f.name, 0o600)
    server.settings = {"ssl": "on", "ssl_cert_file": f"'{server.base_dir / cert.name}'",
                       "ssl_key_file": f"'{server.base_dir / key.name}'"}
    owner = server._os_user
    if owner is not None:
        for f in (cert, key):
            os.chown(server.base_dir / f.name, owner.pw_uid, owner.pw_gid)
    server.start()
    try:
        table = f"public.{unique}"
        dsn = f"{server.dsn}?sslmode=verify-full&sslrootcert={ca}"
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
            cur.execute(f"INSERT INTO {table} VALUES (1, 'a')")
            cur.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            assert cur.fetchone()[0] is True
        config = _with_dsn(make_config(server, warehouse, tmp_path / "segments", unique,
                                       [table]), dsn)
        with caplog.at_level(logging.DEBUG, logger="walberg"):
            run_once(config, spark)
        assert "goes through" not in caplog.text and ": 1 rows in" in caplog.text
        with conn.cursor() as cur:
            cur.execute(f"INSERT INTO {table} VALUES (2, 'b')")
            cur.execute("SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
                        "WHERE a.backend_type = 'walsender' AND NOT s.ssl")
            assert cur.fetchone()[0] == 0
        run_once(config, spark)
        assert iceberg_rows(warehouse, config.target_for(table)) == postgres_rows(conn, table)
        conn.close()
        # A server certificate signed by another CA is refused, and said so.
        other, _, _ = _make_certificates(_fresh(tmp_path / "other"))
        with pytest.raises(WalbergError, match="certificate verify failed"):
            run_once(_with_dsn(config, f"{server.dsn}?sslmode=verify-full&sslrootcert={other}"),
                 spark)
    finally:
        server.stop()


def _fresh(path: Path) -> Path:
    path.mkdir()
    return path


def test_odd_identifiers_are_names_not_sql(pg_conn: Any, postgres: Any, spark: Any,
                                           warehouse: Path, tmp_path: Path,
                                           unique: str) -> None:
    schema, name = f"Odd {unique}", 'Weird "T"; DROP TABLE decoy; --'
    table = f"{schema}.{name}"
    with pg_conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {unique}_decoy (x int)")
        cur.execute(f'CREATE SCHEMA "{schema}"')
        cur.execute(f'CREATE TABLE "{schema}"."{name.replace(chr(34), chr(34) * 2)}" '
                    '("Id" int PRIMARY KEY, "from" text, "a b" numeric(6,2), '
                    '"q""uote" text, "select" timestamptz)')
        quoted = f'"{schema}"."{name.replace(chr(34), chr(34) * 2)}"'
        cur.execute(f"INSERT INTO {quoted} SELECT g, 'f' || g, g / 3.0, 'q', now() "
                    "FROM generate_series(1, 20) g")
    config = make_config(postgres, warehouse, tmp_path / "segments", unique, [table])
    run_once(config, spark)
    with pg_conn.cursor() as cur:
        cur.execute(f'UPDATE {quoted} SET "from" = \'changed\', "q""uote" = \'it\'\'s\' '
                    'WHERE "Id" <= 5')
        cur.execute(f'DELETE FROM {quoted} WHERE "Id" > 18')
    run_once(config, spark)
    with Lake(config, session=spark) as lake:
        [verdict] = verify(lake)
    assert verdict.equal, verdict
    assert iceberg_rows(warehouse, config.target_for(table), "Id") == \
        postgres_rows(pg_conn, quoted, '"Id"')
    with pg_conn.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {unique}_decoy")  # still there
        assert cur.fetchone()[0] == 0
