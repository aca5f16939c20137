"""The import graph of src/kvcore and service/ (installed as kvcore.service, which import-linter's
grimp cannot see under src/): no cycle between modules, and service/ imports no layer above it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the layers above the service: it never imports them (pyproject's import-linter contract checks
# the rest of kvcore, where grimp can see)
ABOVE_SERVICE = ("kvcore.cli", "kvcore.cluster")


def module_files() -> dict[str, Path]:
    """Every module of kvcore by its dotted name, service/ under kvcore.service."""
    found: dict[str, Path] = {}
    for base, prefix in ((ROOT / "src" / "kvcore", "kvcore"), (ROOT / "service", "kvcore.service")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvcore modules `name` imports (at any depth of its code, TYPE_CHECKING included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the submodule when there is one
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between kvcore's subpackages (kvcore.cli, kvcore.service, ...)."""
    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])
    out: dict[str, set[str]] = {top(name): set() for name in graph}
    for name, targets in graph.items():
        out[top(name)].update(top(t) for t in targets if top(t) != top(name))
    return out


def test_the_walk_sees_service_and_cluster() -> None:
    graph = import_graph()
    assert "kvcore.service.app" in graph and "kvcore.cluster.serve" in graph
    assert "kvcore.service.serve" in graph["kvcore.cluster.serve"]  # a real edge, found
    assert "kvcore.engine" in package_graph(graph)["kvcore.service"]


def test_no_import_cycle_between_modules() -> None:
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_packages() -> None:
    assert cycles(package_graph(import_graph())) == []


def test_the_service_imports_no_layer_above_it() -> None:
    graph = import_graph()
    bad = {(name, t) for name, targets in graph.items() if name.startswith("kvcore.service")
           for t in targets if t.startswith(ABOVE_SERVICE)}
    assert bad == set()


def test_only_the_layers_above_import_the_service() -> None:
    graph = import_graph()
    importers = {name for name, targets in graph.items() if not name.startswith("kvcore.service")
                 and any(t.startswith("kvcore.service") for t in targets)}
    assert importers and all(name.startswith(ABOVE_SERVICE) for name in importers), importers


def test_a_cycle_is_found() -> None:
    """The check has teeth: a two-module cycle and a longer one are reported."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
