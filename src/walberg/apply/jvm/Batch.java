// The per-file work of a batch applied by position, done in the driver's JVM in one call per
// step instead of several py4j round trips per file: describing the data files written on the
// driver (their footers read here, in threads), describing its delete files, filling the row
// delta, and reading the live data files of a table. Compiled at run time by Janino, which
// Spark ships (see walberg.apply.jvm.helper); so Java 7 style: raw types, no lambdas.
// Arguments and answers that are many values travel as one JSON string.
package walberg;

import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.concurrent.Callable;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;

import com.fasterxml.jackson.databind.ObjectMapper;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.FilterFileSystem;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.io.nativeio.NativeIO;
import org.apache.iceberg.AppendFiles;
import org.apache.iceberg.BaseTransaction;
import org.apache.iceberg.BlobMetadata;
import org.apache.iceberg.CatalogUtil;
import org.apache.iceberg.ContentFile;
import org.apache.iceberg.DataFile;
import org.apache.iceberg.DataFiles;
import org.apache.iceberg.DeleteFile;
import org.apache.iceberg.FileContent;
import org.apache.iceberg.FileFormat;
import org.apache.iceberg.FileMetadata;
import org.apache.iceberg.FileScanTask;
import org.apache.iceberg.GenericBlobMetadata;
import org.apache.iceberg.GenericStatisticsFile;
import org.apache.iceberg.HasTableOperations;
import org.apache.iceberg.Metrics;
import org.apache.iceberg.MetricsConfig;
import org.apache.iceberg.OverwriteFiles;
import org.apache.iceberg.PartitionField;
import org.apache.iceberg.PartitionSpec;
import org.apache.iceberg.RowDelta;
import org.apache.iceberg.Schema;
import org.apache.iceberg.Snapshot;
import org.apache.iceberg.SnapshotUpdate;
import org.apache.iceberg.StatisticsFile;
import org.apache.iceberg.StructLike;
import org.apache.iceberg.Table;
import org.apache.iceberg.TableScan;
import org.apache.iceberg.Transaction;
import org.apache.iceberg.UpdateStatistics;
import org.apache.iceberg.catalog.TableCommit;
import org.apache.iceberg.expressions.Expression;
import org.apache.iceberg.expressions.Expressions;
import org.apache.iceberg.catalog.TableIdentifier;
import org.apache.iceberg.rest.RESTCatalog;
import org.apache.iceberg.io.CloseableIterable;
import org.apache.iceberg.relocated.com.google.common.util.concurrent.MoreExecutors;
import org.apache.iceberg.types.Types;
import org.apache.iceberg.parquet.ParquetUtil;
import org.apache.iceberg.shaded.org.apache.parquet.ParquetReadOptions;
import org.apache.iceberg.shaded.org.apache.parquet.hadoop.ParquetFileReader;
import org.apache.iceberg.shaded.org.apache.parquet.io.LocalInputFile;

public class Batch {
    private final ObjectMapper json = new ObjectMapper();
    private static final java.util.concurrent.ExecutorService DIRECT =
        MoreExecutors.newDirectExecutorService();
    private final ParquetReadOptions options = ParquetReadOptions.builder().build();

    /** Hadoop's file system for this machine's disk, setting permissions in the JVM. Without
     * Hadoop's native library (pip's pyspark has none) {@code RawLocalFileSystem} sets each new
     * file's permissions by starting a {@code chmod} process: 8-17 ms, five times an Iceberg
     * commit. The same permissions through java.nio; anything it cannot say (a sticky bit) goes
     * the old way. */
    public static class LocalPermissions extends RawLocalFileSystem {
        public void setPermission(Path path, FsPermission permission) throws java.io.IOException {
            String text = permission.toString();
            if (permission.getStickyBit() || text.length() != 9) {
                super.setPermission(path, permission);
                return;
            }
            java.nio.file.Files.setPosixFilePermissions(pathToFile(path).toPath(),
                java.nio.file.attribute.PosixFilePermissions.fromString(text));
        }
    }

