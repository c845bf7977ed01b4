"""The suite proves its power (conformance/make/mutants.py): the slots engine passes every case (but the traces with tree
rows, which its slot memory does not model), and each realistic one-line bug in it makes the serving traces report an
unexpected FAIL or ERROR naming a case."""

import re
from functools import lru_cache

import pytest

import reference as R
from conformance.make import mutants as M
from conformance import runner
from conformance.format import HERE, case_dirs, read_manifest

# exceptions that mean the mutated line itself is broken (a typo in the catalogue), not an engine bug that was caught
BROKEN_MUTANT = ("NameError", "AttributeError", "TypeError", "UnboundLocalError", "SyntaxError")


def test_the_slots_engine_passes_every_case_but_the_traces_with_tree_rows_which_it_skips(capsys):
    results, code = runner.run("slots")
    capsys.readouterr()
    assert code == 0 and {r.status for r in results} == {"PASS", "SKIP"}
    assert {r.name.split("@")[0] for r in results} == {folder.name for folder in case_dirs()
                                                       if read_manifest(folder)["kind"] not in runner.STATISTICAL}
    assert {r.name.split("@")[0] for r in results if r.status == "SKIP"} == {
        folder.name for folder in case_dirs() if "trace:tree" in read_manifest(folder)["features"]}
    traces = {r.name for r in results if r.name.startswith("trace-") and "@" in r.name}
    assert {name.split("@")[1] for name in traces} == set(R.ROLLBACK_STRATEGIES)


def test_the_catalogue_holds_at_least_20_distinct_mutants_each_changing_one_line_of_slots_py():
    source = M.SLOTS.read_text()
    assert len(M.CATALOGUE) >= 20 and len({m.name for m in M.CATALOGUE}) == len(M.CATALOGUE)
    assert len({(m.original, m.replacement) for m in M.CATALOGUE}) == len(M.CATALOGUE)
    for mutant in M.CATALOGUE:
        assert mutant.replacement != mutant.original
        changed = [(a, b) for a, b in zip(source.splitlines(), M.mutated_source(mutant, source).splitlines())
                   if a != b]
        assert [a.strip() for a, _ in changed] == [mutant.original, M.REGISTRATION], mutant.name
        compile(M.mutated_source(mutant, source), mutant.name, "exec")


def test_a_line_that_is_not_in_slots_py_exactly_once_is_refused():
    mutant = M.CATALOGUE[0]
    with pytest.raises(ValueError, match="occurs 0 times"):
        M.mutated_source(mutant._replace(original="no such line"), M.SLOTS.read_text())
    source = M.SLOTS.read_text().replace(mutant.original, f"{mutant.original}\n    {mutant.original}")
    with pytest.raises(ValueError, match="occurs 2 times"):
        M.mutated_source(mutant, source)


@lru_cache(maxsize=None)
def documented_rows():
    """INTERPRETING.md's catalogue table: {mutant name: its row}."""
    text = (HERE / "INTERPRETING.md").read_text()
    section = text[text.index("### What the traces catch"):text.index("## 5. Features")]
    return {m: line for line in section.splitlines() for m in re.findall(r"^\| `([a-z0-9-]+)` \|", line)}


def test_interpreting_md_reports_every_mutant_and_how_many_the_traces_catch():
    assert list(documented_rows()) == [m.name for m in M.CATALOGUE]
    caught = sum(not m.escapes for m in M.CATALOGUE)
    assert f"**The traces catch {caught} of the {len(M.CATALOGUE)}.**" in (HERE / "INTERPRETING.md").read_text()


def check_documented(mutant, caught):
    assert documented_rows()[mutant.name] == M.table_row(mutant, caught), (
        "INTERPRETING.md's row differs from the catalogue or from the measurement: run `python -m conformance.make.mutants` "
        "and update its table")


@pytest.mark.parametrize("mutant", M.CATALOGUE, ids=lambda m: m.name)
def test_the_traces_catch_each_mutant(mutant, record_property):
    caught = M.first_catch(mutant)
    if mutant.escapes:
        assert caught is None, (f"{mutant.name} is now caught by {caught.name}: remove its `escapes` in "
                                "conformance/make/mutants.py and update INTERPRETING.md")
    else:
        assert caught is not None, f"no trace catches {mutant.name}: {mutant.does}"
        assert caught.unexpected and caught.status in ("FAIL", "ERROR") and caught.name.startswith("trace-")
        assert not (caught.status == "ERROR" and caught.details[0].startswith(BROKEN_MUTANT)), caught.details
        record_property("caught_first_by", f"{caught.name} ({caught.status})")
    check_documented(mutant, caught)
