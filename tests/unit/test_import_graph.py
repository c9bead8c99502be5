"""kvpool's and kvpoold's imports point one way at every level, and no two modules share a name.

The graph is built from the source with ``ast``: every ``import`` and ``from ... import`` in a
module, function bodies included (a local import hides a cycle, it does not remove it), with
relative imports resolved and the packages an import runs first (``a`` and ``a.b`` for
``a.b.c``) counted as arrows too. Imports under ``if TYPE_CHECKING:`` are left out: they never
run. Two checks: no module reaches itself, and at every package level no room (a subpackage or
module, everything below it counted as it) reaches itself through the others.
"""

from __future__ import annotations

import ast
import functools
from collections import Counter
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvpool": ROOT / "client" / "kvpool", "kvpoold": ROOT / "service" / "kvpoold"}

def module_name(package: str, root: Path, path: Path) -> str:
    """The dotted name of the module at ``path`` inside ``package`` (rooted at ``root``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def is_type_checking(node: ast.If) -> bool:
    """Whether ``node`` is ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(
    tree: ast.Module, name: str, is_package: bool, modules: Collection[str]
) -> set[str]:
    """Every module named by an import anywhere in ``tree``, function bodies included.

    Imports under ``if TYPE_CHECKING:`` are left out: they never run, so they make no cycle
    at import time (annotations only). Relative imports are resolved against ``name``.
    ``from X import y`` names ``X.y`` where that is one of ``modules`` (a submodule), else ``X``.
    """
    found: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_type_checking(node):
            skip.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                # A package's own name is its first level; a module's is its parent's.
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in modules else target)
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of both packages it imports (a package stands for its ``__init__``)."""
    sources: dict[str, tuple[ast.Module, bool]] = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            sources[module_name(package, root, path)] = (
                ast.parse(path.read_text(), filename=str(path)),
                path.name == "__init__.py",
            )
    graph: dict[str, set[str]] = {}
    for name, (tree, is_package) in sources.items():
        own = set(ancestors(name))
        targets: set[str] = set()
        for target in imported_names(tree, name, is_package, sources):
            # Importing a.b.c runs a and a.b first: arrows to those packages too, except to
            # this module's own packages (already running when this module runs).
            targets.update(parent for parent in ancestors(target) if parent not in own)
            targets.add(target)
        graph[name] = {target for target in targets if target in sources and target != name}
    return graph


def ancestors(name: str) -> list[str]:
    """The packages above ``name``: ``a.b.c`` -> ``["a", "a.b"]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def level_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Cycles between the rooms of each package: its subpackages and modules, each taken whole.

    Arrows point one way at every level: for each package, every module below one of its
    children counts as that child, and the children's graph must have no cycle.
    """
    packages = {parent for name in graph for parent in ancestors(name)}
    found: list[tuple[str, ...]] = []
    for package in sorted(packages):
        depth = package.count(".") + 2

        def child(name: str, package: str = package, depth: int = depth) -> str | None:
            inside = name.startswith(package + ".")
            return ".".join(name.split(".")[:depth]) if inside else None

        rooms: dict[str, set[str]] = {}
        for src, dsts in graph.items():
            room = child(src)
            if room is None:
                continue
            arrows = rooms.setdefault(room, set())
            arrows.update(c for c in map(child, dsts) if c is not None and c != room)
        found.extend(cycles(rooms))
    return found


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    edges = graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        # Recursion depth is bounded by the module count (a few hundred).
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_checker_sees_function_local_and_relative_imports() -> None:
    """A function-local import and a relative one are arrows; a TYPE_CHECKING one is not."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvpool.a import hidden\n"
        "def f():\n    from .b import c\n    import kvpool.d\n"
    )
    names = imported_names(tree, "kvpool.pkg.mod", False, {"kvpool.pkg.b.c"})
    assert names == {"typing", "kvpool.pkg.b.c", "kvpool.d"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]


def within(name: str, room: str) -> bool:
    """Whether module ``name`` is ``room`` or below it."""
    return name == room or name.startswith(room + ".")


def show(found: list[tuple[str, ...]]) -> str:
    return "\n".join(" <-> ".join(cycle) for cycle in found)


def test_the_checker_finds_cycles_between_rooms() -> None:
    """Two modules that do not import each other, whose rooms do, make a room cycle."""
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.w"}, "p.a.w": set()}
    assert cycles(graph) == []
    assert level_cycles(graph) == [("p.a", "p.b")]


def test_no_module_imports_itself_through_others() -> None:
    """No module reaches itself through imports (function-local ones count)."""
    found = cycles(import_graph())
    assert not found, "import cycles between modules:\n" + show(found)


def test_rooms_import_one_way_at_every_level() -> None:
    """In each package, no subpackage or module reaches itself through its siblings."""
    found = level_cycles(import_graph())
    assert not found, "import cycles between rooms:\n" + show(found)


def test_no_two_modules_share_a_file_name() -> None:
    """One module per name: no two files in client/ and service/ share a name (``__init__.py``
    aside), so a name in a traceback, a log or a review says which module it is."""
    names = Counter(
        path.name
        for root in PACKAGES.values()
        for path in root.rglob("*.py")
        if path.name != "__init__.py"
    )
    dupes = {name for name, count in names.items() if count > 1}
    assert not dupes, f"file names used more than once: {sorted(dupes)}"