    /** Puts {@link LocalPermissions} under the one {@code file:} file system instance this JVM
     * shares (Iceberg's, Spark's): true when it is there, false when it was left alone (Hadoop's
     * native library loaded, or a local file system of the user's own). */
    public boolean localPermissions(Configuration conf) throws Exception {
        LocalFileSystem local = FileSystem.getLocal(conf);
        FileSystem raw = local.getRawFileSystem();
        if (raw instanceof LocalPermissions) {
            return true;
        }
        if (NativeIO.isAvailable() || raw.getClass() != RawLocalFileSystem.class
                || !java.nio.file.FileSystems.getDefault().supportedFileAttributeViews()
                    .contains("posix")) {
            return false;
        }
        LocalPermissions quick = new LocalPermissions();
        quick.initialize(local.getUri(), raw.getConf());
        quick.setWorkingDirectory(raw.getWorkingDirectory());
        java.lang.reflect.Field field = FilterFileSystem.class.getDeclaredField("fs");
        field.setAccessible(true);
        field.set(local, quick);
        return true;
    }

    private List parse(String text) throws Exception {
        return (List) json.readValue(text, List.class);
    }

    private static long asLong(Object value) {
        return ((Number) value).longValue();
    }

    /** Data files written on this machine as Iceberg data files of the table's current spec:
     * each of {@code files} is [location, local path, size, partition values (a list; empty if
     * unpartitioned)]. The footers are read from the local files, in {@code threads} threads;
     * with {@code conf} the files are first moved to their locations through Hadoop. */
    public List dataFiles(final Table table, String files, final Configuration conf, int threads)
            throws Exception {
        final List items = parse(files);
        final PartitionSpec spec = table.spec();
        final MetricsConfig metrics = MetricsConfig.forTable(table);
        final boolean partitioned = !spec.isUnpartitioned();
        final DataFile[] out = new DataFile[items.size()];
        ExecutorService pool = Executors.newFixedThreadPool(Math.max(1, threads));
        try {
            List waits = new ArrayList();
            for (int i = 0; i < items.size(); i++) {
                final int at = i;
                waits.add(pool.submit(new Callable() {
                    public Object call() throws Exception {
                        List item = (List) items.get(at);
                        String location = (String) item.get(0);
                        String local = (String) item.get(1);
                        Metrics found = footer(local, metrics);
                        if (conf != null) {
                            Path dest = new Path(location);
                            dest.getFileSystem(conf).copyFromLocalFile(
                                true, true, new Path(new java.io.File(local).toURI()), dest);
                        }
                        DataFiles.Builder builder = DataFiles.builder(spec).withPath(location)
                            .withFormat(FileFormat.PARQUET).withFileSizeInBytes(asLong(item.get(2)))
                            .withMetrics(found);
                        if (partitioned) {
                            builder = builder.withPartitionValues((List) item.get(3));
                        }
                        out[at] = builder.build();
                        return null;
                    }
                }));
            }
            for (int i = 0; i < waits.size(); i++) {
                ((Future) waits.get(i)).get();
            }
        } finally {
            pool.shutdown();
        }
        return new ArrayList(Arrays.asList(out));
    }

    /** Runs once the code a batch's own files go through, so that a process's first batch
     * does not load it: {@code files} is [a data file, a position-delete file], both local and
     * in no table. Both described as files of an unpartitioned table, footers read here, and
     * sent through {@code describe} and {@code parse}; returned as a Java list [data file,
     * delete file]. */
    public List warm(String files) throws Exception {
        List items = parse(files);
        PartitionSpec spec = PartitionSpec.unpartitioned();
        MetricsConfig config = MetricsConfig.getDefault();
        java.io.File data = new java.io.File((String) items.get(0));
        java.io.File deletes = new java.io.File((String) items.get(1));
        List out = new ArrayList();
        out.add(DataFiles.builder(spec).withPath(data.toURI().toString())
            .withFormat(FileFormat.PARQUET).withFileSizeInBytes(data.length())
            .withMetrics(footer(data.getPath(), config)).build());
        out.add(FileMetadata.deleteFileBuilder(spec).ofPositionDeletes()
            .withPath(deletes.toURI().toString()).withFormat(FileFormat.PARQUET)
            .withFileSizeInBytes(deletes.length()).withMetrics(footer(deletes.getPath(), config))
            .build());
        if (parse(describe(out)).size() != 2) {
            throw new IllegalStateException("warm: two files described, not two rows back");
        }
        return out;
    }

