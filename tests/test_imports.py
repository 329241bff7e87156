"""The package layering, read from the source (no import runs): kernels -> frameworks -> engine.

* ``m3_kernels`` (kernels/) imports no framework and none of the packages above it;
* ``m3_engine`` imports no framework and neither ``m3_torch`` nor ``m3_jax`` at module level
  (a framework is chosen by name at run time, inside a function);
* no import cycle among the project's modules (module-level imports, a package's
  ``__init__`` included).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"m3_kernels": ROOT / "kernels", "m3_engine": ROOT / "m3_engine", "m3_torch": ROOT / "m3_torch",
            "m3_jax": ROOT / "m3_jax"}
FRAMEWORKS = ("torch", "jax", "jaxlib", "jax_triton")


def modules() -> dict:
    """Module name -> its source path, for every module of the project's packages."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def imports(name: str, path: pathlib.Path, *, module_level: bool) -> set:
    """The absolute names a module imports (``from a import b`` gives ``a`` and ``a.b``)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if node.module:   # "from . import x" imports x, not the package it is written in
                found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("package, forbidden", [
    ("m3_kernels", FRAMEWORKS + ("m3_engine", "m3_torch", "m3_jax")),
    ("m3_engine", FRAMEWORKS + ("m3_torch", "m3_jax")),
])
def test_lower_layers_import_nothing_above_them(package, forbidden):
    checked = 0
    for name, path in modules().items():
        if top(name) != package:
            continue
        bad = {i for i in imports(name, path, module_level=True) if top(i) in forbidden}
        assert not bad, f"{name} imports {sorted(bad)} at module level"
        checked += 1
    assert checked >= 5


def test_the_shared_kernels_import_no_framework_anywhere():
    for name, path in modules().items():
        if top(name) == "m3_kernels":
            bad = {i for i in imports(name, path, module_level=False) if top(i) in FRAMEWORKS + ("m3_torch", "m3_jax")}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_no_import_cycles():
    mods = modules()
    graph = {name: {i for i in imports(name, path, module_level=True) if i in mods and i != name}
             for name, path in mods.items()}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert len(state) == len(mods) > 30
