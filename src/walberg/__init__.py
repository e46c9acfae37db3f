"""walberg: stream PostgreSQL tables into Apache Iceberg tables on Apache Spark, exactly once.

    from walberg import Pipeline
    Pipeline.from_yaml("pipeline.yaml").run(once=True)

``Pipeline`` (in ``walberg.pipeline``) runs a pipeline. The commands that read or tend the lake
take a ``walberg.lake.services.Lake``: ``walberg.lake`` (query, changes, history, maintain) and
``walberg.ops`` (check, status, verify, resync, slot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from walberg.config import Config
    from walberg.pipeline import Pipeline

__all__ = ["Pipeline", "Config", "load_config"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so `walberg --help` does not load Spark, numpy and pyarrow.
    if name == "Pipeline":
        from walberg.pipeline import Pipeline

        return Pipeline
    if name in ("Config", "load_config"):
        from walberg import config

        return getattr(config, name)
    raise AttributeError(f"module 'walberg' has no attribute {name!r}")
