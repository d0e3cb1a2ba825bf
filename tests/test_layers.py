"""One direction of dependency, package by package; no cycle between modules.

Every module of the project is parsed (ast) and every import statement in it is read, including
the ones inside functions, which hide a dependency from a plain `python -c "import ..."`. The
layers, lowest first; a module imports its own layer and the layers below, never one above:

    data_prep               data preparation (encoders, sources, precompute)
    framework.models        backbones, blocks, objectives, conditioning, flops
    framework.data          the Streaming data module and its shard dataset
    framework.distributed   strategies, FSDP2, sequence parallelism, process groups
    framework.inference     checkpoint reading, the sampling pipeline, cached / decoupled sampling, best-of-N
    framework.evaluation    prompt sets, metrics, judges, scoring, own-data fid / clip_score, settings
    framework.training      the LightningModule, optimizer, checkpoint writing, loggers, plugin registry, grids
    framework (top)         config (the schema of every group) and cli (the commands' shared set-up)
    plugins                 one plugin per file or package
    commands                framework.train, sample, eval, export, framework.bench, framework.studies, launch/

So inference never imports training: sampling, evaluation and export run without the training stack.
The benchmark harness (framework.bench.harness and fresh) imports the framework only, no plugin. Benchmarks (timings,
framework.bench) and studies (training runs compared with intervals, framework.studies) are both commands and
never import each other.
Imports by string (importlib, Hydra `_target_`) are not seen; the project keeps those to data sources.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_prep", "framework", "plugins", "launch")
COMMANDS = {"framework.train", "framework.sample", "framework.eval", "framework.export"}
HARNESS = ("framework.bench.harness", "framework.bench.fresh")  # what the benchmarks share
# Lowest first; a module may import its own layer and those below it.
LAYERS = ["data_prep", "framework.models", "framework.data", "framework.distributed", "framework.inference",
          "framework.evaluation", "framework.training", "framework", "plugins", "command"]


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
    """The layer of a module: its subpackage of framework/, or the top-level package, or command."""
    parts = module.split(".")
    if module in COMMANDS or parts[0] == "launch" or parts[:2] in (["framework", "bench"], ["framework", "studies"]):
        return "command"
    if parts[0] == "framework" and len(parts) > 2:  # framework.<package>.<module>
        return ".".join(parts[:2])
    if parts[0] == "framework" and len(parts) == 2 and f"framework.{parts[1]}" in LAYERS:  # a package's __init__
        return module
    return parts[0]  # data_prep, plugins, or framework's top-level modules (config, cli)


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
            # The harness measures the framework alone: no plugin, no command (its parts import each other).
            ceiling = LAYERS.index("framework") if src in HARNESS else LAYERS.index(layer(src))
            if LAYERS.index(layer(dst)) > ceiling and not (src in HARNESS and dst in HARNESS):
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
        "framework/inference/__init__.py": "",
        "framework/inference/pipe.py": "def f():\n    from framework.training.loop import step\n",  # the wrong way
        "framework/training/__init__.py": "",
        "framework/training/loop.py": "from framework.inference.pipe import f\n",  # the right way
    })
    graph = import_graph(tmp_path, ("framework", "plugins"))
    assert graph["framework.d"] == {"framework.a"} and graph["framework.c"] == {"plugins.p"}
    assert cycles(graph) == [["framework.a", "framework.b"], ["framework.bench.harness", "plugins.p"],
                             ["framework.inference.pipe", "framework.training.loop"]]
    assert layer_violations(graph) == [
        ("framework.bench.harness", "plugins.p"),  # the harness depends on the core only
        ("framework.c", "plugins.p"),  # core -> plugin
        ("framework.inference.pipe", "framework.training.loop"),  # inference -> training
        ("plugins.p", "framework.bench.harness"),  # plugin -> benchmark
    ]


# --------------------------------------------------------------------------------------------
# The project
# --------------------------------------------------------------------------------------------


def test_every_package_is_parsed():
    graph = import_graph()
    for module in ("framework.train", "framework.distributed.strategy", "framework.bench.__main__", "framework.bench.harness",
                   "plugins.ema", "plugins.came", "data_prep.precompute"):
        assert module in graph
    assert "plugins" in graph["framework.train"]  # the one place the plugins are loaded for training


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_imports_follow_the_layers():
    assert layer_violations(import_graph()) == []


def test_inference_and_evaluation_import_no_lightning():
    """Sampling, evaluation and export read checkpoints without the training stack: a fresh interpreter that imports
    every module of framework.inference and framework.evaluation has not loaded Lightning."""
    import subprocess
    import sys

    modules = [m for m in import_graph() if m.startswith(("framework.inference", "framework.evaluation"))]
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-500:]


def test_parallel_code_reads_plans_and_never_names_a_family():
    """FSDP2, sequence parallelism, cached sampling, growth, pruning and the cache router take what they need of a
    backbone family from its plan (its file's `plan` in framework/models/families/): none of them compares against a
    family's name, and every model preset's family has a plan."""
    import re

    from framework.models.families import FAMILIES as PLANS

    readers = ["framework/distributed/fsdp.py", "framework/distributed/sequence.py", "framework/inference/caching.py",
               "plugins/growth/__init__.py", "plugins/prune.py", "plugins/cache_router.py"]
    names = "|".join(PLANS)
    for rel in readers:
        found = re.findall(rf"""["']({names})["']""", (ROOT / rel).read_text())
        assert not found, f"{rel} names the families {sorted(set(found))}: read them from the family's plan instead"
    families = {re.search(r"^family:\s*(\w+)", p.read_text(), re.M).group(1) for p in (ROOT / "conf" / "model").glob("*.yaml")}
    assert families == set(PLANS), families


def test_only_the_family_files_compare_family_names():
    """One family, one file: code outside framework/models/families/ asks the family object (`family_of(cfg)`) for a
    capability and never compares `family` against a name (==, !=, in, not in), nor keys a table by family names."""
    import re

    from framework.models.families import FAMILIES

    names = "|".join(FAMILIES)
    comparison = re.compile(r"family\s*(==|!=|\bin\b|\bnot in\b)")
    keyed = re.compile(rf"""^\s*["']({names})["']\s*:""", re.M)  # a dict row keyed by a family's name
    found = []
    for name, path in find_modules(ROOT).items():
        if name.startswith("framework.models.families"):
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}"
                  for pattern in (comparison, keyed) for m in pattern.finditer(text)]
    assert not found, found


