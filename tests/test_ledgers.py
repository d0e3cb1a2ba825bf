"""The ledgers' audits (tests/mutants.py, tests/config_keys.py) against hand-made trees: a reflowed line still matches
its mutant, a renamed test or a moved line is reported, and nothing here reads the real table, so renaming a test or
reflowing a product line never fails the suite (.ci/run prints the real audits after it).

Text and ast only: nothing is trained, imported from the product or run.
"""

from __future__ import annotations

from pathlib import Path

from tests.config_keys import audit as keys_audit
from tests.mutants import Mutant, apply, audit, spans

CODE = "def step(x, n, W):\n    return keys(seed, micro, range(r, r + n * W, W), tag)\n"
REFLOWED = ("def step(x, n, W):\n    return keys(\n        seed,\n        micro,\n        range(r, r + n * W, W),\n"
            "        tag\n    )\n")


def test_a_mutants_text_matches_its_line_reflowed_and_nothing_that_only_looks_alike():
    old = "keys(seed, micro, range(r, r + n * W, W), tag)"
    assert spans(CODE, old) == [(CODE.index("keys"), CODE.index("keys") + len(old))]
    assert spans(REFLOWED, old) == [(REFLOWED.index("keys"), len(REFLOWED) - 1)]  # to the closing parenthesis
    assert spans(CODE, "keys(seed, micro, range(r, r + n * W, W), tags)") == []  # another name
    assert spans("return key s(seed)", "return keys(seed)") == []  # words are not joined
    assert spans("returnkeys(seed)", "return keys(seed)") == []  # nor split


def test_a_reflowed_line_is_mutated_in_place(tmp_path: Path):
    (tmp_path / "m.py").write_text(REFLOWED)
    m = Mutant("micro_zero", "", (("m.py", "micro, range(r, r + n * W, W)", "0, range(n)"),), ())
    assert apply(m, tmp_path) is None
    assert (tmp_path / "m.py").read_text() == REFLOWED.replace("micro,\n        range(r, r + n * W, W)", "0, range(n)")
    assert apply(m, tmp_path) == "m.py: the text to change occurs 0 times, expected once"


def test_a_mutated_block_found_at_another_depth_keeps_the_indentation_of_its_code(tmp_path: Path):
    (tmp_path / "m.py").write_text("for k in ks:\n    if k:\n        own[k] = 1\n    n += 1\n")
    m = Mutant("deeper", "", (("m.py", "            own[k] = 1\n", "            pass\n            pass\n"),), ())
    assert apply(m, tmp_path) is None
    assert (tmp_path / "m.py").read_text() == "for k in ks:\n    if k:\n        pass\n        pass\n    n += 1\n"
    (tmp_path / "m.py").write_text("def f():\n    if x:\n                return 1\n")
    m = Mutant("shallower", "", (("m.py", "        if x:\n            return 1", "        if x:\n            return 2"),), ())
    assert apply(m, tmp_path) is None
    assert (tmp_path / "m.py").read_text() == "def f():\n    if x:\n        return 2\n"


def test_the_audits_report_a_renamed_test_a_moved_line_and_a_new_key(tmp_path: Path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_renamed():\n    pass\n\n\nclass TestB:\n"
                                                  "    def test_c(self):\n        pass\n")
    (tmp_path / "m.py").write_text(CODE + CODE)  # the line twice: not a place to mutate
    good = Mutant("good", "", (("m.py", "def step", "def step"),), ())
    m = Mutant("m", "", (("m.py", "return keys", "return 0"),),
               ("tests/test_a.py::test_old[p]", "tests/test_a.py::TestB::test_c", "tests/test_a.py"))
    assert audit([good, m], tmp_path) == [
        "good: stale, its text occurs 2 times in m.py (retarget it)",
        "m: stale, its text occurs 2 times in m.py (retarget it)",
        "m: names tests/test_a.py::test_old[p], which does not exist (renamed? update its tests)"]
    keys = {"a.b": {"tests": ["tests/test_a.py::test_renamed", "tests/test_a.py::test_gone"], "mutant": "no_such"},
            "gone": {"tests": [], "mutant": None}, "bad": {"tests": "tests/test_a.py"}}
    assert keys_audit(keys, ["a.b", "bad", "new"], tmp_path) == [
        "new: a config key without an entry (add one, with tests [] if none)",
        "gone: an entry for a key the config no longer has (remove it)",
        "a.b: names tests/test_a.py::test_gone, which does not exist (renamed? update it)",
        "a.b: mutant no_such is not in tests/mutants.py",
        "bad: the entry must be {'tests': [test ids], 'mutant': name or None}"]
