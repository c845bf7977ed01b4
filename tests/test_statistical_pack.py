"""The statistical pack (`python -m conformance sample`): correct engines drawing with their own random numbers pass,
each wrong rule drawing with its own random numbers fails (the negative controls), the stated false-alarm rate holds,
and the closed-form distribution the goldens hold is the one reference.accept_speculative draws from."""

import numpy as np
import pytest

import reference as R
from conformance import chisquare, diagnosis, rules, runner
from conformance.make import draws
from conformance.__main__ import main
from conformance.engines import register_engine
from conformance.engines.reference import Reference
from conformance.format import EXPECTED, INPUTS, case_dirs, read_manifest, read_tensors
from test_conformance import run_quietly

PACK = [folder for folder in case_dirs() if read_manifest(folder)["kind"] in runner.STATISTICAL]


def test_the_pack_covers_plain_draws_and_every_q_shape():
    metas = [read_manifest(folder) for folder in PACK]
    assert {meta["attrs"].get("q") for meta in metas if meta["kind"] == "speculative_draws"} == {
        "full", "one-hot", "candidates"}
    assert any(meta["kind"] == "sampling_draws" for meta in metas)
    for meta in metas:       # sized for the stated power against every wrong rule that changes its distribution
        test = meta["outputs"]["outcomes"]["test"]
        assert test["detects"] and min(test["detects"].values()) >= meta["outputs"]["outcomes"]["power"]


def test_the_reference_passes_the_pack(capsys):
    results, code, out = run_quietly("reference", capsys, statistical=True)
    assert code == 0 and len(results) == len(PACK) and {r.status for r in results.values()} == {"PASS"}, out
    assert all("chi-square" in r.note for r in results.values())
    # `run` leaves the pack out, `sample` runs only the pack
    assert not set(results) & {r.name for r in runner.run("reference", pattern="^op-l2norm$")[0]}


def test_the_command_line_runs_the_pack(capsys):
    assert main(["sample", "--engine", "reference", "--cases", "draws-spec-one-hot", "--seed", "7"]) == 0
    assert "draws-spec-one-hot-q" in capsys.readouterr().out


def own_random_engine(rule):
    """reference.py drawing with its own np.random.Generator, one part of the rule replaced."""
    @register_engine(f"test_draws_{rule.name}")
    class Wrong(Reference):
        def draw(self, logits, sampling, n, seed):
            rng, sampling = np.random.default_rng(seed), R.sampling_of(sampling)
            return np.array([[rules.decide(rule.parts, rules.Round([], None, row[None], sampling), [u])[1]
                              for u in rng.random(n)] for row in logits])

        def accept_draws(self, draft, q, logits, sampling, n, seed):
            rng, r = np.random.default_rng(seed), rules.Round(list(draft), q, logits, R.sampling_of(sampling))
            return np.array([rules.decide(rule.parts, r, rng.random(len(draft) + 1)) for _ in range(n)]).T
    return Wrong.name


@pytest.mark.parametrize("rule", [rule for rule in rules.WRONG if rule.distribution], ids=lambda rule: rule.name)
def test_each_wrong_rule_drawing_its_own_numbers_is_flagged(rule, capsys):
    """The negative controls: an engine whose draws follow a wrong rule fails every pack case whose distribution the
    rule changes (the case lists it among those it detects)."""
    results, code, out = run_quietly(own_random_engine(rule), capsys, statistical=True, expectations={})
    detecting = {read_manifest(folder)["name"] for folder in PACK
                 if rule.name in read_manifest(folder)["outputs"]["outcomes"]["test"]["detects"]}
    assert detecting and code == 1, out
    assert {name for name, r in results.items() if r.status == "FAIL"} == detecting, out


@pytest.mark.parametrize("folder", PACK, ids=lambda folder: folder.name)
def test_a_correct_engine_fails_a_case_at_the_stated_rate(folder):
    """200,000 simulated correct engines (multinomial draws from the golden distribution) fail the case about alpha of
    the time: the critical value is simulated because the chi-square distribution's own errs up to 3x this far out."""
    meta, expected = read_manifest(folder), read_tensors(folder, EXPECTED)
    spec, n = meta["outputs"]["outcomes"], meta["attrs"]["draws"]
    P, bins = expected["outcomes"], expected[spec["test"]["bins"]]
    groups = [range(P.size)] if meta["kind"] != "sampling_draws" else [range(i * P.shape[1], (i + 1) * P.shape[1])
                                                                         for i in range(len(P))]
    rng, simulations = np.random.default_rng(1), 200_000
    statistics = np.zeros(simulations)
    for p in chisquare.group_bins(P.astype(np.float64), bins, groups):
        counts = rng.multinomial(n, p / p.sum(), size=simulations)
        statistics += ((counts - n * p) ** 2 / (n * p)).sum(axis=1)
    alarms = int((statistics > spec["test"]["critical"]).sum())
    assert 3 <= alarms <= 50, f"{alarms} false alarms in {simulations}, {simulations * spec['alpha']:.0f} expected"


