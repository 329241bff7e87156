"""The project's floors, bottom up, as its imports must show them:

    0  m3_kernels (kernels/)      the Triton kernels and the host code both frameworks' ops need
    1  m3_torch / m3_jax ops      public ops, cache views, interop
    2  m3_engine                  the framework-neutral engine; it defines the runner protocol
    3  m3_torch / m3_jax models   model, runner, rank, tensor parallelism, EAGLE-3 draft, ``LLM``
    4  m3_engine.cli / .server    the CLI and the server (a package)

A module imports modules of its own floor and the floors below, never those of the other
framework: m3_torch and m3_jax never import each other, the kernels and the engine neither one
(nor torch, nor JAX). The engine reaches a framework in one place, by name at run time
(``m3_engine.engine_class``), and ``m3_torch.LLM`` / ``m3_jax.LLM`` and the engine names they
re-export (``SamplingParams`` ...) resolve on first use: ``import m3_torch`` for one op loads no
engine.

Checked two ways:

* what importing each package loads, in fresh interpreters (one per case, run together);
* from the source (ast; nothing runs): every import, inside functions too, respects the floors;
  no import cycle (so no import inside a function hides one); no framework where none belongs;
  no ``_private`` name of another module imported or read.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"m3_kernels": ROOT / "kernels", "m3_engine": ROOT / "m3_engine", "m3_torch": ROOT / "m3_torch",
            "m3_jax": ROOT / "m3_jax"}
# the third-party frameworks, and the framework each belongs to
FRAMEWORK_OF = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "jax_triton": "jax"}
# modules of m3_torch / m3_jax above the engine (floor 3); the others are their ops (floor 1)
MODEL_MODULES = {"model", "runner", "rank", "tp", "eagle3", "llm", "dummy_weights"}
FRONT_ENDS = ("m3_engine.cli", "m3_engine.server")   # these modules and their submodules


def floor(module: str) -> tuple[int, str | None]:
    """(floor, framework) of one of the project's modules: floor 0..4 as in the docstring; framework
    "torch", "jax" or None (the kernels and the engine)."""
    package, _, name = module.partition(".")
    if package == "m3_kernels":
        return 0, None
    if package == "m3_engine":
        return (4 if module.startswith(FRONT_ENDS) else 2), None
    return (3 if name in MODEL_MODULES else 1), package.removeprefix("m3_")


@functools.cache
def modules() -> dict:
    """Module name -> its source path, for every module of the project's packages."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            out[".".join(parts[:-1] if path.stem == "__init__" else parts)] = path
    return out


def imports(name: str, path: pathlib.Path, *, module_level: bool) -> list[tuple[str, str | None, str]]:
    """(module, name imported from it or None, the name bound) of each import of a module, absolute:
    ``import a.b`` gives ("a.b", None, "a"), ``from a import b as c`` ("a", "b", "c"), where ``b``
    is a name of ``a`` or its submodule ``a.b``."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    tree = parse(path)
    found = []
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, a.asname or top(a.name)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found += [(base, a.name, a.asname or a.name) for a in node.names]
    return found


@functools.cache
def parse(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text())


def imported_modules(name: str, path: pathlib.Path, *, module_level: bool) -> set:
    """The project's modules a module imports (``from . import x`` imports x, not the package)."""
    mods = modules()
    out = set()
    for module, what, _ in imports(name, path, module_level=module_level):
        if what is not None and f"{module}.{what}" in mods:
            out.add(f"{module}.{what}")
        elif module in mods:
            out.add(module)
    return out - {name}


def top(name: str) -> str:
    return name.split(".")[0]


def private_uses(name: str, path: pathlib.Path) -> set:
    """``module._name`` for each ``_private`` name of another of the project's modules that a module
    imports (``from module import _name``) or reads (``module._name``, ``module`` imported as a module)."""
    mods = modules()
    found, modules_bound = set(), {}
    for module, what, bound in imports(name, path, module_level=False):
        if what is None:   # "import a.b" binds a, "import a.b as c" binds c to a.b
            modules_bound[bound] = top(module) if bound == top(module) else module
        elif f"{module}.{what}" in mods:
            modules_bound[bound] = f"{module}.{what}"
        elif module in mods and is_private(what):
            found.add(f"{module}.{what}")
    for node in ast.walk(parse(path)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and is_private(node.attr)
                and modules_bound.get(node.value.id) in mods):
            found.add(f"{modules_bound[node.value.id]}.{node.attr}")
    return found


def is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


# -- what importing each package loads ---------------------------------------------------------

