"""The source stage: reading PostgreSQL (logical replication with pgoutput, the initial copy in
the slot's snapshot) and Debezium change events from Kafka, decoded into walberg's model.
Imports only itself and the shared modules (errors, model, config, metrics, progress, faults);
psycopg2 and confluent_kafka live here and nowhere else."""
