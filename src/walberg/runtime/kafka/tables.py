"""A Kafka topic's table as walberg stages it: its columns and key, settled by the first record
of a run (from the pipeline file, the existing Iceberg table, the record's schema, else its
values), widened by the schemas of later records; and the Iceberg table (and the changelog
beside it) created, or evolved, to take the staged columns."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from walberg.apply import evolution
from walberg.apply.batch import BatchBuilder, StagedTable
from walberg.apply.iceberg import IcebergSink
from walberg.apply.types import TypeMap, pg_type_for
from walberg.config import Config, KafkaTopic
from walberg.errors import ConfigError
from walberg.model import Column, Layout
from walberg.runtime.applier import Batch
from walberg.source import debezium as dbz
from walberg.source.debezium_columns import Columns, is_envelope, split_envelope

log = logging.getLogger("walberg")

# A topic's table's key columns (a JSON list), for a run whose first record names none: a
# Debezium truncate has no message key.
KEY_PROPERTY = "walberg.key"
_SCHEMAS = 64  # schema texts remembered per table, at most


@dataclass
class Shape:
    """A topic's table as walberg stages it: columns (with keys) and their value types."""

    columns: tuple[Column, ...]
    types: tuple[dbz.FieldType, ...]
    images: dbz.Images = field(init=False)  # (records without a schema of their own)

    decoder: Columns = field(init=False)  # the same, a run of records at a time
    # Records with a schema of their own: a decoder per schema text seen (and checked).
    schemas: dict[bytes, Columns] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.images = dbz.Images(self.columns, self.types)
        self.decoder = Columns(self.images)


class NewColumns(Exception):
    """A record adds columns to a table the batch has rows of: the batch ends before it."""


