"""The package's import graph: no cycles, and no library module imports the CLI.

Every ``import`` / ``from ... import`` of a ``policyworker`` module counts, at module
level or inside a function (a deferred import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import policyworker

pytestmark = pytest.mark.timeout(60)

ROOT = Path(policyworker.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_package, node.level, node.module)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in modules:  # `from pkg import name`: the module that holds it
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("policyworker") and not mod.startswith(t + "."):
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_library_module_imports_the_cli():
    graph = import_graph()
    offenders = {m: sorted(t for t in ts if t.startswith("policyworker.cli"))
                 for m, ts in graph.items() if not m.startswith("policyworker.cli")}
    assert {m: ts for m, ts in offenders.items() if ts} == {}


def test_import_graph_has_no_cycles():
    # Package __init__ re-exports are edges into the package; a module importing its own
    # package's __init__ would be a cycle too, so they stay in the graph.
    assert _cycles(import_graph()) == []


def test_no_integration_calls_a_private_worker_method():
    """Integrations and engine adapters use the workers' public surface (the generic road:
    attach_transport / refit, plus refit_source / ensure_open); a private method is the
    worker's own business. Found by AST: any ``<name>._x`` attribute where ``<name>``
    names a worker (worker, rollout, trainer, w)."""
    import ast as _ast

    found = []
    files = sorted((ROOT / "integrations").rglob("*.py"))
    for path in files:
        for node in _ast.walk(_ast.parse(path.read_text())):
            if isinstance(node, _ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, _ast.Name) and node.value.id in ("worker", "rollout", "trainer", "w"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, found


#: The layers, lowest first (docs/architecture.md): a module imports its own layer or lower ones.
LAYERS = {"contracts": 0, "runtime": 1, "models": 1, "ops": 2, "layout": 3, "transports": 4, "workers": 5,
          "integrations": 6, "testing": 7, "cli": 8}


def _layer(module: str) -> str | None:
    parts = module.split(".")[1:]
    if not parts:
        return None  # the package's __init__: the public surface re-exports every layer (lazily)
    if parts[0] in ("errors", "config", "ledger", "wire"):
        return "contracts"
    if parts[0] == "registry":  # finds transports by entry point: it sits with them
        return "transports"
    if parts[:2] == ["transports", "base"]:
        return "runtime"
    return parts[0] if parts[0] in LAYERS else None


def test_layers_import_downwards_only():
    up = []
    for module, deps in import_graph().items():
        mine = _layer(module)
        for dep in deps:
            theirs = _layer(dep)
            if mine is not None and theirs is not None and LAYERS[theirs] > LAYERS[mine]:
                up.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not up, up
    assert all(_layer(m) is not None for m in import_graph() if m != "policyworker"), \
        [m for m in import_graph() if m != "policyworker" and _layer(m) is None]
