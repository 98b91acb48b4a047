"""No import circles in python/kvblocks: the graph of which module imports which, read from the
source with :mod:`ast` (nothing is imported), has no cycle.

What counts as an edge ``A -> B`` (A imports B):

- every ``import`` statement of A, at module level or inside a function or class alike, but
  not one under ``if TYPE_CHECKING:`` (annotations only; its ``else:`` branch does count), and
  ``importlib.import_module("...")`` / ``__import__("...")`` of a literal absolute name;
- ``import kvblocks.x.y``: an edge to ``kvblocks.x.y``;
- ``from kvblocks.x import y`` (relative imports resolved): an edge to ``kvblocks.x.y`` when
  that is a module, and an edge to ``kvblocks.x`` (its ``__init__``) when ``y`` is a name that
  ``__init__`` binds (defines or re-exports) or may provide (it is no submodule, or the
  ``__init__`` has a module ``__getattr__``); importing a submodule of a package is no edge to
  the package's ``__init__``;
- the packages a target lies in that do not contain A: Python runs their ``__init__`` before
  the target (``import kvblocks.runtime.attention`` from ``kvblocks.engine`` is an edge to
  ``kvblocks.runtime`` too). The packages containing A are being imported already, so they
  are no edge (a submodule reaches its package's ``__init__`` only through the names it takes
  from it).

Every cycle is reported, not just the first one found: each group of modules that import each
other (a strongly connected component), then each elementary cycle in it once (up to
``MAX_CYCLES`` per group), with the file, line and statement of each import along it.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "python" / "kvblocks"

#: At most this many cycles are listed per strongly connected component (the count says when
#: there are more).
MAX_CYCLES = 500


@dataclass(frozen=True)
class Site:
    """Where an import is: its file, line and statement."""

    path: Path
    line: int
    statement: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.statement}"


@dataclass
class ImportGraph:
    """Every module of a package (dotted name -> file) and the edges between them."""

    files: dict[str, Path]
    packages: set[str]
    edges: dict[str, dict[str, list[Site]]] = field(default_factory=dict)

    def add(self, source: str, target: str, site: Site) -> None:
        if source == target:
            return
        sites = self.edges.setdefault(source, {}).setdefault(target, [])
        if site not in sites:
            sites.append(site)

    def targets(self, module: str) -> list[str]:
        return sorted(self.edges.get(module, {}))


def _module_files(package_dir: Path) -> tuple[dict[str, Path], set[str]]:
    files, packages = {}, set()
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
            packages.add(".".join(parts))
        files[".".join(parts)] = path
    # A folder without __init__.py is still a (namespace) package.
    for name in list(files):
        parts = name.split(".")
        packages.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return files, packages


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_not_type_checking(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and _is_type_checking(test.operand)
    )


def _runtime_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a block that run, with the blocks they contain (not the type-only
    branch of ``if TYPE_CHECKING:``; the bodies of functions and classes not entered)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            if _is_type_checking(stmt.test):
                yield from _runtime_statements(stmt.orelse)
            elif _is_not_type_checking(stmt.test):
                yield from _runtime_statements(stmt.body)
            else:
                yield from _runtime_statements(stmt.body)
                yield from _runtime_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from _runtime_statements(block)
            for handler in stmt.handlers:
                yield from _runtime_statements(handler.body)
        elif isinstance(stmt, ast.For | ast.AsyncFor | ast.While):
            yield from _runtime_statements(stmt.body)
            yield from _runtime_statements(stmt.orelse)
        elif isinstance(stmt, ast.With | ast.AsyncWith):
            yield from _runtime_statements(stmt.body)
        elif isinstance(stmt, ast.Match):
            for case in stmt.cases:
                yield from _runtime_statements(case.body)


def _from_module(base: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module a ``from ... import`` reads (``base``: the package of
    the module the statement is in)."""
    if not node.level:
        return node.module or ""
    parts = base.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _init_names(package: str, tree: ast.Module, files: dict[str, Path]) -> set[str] | None:
    """The names a package's ``__init__`` binds at its top level (defines or re-exports) to
    something else than its submodule of that name; None when it may provide any name (a
    module ``__getattr__``, a star import)."""

    def submodule(target: str, name: str) -> bool:
        return target == f"{package}.{name}" and target in files

    names: set[str] = set()
    for stmt in _runtime_statements(tree.body):
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if stmt.name == "__getattr__":
                return None
            names.add(stmt.name)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname is None:
                    names.add(alias.name.split(".")[0])
                elif not submodule(alias.name, alias.asname):
                    names.add(alias.asname)
        elif isinstance(stmt, ast.ImportFrom):
            module = _from_module(package, stmt)
            for alias in stmt.names:
                if alias.name == "*":
                    return None
                bound = alias.asname or alias.name
                if not (bound == alias.name and submodule(f"{module}.{bound}", bound)):
                    names.add(bound)
        elif isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign | ast.AugAssign | ast.For | ast.AsyncFor):
            # (an annotation without a value binds nothing)
            if not isinstance(stmt, ast.AnnAssign) or stmt.value is not None:
                targets = [stmt.target]
        elif isinstance(stmt, ast.With | ast.AsyncWith):
            targets = [i.optional_vars for i in stmt.items if i.optional_vars is not None]
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    # Walrus targets (anywhere: binding more names only adds edges).
    names.update(n.target.id for n in ast.walk(tree) if isinstance(n, ast.NamedExpr))
    return names