    private Metrics footer(String local, MetricsConfig config) throws Exception {
        ParquetFileReader reader = ParquetFileReader.open(
            new LocalInputFile(new java.io.File(local).toPath()), options);
        try {
            return ParquetUtil.footerMetrics(reader.getFooter(), java.util.stream.Stream.empty(),
                                             config);
        } finally {
            reader.close();
        }
    }

    /** What a table's plan for its new rows depends on, as one string: its schema, spec,
     * sort order, properties and location (a change to any of them changes it). */
    public String shape(Table table) {
        return table.schema().schemaId() + "/" + table.spec().specId() + "/"
            + table.sortOrder().orderId() + "/" + table.properties().hashCode() + "/"
            + table.properties().size() + "/" + table.location();
    }

    /** A position-delete file written on this machine at {@code local}, described as the
     * Iceberg delete file it becomes at {@code location} (of the table's spec, unpartitioned),
     * with the metrics of its footer read here: the bounds of its {@code file_path} tell
     * readers which data files it applies to. Read before the file moves, with the reader
     * options made once (Iceberg's own footer reader makes a Hadoop configuration per file,
     * parsing its XML resources each time). */
    public Object positionDeleteFile(Table table, String location, String local, long size)
            throws Exception {
        return FileMetadata.deleteFileBuilder(table.spec()).ofPositionDeletes()
            .withPath(location).withFormat(FileFormat.PARQUET).withFileSizeInBytes(size)
            .withMetrics(footer(local, MetricsConfig.forPositionDelete(table))).build();
    }

    /** Position-delete files already in the table's storage: each of {@code files} is
     * [location, size, rows, a data file they point into (its spec and partition are the
     * delete file's; null: the table's spec, unpartitioned)], the data files as {@code live}
     * maps them. */
    public List positionDeletes(Table table, Map live, String files) throws Exception {
        List items = parse(files);
        List out = new ArrayList();
        Map specs = table.specs();
        for (int i = 0; i < items.size(); i++) {
            List item = (List) items.get(i);
            DataFile of = item.get(3) == null ? null : known(live, (String) item.get(3));
            FileMetadata.Builder builder = of == null
                ? FileMetadata.deleteFileBuilder(table.spec()).ofPositionDeletes()
                : FileMetadata.deleteFileBuilder((PartitionSpec) specs.get(of.specId()))
                    .ofPositionDeletes().withPartition(of.partition());
            out.add(builder.withPath((String) item.get(0)).withFormat(FileFormat.PARQUET)
                .withFileSizeInBytes(asLong(item.get(1))).withRecordCount(asLong(item.get(2)))
                .build());
        }
        return out;
    }

    /** Deletion vectors already in the table's storage: each of {@code vectors} is [Puffin
     * file's location, its size, the vector's cardinality, its data file, blob offset, blob
     * length]; spec and partition those of the data file as {@code live} maps it. */
    public List vectors(Table table, Map live, String vectors) throws Exception {
        List items = parse(vectors);
        List out = new ArrayList();
        Map specs = table.specs();
        for (int i = 0; i < items.size(); i++) {
            List item = (List) items.get(i);
            String path = (String) item.get(3);
            DataFile of = known(live, path);
            out.add(FileMetadata.deleteFileBuilder((PartitionSpec) specs.get(of.specId()))
                .ofPositionDeletes().withPath((String) item.get(0)).withFormat(FileFormat.PUFFIN)
                .withFileSizeInBytes(asLong(item.get(1))).withPartition(of.partition())
                .withRecordCount(asLong(item.get(2))).withReferencedDataFile(path)
                .withContentOffset(asLong(item.get(4))).withContentSizeInBytes(asLong(item.get(5)))
                .build());
        }
        return out;
    }

    private static DataFile known(Map live, String path) {
        DataFile found = (DataFile) live.get(path);
        if (found == null) {
            throw new IllegalStateException("data file " + path + " is not among the table's "
                                            + "live files as walberg read them");
        }
        return found;
    }

    /** A REST catalog client of its own (the Spark catalog's settings in {@code props}), for
     * commits of several tables at once. */
    public Object restCatalog(String name, Map props, Configuration conf) {
        return CatalogUtil.buildIcebergCatalog(name, props, conf);
    }

