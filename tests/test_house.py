"""The house's shape: no import loop anywhere in the library, counting every import a module
makes (at the top, inside a function, or for type checking only), so a loop cannot hide in
a deferred import."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "prefixreg"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The library modules `path` imports (`from a import b` is a.b when b is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= (subs & modules) or ({node.module} & modules)
    return found - {module_name(path)}


def find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of `graph` as its modules in order, or None (depth-first, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (loop := visit(nxt)) is not None:
                return loop
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (loop := visit(start)) is not None:
            return loop
    return None


def test_the_library_has_no_import_loop() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    assert len(graph) > 90 and any(graph.values())  # the walk saw the house
    assert find_loop(graph) is None, " -> ".join(find_loop(graph) or [])


def test_a_loop_through_a_deferred_import_is_found() -> None:
    """The finder itself: a two-module loop, and a clean chain."""
    assert find_loop({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_loop({"a": {"b"}, "b": {"c"}, "c": set()}) is None
