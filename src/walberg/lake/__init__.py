"""Reading and tending the lake without running a pipeline: the ``Lake`` (services.py) and the
commands built on it: query.py (queries, exports, time travel), changes.py (net changes between
two snapshots), history.py (a table's snapshots) and maintain.py (compaction and clean-up)."""