    /** Each of {@code transactions} (Iceberg transactions of the tables {@code names},
     * "namespace.table"), committed in one catalog transaction: all or nothing. Answers
     * "unsupported" (committing nothing) when the catalog does not offer the endpoint. */
    public String commitTogether(Object catalog, List names, List transactions) {
        List commits = new ArrayList();
        for (int i = 0; i < names.size(); i++) {
            BaseTransaction txn = (BaseTransaction) transactions.get(i);
            commits.add(TableCommit.create(TableIdentifier.parse((String) names.get(i)),
                txn.startMetadata(), txn.currentMetadata()));
        }
        try {
            ((RESTCatalog) catalog).commitTransaction(commits);
        } catch (UnsupportedOperationException e) {
            return "unsupported";
        }
        return "committed";
    }

    /** The Iceberg table {@code name} ({@code catalog.namespace.table}, unquoted; a namespace
     * of several levels has their names between) as Spark's catalog holds it, refreshed: one
     * round trip where py4j took four (the class, its method, the load, the refresh), and
     * asked of the catalog's Iceberg catalog directly: Spark's way parses the name with its SQL
     * parser, most of a load at a start of 1,000 tables. With {@code missingOk}, null when the
     * table or its namespace does not exist. */
    public Table table(org.apache.spark.sql.SparkSession spark, String name, boolean missingOk)
            throws Exception {
        Table table;
        // Spark finds a catalog by the settings of the calling thread's active session; a
        // py4j thread made for a new Python thread has none, and a catalog not loaded yet would
        // be taken for a namespace of the session catalog.
        org.apache.spark.sql.SparkSession.setActiveSession(spark);
        String[] parts = name.split("\\.", -1);
        try {
            Object plugin = parts.length < 3 ? null
                : spark.sessionState().catalogManager().catalog(parts[0]);
            if (plugin instanceof org.apache.iceberg.spark.source.HasIcebergCatalog) {
                table = ((org.apache.iceberg.spark.source.HasIcebergCatalog) plugin)
                    .icebergCatalog().loadTable(TableIdentifier.of(
                        org.apache.iceberg.catalog.Namespace.of(
                            (String[]) Arrays.copyOfRange(parts, 1, parts.length - 1)),
                        parts[parts.length - 1]));
            } else {
                StringBuilder quoted = new StringBuilder();
                for (int i = 0; i < parts.length; i++) {
                    quoted.append(i == 0 ? "`" : ".`").append(parts[i].replace("`", "``"))
                        .append('`');
                }
                table = org.apache.iceberg.spark.Spark3Util.loadIcebergTable(spark,
                    quoted.toString());
            }
        } catch (Exception e) {
            if (missingOk && notFound(e)) {
                return null;
            }
            throw e;
        }
        table.refresh();
        return table;
    }

    private static boolean notFound(Exception e) {
        String kind = e.getClass().getName();
        if (kind.endsWith(".NoSuchTableException") || kind.endsWith(".NoSuchNamespaceException")) {
            return true;
        }
        if (e instanceof org.apache.spark.SparkThrowable) {
            String error = ((org.apache.spark.SparkThrowable) e).getErrorClass();
            return "TABLE_OR_VIEW_NOT_FOUND".equals(error) || "SCHEMA_NOT_FOUND".equals(error);
        }
        return false;
    }

    /** What walberg checks of a table: its columns as Spark's schema JSON ("struct"), the
     * fields of its current spec as [transform, source column] ("spec"), its properties and
     * format version (some twenty round trips through py4j). */
    private Map facts(Table table) throws Exception {
        Map out = new HashMap();
        Schema schema = table.schema();
        out.put("struct", json.readTree(
            org.apache.iceberg.spark.SparkSchemaUtil.convert(schema).json()));
        List spec = new ArrayList();
        for (Iterator it = table.spec().fields().iterator(); it.hasNext();) {
            PartitionField field = (PartitionField) it.next();
            spec.add(Arrays.asList(new Object[] {field.transform().toString(),
                schema.findColumnName(field.sourceId())}));
        }
        out.put("spec", spec);
        out.put("properties", table.properties());
        out.put("format", Integer.valueOf(
            ((HasTableOperations) table).operations().current().formatVersion()));
        return out;
    }