class _ImportFinder(ast.NodeVisitor):
    """Every import a module can run: module level, functions and classes alike, but not the
    type-only branch of ``if TYPE_CHECKING:``."""

    def __init__(self) -> None:
        self.found: list[ast.Import | ast.ImportFrom | ast.Call] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.visit(node.test)
            for stmt in node.orelse:
                self.visit(stmt)
        elif _is_not_type_checking(node.test):
            self.visit(node.test)
            for stmt in node.body:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if (
            name in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            self.found.append(node)
        self.generic_visit(node)


def build_graph(package_dir: Path) -> ImportGraph:
    """The import graph of every module of the package in ``package_dir``."""
    files, packages = _module_files(package_dir)
    graph = ImportGraph(files, packages)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
    init_names = {
        name: _init_names(name, tree, files) for name, tree in trees.items() if name in packages
    }

    def from_init(package: str, name: str) -> bool:
        """Whether ``from package import name`` takes ``name`` from the package's
        ``__init__`` (rather than only importing its submodule ``name``)."""
        if f"{package}.{name}" not in files:
            return True  # a name it defines (or a missing one: sound either way)
        names = init_names.get(package, set())
        return names is None or name in names

    root = package_dir.name
    for source, tree in trees.items():
        base = source if source in packages else source.rpartition(".")[0]
        finder = _ImportFinder()
        finder.visit(tree)
        for node in finder.found:
            site = Site(files[source], node.lineno, ast.unparse(node).splitlines()[0])
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.Call):
                assert isinstance(node.args[0], ast.Constant)
                targets = [str(node.args[0].value)]
            else:
                module = _from_module(base, node)
                for alias in node.names:
                    if f"{module}.{alias.name}" in files:
                        targets.append(f"{module}.{alias.name}")
                    if module not in packages or alias.name == "*" or from_init(module, alias.name):
                        targets.append(module)
            for target in dict.fromkeys(targets):
                if target.split(".")[0] != root:
                    continue
                parts = target.split(".")
                # The target, and the packages it lies in that do not contain the importer
                # (Python runs their __init__ first).
                for i in range(1, len(parts) + 1):
                    name = ".".join(parts[:i])
                    contains_source = source == name or source.startswith(name + ".")
                    if name in files and (i == len(parts) or not contains_source):
                        graph.add(source, name, site)
    return graph


