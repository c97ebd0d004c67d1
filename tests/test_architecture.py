"""The package graph keeps the one-way flow of DESIGN.md: spec -> cost -> planner -> plan -> runtime and
profiler -> cost, with no cycle between packages (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import plait

ROOT = Path(plait.__file__).parent
FACADES = {"plait", "cli"}
"""The package's top (its Python API and the command line) may import anything; nothing imports them."""


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "plait"


def import_graph() -> dict[str, set[str]]:
    """Package -> the plait packages its modules import (module level or inside functions)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        source = _package(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("plait"):
                target = _package(node.module)
                if target != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_package_imports_the_facades() -> None:
    graph = import_graph()
    assert not {p for p, targets in graph.items() if p not in FACADES and targets & FACADES}


def test_packages_form_no_cycle() -> None:
    graph = {p: t - FACADES for p, t in import_graph().items() if p not in FACADES}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_flow_runs_one_way() -> None:
    graph = import_graph()
    assert "cost" not in graph["spec"] and "plan" not in graph["spec"]
    for upstream in ("spec", "cost", "plan", "planner", "simulate"):
        assert not graph.get(upstream, set()) & {"runtime", "profile", "models"}, upstream
    assert "cost" not in graph.get("profile", set()) or "profile" not in graph.get("cost", set())
