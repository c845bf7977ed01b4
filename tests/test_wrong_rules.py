"""Every decision the goldens take with supplied uniforms tells the usual wrong rules (conformance/rules.py) from the
spec's: checked on the shipped goldens round by round, and by running each wrong rule as an engine."""

import numpy as np
import pytest

import reference as R
from conformance import rules, runner
from conformance.engines import register_engine
from conformance.engines.reference import Reference
from conformance.format import EXPECTED, INPUTS, case_dirs, read_manifest, read_tensors, trace_batches
from test_conformance import run_quietly


def random_round(rng, K, V=12, sampling=R.Sampling(0.8, 5, 0.9)):
    logits = rng.normal(0, 2, (K + 1, V)).astype(np.float32)
    q = R.softmax(rng.normal(0, 2, (K, V)))
    draft = [int(rng.choice(V, p=row)) for row in q]
    return rules.Round(draft, q, logits, sampling)


def test_the_rules_spec_parts_are_reference_py():
    """rules.decide and rules.outcomes with the spec's parts are reference.accept and reference.speculative_outcomes."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        r = random_round(rng, int(rng.integers(0, 4)))
        u = rng.random(len(r.draft) + 1)
        assert rules.decide(rules.SPEC, r, u) == R.accept(r.draft, r.q, r.logits, r.sampling, u)
        np.testing.assert_array_equal(rules.outcomes(rules.SPEC, r),
                                      R.speculative_outcomes(r.draft, r.q, R.probabilities(r.logits, r.sampling)))


NO_UNIFORMS = np.zeros(0)       # a greedy decision takes none


def supplied_uniform_rounds():
    """(case, round, uniforms, the golden's (accepted, next token) or None where a stop token cut it) of every decision
    with supplied uniforms, and every greedy acceptance, in the goldens, on the float32 logits an engine is compared
    with."""
    for folder in case_dirs():
        meta = read_manifest(folder)
        inputs, expected = read_tensors(folder, INPUTS), read_tensors(folder, EXPECTED)
        sampling = R.sampling_of(meta["attrs"])
        if meta["kind"] == "sampling":
            for row, u, token in zip(inputs["logits"], inputs["uniforms"], expected["tokens"]):
                yield meta["name"], rules.Round([], None, row[None], sampling), u[None], (0, int(token))
        elif meta["kind"] == "speculative" and "accepted" in expected:
            accepted, draft = int(expected["accepted"][0]), list(inputs["verify_tokens"][1:])
            yield (meta["name"], rules.Round(draft, inputs.get("q"), expected["verify_logits"], sampling),
                   inputs.get("uniforms", NO_UNIFORMS), (accepted, int(expected["committed"][-1])))
        elif meta["kind"] == "trace":
            for b, batch in enumerate(trace_batches(meta["attrs"], inputs)):
                for s, step in enumerate(batch):
                    rule = step.get("commit", {})
                    if step["op"] == "verify" and rule.get("accept") in ("sampling", "greedy"):
                        prefix = f"b{b}.s{s}."
                        accepted, committed = int(expected[prefix + "accepted"][0]), expected[prefix + "committed"]
                        cut = len(committed) < accepted + 1
                        r = rules.Round(step["tokens"][1:], rule.get("q"), expected[prefix + "logits"],
                                        R.sampling_of(rule))
                        yield f"{meta['name']} {prefix}", r, rule.get("uniforms", NO_UNIFORMS), None if cut else (
                            accepted, int(committed[-1]))


ROUNDS = list(supplied_uniform_rounds())


def test_every_decision_with_supplied_uniforms_tells_every_wrong_rule_that_applies():
    told = {rule.name: 0 for rule in rules.WRONG}
    for name, r, u, golden in ROUNDS:
        outcome = rules.decide(rules.SPEC, r, u)
        assert golden in (None, outcome), f"{name}: the spec decides {outcome} on the stored logits, golden {golden}"
        assert not rules.undiscriminated(r, u, outcome), name
        for rule in rules.applicable(r, outcome[0]):
            told[rule.name] += 1
    # every rule is told apart by some decision: the sampled rounds cover them all
    assert all(told.values()), told
    assert len(ROUNDS) > 100


def wrong_engine(rule):
    """reference.py with one part of sampling replaced by the rule's."""
    @register_engine(f"test_rule_{rule.name}")
    class Wrong(Reference):
        def sample(self, logits, sampling, uniforms):
            sampling = R.sampling_of(sampling)
            tokens = [rules.decide(rule.parts, rules.Round([], None, row[None], sampling), [u])[1]
                      for row, u in zip(logits, uniforms)]
            return rule.parts.probabilities(logits, sampling), np.array(tokens, dtype=np.int64)

        def accept(self, draft, q, logits, sampling, uniforms):
            return rules.decide(rule.parts, rules.Round(list(draft), q, logits, R.sampling_of(sampling)), uniforms)
    return Wrong.name


@pytest.mark.parametrize("rule", rules.WRONG, ids=lambda rule: rule.name)
def test_each_wrong_rule_as_an_engine_fails_a_case(rule, capsys):
    results, code, out = run_quietly(wrong_engine(rule), capsys, expectations={}, diagnose=False,
                                     pattern="^(sampling-|spec-tiny-dense-|trace-greedy-rematch-tiny-draft-)")
    failed = sorted(name for name, r in results.items() if r.status == "FAIL")
    assert code == 1 and failed, out