def _components(graph: ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.targets(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for module in sorted(graph.files):
        if module not in index:
            visit(module)
    return sorted(out)


def _cycles_from(graph: ImportGraph, start: str, members: set[str], limit: int) -> list[list[str]]:
    """The elementary cycles through ``start`` whose other modules are in ``members`` (at most
    ``limit``; depth first)."""
    cycles: list[list[str]] = []
    path = [start]

    def extend(v: str) -> None:
        for w in graph.targets(v):
            if len(cycles) >= limit:
                return
            if w == start:
                cycles.append([*path, start])
            elif w in members and w not in path:
                path.append(w)
                extend(w)
                path.pop()

    extend(start)
    return cycles


def find_cycles(graph: ImportGraph) -> list[tuple[list[str], list[list[str]], bool]]:
    """Per strongly connected component: its modules, its elementary cycles (each once,
    starting from its smallest module) and whether more than ``MAX_CYCLES`` were left off."""
    result = []
    for component in _components(graph):
        cycles: list[list[str]] = []
        for start in component:
            later = {m for m in component if m > start}
            cycles += _cycles_from(graph, start, later, MAX_CYCLES + 1 - len(cycles))
        result.append((component, cycles[:MAX_CYCLES], len(cycles) > MAX_CYCLES))
    return result


def describe_cycles(graph: ImportGraph) -> str:
    lines = []
    for component, cycles, truncated in find_cycles(graph):
        lines.append(f"modules importing each other in a circle: {', '.join(component)}")
        for cycle in cycles:
            lines.append("  cycle: " + " -> ".join(cycle))
            for a, b in itertools.pairwise(cycle):
                for site in graph.edges[a][b]:
                    lines.append(f"    {a} -> {b}  ({site})")
        if truncated:
            lines.append(f"  (more than {MAX_CYCLES} cycles; the first {MAX_CYCLES} listed)")
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    graph = build_graph(PACKAGE_DIR)
    report = describe_cycles(graph)
    print(report)
    assert not report, "import cycles in python/kvblocks:\n" + report


def test_the_graph_reads_the_real_package() -> None:
    """Not vacuous: the modules are found and imports of each kind become edges."""
    graph = build_graph(PACKAGE_DIR)
    assert {"kvblocks", "kvblocks.reference.manager", "kvblocks.runtime.attention"} <= set(
        graph.files
    )
    # A module-level import, an import in a function, and a package's __init__.
    assert "kvblocks.reference.pool" in graph.targets("kvblocks.reference.manager")
    assert "kvblocks.runtime.triton_selfcheck" in graph.targets("kvblocks.runtime.attention")
    assert "kvblocks.reference.manager" in graph.targets("kvblocks.reference")


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_rules_on_a_made_up_package(tmp_path: Path) -> None:
    package = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub import Thing\nVALUE = 1\n",
            "pkg/sub/__init__.py": "from .a import Thing\n",
            "pkg/sub/a.py": (
                "from __future__ import annotations\n"
                "from typing import TYPE_CHECKING\n"
                "from pkg.sub import b\n"  # a submodule: no edge to pkg.sub's __init__
                "if TYPE_CHECKING:\n"
                "    from pkg.sub.c import C\n"  # type-only: no edge
                "else:\n"
                "    import pkg.d\n"  # the else branch runs
                "class Thing:\n"
                "    def f(self) -> C:\n"
                "        from . import c\n"  # in a method: an edge
                "        return c.C()\n"
            ),
            "pkg/sub/b.py": "from pkg.sub import Thing\n",  # a name of pkg.sub's __init__
            "pkg/sub/c.py": "from .. import VALUE\nclass C: ...\n",
            "pkg/d.py": (
                "import importlib\n"
                "import os\n"
                "def g() -> object:\n"
                "    return importlib.import_module('pkg.e')\n"
            ),
            "pkg/e.py": "import pkg.sub.c\n",  # and pkg.sub's __init__ first
        },
    )
    graph = build_graph(package)
    assert set(graph.files) == {"pkg", "pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.sub.c"} | {
        "pkg.d",
        "pkg.e",
    }
    assert graph.targets("pkg") == ["pkg.sub"]
    assert graph.targets("pkg.sub") == ["pkg.sub.a"]
    assert graph.targets("pkg.sub.a") == ["pkg.d", "pkg.sub.b", "pkg.sub.c"]
    assert graph.targets("pkg.sub.b") == ["pkg.sub"]
    assert graph.targets("pkg.sub.c") == ["pkg"]
    assert graph.targets("pkg.d") == ["pkg.e"]
    assert graph.targets("pkg.e") == ["pkg.sub", "pkg.sub.c"]
    found = find_cycles(graph)
    assert [component for component, _, _ in found] == [
        ["pkg", "pkg.d", "pkg.e", "pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.sub.c"]
    ]
    assert sorted(found[0][1]) == [
        ["pkg", "pkg.sub", "pkg.sub.a", "pkg.d", "pkg.e", "pkg.sub.c", "pkg"],
        ["pkg", "pkg.sub", "pkg.sub.a", "pkg.sub.c", "pkg"],
        ["pkg.d", "pkg.e", "pkg.sub", "pkg.sub.a", "pkg.d"],
        ["pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.sub"],
    ]
    report = describe_cycles(graph)
    assert "pkg.sub.b -> pkg.sub  (" in report
    assert "b.py:1: from pkg.sub import Thing" in report


def test_a_package_without_cycles_reports_none(tmp_path: Path) -> None:
    package = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "from pkg import b\nclass A: ...\n",
            "pkg/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
            ),
        },
    )
    graph = build_graph(package)
    assert graph.targets("pkg.a") == ["pkg.b"]
    assert graph.targets("pkg.b") == []
    assert describe_cycles(graph) == ""


def test_a_module_getattr_may_provide_any_name(tmp_path: Path) -> None:
    """``from pkg import sub`` asks pkg's module ``__getattr__`` first (an edge to pkg), and
    ``if not TYPE_CHECKING:`` runs its body, not its ``else:``."""
    package = _package(
        tmp_path,
        {
            "pkg/__init__.py": "def __getattr__(name: str) -> object:\n    raise AttributeError\n",
            "pkg/sub.py": (
                "import typing\n"
                "if not typing.TYPE_CHECKING:\n"
                "    from pkg import other\n"
                "else:\n"
                "    import pkg\n"
            ),
            "pkg/other.py": "",
        },
    )
    graph = build_graph(package)
    assert graph.targets("pkg.sub") == ["pkg", "pkg.other"]
