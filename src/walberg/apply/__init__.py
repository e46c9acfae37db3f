"""The apply stage: Spark and Iceberg. Staging a batch, committing it (MERGE, appends, or by
position through position/), the JVM plumbing (jvm/) and catalogs and storage (catalog/).
Imports only itself and the shared modules; pyspark, py4j and pyiceberg live here only."""
