"""`walberg check`: everything a pipeline needs, checked without changing anything, one result
per item: the source (Postgres: server, role, tables, publication, slot; Kafka: broker,
topics), then this machine and the lake (segment space, Java, the Iceberg
jar, catalog and warehouse). Each item is one function; the lists below say which run."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from walberg.apply import staging
from walberg.apply.catalog import catalogs, storage
from walberg.apply.catalog.catalog_reads import describe_rest
from walberg.apply.jvm.java import JAR_PACKAGE, check_java, find_java, iceberg_jar
from walberg.errors import Terminal, WalbergError
from walberg.lake.services import Lake, LakeSource
from walberg.runtime.lakeside import check_catalog
from walberg.runtime.parking import parked_why
from walberg.source import kafka, slots
from walberg.source import postgres as pg


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str


@dataclass
class SourceChecks:
    source: Optional[str]  # its name among several sources
    results: list[CheckResult]


@dataclass
class Probe:
    """What the items of one source share: the lake, the source, and what earlier items
    opened (a Postgres connection, a Kafka consumer)."""

    lake: Lake
    source: LakeSource
    conn: Any = None
    consumer: Optional[kafka.Consumer] = None
    opened: list[Any] = field(default_factory=list)


Item = tuple[str, Callable[[Probe], str]]


def check(lake: Lake) -> list[SourceChecks]:
    """The checks of every source of the pipeline."""
    return [SourceChecks(source.name, _check_source(lake, source)) for source in lake.sources]


def _check_source(lake: Lake, source: LakeSource) -> list[CheckResult]:
    probe = Probe(lake, source)
    try:
        if source.kind == "postgres":
            results = _run(POSTGRES_REACH, probe)
            if results[-1].ok:
                results += _run(POSTGRES_ITEMS, probe)
        else:
            results = _run(KAFKA_REACH, probe)
            if results[-1].ok:
                results += _run(_topic_items(source), probe)
    finally:
        for thing in probe.opened:
            thing.close()
    return results + _run(MACHINE_ITEMS, probe)


def _run(items: list[Item], probe: Probe) -> list[CheckResult]:
    out = []
    for name, fn in items:
        try:
            out.append(CheckResult(name, True, fn(probe)))
        except WalbergError as exc:
            out.append(CheckResult(name, False, str(exc)))
        except Exception as exc:  # a check must report, never crash the command
            out.append(CheckResult(name, False, f"{type(exc).__name__}: {exc}"))
    return out


# ---- Postgres ------------------------------------------------------------------------------


def postgres_reachable(p: Probe) -> str:
    dsn = p.source.postgres.dsn
    p.conn = pg.connect(dsn)
    p.opened.append(p.conn)
    with p.conn.cursor() as cur:
        cur.execute("SHOW server_version")
        return f"PostgreSQL {cur.fetchone()[0]} at {pg.redact(dsn)}"


def wal_level(p: Probe) -> str:
    pg.check_wal_level(p.conn)
    return "wal_level = logical"


def replication_role(p: Probe) -> str:
    name, ok = pg.role_can_replicate(p.conn)
    if not ok:
        raise Terminal(f"role {name} may not replicate: ALTER ROLE \"{name}\" REPLICATION;")
    denied = [t for t in p.source.targets if not pg.can_select(p.conn, t)]
    if denied:
        raise Terminal(f"role {name} cannot SELECT {', '.join(denied)}: GRANT SELECT "
                       f"ON {', '.join(pg.quote_table(t) for t in denied)} TO \"{name}\";")
    return f"role {name} has REPLICATION and SELECT on the tables"


def tables(p: Probe) -> str:
    publications = p.source.postgres.publications
    infos = pg.describe_tables(p.conn, list(p.source.targets), publications)
    for info in infos.values():
        pg.require_key(info)
    p.lake.learn_types(p.source, p.conn, infos)
    # What lands of each table: the publication's row filter and column list; and what does
    # not: the rows of inheritance children, tables of their own.
    lines = [i.describe_publishing() for i in infos.values()]
    for table in infos:
        children = [c for c in pg.inheritance_children(p.conn, table) if c not in infos]
        if children:
            lines.append(
                f"{table} has inheritance children ({', '.join(children)}): their rows are not "
                f"in {table}'s lake table (PostgreSQL publishes and its subscriber copies each "
                "child as a table of its own); to mirror them, add them to "
                "source.postgres.tables")
    return (f"{len(infos)} table(s) exist with a usable replica identity and column types "
            "walberg maps; what lands of each:\n" +
            "\n".join(f"         {line}" for line in lines))


def publication(p: Probe) -> str:
    name = p.source.postgres.publication
    missing = pg.publication_missing(p.conn, name, list(p.source.targets))
    if missing is None:
        return f"publication {name} missing: walberg will create it"
    if missing:
        raise Terminal(pg.missing_tables_message(name, missing))
    return f"publication {name} covers the tables"


def replication_slot(p: Probe) -> str:
    slot = p.source.postgres.slot
    state = slots.slot_state(p.conn, slot)
    if state is None:
        return f"slot {slot} missing: walberg will create it"
    used = f", in use by server pid {state.active_pid}" if state.active_pid else ""
    room = ("" if state.safe_wal_size is None
            else f", {state.safe_wal_size / 2**20:.0f} MiB of WAL before the server drops it")
    return f"slot {slot} at {state.confirmed_flush} (wal_status {state.wal_status}{room}){used}"


def failover(p: Probe) -> str:
    """Whether a failover to a standby would keep the slot (reported, not required: a server
    before PostgreSQL 17, or one without standbys, is fine as it is)."""
    src = p.source.postgres
    if not slots.supports_failover_slots(p.conn):
        return (f"PostgreSQL {pg.server_version(p.conn) // 10000} has no failover slots (17+): "
                "a promoted standby would not have the slot, and `walberg resync` would copy "
                "the tables again")
    if src.failover_slot is False:
        return ("source.postgres.failover_slot is false: a promoted standby will not have the "
                "slot; set it to true (or remove it) to keep the slot through a failover")
    good, missing = slots.failover_readiness(p.conn, src.dsn, src.slot)
    if missing:
        raise Terminal("a failover would lose the slot:\n" +
                       "\n".join(f"         {line}" for line in missing))
    return "; ".join(good)


def parked_tables(p: Probe) -> str:
    """No table is parked (see runtime.parking): read from the tables' metadata."""
    parked = {}
    for table, target in p.source.targets.items():
        try:
            summary = p.source.table_summary(target)
        except Exception:  # (a catalog that cannot be read: the catalog item says so)
            continue
        why = parked_why(summary.properties, p.source.tag) if summary is not None else None
        if why:
            parked[table] = why
    if parked:
        raise Terminal(f"{len(parked)} table(s) parked, their changes held for them while "
                       "the other tables go on: " + " ".join(
                           f"[{t}] {why}" for t, why in sorted(parked.items())))
    return "no table is parked"


