"""The house stays layered: every module imports only from its own folder or folders below it, no module
imports itself back through a circle of imports (function-level imports included), and Prefect and Ray stay in
their layers. The layers and what each holds: docs/architecture.md, "The layering"."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("algorithms", "storage", "configs", "data", "workers", "tasks", "flows")
"""Bottom to top: a module may import from its own layer and the layers before it."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("ppoflow",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def project_imports(path: Path) -> set[str]:
    """The ``ppoflow.*`` modules a file imports anywhere in its body (``from x import y`` counts ``x.y``
    when ``x.y`` is a module, else ``x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("ppoflow."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.startswith("ppoflow."):
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    found.add(candidate if candidate in MODULES else base)
    return found


MODULES = {module_name(path): path for layer in LAYERS for path in (ROOT / layer).rglob("*.py")}


FRAMEWORK_LAYERS = {"prefect": ("tasks", "flows"), "prefect_ray": ("tasks", "flows"), "ray": ("workers",)}
"""A framework -> the only layers that may import it."""


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the packages a file imports anywhere in its body (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def layer_of(module: str) -> str:
    return module.split(".")[1]


def test_every_folder_is_a_known_layer_and_an_installed_package():
    import tomllib

    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(path) for path in MODULES.values() if path.name == "__init__.py"}
    # A folder of data only (configs/tools) is a package to setuptools too: listed, with no Python in it.
    data_only = {
        package
        for package in packages - found - {"ppoflow"}
        if (folder := ROOT.joinpath(*package.split(".")[1:])).is_dir() and not any(folder.glob("*.py"))
    }
    assert found <= packages, f"folders missing from pyproject's packages: {sorted(found - packages)}"
    assert packages - {"ppoflow"} - data_only <= found, (
        f"packages without a folder: {sorted(packages - found - data_only - {'ppoflow'})}"
    )
    data_folders = {
        module_name(folder / "x.py").rpartition(".")[0]
        for layer in LAYERS
        for folder in (ROOT / layer).rglob("*")
        if folder.is_dir() and folder.name != "__pycache__" and not (folder / "__init__.py").exists()
    }
    assert data_folders <= packages, f"data folders not in pyproject's packages: {sorted(data_folders - packages)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    rank = LAYERS.index(layer_of(module))
    upward = sorted(
        imported for imported in project_imports(MODULES[module]) if LAYERS.index(layer_of(imported)) > rank
    )
    assert not upward, f"{module} ({LAYERS[rank]}) imports from a higher layer: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_frameworks_stay_in_their_layers(module):
    layer = layer_of(module)
    misplaced = sorted(
        framework
        for framework in third_party_imports(MODULES[module]) & FRAMEWORK_LAYERS.keys()
        if layer not in FRAMEWORK_LAYERS[framework]
    )
    assert not misplaced, (
        f"{module} ({layer}) imports {misplaced}, which belong to {[FRAMEWORK_LAYERS[f] for f in misplaced]}"
    )


def test_no_import_cycles():
    graph = {
        module: {imported for imported in project_imports(path) if imported in MODULES and imported != module}
        for module, path in MODULES.items()
    }
    # Packages import their own submodules only when they say so; a submodule importing its package's
    # __init__ is normal, so edges into a package's own __init__ from inside it are not cycles.
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(sorted(cycle)) for cycle in cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for neighbour in graph[node]:
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in on_stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_checks_catch_what_they_should(tmp_path):
    """The checks themselves fail on an upward import and on a circle."""
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()}) == [{"a", "b"}]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
    assert LAYERS.index(layer_of("ppoflow.flows.train")) > LAYERS.index(layer_of("ppoflow.storage.fs"))
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import ray.util\nfrom prefect.tasks import task\nfrom . import near\n\ndef f():\n    import torch\n"
    )
    assert third_party_imports(sample) == {"ray", "prefect", "torch"}
