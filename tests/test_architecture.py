"""The layout walberg keeps, pinned by reading its source with ``ast`` (no module is imported):

- the stages source/, buffer/ and apply/ never import each other, nor any walberg module outside
  themselves but the shared plain modules (``SHARED``), which import only each other;
- each third-party driver is imported in its own stage only (``DRIVERS``);
- no import cycle among walberg's modules.

An import counts wherever it is written: at module level, inside a function, and under
``if TYPE_CHECKING:`` (a stage that names another stage's types knows that stage). One
exception, for cycles only: an import under ``TYPE_CHECKING`` never runs, so a cycle that needs
one is harmless and not reported. Importing ``walberg.a.b`` also runs the packages' ``__init__``
modules; those implicit imports are not edges (walberg's ``__init__`` imports lazily).

Every failure names the importing module, the file and line, and the import as written.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "walberg"

STAGES = ("walberg.source", "walberg.buffer", "walberg.apply")
# The plain modules every stage may use: data, errors, settings, metrics, progress reporting and
# crash points, none of which knows a stage. Today the stages import walberg.errors and
# walberg.model only; the others are leaves of the same kind (each imports only shared modules,
# see test_shared_modules_import_only_each_other), so a stage may use them as well.
SHARED = frozenset({"walberg.errors", "walberg.model", "walberg.config", "walberg.config_sink",
                    "walberg.metrics",
                    "walberg.progress", "walberg.faults"})
# Each third-party driver and the only places that may import it. (source/embedded_pg.py runs
# PostgreSQL's own binaries and needs no driver.)
DRIVERS = {
    "psycopg2": ("walberg.source",),
    "confluent_kafka": ("walberg.source",),
    "pyspark": ("walberg.apply",),
    "py4j": ("walberg.apply",),
    "pyiceberg": ("walberg.apply",),
}


@dataclass(frozen=True)
class Import:
    """One import statement of a walberg module, with each module it brings in."""

    module: str  # the importing module, e.g. walberg.apply.iceberg
    path: Path
    line: int
    text: str  # the statement as written
    targets: tuple[str, ...]  # modules imported (for ``from m import name``: m.name if a module, else m)
    type_checking: bool  # under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        return f"{self.module} ({self.path.relative_to(SRC.parent)}:{self.line}): {self.text}"


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _statements(body: list[ast.stmt], type_checking: bool
                ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement in ``body``, however deeply nested, with whether it sits under
    ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.body, True)
            yield from _statements(node.orelse, type_checking)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _statements([child], type_checking)
                elif isinstance(child, ast.ExceptHandler):
                    yield from _statements(child.body, type_checking)
                elif isinstance(child, ast.match_case):
                    yield from _statements(child.body, type_checking)


def read_imports(source: str, module: str, path: Path, is_package: bool,
                 modules: frozenset[str]) -> list[Import]:
    """The imports of one module. ``modules``: every walberg module, to tell ``from walberg
    import metrics`` (a module) from ``from walberg.model import Lsn`` (a name in one)."""
    found = []
    for node, type_checking in _statements(ast.parse(source).body, False):
        if isinstance(node, ast.Import):
            targets = tuple(a.name for a in node.names)
        else:
            base = _absolute(node, module, is_package)
            targets = tuple(dict.fromkeys(
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names))
        found.append(Import(module, path, node.lineno, ast.unparse(node), targets, type_checking))
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def walberg_imports() -> list[Import]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = frozenset(module_name(p) for p in paths)
    out: list[Import] = []
    for path in paths:
        out += read_imports(path.read_text(), module_name(path), path, path.name == "__init__.py",
                            modules)
    return out


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _stage_of(module: str) -> Optional[str]:
    return next((s for s in STAGES if _within(module, s)), None)


def _report(what: str, violations: list[str]) -> str:
    return f"{what}:\n  " + "\n  ".join(violations)


def test_the_reader_sees_every_kind_of_import() -> None:
    """The checks below are only as good as the reader: it finds imports inside functions,
    classes, try blocks and TYPE_CHECKING blocks, resolves relative ones, and tells a module
    imported from a package from a name imported from a module."""
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from walberg import metrics\n"
        "from walberg.model import Lsn\n"
        "from . import segment\n"
        "from .store import SegmentStore\n"
        "if TYPE_CHECKING:\n"
        "    from walberg.apply.batch import StagedTable\n"
        "else:\n"
        "    import json\n"
        "class Reader:\n"
        "    def read(self) -> None:\n"
        "        try:\n"
        "            import pyspark.sql.functions as F\n"
        "        except ImportError:\n"
        "            from py4j import protocol\n"
    )
    modules = frozenset({"walberg.metrics", "walberg.model", "walberg.buffer.segment",
                         "walberg.buffer.store", "walberg.buffer.reader", "walberg.apply.batch"})
    found = read_imports(source, "walberg.buffer.reader", PACKAGE / "buffer" / "reader.py", False,
                         modules)
    got = [(i.line, i.targets, i.type_checking) for i in found]
    assert got == [
        (1, ("__future__",), False), (2, ("typing",), False),
        (3, ("walberg.metrics",), False), (4, ("walberg.model",), False),
        (5, ("walberg.buffer.segment",), False), (6, ("walberg.buffer.store",), False),
        (8, ("walberg.apply.batch",), True), (10, ("json",), False),
        (14, ("pyspark.sql.functions",), False), (16, ("py4j",), False),
    ]
    assert str(found[6]) == ("walberg.buffer.reader (src/walberg/buffer/reader.py:8): "
                             "from walberg.apply.batch import StagedTable")


def test_stages_import_only_themselves_and_shared_modules() -> None:
    imports = walberg_imports()
    assert {i.module for i in imports if _stage_of(i.module)} >= {
        "walberg.source.pgoutput", "walberg.buffer.store", "walberg.apply.iceberg"}
    violations = []
    for imp in imports:
        stage = _stage_of(imp.module)
        if stage is None:
            continue
        for target in imp.targets:
            if _within(target, "walberg") and not _within(target, stage) and target not in SHARED:
                violations.append(f"{imp}  -> {target}")
    assert not violations, _report(
        f"a stage imports outside itself (allowed besides its own package: {sorted(SHARED)})",
        violations)


def test_shared_modules_import_only_each_other() -> None:
    """What makes them shareable: they know no stage and no orchestrator."""
    violations = [f"{imp}  -> {target}" for imp in walberg_imports() if imp.module in SHARED
                  for target in imp.targets
                  if _within(target, "walberg") and target not in SHARED]
    assert not violations, _report("a shared module imports beyond the shared modules",
                                   violations)


def test_each_driver_is_imported_in_its_stage_only() -> None:
    imports = walberg_imports()
    seen = {t.split(".")[0] for i in imports for t in i.targets}
    assert {"psycopg2", "pyspark", "confluent_kafka"} <= seen
    violations = []
    for imp in imports:
        for target in imp.targets:
            allowed = DRIVERS.get(target.split(".")[0])
            if allowed is not None and not any(_within(imp.module, p) for p in allowed):
                violations.append(f"{imp}  ({target.split('.')[0]} belongs in "
                                  f"{' or '.join(allowed)})")
    assert not violations, _report("a third-party driver is imported outside its stage",
                                   violations)


def _groups(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(groups)


def _cycle(edges: dict[str, dict[str, Import]], group: list[str]) -> list[tuple[str, Import]]:
    """The shortest cycle from the group's first module back to it, as (imported module,
    import) steps."""
    start, members = group[0], set(group)
    paths: dict[str, list[tuple[str, Import]]] = {start: []}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt, imp in sorted(edges.get(node, {}).items(), key=lambda e: e[0]):
            if nxt == start:
                return paths[node] + [(nxt, imp)]
            if nxt in members and nxt not in paths:
                paths[nxt] = paths[node] + [(nxt, imp)]
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {group}")


def _describe(group: list[str], cycle: list[tuple[str, Import]]) -> str:
    text = " -> ".join([group[0]] + [target for target, _ in cycle])
    if len(group) > len(cycle):
        text += f" (one cycle among {', '.join(group)})"
    return text + "".join(f"\n    {imp}" for _, imp in cycle)


def test_no_import_cycle() -> None:
    edges: dict[str, dict[str, Import]] = {}
    for imp in walberg_imports():
        if imp.type_checking:
            continue
        for target in imp.targets:
            if _within(target, "walberg") and target != imp.module:
                edges.setdefault(imp.module, {}).setdefault(target, imp)
    assert sum(len(e) for e in edges.values()) > 50  # the graph was read
    found = [_describe(group, _cycle(edges, group)) for group in _groups(edges)]
    assert not found, _report("walberg's modules import each other in a cycle", found)


# ---- sizes: what a newcomer can read -------------------------------------------------------

MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 90
MAX_CLASS_LINES = 500
MAX_MODULES_PER_FOLDER = 15


def _sizes() -> Iterator[tuple[Path, str, str, int]]:
    """(file, kind, name, lines) of every module, class and function of walberg."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        yield path, "module", module_name(path), len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                kind = "class"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "function"
            else:
                continue
            assert node.end_lineno is not None
            yield path, kind, node.name, node.end_lineno - node.lineno + 1


