"""tests/config_keys.py's record against the code: one entry per config key, and only tests and mutants that exist.

Introspection and ast only: nothing is trained or built (few test functions on purpose: tests/conftest.py collects
garbage after each one). Whether a key has a test is not checked here; the table (`python tests/config_keys.py
--markdown`) shows the keys that no test observes.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from tests.config_keys import KEYS, ROOT, config_keys
from tests.mutants import MUTANTS


@functools.cache
def defined_tests(path: Path) -> frozenset[str]:
    """The test functions a file defines: `test_x` at module level, `Class::test_x` for a method."""
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    names = {n.name for n in tree.body if isinstance(n, functions)}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{m.name}" for m in cls.body if isinstance(m, functions)}
    return frozenset(n for n in names if n.rpartition("::")[2].startswith("test_"))


def test_every_config_key_has_an_entry_and_every_entry_is_a_key():
    code = config_keys()
    assert len(code) == len(set(code))
    missing = [k for k in code if k not in KEYS]
    gone = [k for k in KEYS if k not in code]
    assert not missing and not gone, (
        f"tests/config_keys.py KEYS is out of step with the config: keys without an entry (add them, with tests [] if "
        f"none): {missing}; entries for keys the config no longer has (remove them): {gone}")


def test_every_entry_has_its_test_list_and_mutant():
    bad = {k: e for k, e in KEYS.items()
           if not isinstance(e, dict) or set(e) != {"tests", "mutant"} or not isinstance(e["tests"], list)
           or not (e["mutant"] is None or isinstance(e["mutant"], str)) or len(set(e["tests"])) != len(e["tests"])}
    assert not bad, f"entries must be {{'tests': [unique test ids], 'mutant': name or None}}: {bad}"


def test_every_listed_test_is_defined():
    missing = {}
    for key, entry in KEYS.items():
        for test_id in entry["tests"]:
            path, sep, name = re.sub(r"\[.*\]$", "", test_id).partition("::")
            file = ROOT / path
            if not sep or not path.startswith("tests/test_") or not file.is_file() or name not in defined_tests(file):
                missing.setdefault(key, []).append(test_id)
    assert not missing, f"no such test (file::function under tests/), by key: {missing}"


def test_every_listed_mutant_is_in_the_mutants_table():
    known = {m.name for m in MUTANTS}
    unknown = {k: e["mutant"] for k, e in KEYS.items() if e["mutant"] and e["mutant"] not in known}
    assert not unknown, f"mutants not in tests/mutants.py MUTANTS: {unknown}"


def test_every_mutant_still_applies_and_names_tests_that_exist():
    """A mutant whose text moved (a refactor) is reported stale only when someone runs the whole table; here it fails
    at once, as does one whose test was renamed: each edit's text occurs exactly once in its file."""
    stale, missing = {}, {}
    for m in MUTANTS:
        for rel, old, _ in m.edits:
            count = (ROOT / rel).read_text().count(old) if (ROOT / rel).is_file() else 0
            if count != 1:
                stale.setdefault(m.name, []).append(f"{rel}: {count} times")
        for test_id in m.tests:
            path, _, name = re.sub(r"\[.*\]$", "", test_id).partition("::")
            if not (ROOT / path).is_file() or (name and name not in defined_tests(ROOT / path)):  # a file: all of it
                missing.setdefault(m.name, []).append(test_id)
    assert not stale, f"mutants whose text is not in the code exactly once (retarget them): {stale}"
    assert not missing, f"mutants naming tests that do not exist: {missing}"
