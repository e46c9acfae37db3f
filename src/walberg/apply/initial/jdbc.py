"""Reading a source table through Spark's JDBC reader, for the parallel initial copy: each query
becomes one partition, so Spark's executors read the table's spans side by side."""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

from walberg.apply.catalog.catalogs import jdbc_driver


def driver_jar() -> str:
    """The PostgreSQL JDBC driver, which Spark's executors need on their class path."""
    return str(jdbc_driver("source.postgres.initial_copy.method jdbc"))


def read_text(spark: Any, url: str, props: Mapping[str, str], queries: Sequence[str],
              init: str, fetch_size: int) -> Any:
    """One DataFrame of the rows all ``queries`` return, one partition each. Every reader runs
    ``init`` first (in its own transaction: Spark's PostgreSQL dialect turns autocommit off
    when a fetch size is set, which also makes the driver stream rows instead of buffering the
    whole result)."""
    frames = []
    for query in queries:
        reader = (spark.read.format("jdbc").option("url", url).option("query", query)
                  .option("sessionInitStatement", init).option("fetchsize", str(fetch_size))
                  .option("pushDownPredicate", "false"))
        for key, value in props.items():
            reader = reader.option(key, value)
        frames.append(reader.load())
    return functools.reduce(lambda a, b: a.unionAll(b), frames)
