"""Where the lake lives: Iceberg catalogs and object storage mapped to Spark settings and jars
(catalogs, storage), and reading a table's metadata without Spark, for status and history
(metadata, catalog_reads).

Imports nothing of walberg.apply outside this folder; apply.jvm and the commands build on it.
"""
