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
from pathlib import Path
from typing import Any, Optional, Sequence

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


def spark_settings(s3: Optional[dict[str, Any]] = None, gcs: Optional[dict[str, Any]] = None,
                   azure: Optional[dict[str, Any]] = None) -> tuple[dict[str, str], list[str]]:
    """Spark settings and jars for the configured storages (None: not configured)."""
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
