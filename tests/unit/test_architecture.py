"""The package's layout holds: no import cycles, ``torch.distributed`` only where it belongs.

Read from the source with :mod:`ast` (every import counts: module level,
inside functions and under ``TYPE_CHECKING``), so a lazy import that hides
a cycle from the interpreter is still found.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kaisa

ROOT = Path(kaisa.__file__).parent

#: packages of the pure core: tensor math, nothing that knows processes
PURE = ("kaisa.core", "kaisa.layers", "kaisa.methods", "kaisa.planner")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every module ``name`` imports (kaisa's own, resolved to modules, and others as written)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {m for m in _imports(path, name, modules) if m in modules and m != name}
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    # the reader must see the imports a cycle would hide in: inside a
    # function and under TYPE_CHECKING (wiring builds the step's parts lazily)
    graph = _graph()
    assert "kaisa.preconditioner" in graph["kaisa.planner.probe"]
    assert "kaisa.wiring" in graph["kaisa.checkpoint.sharded"]  # TYPE_CHECKING only
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles among kaisa's modules: {cycles}"


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_never_import_torch_distributed(package: str) -> None:
    modules = _modules()
    offenders = {
        name: sorted(m for m in _imports(path, name, modules) if m.startswith("torch.distributed"))
        for name, path in modules.items()
        if name == package or name.startswith(package + ".")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package} must not import torch.distributed: {offenders}"


def test_library_never_imports_the_lab() -> None:
    modules = _modules()
    offenders = [
        name
        for name, path in modules.items()
        if any(m.split(".")[0] in {"kaisa_lab"} for m in _imports(path, name, modules))
        and name != "kaisa.__main__"
    ]
    assert not offenders
