"""Object storage for the warehouse: the pipeline file's ``storage`` section mapped to Hadoop's
filesystem connectors (Spark settings ``spark.hadoop.fs.*``) and the jars each one needs.

S3 and S3-compatible servers (MinIO, ...) use Hadoop's s3a connector: ``hadoop-aws`` and the
AWS SDK bundle. They are found in the ``sagemaker_pyspark`` package when it is installed
(``pip install --no-deps sagemaker-pyspark==1.4.5`` ships hadoop-aws-3.3.1 and
aws-java-sdk-bundle-1.11.901, which match pyspark 3.5's Hadoop), in the folder
``WALBERG_S3A_JARS`` names, or listed in ``jars``.
GCS and Azure map their settings the same way; their connector jars go on ``jars``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from walberg.errors import EnvironmentProblem

S3A_JARS = ("hadoop-aws-", "aws-java-sdk-bundle-")


def _shipped_s3a_jars() -> list[str]:
    folder_env = os.environ.get("WALBERG_S3A_JARS")  # a folder holding the two jars
    if folder_env:
        return sorted(str(p) for p in Path(folder_env).glob("*.jar")
                      if p.name.startswith(S3A_JARS))
    try:
        package = importlib.import_module("sagemaker_pyspark")
    except ImportError:
        return []
    folder = Path(str(package.__file__)).parent / "jars"
    return sorted(str(p) for p in folder.glob("*.jar") if p.name.startswith(S3A_JARS))


def _require(jars: Sequence[str], prefixes: Sequence[str], what: str, how: str) -> None:
    missing = [p for p in prefixes if not any(Path(j).name.startswith(p) for j in jars)]
    if missing:
        raise EnvironmentProblem(f"{what} needs {', '.join(m + '*.jar' for m in missing)} on "
                                 f"the classpath, which is not there. {how}")


def s3a_deadlines(timeout: float) -> dict[str, str]:
    """The s3a connector's timeouts and retries, bounded by ``storage.timeout_seconds``.

    At hadoop-aws 3.3.1's defaults one unreachable request takes minutes: the AWS SDK tries it
    11 times (fs.s3a.attempts.maximum 10), each connect may wait 50 s
    (fs.s3a.connection.establish.timeout) and each read 200 s (fs.s3a.connection.timeout),
    and S3A's own Invoker repeats all of that 7 times with a doubling wait from 500 ms
    (fs.s3a.retry.limit, fs.s3a.retry.interval). Here a connect waits at most 5 s, a read at
    most the deadline, and the two retry layers together wait a few seconds: an unreachable
    endpoint fails one call in well under the deadline. Throttling (503 SlowDown) is the store
    answering, not an outage: fs.s3a.retry.throttle.* keep their defaults. Iceberg's own
    retries (a catalog's metadata refresh, commit.retry.*) sit above these; walberg's
    storage watch (apply.jvm.watch) bounds them."""
    ms = max(int(timeout * 1000), 1000)
    return {
        "spark.hadoop.fs.s3a.connection.establish.timeout": str(min(5000, ms)),
        "spark.hadoop.fs.s3a.connection.timeout": str(ms),
        "spark.hadoop.fs.s3a.attempts.maximum": "1",
        "spark.hadoop.fs.s3a.retry.limit": "2",
        "spark.hadoop.fs.s3a.retry.interval": f"{max(ms // 20, 100)}ms",
    }


def spark_settings(s3: Optional[dict[str, Any]] = None, gcs: Optional[dict[str, Any]] = None,
                   azure: Optional[dict[str, Any]] = None,
                   timeout: Optional[float] = None) -> tuple[dict[str, str], list[str]]:
    """Spark settings and jars for the configured storages (None: not configured).
    ``timeout``: storage.timeout_seconds, which bounds the s3a connector's retries."""
    conf: dict[str, str] = {}
    jars: list[str] = []
    h = "spark.hadoop.fs"
    if s3 is not None:
        given = [str(j) for j in s3.get("jars") or []]
        s3_jars = given or _shipped_s3a_jars()
        _require(s3_jars, S3A_JARS, "storage.s3 (the s3a connector)",
                 "Install them with `pip install --no-deps sagemaker-pyspark==1.4.5`, or list "
                 "hadoop-aws and aws-java-sdk-bundle jars matching Hadoop 3.3 in storage.s3.jars.")
        jars += s3_jars
        conf[f"{h}.s3a.impl"] = "org.apache.hadoop.fs.s3a.S3AFileSystem"
        conf[f"{h}.s3.impl"] = "org.apache.hadoop.fs.s3a.S3AFileSystem"  # s3:// paths too
        endpoint = s3.get("endpoint")
        if endpoint:
            conf[f"{h}.s3a.endpoint"] = str(endpoint)
            conf[f"{h}.s3a.connection.ssl.enabled"] = str(
                str(endpoint).startswith("https")).lower()
        if s3.get("region"):
            conf[f"{h}.s3a.endpoint.region"] = str(s3["region"])
        conf[f"{h}.s3a.path.style.access"] = str(bool(s3.get("path_style_access"))).lower()
        if s3.get("access_key_id"):
            conf[f"{h}.s3a.access.key"] = str(s3["access_key_id"])
            conf[f"{h}.s3a.secret.key"] = str(s3.get("secret_access_key") or "")
            conf[f"{h}.s3a.aws.credentials.provider"] = \
                "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
        if timeout is not None:
            conf.update(s3a_deadlines(timeout))
    if gcs is not None:
        given = [str(j) for j in gcs.get("jars") or []]
        _require(given, ["gcs-connector"], "storage.gcs",
                 "Add the shaded gcs-connector-hadoop3 jar (Maven com.google.cloud.bigdataoss:"
                 "gcs-connector) to storage.gcs.jars.")
        jars += given
        conf[f"{h}.gs.impl"] = "com.google.cloud.hadoop.fs.gcs.GoogleHadoopFileSystem"
        if gcs.get("project_id"):
            conf[f"{h}.gs.project.id"] = str(gcs["project_id"])
        if gcs.get("service_account_json_keyfile"):
            conf["spark.hadoop.google.cloud.auth.service.account.json.keyfile"] = \
                str(gcs["service_account_json_keyfile"])
    if azure is not None:
        given = [str(j) for j in azure.get("jars") or []]
        _require(given, ["hadoop-azure-"], "storage.azure",
                 "Add hadoop-azure-3.3.x.jar (and its azure-storage dependencies) to "
                 "storage.azure.jars.")
        jars += given
        account = azure.get("account_name")
        if account and azure.get("account_key"):
            conf[f"{h}.azure.account.key.{account}.dfs.core.windows.net"] = \
                str(azure["account_key"])
    return conf, jars


@dataclass(frozen=True)
class Problem:
    """Why the warehouse's object store did not answer a probe."""

    kind: Literal["unreachable", "credentials", "bucket"]
    detail: str  # what the store (or the network) said, one line


class S3Probe:
    """Asks the S3 endpoint about the warehouse from Python (pyarrow's S3 client, one try,
    its own short timeouts), independent of the JVM: whether the storage answers at all, and
    whether it takes walberg's credentials."""

    def __init__(self, s3: dict[str, Any], warehouse: str) -> None:
        self.s3 = s3
        self.warehouse = warehouse
        _, _, rest = warehouse.partition("://")
        self.path = rest.rstrip("/")
        self.endpoint = str(s3.get("endpoint") or "the AWS S3 endpoint of the region")

    def check(self, timeout: float) -> Optional[Problem]:
        """None when the warehouse location can be looked up; else what went wrong."""
        from pyarrow import fs

        endpoint = self.s3.get("endpoint")
        scheme, _, host = str(endpoint or "").partition("://")
        try:
            store = fs.S3FileSystem(
                access_key=self.s3.get("access_key_id"),
                secret_key=self.s3.get("secret_access_key"),
                region=self.s3.get("region") or "us-east-1",
                endpoint_override=(host or None) if endpoint else None,
                scheme=scheme if endpoint else "https",
                connect_timeout=min(timeout, 5.0), request_timeout=timeout,
                retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=1))
            store.get_file_info(self.path)
            bucket = self.path.split("/", 1)[0]
            if store.get_file_info(bucket).type == fs.FileType.NotFound:
                return Problem("bucket", f"no bucket {bucket}")
        except OSError as exc:
            return _classify(str(exc))
        return None

    def describe(self, problem: Problem, timeout: float) -> str:
        """One paragraph for people: what failed, where, and what to check."""
        where = f"The warehouse {self.warehouse} on S3 at {self.endpoint}"
        if problem.kind == "credentials":
            return (f"{where} refused walberg's credentials ({problem.detail}). Check "
                    "storage.s3.access_key_id and storage.s3.secret_access_key (and the "
                    "environment variables they name): the secret must belong to the key, and "
                    "the key must be allowed to read and write the bucket.")
        if problem.kind == "bucket":
            return (f"{where} is not there: the bucket does not exist ({problem.detail}). "
                    "Create the bucket, or correct sink.catalog.warehouse.")
        return (f"{where} does not answer (storage.timeout_seconds is {timeout:g} s): "
                f"{problem.detail}. Check that the S3 server is running and reachable from "
                "this machine (storage.s3.endpoint, the network, a proxy or firewall between). "
                "Nothing was lost: what is not in the lake stays in the segments and the "
                "replication slot, and the next run goes on from there.")


_CREDENTIALS = ("ACCESS_DENIED", "INVALID_ACCESS_KEY", "SIGNATURE_DOES_NOT_MATCH",
                "Forbidden", "HTTP response code: 403", "EXPIRED_TOKEN", "InvalidAccessKeyId",
                "SignatureDoesNotMatch")


def _classify(text: str) -> Problem:
    # pyarrow says "When getting information for key ... during HeadObject operation: <why>".
    line = " ".join(text.split()).split(" operation: ", 1)[-1][:300]
    if any(word in text for word in _CREDENTIALS):
        return Problem("credentials", line)
    if "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text:
        return Problem("bucket", line)
    return Problem("unreachable", line)


def probe_for(s3: Optional[dict[str, Any]], warehouse: str) -> Optional[S3Probe]:
    """A probe for a warehouse on S3 (s3a://, s3://), else None."""
    if s3 is None or not warehouse.startswith(("s3a://", "s3://", "s3n://")):
        return None
    return S3Probe(s3, warehouse)
