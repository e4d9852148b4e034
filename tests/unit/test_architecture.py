"""The package's layout holds: no import cycles, ``torch.distributed`` only in
``kaisa.distributed``.

Read from the source with :mod:`ast` (every import counts: module level,
inside functions and under ``TYPE_CHECKING``), so a lazy import that hides
a cycle from the interpreter is still found.

Why not import-linter: its ``forbidden`` contracts may name an external
package only at its root (``torch``, not ``torch.distributed``: the graph
it builds squashes external packages to their top level), and every kaisa
module imports ``torch``.  So the rule is read here, from the syntax tree:
``import torch.distributed [as d]``, ``from torch.distributed[.x] import
...``, ``from torch import distributed``, an ``import_module`` /
``__import__`` of the name, and the attribute chain ``torch.distributed``
on any name bound to ``torch`` (``import torch as t; t.distributed.x``).
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


#: the package that owns every torch.distributed call (collectives, groups,
#: DTensor and FSDP checks, pipelining schedules)
DISTRIBUTED = "kaisa.distributed"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _is_torch_distributed(name: str) -> bool:
    return _within(name, "torch.distributed")


def torch_distributed_uses(source: str) -> list[str]:
    """Every place ``source`` reaches ``torch.distributed``, as ``line: what``."""
    tree = ast.parse(source)
    torch_names = {"torch"}  # names bound to the torch module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names.update(a.asname for a in node.names if a.name == "torch" and a.asname)
    found: list[str] = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if _is_torch_distributed(a.name)]
            what = f"import {', '.join(names)}" if names else None
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if _is_torch_distributed(module):
                what = f"from {module} import ..."
            elif module == "torch" and any(a.name == "distributed" for a in node.names):
                what = "from torch import distributed"
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            if isinstance(node.value, ast.Name) and node.value.id in torch_names:
                what = f"{node.value.id}.distributed"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (
                called in {"import_module", "__import__"}
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and _is_torch_distributed(first.value)
            ):
                what = f"{called}({first.value!r})"
        if what is not None:
            found.append(f"{node.lineno}: {what}")
    return sorted(set(found), key=lambda f: int(f.split(":")[0]))


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist",
        "import torch.distributed",
        "import os, torch.distributed.tensor",
        "from torch.distributed import ProcessGroup",
        "from torch.distributed.fsdp import FSDPModule",
        "from torch import nn, distributed",
        "import torch\ntorch.distributed.get_rank()",
        "import torch as T\nx = T.distributed.is_initialized()",
        "def f():\n    import torch.distributed.tensor as dt\n    return dt",
        "import importlib\nimportlib.import_module('torch.distributed.tensor')",
        "__import__('torch.distributed')",
    ],
)
def test_the_reader_sees_every_way_to_reach_torch_distributed(source: str) -> None:
    assert torch_distributed_uses(source), source


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nfrom torch import nn\nx = torch.zeros(1)",
        "from kaisa.distributed import collectives\ncollectives.rank()",
        "from . import distributed",
        "import torch\ny = torch.nn.parallel.DistributedDataParallel",
        '"""torch.distributed in a docstring"""',
    ],
)
def test_the_reader_ignores_what_is_not_torch_distributed(source: str) -> None:
    assert not torch_distributed_uses(source), source


def test_only_kaisa_distributed_touches_torch_distributed() -> None:
    """Every ``torch.distributed`` import and attribute use of the library is
    in :mod:`kaisa.distributed`; engines, the step, checkpoints and the rest
    call its functions (issue 22: a narrow engine)."""
    offenders = {
        name: uses
        for name, path in _modules().items()
        if not _within(name, DISTRIBUTED) and (uses := torch_distributed_uses(path.read_text()))
    }
    assert not offenders, (
        "torch.distributed outside kaisa.distributed (move the call into "
        f"kaisa/distributed/, e.g. collectives.py or tensors.py): {offenders}"
    )


def test_library_never_imports_the_lab() -> None:
    modules = _modules()
    offenders = [
        name
        for name, path in modules.items()
        if any(m.split(".")[0] in {"kaisa_lab"} for m in _imports(path, name, modules))
        and name != "kaisa.__main__"
    ]
    assert not offenders


# -- imports run one way ----------------------------------------------------------------


def _top(name: str) -> str:
    """The top-level package of a kaisa module (``kaisa.step.capture.hooks`` →
    ``kaisa.step``); a module at the top is its own."""
    return ".".join(name.split(".")[:2])


def private_imports(path: Path, name: str, modules: dict[str, Path]) -> list[str]:
    """``from kaisa.x import _name`` where ``kaisa.x`` lies in another
    top-level package than ``name``: a private name crossing a boundary."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base]) if base else ".".join(anchor)
        if not _within(base, "kaisa") or _top(base) == _top(name):
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{node.lineno}: from {base} import {alias.name}")
    return found


def test_the_private_reader_finds_a_crossing() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.py"
        path.write_text("from kaisa.step.capture.hooks import _x, y\nfrom . import _z\n")
        assert private_imports(path, "kaisa.engines.m", {}) == [
            "1: from kaisa.step.capture.hooks import _x"
        ]  # the relative import stays in kaisa.engines
        assert private_imports(path, "kaisa.step.m", {}) == []


def test_no_private_name_is_imported_across_packages() -> None:
    modules = _modules()
    offenders = {
        name: found
        for name, path in modules.items()
        if (found := private_imports(path, name, modules))
    }
    assert not offenders, (
        "a private name imported from another package (make it public where it "
        f"is declared, or move it): {offenders}"
    )


#: what a package must not import of kaisa (itself excepted): the layers run one way
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # tensor math only: no options, layers, processes or step
    "kaisa.core": ("kaisa",),
    # the planner reads the resolved method and the declared messages, never the step
    "kaisa.planner": ("kaisa.step",),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_below_them(package: str) -> None:
    graph = _graph()
    offenders = {
        n: sorted(
            m
            for m in deps
            if not _within(m, package) and any(_within(m, f) for f in FORBIDDEN[package])
        )
        for n, deps in graph.items()
        if _within(n, package)
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package} imports against the layering: {offenders}"


def test_the_step_knows_engines_only_through_their_base() -> None:
    """The step reads an engine through :class:`kaisa.engines.base.Engine`
    and its capability protocols, never a concrete engine."""
    graph = _graph()
    offenders = {
        n: sorted(m for m in deps if _within(m, "kaisa.engines") and m != "kaisa.engines.base")
        for n, deps in graph.items()
        if _within(n, "kaisa.step")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"the step imports concrete engines: {offenders}"