POSTGRES_REACH: list[Item] = [("postgres reachable", postgres_reachable)]
POSTGRES_ITEMS: list[Item] = [
    ("wal_level", wal_level),
    ("replication role", replication_role),
    ("tables", tables),
    ("publication", publication),
    ("replication slot", replication_slot),
    ("failover", failover),
    ("parked tables", parked_tables),
]


# ---- Kafka ---------------------------------------------------------------------------------


def broker(p: Probe) -> str:
    settings = p.source.config.source.kafka
    assert settings is not None
    p.consumer = kafka.Consumer(settings.bootstrap_servers, settings.group_id,
                                settings.properties)
    p.opened.append(p.consumer)
    p.consumer.partitions([])  # lists the cluster's topics: the broker answers
    return f"reached {settings.bootstrap_servers}"


def _topic_items(source: LakeSource) -> list[Item]:
    def one(topic: str, target: str) -> Callable[[Probe], str]:
        def item(p: Probe) -> str:
            assert p.consumer is not None
            return f"{len(p.consumer.partitions([topic]))} partition(s) -> {target}"
        return item

    return [(f"topic {topic}", one(topic, source.targets[table]))
            for table, topic in source.topics.items()]


KAFKA_REACH: list[Item] = [("broker", broker)]


# ---- this machine and the lake -------------------------------------------------------------


def segment_space(p: Probe) -> str:
    config = p.source.config
    directory = config.segment_dir
    probe = directory if directory.exists() else next(
        d for d in directory.parents if d.exists())
    free = shutil.disk_usage(probe).free
    need = 4 * config.buffer.max_segment_bytes
    if free < need:
        raise Terminal(f"only {free >> 20} MiB free under {probe}; walberg wants at "
                       f"least {need >> 20} MiB (4 segments) for buffer.dir")
    return f"{free >> 30} GiB free for segments under {probe}"


def java(p: Probe) -> str:
    path = find_java()
    check_java(path)
    return f"Java at {path}"


def jar(p: Probe) -> str:
    """Each jar walberg puts on Spark's class path, and where it comes from."""
    config = p.source.config
    jars = [f"Iceberg runtime {iceberg_jar()} (from PyPI package {JAR_PACKAGE}), intact"]
    jdbc_copy = p.source.kind == "postgres" and p.source.postgres.initial_copy.method == "jdbc"
    if config.sink.catalog.type == "jdbc" or jdbc_copy:
        jars.append(catalogs.describe_jdbc_driver())
    return "; ".join(jars)


