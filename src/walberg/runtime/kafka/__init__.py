"""What a Kafka (Debezium) pipeline runs: the reader (topics -> segment files, ``reader``), the
frames it writes (``frames``) and the stager (a batch of segments -> staged changes per table,
``stager``). It may import runtime's shared modules (``applier``, ``state``), the stages and
the shared plain modules; no Postgres runtime module."""
