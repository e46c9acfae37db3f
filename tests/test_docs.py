"""The README's configuration reference is generated from the config models; it must be current."""

from __future__ import annotations

from walberg import docs


def test_the_readme_config_reference_is_current() -> None:
    assert docs.main(["--check"]) == 0, "run: python -m walberg.docs --write"


def test_every_config_key_has_a_description() -> None:
    missing = [row for row in docs.reference().splitlines()[2:] if row.endswith("|  |")]
    assert missing == []


def test_the_grafana_dashboard_shows_every_metric_and_only_real_ones() -> None:
    import json
    import re
    from pathlib import Path

    from prometheus_client import REGISTRY

    import walberg.metrics  # noqa: F401  (registers the metrics)

    dashboard = json.loads((Path(__file__).parent.parent / "grafana" / "walberg.json").read_text())
    used = {m for p in dashboard["panels"] for t in p["targets"]
            for m in re.findall(r"walberg_[a-z_]+", t["expr"])}
    families = [m for m in REGISTRY.collect() if m.name.startswith("walberg_")]
    ours = {m.name for m in families}
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    exposed = {m.name + s for m in families for s in suffixes[m.type]}
    assert used <= exposed, used - exposed
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in used}
    assert ours <= shown, f"not on the dashboard: {ours - shown}"
