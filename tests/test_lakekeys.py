"""A key index's rows read from the lake on the driver (``apply.position.lakekeys``) are the
rows Spark reads: the same keys at the same (data file, position), deletes applied, for
tables whose deletes another engine (Spark's own merge-on-read writer) wrote: position-delete
files, in an unpartitioned and a partitioned table, and format 3's deletion vectors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from walberg.apply.position.entries import lake_entries
from walberg.apply.position.keycodec import KeyCodec
from walberg.apply.position.lakekeys import live_scan
from walberg.apply.session import java_table


@pytest.mark.parametrize("version, partitioned, key", [(2, False, "id"), (2, True, "k"),
                                                       (3, False, "id")])
def test_live_rows_read_on_the_driver_are_sparks(spark: Any, unique: str, tmp_path: Path,
                                                 version: int, partitioned: bool,
                                                 key: str) -> None:
    """Against Spark's own ``_file`` and ``_pos``, and against the entries Spark reads for an
    index when the driver cannot (``entries.lake_entries``), for a bigint and a text key."""
    name = f"lake.lakekeys.{unique}_v{version}{'_p' if partitioned else ''}"
    spark.sql(f"CREATE TABLE {name} (id BIGINT, g INT, note STRING, k STRING) USING iceberg "
              f"{'PARTITIONED BY (g)' if partitioned else ''} TBLPROPERTIES "
              f"('format-version'='{version}', 'write.delete.mode'='merge-on-read', "
              "'write.update.mode'='merge-on-read', 'write.merge.mode'='merge-on-read')")
    spark.sql(f"INSERT INTO {name} SELECT id, CAST(id % 4 AS INT), CAST(id AS STRING), "
              "'k' || id FROM range(0, 3000)")
    spark.sql(f"INSERT INTO {name} SELECT id, CAST(id % 4 AS INT), 'second', 'k' || id "
              "FROM range(3000, 5000)")
    for statement in (f"DELETE FROM {name} WHERE id % 7 = 0",
                      f"UPDATE {name} SET note = 'updated' WHERE id % 5 = 0",
                      f"DELETE FROM {name} WHERE id % 11 = 0 OR id BETWEEN 100 AND 180"):
        spark.sql(statement)

    scan = live_scan(spark, java_table(spark, name), [key])
    assert scan is not None and scan.delete_files > 0
    if version == 3:
        assert all(d.vector for applies in scan.deletes for d in applies)
    codec = KeyCodec.for_types(["BIGINT" if key == "id" else "STRING"])
    assert codec is not None
    ours = []
    for number, at, keys, checks in scan.rows(codec):
        positions = at if isinstance(at, np.ndarray) else np.arange(at, at + len(keys))
        checks = np.zeros(len(keys), np.int64) if checks is None else checks
        ours += [(int(k), int(c), scan.locations[number], int(p))
                 for k, c, p in zip(keys, checks, positions, strict=True)]
    rows = spark.sql(f"SELECT {key}, _file, _pos FROM {name}").collect()
    encoded = codec.encode([pa.array([r[key] for r in rows])])
    checks = np.zeros(len(rows), np.int64) if encoded[1] is None else encoded[1]
    theirs = [(int(k), int(c), r["_file"], r["_pos"])
              for k, c, r in zip(encoded[0], checks, rows, strict=True)]
    assert len(theirs) < 5000 and sorted(ours) == sorted(theirs)

    files: list[str] = []
    _, entries = lake_entries(spark, name, [key], codec, tmp_path, files)
    by_spark = []
    for keys, checks, numbers, positions in entries:
        checks = np.zeros(len(keys), np.int64) if checks is None else checks
        by_spark += [(int(k), int(c), files[n], int(p))
                     for k, c, n, p in zip(keys, checks, numbers, positions, strict=True)]
    assert sorted(by_spark) == sorted(theirs)