def test_modules_classes_and_functions_stay_readable() -> None:
    """No module over 650 lines, no class over 500, no function over 90: split what grows
    along what changes together (see docs/how-it-works.md#the-packages)."""
    limits = {"module": MAX_MODULE_LINES, "class": MAX_CLASS_LINES,
              "function": MAX_FUNCTION_LINES}
    over = [f"{path.relative_to(SRC.parent)}: {kind} {name} has {lines} lines (at most "
            f"{limits[kind]})" for path, kind, name, lines in _sizes() if lines > limits[kind]]
    assert not over, _report("too long to read as one piece", over)


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    crowded = []
    for folder in [PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir()
                                    and (p / "__init__.py").exists())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded.append(f"{folder.relative_to(SRC.parent)}: {len(modules)} modules")
    assert not crowded, _report(
        f"a folder with more than {MAX_MODULES_PER_FOLDER} modules (split it by reason to "
        "change, as apply/position/ and apply/jvm/ are)", crowded)


def test_the_package_map_in_the_docs_names_every_package() -> None:
    """docs/how-it-works.md#the-packages: one line a package, each package once, none that is
    gone."""
    text = (SRC.parent / "docs" / "how-it-works.md").read_text()
    section = text.split("## The packages", 1)[1].split("\n## ", 1)[0]
    mapped = re.findall(r"^- `(walberg(?:\.[a-z_]+)*)`:", section, flags=re.M)
    packages = sorted(module_name(p.parent) for p in PACKAGE.rglob("__init__.py"))
    assert sorted(mapped) == packages, (
        f"the map lists {sorted(set(mapped) - set(packages))} that are no packages and misses "
        f"{sorted(set(packages) - set(mapped))}")


def test_runtime_never_imports_the_commands() -> None:
    """The commands (ops, lake) are built on the runtime, not the other way round."""
    violations = [f"{imp}  -> {target}" for imp in walberg_imports()
                  if _within(imp.module, "walberg.runtime") for target in imp.targets
                  if _within(target, "walberg.ops") or _within(target, "walberg.lake")
                  or _within(target, "walberg.cli")]
    assert not violations, _report("the runtime imports a command", violations)


def test_the_top_level_holds_the_pipelines_and_the_shared_modules() -> None:
    """The rest lives in the package that owns it (see docs/how-it-works.md#the-packages)."""
    top = sorted(module_name(p) for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert set(top) <= SHARED | {"walberg.pipeline", "walberg.kafka_pipeline"}, top


def test_ops_never_import_the_command_line() -> None:
    violations = [f"{imp}  -> {target}" for imp in walberg_imports()
                  if not _within(imp.module, "walberg.cli") for target in imp.targets
                  if _within(target, "walberg.cli")]
    assert not violations, _report("the command line is imported from below it", violations)
