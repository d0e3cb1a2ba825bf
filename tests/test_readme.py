"""Every command the README (and each docs/ page) shows is accepted by the command it names: same module, keys that
exist, values of the right type. Each runs with Hydra's `--cfg job` (compose and print, nothing trained or read), so the README's
placeholder paths (/data/my_images, /models/...) need not exist. What the commands then do is run for real
elsewhere: the quickstart in test_train.py, the own-images recipe (precompute, train, sample, eval, export)
in test_own_data.py, sbatch and the submitit sweep in test_slurm.py, each plugin's command in its own file.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from tests import zygote

ROOT = Path(__file__).resolve().parents[1]
NOT_HYDRA = {"pytest"}  # `python -m pytest -q tests`: the suite itself


def readme_commands(path: Path = ROOT / "README.md") -> list[tuple[str, list[str]]]:
    """(module, arguments) of every `python -m MODULE ...` in the README's bash blocks (continuation lines joined,
    comments dropped, `a && b` split); `sbatch ... launch/NAME.sbatch ARGS` is the module that script runs
    (`python -m MODULE` in it) with ARGS, and `sbatch ... --wrap "COMMAND"` the command it wraps."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        lines = block.replace("\\\n", " ").splitlines()
        while lines:
            tokens = shlex.split(lines.pop(0), comments=True)
            if tokens[:1] == ["sbatch"] and "--wrap" in tokens:
                lines.insert(0, tokens[tokens.index("--wrap") + 1])
                continue
            while tokens:
                cut = tokens.index("&&") if "&&" in tokens else len(tokens)
                part, tokens = tokens[:cut], tokens[cut + 1:]
                if part[:2] == ["python", "-m"] and part[2] not in NOT_HYDRA:
                    found.append((part[2], part[3:]))
                elif part[:1] == ["sbatch"]:
                    script = next(i for i, t in enumerate(part) if t.endswith(".sbatch"))
                    text = (ROOT / part[script]).read_text()
                    runs = re.findall(r"^\s*(?:srun .*)?(?:\$\{LATENTFORGE_EXEC:-\} )?python -m ([\w.]+)", text, re.M)
                    assert len(set(runs)) == 1, (part[script], runs)
                    found.append((runs[0], part[script + 1:]))
    return found


# The README's placeholders that name something in conf/ (paths need not exist for --cfg job).
PLACEHOLDERS = {"experiment=NAME": "experiment=pixart_xl_2_256"}


def as_one_job(module: str, args: list[str]) -> list[str]:
    """The command line of one job with `--cfg job`: a sweep (-m, a=1,2) as its first job, `...` (the README's
    "and the rest") dropped, placeholders filled; `--cfg job` before the overrides (after a bench suite's or a study's name)."""
    out = []
    for a in args:
        if a in ("-m", "..."):
            continue
        key, _, value = a.partition("=")
        if "," in value and not value.startswith(("[", "'", '"')):
            a = f"{key}={value.split(',')[0]}"
        out.append(PLACEHOLDERS.get(a, a))
    head = 1 if module in ("framework.bench", "framework.studies") else 0
    return [*out[:head], "--cfg", "job", *out[head:]]


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = [(f"{page.name}: {module}", module, args) for page in DOCS for module, args in readme_commands(page)]


def test_the_readme_shows_every_public_command():
    modules = {m for m, _ in readme_commands()}
    assert {"framework.train", "framework.sample", "framework.eval", "framework.export", "framework.bench", "framework.studies",
            "data_prep.precompute", "plugins.growth", "plugins.prune"} <= modules, modules


@pytest.mark.parametrize("module,args", [c[1:] for c in COMMANDS], ids=[" ".join([w, *a])[:90] for w, _, a in COMMANDS])
def test_a_readme_command_is_accepted_as_written(module, args):
    proc = zygote.run([sys.executable, "-m", module, *as_one_job(module, args)], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_ci_floors_are_the_lowest_versions_pyproject_allows():
    """.ci/floors.txt (the floors job of .ci/run) pins each package of the training stack to its floor in pyproject.toml:
    the versions CI tests are the oldest a user may install."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = {Requirement(d).name: Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
            ["dependencies"]}
    pins = [Requirement(line) for line in (ROOT / ".ci/floors.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {"torch", "torchvision", "lightning", "diffusers", "transformers"} <= {p.name for p in pins}
    for pin in pins:
        (spec,) = pin.specifier
        floors = [s.version for s in deps[pin.name].specifier if s.operator == ">="]
        assert floors and Version(floors[0]) == Version(spec.version), (pin, deps[pin.name])
        assert deps[pin.name].specifier.contains(spec.version), (pin, deps[pin.name])
