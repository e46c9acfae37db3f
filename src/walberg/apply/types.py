"""Postgres column types -> Iceberg (Spark SQL) types, and the expression that turns Postgres's
text representation of a value into the typed value.

This is the one type path: the initial copy and the stream both hand over Postgres text
(rendered with the same session settings), and both are converted here, inside Spark.
"""

from __future__ import annotations

from dataclasses import dataclass

from walberg.model import Column

# Postgres type OIDs (pg_type.oid, stable across versions).
BOOL, BYTEA, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 19, 20, 21, 23, 25, 26
JSON, FLOAT4, FLOAT8, BPCHAR, VARCHAR, DATE, TIME = 114, 700, 701, 1042, 1043, 1082, 1083
TIMESTAMP, TIMESTAMPTZ, NUMERIC, UUID, JSONB = 1114, 1184, 1700, 2950, 3802

# Unconstrained NUMERIC has no declared precision; this is where it lands.
DEFAULT_DECIMAL = (38, 18)


@dataclass(frozen=True)
class SparkType:
    sql: str  # the Spark SQL type for CREATE TABLE
    convert: str  # expression template over the text column, `{}` stands for the column


def quote(name: str) -> str:
    """Quote one Spark SQL identifier. Every name that reaches Spark SQL goes through here."""
    return "`" + name.replace("`", "``") + "`"


def numeric_precision(type_modifier: int) -> tuple[int, int] | None:
    if type_modifier < 4:
        return None
    mod = type_modifier - 4
    return (mod >> 16) & 0xFFFF, mod & 0xFFFF


def spark_type(col: Column) -> SparkType:
    oid = col.type_oid
    if oid == BOOL:
        return SparkType("BOOLEAN", "CAST({} AS BOOLEAN)")
    if oid == INT2 or oid == INT4:
        return SparkType("INT", "CAST({} AS INT)")
    if oid == INT8 or oid == OID:
        return SparkType("BIGINT", "CAST({} AS BIGINT)")
    if oid == FLOAT4:
        return SparkType("FLOAT", "CAST({} AS FLOAT)")
    if oid == FLOAT8:
        return SparkType("DOUBLE", "CAST({} AS DOUBLE)")
    if oid == NUMERIC:
        ps = numeric_precision(col.type_modifier)
        if ps is None or ps[0] > 38:
            ps = DEFAULT_DECIMAL
        t = f"DECIMAL({ps[0]},{ps[1]})"
        return SparkType(t, f"CAST({{}} AS {t})")
    if oid == DATE:
        return SparkType("DATE", "CAST({} AS DATE)")
    if oid == TIMESTAMP:
        return SparkType("TIMESTAMP_NTZ", "CAST({} AS TIMESTAMP_NTZ)")
    if oid == TIMESTAMPTZ:
        return SparkType("TIMESTAMP", "CAST({} AS TIMESTAMP)")
    if oid == BYTEA:
        # bytea_output=hex renders '\x0a0b...'
        return SparkType("BINARY", "unhex(substring({}, 3))")
    # text, varchar, char, name, uuid, json/jsonb and every other type keep their exact
    # Postgres text representation: lossless, and readable by every engine.
    return SparkType("STRING", "{}")
