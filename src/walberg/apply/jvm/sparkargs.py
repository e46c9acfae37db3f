"""The Spark session a pipeline file asks for, as ``apply.jvm.spark.build_session`` takes it,
worked out with nothing heavier than the file itself: so the CLI can start the driver's JVM
as soon as it has read the file (``start_early``), while the rest of walberg is imported."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple, Optional

from walberg.apply.catalog import catalogs, storage
from walberg.apply.initial import jdbc
from walberg.config import Config

log = logging.getLogger("walberg")


class SessionArgs(NamedTuple):
    master: str
    catalog: str
    warehouse: str
    catalog_properties: dict[str, str]
    extra_conf: dict[str, str]
    jars: list[str]


def session_args(config: Config) -> SessionArgs:
    """The session's master, catalog, warehouse, catalog properties, Spark settings and jars."""
    cat = config.sink.catalog
    props, jars = catalogs.spark_properties(
        cat.type, config.warehouse, cat.uri, cat.options(), cat.properties,
        config.spark.conf.get("spark.jars", ""))
    st = config.storage
    s3, gcs, azure = (None if x is None else x.model_dump() for x in (st.s3, st.gcs, st.azure))
    storage_conf, storage_jars = storage.spark_settings(s3, gcs, azure,
                                                        timeout=st.timeout_seconds)
    if any(src.postgres is not None and src.postgres.initial_copy.method == "jdbc"
           for src in [config.source, *config.sources.values()]):
        jars.append(jdbc.driver_jar())  # the parallel initial copy's readers need it
    return SessionArgs(config.spark.master, cat.name, config.warehouse, props,
                       {**storage_conf, **config.spark.conf}, jars + storage_jars)


def start_early(config: Config, once: bool, file_memo: Optional[Path] = None) -> None:
    """Start the driver's JVM the pipeline's session will want, if that can be done at once
    (``apply.jvm.spark.start_jvm_early``); anything that goes wrong here is met again, and
    said, when the session is built."""
    from walberg.apply.jvm.spark import start_jvm_early

    try:
        args = session_args(config)
        start_jvm_early(*args[:5], jars=args.jars, short_lived=once, file_memo=file_memo)
    except Exception as exc:  # noqa: BLE001  (said when the session is built)
        log.debug("the driver's JVM was not started early: %s", exc)