    /** The table {@code name} loaded as {@code table} loads it (null: it does not exist) and
     * read in the same call: JSON {"facts": what {@code facts} says, "marks": what {@code marks}
     * says}. A start asks both of every table; one call loads the table once. */
    public String describe(org.apache.spark.sql.SparkSession spark, String name, String lsnKey,
                           String serverKey) throws Exception {
        Table table = table(spark, name, true);
        if (table == null) {
            return null;
        }
        Map out = new HashMap();
        out.put("facts", facts(table));
        out.put("marks", markList(table, lsnKey, serverKey));
        return json.writeValueAsString(out);
    }

    /** The table's properties, as a JSON object (py4j would iterate the map in three round
     * trips a property). */
    public String properties(Table table) throws Exception {
        return json.writeValueAsString(table.properties());
    }

    /** The summaries of the table's current snapshot and of each ancestor it still holds,
     * newest first, as a JSON list (py4j would walk the chain in three round trips a
     * snapshot and iterate each summary in three an entry). */
    public String ancestry(Table table) throws Exception {
        List summaries = new ArrayList();
        Snapshot snapshot = table.currentSnapshot();
        while (snapshot != null) {
            summaries.add(snapshot.summary());
            Long parent = snapshot.parentId();
            snapshot = parent == null ? null : table.snapshot(parent.longValue());
        }
        return json.writeValueAsString(summaries);
    }

    /** walberg's marks in the table's current history, as JSON [every value under {@code
     * lsnKey}, newest first; the newest value under {@code serverKey}, or null]: what a start
     * asks of every table (its ancestry as JSON, whole summaries, was most of a start's time at
     * 200 tables with a few dozen snapshots each). */
    public String marks(Table table, String lsnKey, String serverKey) throws Exception {
        return json.writeValueAsString(markList(table, lsnKey, serverKey));
    }

    private List markList(Table table, String lsnKey, String serverKey) {
        List lsns = new ArrayList();
        String server = null;
        Snapshot snapshot = table.currentSnapshot();
        while (snapshot != null) {
            Map summary = snapshot.summary();
            if (summary.get(lsnKey) != null) {
                lsns.add(summary.get(lsnKey));
            }
            if (server == null) {
                server = (String) summary.get(serverKey);
            }
            Long parent = snapshot.parentId();
            snapshot = parent == null ? null : table.snapshot(parent.longValue());
        }
        return Arrays.asList(new Object[] {lsns, server});
    }

    /** The table's current snapshot and each ancestor it still holds, oldest first, as a JSON
     * list of [snapshot id, the summary's value at {@code key}, at {@code fromKey}] (null where
     * the summary has none). */
    public String lineage(Table table, String key, String fromKey) throws Exception {
        List out = new ArrayList();
        Snapshot snapshot = table.currentSnapshot();
        while (snapshot != null) {
            List entry = new ArrayList();
            entry.add(Long.valueOf(snapshot.snapshotId()));
            entry.add(snapshot.summary().get(key));
            entry.add(snapshot.summary().get(fromKey));
            out.add(0, entry);
            Long parent = snapshot.parentId();
            snapshot = parent == null ? null : table.snapshot(parent.longValue());
        }
        return json.writeValueAsString(out);
    }

    /** The table's statistics files, as a JSON list of [snapshot id, path, [[blob type, its
     * properties], ...]]. */
    public String statistics(Table table) throws Exception {
        List out = new ArrayList();
        List files = table.statisticsFiles();
        for (int i = 0; i < files.size(); i++) {
            StatisticsFile file = (StatisticsFile) files.get(i);
            List blobs = new ArrayList();
            List metas = file.blobMetadata();
            for (int j = 0; j < metas.size(); j++) {
                BlobMetadata meta = (BlobMetadata) metas.get(j);
                List blob = new ArrayList();
                blob.add(meta.type());
                blob.add(meta.properties());
                blobs.add(blob);
            }
            List entry = new ArrayList();
            entry.add(Long.valueOf(file.snapshotId()));
            entry.add(file.path());
            entry.add(blobs);
            out.add(entry);
        }
        return json.writeValueAsString(out);
    }

