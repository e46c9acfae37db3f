"""The apply by MERGE: a staged batch netted per key in Spark, TOASTed values carried over
(netting), and committed by Spark SQL (merging). Imports walberg.apply's shared modules
(session, batch, types) and apply.jvm; never apply.position, writes or iceberg.
"""