def test_benchmarks_and_studies_never_import_each_other():
    graph = import_graph()
    crossing = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                      for a, b in (("framework.bench", "framework.studies"), ("framework.studies", "framework.bench"))
                      if (m == a or m.startswith(a + ".")) and (t == b or t.startswith(b + ".")))
    assert not crossing, crossing
    assert "framework.studies.growth" in graph and "framework.bench.suite_train" in graph


# The tests' own layout: test modules, the helpers they share, and the programs multi-process tests start.
TEST_SUPPORT = {"__init__", "conftest", "helpers", "zygote", "config_keys", "mutants"}


def test_test_modules_share_helpers_and_never_import_one_another():
    """tests/ holds test_*.py, the shared helpers (helpers.py, conftest.py's fixtures, zygote.py's process
    launcher, the config-key record and the mutation check) and workers/ (what multi-process tests start); a test
    module importing another one (or conftest) would make its helpers hard to find and import its tests twice."""
    tests = ROOT / "tests"
    stray = sorted(p.stem for p in tests.glob("*.py") if not p.stem.startswith("test_") and p.stem not in TEST_SUPPORT)
    assert not stray, f"tests/ holds {stray}: shared helpers go in tests/helpers.py, workers in tests/workers/"
    wrong = []
    for p in sorted([*tests.glob("*.py"), *(tests / "workers").glob("*.py")]):
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("tests.test_") or name == "tests.conftest":
                    wrong.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not wrong, "\n".join(wrong)
