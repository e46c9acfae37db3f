"""Every Prometheus metric walberg exports, in one place (served at /metrics when
``metrics.port`` is set). Names and labels are documented in docs/operations.md."""

from __future__ import annotations

import threading
from typing import Optional

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECORDS_WRITTEN = Counter("walberg_records_written", "Changes committed to Iceberg",
                          ["table", "op"])
DEAD_LETTERS = Counter("walberg_dead_letters", "Rows sent to the dead-letter table instead of "
                       "their table (they could not be written exactly)", ["table"])
COMMIT_RETRIES = Counter("walberg_commit_retries", "Iceberg commits tried again after a "
                         "storage or catalog failure", ["table"])
MAINTENANCE_FAILURES = Counter("walberg_maintenance_failures", "Scheduled maintenance of an "
                               "Iceberg table that failed (tried again a period later)",
                               ["table"])
BYTES_WRITTEN = Counter("walberg_bytes_written", "Bytes of data and delete files committed",
                        ["table"])
FILES_CREATED = Counter("walberg_files_created", "Data and delete files committed",
                        ["table", "kind"])
COPY_PROGRESS = Gauge("walberg_initial_copy_progress",
                      "Rows copied so far over the estimate (1 when done), per table", ["table"])
TABLE_STOPPED = Gauge("walberg_table_stopped", "1 while a table is stopped by a schema change "
                      "Iceberg cannot follow (the other tables go on)", ["table"])
COMMITS = Counter("walberg_commits", "Iceberg commits by walberg", ["table", "result"])
BATCHES = Counter("walberg_batches", "Batches applied (one Iceberg commit per changed table)")
SEGMENTS_SEALED = Counter("walberg_segments_sealed", "Segment files sealed")
SEGMENTS_APPLIED = Counter("walberg_segments_applied", "Segment files applied and removed")
COPIED_ROWS = Counter("walberg_initial_copy_rows", "Rows written by initial copies", ["table"])

COMMIT_SECONDS = Histogram("walberg_commit_seconds", "Duration of one table's Iceberg commit",
                           ["table"], buckets=(0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128))
BATCH_SECONDS = Histogram("walberg_batch_seconds", "Staging plus commit time of a batch",
                          buckets=(0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256))
BATCH_CHANGES = Histogram("walberg_batch_changes", "Changes per batch",
                          buckets=(10, 100, 1e3, 1e4, 1e5, 1e6, 1e7))
# Freshness as users mean it: how old the oldest transaction an Iceberg commit made visible
# was when it became visible (a batch's first transaction waits the longest).
END_TO_END_SECONDS = Histogram(
    "walberg_end_to_end_seconds",
    "Per table: from the source commit of the oldest transaction an Iceberg commit made "
    "visible to that Iceberg commit",
    ["table"],
    buckets=(0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 30, 60, 120, 300, 900, 1800,
             3600))

COMMITTED_LSN = Gauge("walberg_committed_lsn", "LSN covered by the table's last walberg commit",
                      ["table"])
# Per source (``source``: its name in a pipeline with several, else postgres or kafka), so that
# several sources in one process do not overwrite each other.
PENDING_BYTES = Gauge("walberg_pending_segment_bytes", "Segment bytes not yet applied",
                      ["source"])
LAG_BYTES = Gauge("walberg_replication_lag_bytes",
                  "Server WAL position minus the slot's confirmed flush position", ["source"])
RETAINED_WAL_BYTES = Gauge("walberg_slot_retained_wal_bytes", "WAL the slot keeps on the server",
                           ["source"])
LAG_SECONDS = Gauge("walberg_replication_lag_seconds",
                    "Now minus the source commit time of the oldest transaction received but "
                    "not yet in Iceberg (0 when none): grows while a batch is stuck",
                    ["source"])

_served: Optional[int] = None
_lock = threading.Lock()


def serve(port: int, host: str) -> None:
    """Serve /metrics once per process (further pipelines in the process share it)."""
    global _served
    with _lock:
        if _served is None:
            start_http_server(port, addr=host)
            _served = port
