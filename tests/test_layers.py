"""One direction of dependency: data_prep, then the framework core, then plugins, then the commands.

Every module of the project is parsed (ast) and every import statement in it is read, including
the ones inside functions, which hide a dependency from a plain `python -c "import ..."`. The
layers, lowest first:

    data_prep  data preparation                      imports only data_prep
    core       framework/*, except the commands      imports data_prep and the core
    plugin     plugins/*                             imports data_prep, the core and plugins
    bench      framework/bench/*                     imports the layers below (the harness: the core only)
    command    framework.train, sample, eval, export imports anything

and no two modules may import each other, directly or around a longer cycle. Imports by string
(importlib, Hydra `_target_`) are not seen; the project keeps those to data sources.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_prep", "framework", "plugins", "launch")
COMMANDS = {"framework.train", "framework.sample", "framework.eval", "framework.export"}
HARNESS = "framework.bench.harness"
# What each layer may import (every layer may import itself).
ALLOWED = {
    "data_prep": {"data_prep"},
    "core": {"data_prep", "core"},
    "plugin": {"data_prep", "core", "plugin"},
    "bench": {"data_prep", "core", "plugin", "bench"},
    "command": {"data_prep", "core", "plugin", "bench", "command"},
}


# --------------------------------------------------------------------------------------------
# The import graph
# --------------------------------------------------------------------------------------------


def find_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (a package is its __init__.py)."""
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to: itself, or the nearest enclosing module (an attribute import)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in (or is, for an __init__)
                base_parts = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.update(t for t in (_resolve(t, modules) for t in targets) if t is not None and t != name)
    return out


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    modules = find_modules(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer(module: str) -> str:
    if module == "framework.bench" or module.startswith("framework.bench."):
        return "bench"
    if module in COMMANDS or module.split(".")[0] == "launch":
        return "command"
    if module.split(".")[0] == "plugins":
        return "plugin"
    if module.split(".")[0] == "data_prep":
        return "data_prep"
    return "core"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that go against the direction of the layers."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            allowed = {"core", "data_prep"} if src == HARNESS else ALLOWED[layer(src)]
            if layer(dst) not in allowed:
                bad.append((src, dst))
    return bad


# --------------------------------------------------------------------------------------------
# The checker finds what it should (a tiny project written for it)
# --------------------------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_sees_cycles_and_wrong_directions_inside_functions(tmp_path):
    _write(tmp_path, {
        "framework/__init__.py": "",
        "framework/a.py": "def f():\n    from framework.b import g\n",
        "framework/b.py": "from framework import a\n",
        "framework/c.py": "import plugins.p\n",
        "framework/d.py": "from . import a\n",  # relative: framework.a, no cycle
        "framework/train.py": "import plugins\nfrom framework.bench import harness\n",
        "framework/bench/__init__.py": "",
        "framework/bench/harness.py": "from plugins import p\n",
        "plugins/__init__.py": "from plugins import p\n",
        "plugins/p.py": "def f():\n    from framework.bench.harness import x\n",
    })
    graph = import_graph(tmp_path, ("framework", "plugins"))
    assert graph["framework.d"] == {"framework.a"} and graph["framework.c"] == {"plugins.p"}
    assert cycles(graph) == [["framework.a", "framework.b"], ["framework.bench.harness", "plugins.p"]]
    assert layer_violations(graph) == [
        ("framework.bench.harness", "plugins.p"),  # the harness depends on the core only
        ("framework.c", "plugins.p"),  # core -> plugin
        ("plugins.p", "framework.bench.harness"),  # plugin -> benchmark
    ]


# --------------------------------------------------------------------------------------------
# The project
# --------------------------------------------------------------------------------------------


def test_every_package_is_parsed():
    graph = import_graph()
    for module in ("framework.train", "framework.strategy", "framework.bench.__main__", "framework.bench.harness",
                   "plugins.ema", "plugins.came", "data_prep.precompute"):
        assert module in graph
    assert "plugins" in graph["framework.train"]  # the one place the plugins are loaded for training


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_imports_follow_the_layers():
    assert layer_violations(import_graph()) == []
