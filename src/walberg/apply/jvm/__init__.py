"""The JVM plumbing under the sink: the Spark session and its settings (spark), the Java and
Iceberg jar it needs (java), the JVM's log (jvmlog), calls into Spark and their failures
(calls), commits one at a time per table with their properties (commits), the driver's
class-data archive that makes a cold start cheap (classcache, classbuild), and the storage
watch that puts a deadline on Spark calls waiting for an object store (watch).

Imports nothing of walberg.apply outside this folder but apply.catalog (the jars and settings
of catalogs and storage).
"""