    /** Register the Puffin file at {@code path} as the statistics file of {@code snapshot}, and
     * drop the registrations of the snapshots in {@code replaced} (a JSON list), in one metadata
     * commit. {@code blobs}: a JSON list of [type, sequence number, {properties}]. */
    public void setStatistics(Table table, long snapshot, String path, long size, long footer,
                              String blobs, String replaced) throws Exception {
        List metas = new ArrayList();
        List items = parse(blobs);
        for (int i = 0; i < items.size(); i++) {
            List item = (List) items.get(i);
            metas.add(new GenericBlobMetadata((String) item.get(0), snapshot,
                asLong(item.get(1)), new ArrayList(), (Map) item.get(2)));
        }
        UpdateStatistics update = table.updateStatistics();
        List old = parse(replaced);
        for (int i = 0; i < old.size(); i++) {
            long id = asLong(old.get(i));
            if (id != snapshot) {
                update = update.removeStatistics(id);
            }
        }
        update.setStatistics(new GenericStatisticsFile(snapshot, path, size, footer, metas))
            .commit();
    }

    /** The summary of the table's current snapshot, as a JSON object ({} without one). */
    public String summary(Table table) throws Exception {
        Snapshot snapshot = table.currentSnapshot();
        return json.writeValueAsString(snapshot == null ? new HashMap() : snapshot.summary());
    }

    /** The names of the table's columns, in order, as a JSON list. */
    public String columnNames(Table table) throws Exception {
        List names = new ArrayList();
        List columns = table.schema().columns();
        for (int i = 0; i < columns.size(); i++) {
            names.add(((Types.NestedField) columns.get(i)).name());
        }
        return json.writeValueAsString(names);
    }

    /** The values of {@code map} at {@code keys} (a JSON list of strings), in order. */
    public List pick(Map map, String keys) throws Exception {
        List items = parse(keys);
        List out = new ArrayList();
        for (int i = 0; i < items.size(); i++) {
            out.add(map.get(items.get(i)));
        }
        return out;
    }

    /** The row delta with {@code adds} added, {@code deletes} added and {@code removes}
     * (delete files it replaces) removed. */
    public RowDelta fill(RowDelta delta, List adds, List deletes, List removes) {
        for (int i = 0; i < adds.size(); i++) {
            delta = delta.addRows((DataFile) adds.get(i));
        }
        for (int i = 0; i < deletes.size(); i++) {
            delta = delta.addDeletes((DeleteFile) deletes.get(i));
        }
        for (int i = 0; i < removes.size(); i++) {
            delta = delta.removeDeletes((DeleteFile) removes.get(i));
        }
        return delta;
    }