LOADED = """
import json, sys
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.fixture(scope="module")
def loaded() -> dict:
    """-> {case: the modules loaded by importing it}, each case in a fresh interpreter (all run together):
    a package; for the engine every module of its floor; for the front ends the CLI and the server."""
    engine = sorted(m for m in modules() if floor(m) == (2, None))
    front_ends = ["m3_engine.cli"] + (["m3_engine.server.cli"] if importlib.util.find_spec("fastapi") else [])
    cases = {"m3_kernels": ["m3_kernels"], "m3_torch": ["m3_torch"], "m3_jax": ["m3_jax"], "m3_engine": engine,
             "m3_engine.cli": front_ends}
    procs = {case: subprocess.Popen([sys.executable, "-c", LOADED, *names], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for case, names in cases.items()
             if case not in ("m3_torch", "m3_jax") or importlib.util.find_spec(case.removeprefix("m3_"))}
    out = {}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"importing {cases[case]} failed:\n{stderr}"
        out[case] = set(json.loads(stdout))
    return out


def project(mods: set, package: str) -> set:
    return {m for m in mods if m == package or m.startswith(package + ".")}


@pytest.mark.parametrize("case", ["m3_kernels", "m3_torch", "m3_jax", "m3_engine", "m3_engine.cli"])
def test_importing_a_package_loads_no_floor_above_it(loaded, case):
    if case not in loaded:
        pytest.skip(f"{case.removeprefix('m3_')} is not installed")
    mods = loaded[case]
    ours = {m for p in PACKAGES for m in project(mods, p)}
    assert case in ours, f"{case}: not among the loaded modules"
    level, framework = floor(case)
    above = sorted(m for m in ours if floor(m)[0] > level or floor(m)[1] not in (None, framework))
    assert not above, f"import {case} loads modules of a floor above it or of another framework: {above}"
    frameworks = sorted(m for m in FRAMEWORK_OF if m in mods and FRAMEWORK_OF[m] != framework)
    assert not frameworks, f"import {case} loads {frameworks}"


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_ops_packages_still_name_the_engine(framework):
    """``from m3_torch import LLM, SamplingParams, ...`` works (the names resolve on first use),
    and ``__all__`` and ``dir()`` list them."""
    import m3_engine

    package = pytest.importorskip(f"m3_{framework}")
    names = {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput"}
    assert names <= set(package.__all__) and names <= set(dir(package))
    assert [n for n in package.__all__ if not hasattr(package, n)] == []
    assert package.SamplingParams is m3_engine.SamplingParams
    assert package.RequestOutput is m3_engine.RequestOutput
    assert package.LLM is m3_engine.engine_class(framework)
    with pytest.raises(AttributeError, match="no_such_name"):
        package.no_such_name


# -- the imports, read from the source ----------------------------------------------------------

def test_no_module_imports_a_floor_above_it():
    """Inside functions too: a lazy import of a floor above would only hide the layering."""
    checked = 0
    for name, path in modules().items():
        level, framework = floor(name)
        for target in imported_modules(name, path, module_level=False):
            t_level, t_framework = floor(target)
            assert t_level <= level and t_framework in (None, framework), (
                f"{name} (floor {level}, {framework or 'no framework'}) imports {target} "
                f"(floor {t_level}, {t_framework or 'no framework'})")
        checked += 1
    assert checked > 40


def test_frameworks_only_where_they_belong():
    """The kernels and the engine import no framework, anywhere; m3_torch imports no JAX and m3_jax
    no torch at module level (m3_jax's CPU path imports torch where it first runs a kernel)."""
    for name, path in modules().items():
        framework = floor(name)[1]
        every = {top(m) for m, _, _ in imports(name, path, module_level=False)}
        at_load = {top(m) for m, _, _ in imports(name, path, module_level=True)}
        bad = {m for m in (at_load if framework else every) if FRAMEWORK_OF.get(m, framework) != framework}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_the_engine_reaches_a_framework_in_one_place():
    """``m3_engine.engine_class`` imports ``m3_<framework>.llm`` by name; no other code of the engine's
    floor calls ``importlib.import_module`` / ``__import__`` (the server's engine process, a front end,
    builds the ``LLM`` class it is named as ``"module:Name"``)."""
    callers = []
    for name, path in modules().items():
        if floor(name) != (2, None):
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if called in ("import_module", "__import__"):
                    callers.append(name)
    assert callers == ["m3_engine"]


def test_no_import_cycles():
    """Among all imports, inside functions too: none may only be dodging a cycle."""
    mods = modules()
    graph = {name: imported_modules(name, path, module_level=False) for name, path in mods.items()}
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
    assert len(state) == len(mods) > 40


def test_no_private_name_crosses_modules():
    found = {(name, use) for name, path in modules().items() for use in private_uses(name, path)}
    assert not found, f"private names used across modules: {sorted(found)}"
