"""The YAML configuration: defaults, ${ENV} interpolation, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from walberg.config import load_config, parse_config
from walberg.errors import ConfigError

MINIMAL = """
source:
  postgres:
    dsn: postgresql://app:${WB_TEST_PASSWORD}@127.0.0.1:5432/app
    tables: [employee, sales.orders]
sink:
  catalog: {name: lake, type: hadoop, warehouse: ./warehouse}
"""


def test_minimal_config_with_env_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WB_TEST_PASSWORD", "s3cret")
    path = tmp_path / "pipeline.yaml"
    path.write_text(MINIMAL)
    cfg = load_config(path)
    assert cfg.source.postgres.dsn == "postgresql://app:s3cret@127.0.0.1:5432/app"
    assert cfg.source.postgres.tables == ["public.employee", "sales.orders"]
    assert cfg.source.postgres.slot == "walberg"
    assert cfg.buffer.max_segment_bytes == 16 * 1024 * 1024
    assert cfg.warehouse == str(tmp_path / "warehouse")
    assert cfg.segment_dir == tmp_path / "segments"
    assert cfg.target_for("public.employee") == "lake.public.employee"
    assert cfg.target_for("sales.orders") == "lake.sales.orders"


def test_missing_env_variable_names_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WB_TEST_PASSWORD", raising=False)
    path = tmp_path / "p.yaml"
    path.write_text(MINIMAL)
    with pytest.raises(ConfigError, match=r"source\.postgres\.dsn: the environment variable "
                                          r"WB_TEST_PASSWORD is not set"):
        load_config(path)


@pytest.mark.parametrize("patch, message", [
    ({"buffer": {"max_segment_bytes": "lots"}}, r"buffer\.max_segment_bytes"),
    ({"buffer": {"dirr": "x"}}, r"buffer\.dirr: unknown key"),
    ({"sink": {"catalog": {"name": "lake"}}}, r"sink\.catalog: .*catalog type hadoop needs a warehouse"),
    ({"sink": {"catalog": {"warehouse": "w", "type": "unity"}}}, r"sink\.catalog\.type"),
    ({"sink": {"catalog": {"warehouse": "w", "type": "nessie"}}}, r"catalog type nessie needs a uri"),
    ({"source": {"postgres": {"dsn": "x", "tables": []}}}, r"source\.postgres\.tables"),
    ({"source": {"postgres": {"dsn": "x", "tables": ["a.b.c"]}}}, r"not of the form schema\.table"),
])
def test_invalid_values_are_reported_by_path(patch: dict[str, object], message: str) -> None:
    base = {"source": {"postgres": {"dsn": "postgresql://x/y", "tables": ["t"]}},
            "sink": {"catalog": {"warehouse": "w"}}}
    base.update(patch)
    with pytest.raises(ConfigError, match=message):
        parse_config(base, Path("."))


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read the configuration file"):
        load_config(tmp_path / "nope.yaml")


PARTITIONED = """
source: {postgres: {dsn: "postgresql://x@h/db", tables: [public.orders]}}
sink:
  catalog: {warehouse: ./warehouse}
  tables:
    public.orders:
      partition_by: %s
"""


@pytest.mark.parametrize("written", [
    '[days(created_at), "bucket(16, customer_id)", "truncate(4, name)"]',
    "\n        - days(created_at)\n        - bucket(16, customer_id)\n        - truncate(4, name)",
])
def test_a_partition_transform_with_a_comma_loads_quoted_or_one_a_line(
        tmp_path: Path, written: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(PARTITIONED % written)
    assert load_config(path).layout_for("public.orders").partition_by == (
        "days(created_at)", "bucket(16, customer_id)", "truncate(4, name)")


@pytest.mark.parametrize("written, split", [
    ("[days(created_at), bucket(16, customer_id)]", "bucket(16, customer_id)"),
    ("[truncate( 4 ,name), region]", "truncate( 4, name)"),
])
def test_a_transform_yaml_split_at_its_comma_is_named_with_the_fix(
        tmp_path: Path, written: str, split: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(PARTITIONED % written)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert f"sink.tables.public.orders.partition_by: Value error, YAML split {split!r} at its " \
           "comma" in message
    assert f'quote it ("{split}")' in message and f"(- {split})" in message


yaml_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                      st.text(max_size=20))
yaml_tree = st.recursive(
    yaml_leaf,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(
                                   ["source", "sink", "buffer", "spark", "postgres", "dsn",
                                    "tables", "catalog", "warehouse", "slot", "name", "x"]),
                                   children, max_size=4)),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(yaml_tree)
def test_any_yaml_gives_a_config_or_a_config_error(tree: object) -> None:
    """Fuzzing the loader: whatever the YAML holds, the answer is a Config or a ConfigError."""
    try:
        parse_config(tree, Path("."))
    except ConfigError as exc:
        assert str(exc)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_file_gives_a_config_or_a_config_error(tmp_path_factory: pytest.TempPathFactory,
                                                        text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "pipeline.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(exc)