    /** One table's row delta, in a transaction of its own: {@code adds}, {@code deletes} and
     * {@code removes} as {@code fill} puts them, validated as {@code params} (JSON) says, and
     * committed into the transaction (its validation runs here); the transaction is committed
     * to the catalog too if {@code alone}, else returned for a commit with other tables' (alone
     * and with nothing to expire: no transaction, the row delta commits itself; null).
     * {@code params}: "base" the snapshot the positions were read from (null: none),
     * "referenced" the data files the deletes point into (each must still be there),
     * "key" [a key column, the lowest and highest of its values the batch changes] (null: any
     * key) and "source" (null: none) the rows whose concurrent deletes or new files conflict,
     * "properties" the commit's summary marks, "expire" a staged snapshot that expires in the
     * same transaction (null: none). With no deletes and nothing to expire it is an append
     * (new rows alone). One call instead of two dozen round trips. */
    public Transaction rowDelta(Table table, List adds, List deletes, List removes,
                                String params, boolean alone) throws Exception {
        Map p = (Map) json.readValue(params, Map.class);
        // Alone and with nothing to expire, the row delta commits by itself: a transaction
        // would read back every manifest its commit listed, to tell which files to clean up
        // (BaseTransaction.committedFiles: a seventh of the JVM's time at 200 tables).
        boolean direct = alone && p.get("expire") == null;
        Transaction txn = direct ? null : table.newTransaction();
        if (deletes.isEmpty() && removes.isEmpty() && p.get("expire") == null) {
            // New rows alone (a batch of inserts): an append, as a reader that follows the
            // table's appends (a streaming read) expects of one. What a row delta validates
            // is about rows it deletes; another writer's commit since the index's snapshot
            // is still found after the commit (the index is then read again).
            AppendFiles append = (AppendFiles) (direct ? table.newAppend() : txn.newAppend())
                .scanManifestsWith(DIRECT);
            for (int i = 0; i < adds.size(); i++) {
                append = append.appendFile((DataFile) adds.get(i));
            }
            marked(append, (Map) p.get("properties")).commit();
            return txn;  // (null alone: it committed itself)
        }
        // Its manifests scanned and merged in this thread: through Iceberg's shared worker
        // pool each step waits for the pool, then for a poll that sleeps 10 ms at a time.
        RowDelta delta = (RowDelta) (direct ? table.newRowDelta() : txn.newRowDelta())
            .scanManifestsWith(DIRECT);
        if (p.get("base") != null) {
            delta = delta.validateFromSnapshot(asLong(p.get("base")));
        }
        delta = fill(delta, adds, deletes, removes);
        List referenced = (List) p.get("referenced");
        if (referenced != null && !referenced.isEmpty()) {
            delta = delta.validateDeletedFiles().validateDataFilesExist(referenced);
        }
        delta = delta.validateNoConflictingDeleteFiles().validateNoConflictingDataFiles();
        Expression conflicts = null;
        List key = (List) p.get("key");
        if (key != null) {
            String name = (String) key.get(0);
            conflicts = Expressions.and(Expressions.greaterThanOrEqual(name, key.get(1)),
                                        Expressions.lessThanOrEqual(name, key.get(2)));
        }
        if (p.get("source") != null) {
            Expression mine = Expressions.equal((String) p.get("source_column"), p.get("source"));
            conflicts = conflicts == null ? mine : Expressions.and(conflicts, mine);
        }
        if (conflicts != null) {
            delta = delta.conflictDetectionFilter(conflicts);
        }
        marked(delta, (Map) p.get("properties")).commit();
        if (txn == null) {
            return null;
        }
        if (p.get("expire") != null) {
            // expireOlderThan(0): nothing but the staged snapshot expires.
            txn.expireSnapshots().expireSnapshotId(asLong(p.get("expire"))).expireOlderThan(0)
                .cleanExpiredFiles(false).commit();
        }
        if (alone) {
            txn.commitTransaction();
        }
        return txn;
    }

    /** {@code update} with {@code marks} (summary property -> value) set on its snapshot. */
    private SnapshotUpdate marked(SnapshotUpdate update, Map marks) {
        for (Iterator it = marks.entrySet().iterator(); it.hasNext();) {
            Map.Entry mark = (Map.Entry) it.next();
            update = (SnapshotUpdate) update.set((String) mark.getKey(), (String) mark.getValue());
        }
        return update;
    }

    /** After a commit whose summary carries {@code marks} (JSON map): the table refreshed,
     * and as JSON "snapshot" the snapshot that commit made (the newest carrying them; a later
     * commit may be current already), else the current one; "parent" its parent (null: none,
     * or not found); "summary" its summary. */
    public String committed(Table table, String marks) throws Exception {
        table.refresh();
        Map wanted = (Map) json.readValue(marks, Map.class);
        Snapshot mine = null;
        Snapshot at = table.currentSnapshot();
        for (int i = 0; i < 100 && at != null && !wanted.isEmpty() && mine == null; i++) {
            Map summary = at.summary();
            boolean all = true;
            for (Iterator it = wanted.entrySet().iterator(); it.hasNext();) {
                Map.Entry mark = (Map.Entry) it.next();
                if (!String.valueOf(summary.get(mark.getKey())).equals(mark.getValue())) {
                    all = false;
                }
            }
            if (all) {
                mine = at;
            } else {
                Long parent = at.parentId();
                at = parent == null ? null : table.snapshot(parent.longValue());
            }
        }
        Snapshot found = mine != null ? mine : table.currentSnapshot();
        Map out = new HashMap();
        out.put("snapshot", found == null ? null : Long.valueOf(found.snapshotId()));
        out.put("parent", mine == null ? null : mine.parentId());
        out.put("summary", found == null ? new HashMap() : found.summary());
        return json.writeValueAsString(out);
    }

    /** The overwrite with {@code files} added. */
    public OverwriteFiles addFiles(OverwriteFiles overwrite, List files) {
        for (int i = 0; i < files.size(); i++) {
            overwrite = overwrite.addFile((DataFile) files.get(i));
        }
        return overwrite;
    }

