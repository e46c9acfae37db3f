"""What runs while a pipeline runs, one module per job:

- ``state``: what the reader thread and the applier thread share, behind one lock;
- ``applier``: sealed segments -> Iceberg commits, the same for every source;
- ``pg_reader``: a Postgres source's stream -> segment files (``pg_reader`` starts up,
  ``pg_stream`` streams and reconnects, ``pg_server`` judges which server it reached,
  ``pg_gauges`` reports how far behind the lake is);
- ``pg_stager``: a batch of segments -> staged changes per table;
- ``kafka``: the same two jobs for a Kafka (Debezium) source, a package of its own;
- ``initial_copy``: a Postgres table's first copy into the lake;
- ``tables``: a Postgres pipeline's Iceberg tables, their schema evolution and type learning.
"""
