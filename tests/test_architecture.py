"""The package's layers (docs/architecture.md §5), checked on its own imports.

Every module sits in one layer; it imports only from its own layer or the ones below, never back up, and no two
modules import each other through any chain. The heavy libraries stay where their layer says: the floor imports no
Ray, vLLM, DeepSpeed or transformers, only the vLLM backend imports vLLM, and only the runtime (and the tools that
drive it) import Ray. Read from the source with `ast`, so a lazy import inside a function counts as much as one at
the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lt_opd_ray"

# Lowest first: a module may import from its own layer and every layer above it in this list.
LAYERS = (
    ("floor", ("lt_opd_ray", "lt_opd_ray._torchvision_ops", "lt_opd_ray.core")),
    ("weight transfer, sizing", ("lt_opd_ray.weight_sync", "lt_opd_ray.planning")),
    ("models", ("lt_opd_ray.models",)),
    ("sources", ("lt_opd_ray.sources",)),
    ("job schema", ("lt_opd_ray.config",)),
    ("engines", ("lt_opd_ray.engines",)),
    ("reference, evaluation", ("lt_opd_ray.reference", "lt_opd_ray.evals")),
    ("runtime", ("lt_opd_ray.runtime",)),
    ("serving, tools", ("lt_opd_ray.serving", "lt_opd_ray.tools")),
    ("command line", ("lt_opd_ray.cli",)),
)

# Third-party packages that only some places may import: package -> the module prefixes allowed to.
CONFINED = {
    "ray": ("lt_opd_ray.runtime", "lt_opd_ray.tools"),
    "vllm": ("lt_opd_ray.engines.vllm",),
    "deepspeed": ("lt_opd_ray.models.loading", "lt_opd_ray.runtime", "lt_opd_ray.serving.export"),
    "transformers": ("lt_opd_ray.models", "lt_opd_ray.sources.toy", "lt_opd_ray.runtime", "lt_opd_ray.serving", "lt_opd_ray.cli"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int:
    """The index of the layer whose most specific prefix holds `name`."""
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes if within(name, prefix)]
    if not matches:
        raise AssertionError(f"{name} is in no layer: place it in tests/test_architecture.py LAYERS and docs/architecture.md §5")
    return max(matches)[1]


def imported(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(package modules, third-party top-level packages) that `path` imports, wherever the import statement sits."""
    own, external = set(), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "lt_opd_ray":
                external.add(target.split(".")[0])
                continue
            while target not in known:  # `from pkg.mod import name`: the module that defines it
                target = target.rpartition(".")[0]
            if target != name:
                own.add(target)
    return own, external


@pytest.fixture(scope="module")
def graph() -> dict[str, tuple[set[str], set[str]]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def test_every_module_sits_in_one_layer_and_imports_nothing_above_it(graph):
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for name, (own, _) in graph.items()
        for target in sorted(own)
        if layer_of(target) > layer_of(name)
    ]
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circles(graph):
    found = cycles({name: own for name, (own, _) in graph.items()})
    assert not found, "modules that import each other through a chain:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_heavy_libraries_stay_in_their_layers(graph):
    misplaced = [
        f"{name} imports {package} (allowed only under {', '.join(CONFINED[package])})"
        for name, (_, external) in graph.items()
        for package in sorted(external & CONFINED.keys())
        if not any(within(name, prefix) for prefix in CONFINED[package])
    ]
    assert not misplaced, "\n".join(misplaced)