    /** A Java list of the items of an Iterable or array (as Iceberg hands files out). */
    public List list(Object items) {
        if (items instanceof Object[]) {
            return new ArrayList(Arrays.asList((Object[]) items));
        }
        List out = new ArrayList();
        Iterator it = ((Iterable) items).iterator();
        while (it.hasNext()) {
            out.add(it.next());
        }
        return out;
    }

    /** Put each data file of {@code files} in {@code live}, under its location. */
    public void put(Map live, List files) {
        for (int i = 0; i < files.size(); i++) {
            ContentFile file = (ContentFile) files.get(i);
            live.put(file.location(), file);
        }
    }

    /** Put each deletion vector of {@code files} in {@code vectors}, under its data file. */
    public void putVectors(Map vectors, List files) {
        for (int i = 0; i < files.size(); i++) {
            DeleteFile file = (DeleteFile) files.get(i);
            if (file.referencedDataFile() != null) {
                vectors.put(file.referencedDataFile(), file);
            }
        }
    }

    /** What the driver needs of content files, as JSON: per file [location, spec id,
     * partition (as text, one for each partition), records, referenced data file, content
     * offset, content size, format]. */
    public String describe(List files) throws Exception {
        List out = new ArrayList();
        for (int i = 0; i < files.size(); i++) {
            out.add(row((ContentFile) files.get(i)));
        }
        return json.writeValueAsString(out);
    }

    private static List row(ContentFile file) {
        List row = new ArrayList();
        row.add(file.location());
        row.add(Integer.valueOf(file.specId()));
        row.add(partitionText(file.partition()));
        row.add(Long.valueOf(file.recordCount()));
        if (file instanceof DeleteFile) {
            DeleteFile delete = (DeleteFile) file;
            row.add(delete.referencedDataFile());
            row.add(delete.contentOffset());
            row.add(delete.contentSizeInBytes());
        } else {
            row.add(null);
            row.add(null);
            row.add(null);
        }
        row.add(file.format().toString());
        return row;
    }

    /** A partition's values as text that no other partition has: a JSON list of each value
     * by its type and text, or null (StructLike's own text writes a null and the string
     * "null" alike). */
    private static String partitionText(StructLike partition) {
        StringBuilder out = new StringBuilder("[");
        for (int i = 0; i < partition.size(); i++) {
            Object value = partition.get(i, Object.class);
            if (i > 0) {
                out.append(',');
            }
            if (value == null) {
                out.append("null");
                continue;
            }
            String text;
            if (value instanceof ByteBuffer) {
                ByteBuffer bytes = (ByteBuffer) ((ByteBuffer) value).duplicate();
                StringBuilder hex = new StringBuilder();
                while (bytes.hasRemaining()) {
                    hex.append(String.format("%02x", bytes.get() & 0xff));
                }
                text = hex.toString();
            } else {
                text = String.valueOf(value);
            }
            out.append('"').append(value.getClass().getSimpleName()).append(':')
                .append(text.replace("\\", "\\\\").replace("\"", "\\\"")).append('"');
        }
        return out.append(']').toString();
    }

    /** Every live data file {@code scan} plans, put in {@code live} under its location, and
     * with {@code vectors} its delete files in {@code deletes} (a data file's deletion vector;
     * [] of each file if there are none). As JSON: per data file, the row of {@code describe}
     * and the rows of its delete files. */
    public String plan(TableScan scan, Map live, boolean vectors, Map deletes) throws Exception {
        List out = new ArrayList();
        CloseableIterable tasks = scan.planFiles();
        try {
            Iterator it = tasks.iterator();
            while (it.hasNext()) {
                FileScanTask task = (FileScanTask) it.next();
                DataFile file = (DataFile) task.file();
                live.put(file.location(), file);
                List row = new ArrayList();
                row.add(row(file));
                List found = new ArrayList();
                if (vectors) {
                    List attached = task.deletes();
                    for (int i = 0; i < attached.size(); i++) {
                        DeleteFile delete = (DeleteFile) attached.get(i);
                        found.add(row(delete));
                        if (delete.format() == FileFormat.PUFFIN) {
                            deletes.put(file.location(), delete);
                        }
                    }
                }
                row.add(found);
                out.add(row);
            }
        } finally {
            tasks.close();
        }
        return json.writeValueAsString(out);
    }
}