def catalog_and_warehouse(p: Probe) -> str:
    config = p.source.config
    wh = config.warehouse
    cat = config.sink.catalog
    _, jars = catalogs.spark_properties(cat.type, wh, cat.uri, cat.options(), cat.properties,
                                        config.spark.conf.get("spark.jars", ""))
    reached = _catalog_database(p) + _rest_catalog(p)
    if not wh or ("://" in wh and not wh.startswith("file:")):
        s3 = config.storage.s3
        store = storage.probe_for(None if s3 is None else s3.model_dump(), wh or "")
        if store is not None:  # the question `run` asks first (see lakeside.check_storage)
            problem = store.check(config.storage.timeout_seconds)
            if problem is not None:
                raise Terminal(store.describe(problem, config.storage.timeout_seconds))
            return (f"{cat.type} catalog {cat.name}: warehouse {wh} on S3 at {store.endpoint} "
                    f"answers and takes the credentials{reached}")
        return (f"{cat.type} catalog {cat.name}: {wh or 'warehouse from the catalog'} "
                f"not checked (remote){reached}")
    root = Path(wh.removeprefix("file:"))
    existing = root
    while not existing.is_dir() and existing != existing.parent:
        existing = existing.parent  # check creates nothing: probe what exists
    with tempfile.NamedTemporaryFile(dir=existing, prefix=".walberg-check-"):
        pass
    state = "is writable" if existing == root else f"will be created under {existing}"
    return (f"{cat.type} catalog {cat.name}: warehouse {root} {state}"
            + (f"; driver {jars[0]}" if jars else "") + reached)


def executor_staging(p: Probe) -> str:
    """How staged batches and copies reach Spark's executors (see apply.staging)."""
    config = p.source.config
    master, configured = config.spark.master, config.buffer.stage_uri
    area = staging.stage_uri(master, configured, config.warehouse)
    where = "buffer.stage_uri" if configured else "under the warehouse, the default on a cluster"
    if area is not None:
        return (f"the driver uploads each staged batch and copy to {area}/ ({where}); "
                "executors read them there, and they are removed after each commit")
    if staging.is_local_master(master):
        return f"local mode: executors read staged batches from {config.segment_dir}"
    if configured == staging.LOCAL:
        return (f"executors of {master} read staged batches from {config.segment_dir} "
                "(buffer.stage_uri: local): every executor must mount it at that path")
    raise Terminal(
        f"spark.master {master} runs executors on other machines, and they would read each "
        f"staged batch from buffer.dir ({config.segment_dir}) on this machine, which they "
        "cannot see unless it is mounted at that path on every executor; the warehouse "
        f"({config.warehouse or 'set by the catalog'}) is no object storage or HDFS to stage "
        "through. Set buffer.stage_uri to a location every executor reads (s3a://bucket/"
        "walberg-staging, gs://..., abfs://..., hdfs://...), or to local if buffer.dir is "
        "such a shared mount.")


def _rest_catalog(p: Probe) -> str:
    """A REST catalog: it takes walberg's credential (and namespace), and whether it commits
    several tables at once."""
    config = p.source.config
    cat = config.sink.catalog
    if cat.type != "rest" or not cat.uri:
        return ""
    endpoints = check_catalog(config)
    return (f"; rest catalog {cat.name} at {cat.uri}: authenticated, "
            f"{describe_rest(endpoints, config.sink.atomic_commits)}")


def _catalog_database(p: Probe) -> str:
    """A jdbc catalog in Postgres: its database answers (the check walberg's Spark will pass)."""
    cat = p.source.config.sink.catalog
    if cat.type != "jdbc" or not (cat.uri or "").startswith("jdbc:postgresql://"):
        return ""
    dsn = "postgresql://" + (cat.uri or "").removeprefix("jdbc:postgresql://")
    params = {k: v for k, v in (("user", cat.user), ("password", cat.password)) if v}
    probe = pg.connect(dsn + ("&" if "?" in dsn else "?") + "&".join(
        f"{k}={v}" for k, v in params.items()) if params else dsn)
    probe.close()
    return f"; catalog database {pg.redact(dsn)} reachable"


MACHINE_ITEMS: list[Item] = [
    ("segment space", segment_space),
    ("java", java),
    ("iceberg jar", jar),
    ("catalog and warehouse", catalog_and_warehouse),
    ("staging for executors", executor_staging),
]
