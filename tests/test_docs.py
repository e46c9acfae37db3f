"""The documentation: the configuration reference (docs/configuration.md) is generated from the
config models and must be current; every relative link in README.md and docs/*.md resolves; every
page in docs/ is linked from the README; every ```yaml example loads with walberg's config model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from walberg.config import parse_config
from walberg.ops import config_docs as docs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def test_the_config_reference_is_current() -> None:
    assert docs.main(["--check"]) == 0, "run: python -m walberg.ops.config_docs --write"


def test_every_config_key_has_a_description() -> None:
    missing = [row for row in docs.reference().splitlines()[2:] if row.endswith("|  |")]
    assert missing == []


def test_the_grafana_dashboard_shows_every_metric_and_only_real_ones() -> None:
    import json

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


# --- links -------------------------------------------------------------------------------------

def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where a [x](y) is no link."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to
    hyphens, -1, -2, ... on repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", page.read_text()), re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    prose = _prose(page.read_text())
    return (re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
            + re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", prose, re.M))


def _broken(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # https:, mailto:, ...
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(root)}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: {target.relative_to(root)} has no heading #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert _links(page) or page.name != "README.md"
    assert _broken(page) == []


def test_the_link_check_sees_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Write modes: mirror, or both\n")
    page.write_text("[a](other.md#write-modes-mirror-or-both) [b](gone.md) [c](other.md#nope)\n"
                    "`[d](code.md)` [e](https://example.com/x.md)\n```\n[f](fenced.md)\n```\n")
    assert [b.split(":")[0] for b in _broken(page, tmp_path)] == ["gone.md", "other.md#nope"]


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / link.partition("#")[0]).resolve() for link in _links(readme)}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


# --- yaml examples -----------------------------------------------------------------------------

def _yaml_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == "yaml":
                line = text.count("\n", 0, m.start()) + 1
                blocks.append((f"{page.relative_to(ROOT)}:{line}", m.group(2)))
    return blocks


BLOCKS = _yaml_blocks()


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _complete(block: dict[str, Any]) -> dict[str, Any]:
    """A fragment (only `maintenance:`, only `sink:`, ...) with the least source and sink around
    it; what the block sets wins."""
    sink = block.get("sink") if isinstance(block.get("sink"), dict) else {}
    base: dict[str, Any] = {"sink": {"catalog": {"warehouse": "./warehouse"}}}
    if "source" not in block and "sources" not in block:
        tables = list(sink.get("tables", {})) or ["public.employee"]
        base["source"] = {"postgres": {"dsn": "postgresql://walberg@db/app", "tables": tables}}
    return _merge(base, block)


def test_the_docs_have_yaml_examples() -> None:
    assert len(BLOCKS) >= 8, [where for where, _ in BLOCKS]


@pytest.mark.parametrize("where, text", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_every_yaml_example_loads(where: str, text: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in re.findall(r"\$\{(\w+)\}", text):
        monkeypatch.setenv(name, "example")
    block = yaml.safe_load(text)
    assert isinstance(block, dict), f"{where}: not a YAML mapping"
    config = parse_config(_complete(block), tmp_path, where)
    # What the example sets is what walberg holds (spot check: every top-level section).
    dumped = config.model_dump()
    for section in block:
        assert section in dumped, f"{where}: {section} not in the config model"
