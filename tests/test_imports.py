"""The package's modules import one another without a circle: every import, at the top of a module or inside a
function, read from the source with ast, forms a graph with no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import captioner

PACKAGE = Path(captioner.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, for its __init__.py)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its source (``from a import b`` counts as
    importing ``a.b`` where that is a module, else ``a``); relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {module for module in found if module in modules and module != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the list of its modules (the first one repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_reader_sees_imports_inside_functions_and_relative_ones(tmp_path):
    modules = {"p": tmp_path / "p" / "__init__.py", "p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}
    modules["p.a"].write_text("def f():\n    from p.b import thing\n")
    modules["p.b"].write_text("from . import a\n")
    assert _imports("p.a", modules["p.a"], modules) == {"p.b"}
    assert _imports("p.b", modules["p.b"], modules) == {"p.a"}


def test_no_module_of_the_package_imports_itself_through_others():
    modules = _modules()
    assert "captioner.viz.sheet" in modules and len(modules) > 50
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "captioner.viz.overlay" in graph["captioner.viz.sheet"]  # the reader sees the package's own imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