@register_engine("test_draws_tree_chain_rule")
class ChainRuleOnSiblings(Reference):
    """Tree acceptance by the chain rule on each edge (diagnosis.tree_chain_rule_on_siblings), its own numbers."""
    def accept_tree_draws(self, tokens, parents, q, logits, sampling, n, seed):
        rng, p = np.random.default_rng(seed), R.probabilities(logits, R.sampling_of(sampling))
        rounds = [diagnosis.tree_chain_rule_on_siblings(list(tokens), list(parents), q, p, rng.random(len(tokens)))
                  for _ in range(n)]
        return np.array([path[-1] for path, _ in rounds]), np.array([t for _, t in rounds])


def test_the_chain_rule_on_tree_siblings_is_flagged(capsys):
    trees = {read_manifest(folder)["name"] for folder in PACK if read_manifest(folder)["kind"] == "tree_draws"}
    results, code, out = run_quietly("test_draws_tree_chain_rule", capsys, statistical=True, expectations={})
    assert trees and code == 1, out
    assert {name for name, r in results.items() if r.status == "FAIL"} == trees, out


def test_tree_outcomes_are_what_the_tree_rules_draw():
    """reference.tree_outcomes and the chain rule's closed form (the tree cases' golden and their test's
    alternative) against 20,000 walks of each rule on a pack case's tree."""
    from scipy import stats
    folder = next(f for f in PACK if f.name == "draws-tree-top-k-one-hot-q")
    meta, inputs = read_manifest(folder), read_tensors(folder, INPUTS)
    tokens, parents, q = list(inputs["tree_tokens"]), list(inputs["tree_parents"]), inputs["q"].astype(np.float64)
    p, n = R.probabilities(inputs["tree_logits"].astype(np.float64), R.sampling_of(meta["attrs"])), 20_000
    for walk, closed in ((R.accept_tree_speculative, R.tree_outcomes),
                         (diagnosis.tree_chain_rule_on_siblings, diagnosis.tree_chain_rule_outcomes)):
        rng, counts = np.random.default_rng(0), np.zeros(p.shape)
        for _ in range(n):
            path, token = walk(tokens, parents, q, p, rng.random(len(tokens)))
            counts[path[-1], token] += 1
        P = closed(tokens, parents, q, p)
        bins, count = chisquare.pooled_bins(P, n, [range(P.size)])
        statistic, impossible = chisquare.chi_square(counts, P, bins, n)
        assert impossible == 0 and stats.chi2.sf(statistic, count - 1) > 1e-3, walk.__name__


def test_speculative_outcomes_is_what_accept_speculative_draws():
    """reference.speculative_outcomes (the pack's goldens) against 20,000 rounds of reference.accept_speculative."""
    folder = next(f for f in PACK if f.name == "draws-spec-full-q-topp")
    meta, inputs = read_manifest(folder), read_tensors(folder, INPUTS)
    sampling, n = R.sampling_of(meta["attrs"]), 20_000
    accepted, tokens = Reference().accept_draws(inputs["drafts"], inputs["q"], inputs["verify_logits"],
                                                meta["attrs"], n, 0)
    counts = np.zeros((len(inputs["drafts"]) + 1, inputs["q"].shape[1]))
    np.add.at(counts, (accepted, tokens), 1)
    P = R.speculative_outcomes(list(inputs["drafts"]), inputs["q"].astype(np.float64),
                               R.probabilities(inputs["verify_logits"].astype(np.float64), sampling))
    bins, count = chisquare.pooled_bins(P, n, [range(P.size)])
    statistic, impossible = chisquare.chi_square(counts, P, bins, n)
    from scipy import stats
    assert impossible == 0 and stats.chi2.sf(statistic, count - 1) > 1e-3
