"""tools/mutation_check.py's mutants still aim at train.py and at tests that exist. The check is run by hand
(minutes per mutant): a mutant whose `old` has moved, or whose tests were renamed or moved to another file, ends
as an error instead of a verdict, and the check covers less than it says. This keeps each one applicable."""

import ast
import re

import mutation_check  # tools/ is on the import path (pyproject.toml)
import pytest
from conftest import ROOT


def selected(files: list[str], expression: str | None) -> list[str]:
    """The test functions of files that pytest's -k expression selects (names matched case-insensitively as
    substrings of the function's or the file's name, joined by and, or, not)."""
    chosen = []
    for file in files:
        tree = ast.parse((ROOT / file).read_text())
        for name in (n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")):
            words = f"{name} {file}".lower()
            python = re.sub(
                r"\b(?!and\b|or\b|not\b)(\w+)\b", lambda m, words=words: str(m[1].lower() in words), expression or "x"
            )
            if expression is None or eval(python):
                chosen.append(name)
    return chosen


@pytest.mark.parametrize("mutant", mutation_check.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_changes_one_place_in_train_py_and_names_tests_that_exist(mutant):
    source = (ROOT / "train.py").read_text()
    assert source.count(mutant.old) == 1 and mutant.new != mutant.old, mutant.old
    files = [arg for arg in mutant.tests if arg.endswith(".py")]
    expression = mutant.tests[mutant.tests.index("-k") + 1] if "-k" in mutant.tests else None
    assert files and all((ROOT / f).is_file() for f in files), files
    assert selected(files, expression), f"-k {expression} selects no test in {files}"