class TopicTables:
    """The tables of a Kafka pipeline's topics: their columns learned from the records, and
    their Iceberg tables kept able to take them."""

    def __init__(self, config: Config, types: TypeMap, names: dict[str, str],
                 targets: dict[str, str], sink: Callable[[], IcebergSink]) -> None:
        assert config.source.kafka is not None
        self.config = config
        self.kafka = config.source.kafka
        self.types = types
        self.names = names  # topic -> table name
        self.targets = targets  # topic -> Iceberg table
        self._sink = sink
        self.shapes: dict[str, Shape] = {}  # topic -> its table's shape, once settled

    @property
    def sink(self) -> IcebergSink:
        return self._sink()

    def topic_of(self, name: str) -> str:
        return next(t for t, n in self.names.items() if n == name)

    @staticmethod
    def learn(shape: Shape, value: bytes, images: dbz.Images) -> None:
        """Remember a schema text whose record was staged, so that later records carrying the
        same text (byte for byte) are decoded in columns with the same types."""
        parts = split_envelope(value)
        if parts is None or parts[0] in shape.schemas or len(shape.schemas) >= _SCHEMAS:
            return
        if is_envelope(parts):
            shape.schemas[parts[0]] = Columns(images)

    def widened(self, topic: str, shape: Shape, fields: tuple[tuple[str, dbz.FieldType], ...],
                builder: BatchBuilder) -> Shape:
        """Schema evolution a record's schema asks for: fields the table lacks become new
        (nullable) columns at its end, and a field whose type Iceberg can widen the column to
        in place (int32 to int64, float32 to float64, a decimal of more digits at the same
        scale: what Debezium sends after the source column's type was widened) widens it;
        unless the pipeline file gives the columns or ``sink.schema_evolution`` is strict (or,
        for a widening, add_columns).
        Raises NewColumns when this batch already has rows of the table with the old
        columns."""
        target = self.targets[topic]
        names = {c.name: i for i, c in enumerate(shape.columns)}
        new = [(n, t) for n, t in fields if n not in names]
        wider: dict[int, dbz.FieldType] = {}
        for n, t in fields:
            if n in names:
                col = shape.columns[names[n]]
                mine = self._spark_type(Column(n, t.oid, t.modifier), target)
                theirs = self._spark_type(col, target)
                if mine != theirs and evolution.widens(theirs, mine):
                    wider[names[n]] = t
        chosen = self.kafka.tables.get(topic)
        table = self.names[topic]
        mode = self.config.layout_for(table).schema_evolution
        if mode != "full":
            wider = {}  # (add_columns: additions only)
        if not (new or wider) or (chosen is not None and chosen.columns) or mode == "strict":
            return shape  # (a field the table lacks, or of another type, is then a dead letter)
        if builder.columns_of(table) is not None:
            raise NewColumns(topic)
        kept = tuple(Column(c.name, wider[i].oid, wider[i].modifier, c.is_key) if i in wider
                     else c for i, c in enumerate(shape.columns))
        columns = kept + tuple(Column(n, t.oid, t.modifier, False) for n, t in new)
        for c in columns:
            self.types.spark_type(c, target)
        types = tuple(wider.get(i, t) for i, t in enumerate(shape.types))
        widened = self.shapes[topic] = Shape(columns, types + tuple(t for _, t in new))
        log.info("%s: the records' schema %s; %s follows", topic, "; ".join(
            [f"adds {n}" for n, _ in new] +
            [f"widens {shape.columns[i].name} to {self._spark_type(kept[i], target)}"
             for i in sorted(wider)]), target)
        return widened

    def _spark_type(self, col: Column, target: str) -> str:
        return str(self.types.spark_type(col, target).describe())

    def same_type(self, t: dbz.FieldType, col: Column, target: str) -> bool:
        """Whether a record's field lands in ``col`` as it is: the same Iceberg type, or a
        narrower one the column was widened from (records written before the widening)."""
        mine = self._spark_type(Column(col.name, t.oid, t.modifier), target)
        theirs = self._spark_type(col, target)
        return mine == theirs or evolution.widens(mine, theirs)

    def _fields(self, topic: str, event: dbz.Event) -> list[tuple[str, dbz.FieldType]]:
        """The table's columns: from the pipeline file, else the existing Iceberg table, else
        the record's schema, else its JSON values."""
        chosen = self.kafka.tables.get(topic) or KafkaTopic.model_validate({})
        target = self.targets[topic]
        if chosen.columns:
            try:
                return [(n, dbz.type_from_name(t)) for n, t in chosen.columns.items()]
            except ValueError as exc:
                raise ConfigError(f"source.kafka.tables.{topic}.columns: {exc}") from None
        if self.sink.table_exists(target):
            return [(n, dbz.FieldType(*pg_type_for(t, f"{target}.{n}")))
                    for n, t in self.sink.schema(target)]
        if event.fields is not None:
            return list(event.fields)
        image = event.after if event.after is not None else event.before
        if image is None:
            raise dbz.BadRecord("no columns to learn the table from: the table does not "
                                "exist yet and this first record has no row and no schema")
        return [(n, dbz.infer_type(v)) for n, v in image.items()]

    def shape(self, topic: str, event: dbz.Event, key: Optional[Mapping[str, Any]]) -> Shape:
        """The table's columns and key, settled by the first record of a run."""
        shape = self.shapes.get(topic)
        if shape is not None:
            return shape
        chosen = self.kafka.tables.get(topic) or KafkaTopic.model_validate({})
        target = self.targets[topic]
        where = f"source.kafka.tables.{topic}"
        fields = self._fields(topic, event)
        names = [n for n, _ in fields]
        keys = list(chosen.key)
        if keys:
            missing = [k for k in keys if k not in names]
            if missing:
                raise ConfigError(f"{where}.key names {', '.join(missing)}, which the table "
                                  f"{target} does not have ({', '.join(names)})")
        elif key:
            keys = [k for k in key if k in names]
            if len(keys) != len(key):
                raise dbz.BadRecord(f"missing key: the message key's fields {', '.join(key)} "
                                    f"are not all columns of {target}")
        elif self.sink.table_exists(target):
            keys = [k for k in self._recorded_key(target) if k in names]
        if not keys:
            raise dbz.BadRecord(f"missing key: the record has no message key and {where}.key "
                                "is not set")
        columns = tuple(Column(n, t.oid, t.modifier, n in keys) for n, t in fields)
        for c in columns:
            self.types.spark_type(c, target)
        shape = self.shapes[topic] = Shape(columns, tuple(t for _, t in fields))
        log.info("%s -> %s: columns %s, key %s", topic, target,
                 ", ".join(f"{c.name} {self.types.spark_type(c, target).describe()}"
                           for c in columns), ", ".join(keys))
        return shape

    def follow(self, table: str, staged: StagedTable, batch: Batch) -> None:
        """The topic's table (and in mode both its changelog) exists and takes the staged
        columns."""
        topic = self.topic_of(table)
        layout = self.config.layout_for(table)
        if layout.mode == "append":
            self._follow(topic, self.targets[topic], staged, self.sink.ensure_changelog)
            return
        if layout.mode == "both":
            self._follow(topic, self.config.changelog_for_topic(topic), staged,
                         self.sink.ensure_changelog)
        self._follow(topic, self.targets[topic], staged, self.sink.ensure_table)

    def _recorded_key(self, target: str) -> list[str]:
        value = self.sink.properties(target, KEY_PROPERTY).get(KEY_PROPERTY)
        try:
            return [str(k) for k in json.loads(value)] if value else []
        except (ValueError, TypeError):
            return []  # (not walberg's)

    def _follow(self, topic: str, target: str, staged: StagedTable,
                ensure: Callable[[str, tuple[Column, ...], Layout], bool]) -> None:
        keys = [c.name for c in staged.columns if c.is_key]
        layout = self.config.layout_for(self.names[topic])
        made = dataclasses.replace(layout, properties={**layout.properties,
                                                       KEY_PROPERTY: json.dumps(keys)})
        if ensure(target, staged.columns, made):
            log.info("created %s", target)
        elif not self.sink.columns_match(target, staged.columns):
            current = self.sink.schema(target)
            wanted = [(c.name, self.types.spark_type(c, target).describe())
                      for c in staged.columns]
            try:
                steps = evolution.plan(current, wanted)
            except evolution.NotEvolvable:
                steps = []
            if not steps or any(s.kind not in ("add", "widen") for s in steps):
                raise ConfigError(f"{target} has columns {current}, not those walberg staged "
                                  f"for topic {topic}; give the table's columns in "
                                  f"source.kafka.tables.{topic}.columns")
            after = {n: (wanted[i - 1][0] if i else "") for i, (n, _) in enumerate(wanted)}
            self.sink.evolve(target, steps, after)
            log.info("evolved the schema of %s to follow topic %s: %s", target, topic,
                     "; ".join(s.describe() for s in steps))
        if keys and self._recorded_key(target) != keys:  # (a table made before it was kept)
            self.sink.set_property(target, KEY_PROPERTY, json.dumps(keys))
