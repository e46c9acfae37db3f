"""What a Kafka (Debezium) pipeline runs: the reader (topics -> segment files, ``reader``), the
frames it writes (``frames``) and the stager (a batch of segments -> staged changes per table,
``stager``), which leans on ``tables`` (a topic's table: its columns, key and schema evolution),
``marks`` (the offsets a commit carries) and ``dead_letters`` (records that cannot be applied).
It may import runtime's shared modules (``applier``, ``state``), the stages and the shared plain
modules; no Postgres runtime module."""
