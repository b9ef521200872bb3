"""The mutant set stays applicable: every mutant in tests/mutants/ parses, names a file of this checkout and text
that occurs there exactly once, and its first tests exist (tests/compat/run_mutants.py seeds them one at a time;
a refactor that moves the code must move the mutant with it)."""
import pathlib

import pytest

from tests.mutants import CHECKOUT, every

MUTANTS = every()


def test_the_set_holds_the_defects_fixed_and_the_classic_ones():
    kinds = [m.kind for m in MUTANTS]
    assert kinds.count("history") >= 20 and kinds.count("classic") >= 15, kinds
    assert len({m.id for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_each_mutant_applies_to_today_s_code_and_names_tests_that_exist(mutant, tmp_path):
    source = CHECKOUT / mutant.file
    assert source.is_file(), mutant.file
    copy = tmp_path / mutant.file
    copy.parent.mkdir(parents=True)
    copy.write_text(source.read_text())
    mutant.apply(tmp_path)  # raises unless the original occurs exactly once
    assert copy.read_text() != source.read_text()
    assert mutant.tests, f"{mutant.id}: name the test that kills it"
    for test in mutant.tests:
        path = pathlib.Path(test.split("::")[0])
        assert (CHECKOUT / path).is_file(), test
        assert "distributed" in path.parts or "unit" in path.parts, f"{test}: killers run in the default suite"
