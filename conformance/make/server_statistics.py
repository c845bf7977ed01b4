"""The sizing behind check-server's distribution scenarios (INTERPRETING.md section 11, "Sampled requests"):

    python -m conformance.make.server_statistics [CHECKPOINT ...]     (default: tiny-mtp)
    python -m conformance.make.server_statistics --simulate REPETITIONS [CHECKPOINT]

For each scenario with "distribution": true and each checkpoint it prints the tests as check-server runs them on a
correct server (degrees of freedom, the critical value at tolerances.json "draws" alpha) and their chance of failing
a server that draws under each wrong rule of conformance/rules.py that changes the distribution (noncentral
chi-square, as the statistical pack is sized: conformance/make/draws.py), for the scenario's counts and the ladder
COUNTS; a scenario's count is the least in COUNTS with tolerances.json "draws" power against every such rule:

  * first-token: the rules that change a plain draw (the temperature ignored, applied after top-k and top-p);
  * second-token of n-gram drafted requests: after the prompt and a first token t0 the spec's prompt lookup
    (reference.prompt_lookup, which jax_impl's drafter follows) gives the round's draft, so each rule's distribution
    of the second token is known in closed form (rules.outcomes of that round), for the prefixes prompt + t0 expected
    at least MIN_EXPECTED_GROUP times.

--simulate decodes the scenarios with reference.py under the speculative rules (reference.py's drafters standing in
for the server's) and counts how often the later-tokens test fails them."""

import numpy as np

from .. import reference as R, rules
from ..check_server import Answer, Spec, expand, load_scenarios
from ..chisquare import TEST, bin_totals, group_bins, pooled_bins
from ..server_statistics import SIMULATIONS, critical_value, later_tokens_test, later_uniforms, rng_for, sampling_of
from .draws import detection

COUNTS = (25, 50, 100, 200, 400, 800)
MIN_EXPECTED_GROUP = 20


def groups_of(scenario, spec):
    """{(prompt, sampling): (count, the spec's logits after the prompt)} of the scenario's sampled requests."""
    found = {}
    for _, r in expand(scenario, spec, spec.cfg.max_position_embeddings, None):
        if r.temperature > 0:
            key = (tuple(r.prompt), sampling_of(r))
            count, z = found.get(key, (0, None))
            found[key] = (count + 1, spec.logits(list(r.prompt))[-1].astype(np.float64) if z is None else z)
    return found


def sizing(name, groups, n):
    """The first-token test with n draws per group -> (degrees of freedom, critical value, {rule: detection})."""
    P0 = np.stack([R.probabilities(z, s) for (_, s), (_, z) in groups.items()])
    V = P0.shape[1]
    flat = [range(g * V, (g + 1) * V) for g in range(len(P0))]
    bins, count = pooled_bins(P0, n, flat)
    df = count - len(P0)
    critical = critical_value(group_bins(P0, bins, flat), [n] * len(P0), rng_for(name, "sizing", n), SIMULATIONS)
    power = {}
    for rule in rules.WRONG:
        if not rule.distribution:
            continue
        P1 = np.concatenate([rules.outcomes(rule.parts, rules.Round([], None, z[None], s))
                             for (_, s), (_, z) in groups.items()])
        if np.abs(P1 - P0).sum() > 1e-9:
            power[rule.name] = detection(P0, P1, bins, n, flat, df, critical)
    return df, critical, power


def second_token_distribution(parts, spec, prefix, sampling, K):
    """The chance of each second token after `prefix` (prompt + t0) under `parts`, the round's drafts the prompt
    lookup's (a plain draw where it finds none)."""
    draft = R.prompt_lookup(list(prefix), K)
    logits = spec.logits(list(prefix) + draft)[len(prefix) - 1:].astype(np.float64)
    if not draft:
        return rules.outcomes(parts, rules.Round([], None, logits[:1], sampling))[0]
    O = rules.outcomes(parts, rules.Round(draft, R.one_hot(draft, spec.cfg.vocab_size).astype(np.float64), logits,
                                          sampling))
    marginal = O[0].copy()
    marginal[draft[0]] += O[1:].sum()
    return marginal


def second_token_sizing(name, spec, scenario, counts):
    """-> {count: (degrees of freedom, critical value, {rule: detection}, prefixes)} for the scenario's n-gram
    drafted sampled requests, `count` of each."""
    from scipy import stats as scipy_stats   # as the statistical pack's sizing (draws.detection)
    requests = [r for _, r in expand(scenario, spec, spec.cfg.max_position_embeddings, None)
                if r.temperature > 0 and r.draft == "ngram"]
    settings = sorted({(tuple(r.prompt), sampling_of(r), min(r.draft_len or 4, r.max_tokens - 2)) for r in requests})
    results = {}
    for count in counts:
        prefixes = []
        for prompt, sampling, K in settings:
            z = spec.logits(list(prompt))[-1].astype(np.float64)
            for t0, p in enumerate(R.probabilities(z, sampling)):
                if count * p >= MIN_EXPECTED_GROUP:
                    prefixes.append((prompt + (t0,), sampling, K, int(round(count * p))))
        if not prefixes:
            continue
        P0 = [second_token_distribution(rules.SPEC, spec, *g[:3]) for g in prefixes]
        binned = [pooled_bins(p[None], g[3], [range(len(p))]) for p, g in zip(P0, prefixes)]
        df = sum(c - 1 for _, c in binned)
        critical = critical_value([bin_totals(p[None], b) for p, (b, _) in zip(P0, binned)],
                                  [g[3] for g in prefixes], rng_for(name, "second-sizing", count), SIMULATIONS)
        power = {}
        for rule in rules.WRONG:
            if not rule.distribution:
                continue
            P1 = [second_token_distribution(rule.parts, spec, *g[:3]) for g in prefixes]
            if max(np.abs(a - b).sum() for a, b in zip(P0, P1)) < 1e-9:
                continue
            noncentrality = sum(g[3] * float(((bin_totals(b1[None], bins) - bin_totals(b0[None], bins)) ** 2
                                              / bin_totals(b0[None], bins)).sum())
                                for b0, b1, (bins, _), g in zip(P0, P1, binned, prefixes))
            power[rule.name] = 1 - float(scipy_stats.ncx2.cdf(critical, df, noncentrality))
        results[count] = (df, critical, power, len(prefixes))
    return results


def report(name):
    spec = Spec(R.DEFAULT_MODEL.parent / name)
    for scenario in load_scenarios():
        if not scenario.get("distribution"):
            continue
        groups = groups_of(scenario, spec)
        counts = sorted({count for count, _ in groups.values()})
        print(f"{name} {scenario['name']}: {len(groups)} groups of {counts} sampled requests")
        least = None
        for n in sorted(set(COUNTS) | set(counts)):
            df, critical, power = sizing(scenario["name"], groups, n)
            enough = bool(power) and min(power.values()) >= TEST["power"]
            least = least or (n if enough else None)
            print(f"  first-token, {n:>4} per group: {df} degrees of freedom, critical {critical:.4g}; detects "
                  + (", ".join(f"{rule} {p:.4f}" for rule, p in sorted(power.items())) or "no rule (none applies)")
                  + ("  <- the scenario's" if n in counts else ""))
        print(f"  least count per group with power {TEST['power']} against every rule: {least}")
        ngram = sorted({r.get("count", 1) for r in scenario["requests"] if r.get("draft") == "ngram"
                        and r.get("temperature", 0) > 0})
        second = second_token_sizing(scenario["name"], spec, scenario, sorted(set(COUNTS) | set(ngram)))
        for n, (df, critical, power, prefixes) in second.items():
            print(f"  second-token of the n-gram requests, {n} per group ({prefixes} prefixes expected at least "
                  f"{MIN_EXPECTED_GROUP} times): {df} degrees of freedom, critical {critical:.4g}; detects "
                  + ", ".join(f"{rule} {p:.4f}" for rule, p in sorted(power.items()))
                  + ("  <- the scenario's" if n in ngram else ""))
        if second:
            least = min((n for n, (_, _, power, _) in second.items() if power
                         and min(power.values()) >= TEST["power"]), default=None)
            print(f"  least count per n-gram group with power {TEST['power']} against every rule: {least}")


# ----------------------------------------------------------------------------------------------------------------
# The later-tokens test against engines that decode speculatively under a wrong rule, simulated with reference.py's
# own drafters standing in for the server's (the rule replaces the spec's function by name, as diagnosis.py does)

def accept_bonus_from_previous_row(draft, q, p, u):
    K = len(draft)
    for i, x in enumerate(draft):
        if not u[i] < R.acceptance(p[i, x], q[i, x]):
            return i, R.sample(R.residual(p[i], q[i]), u[K])
    return K, R.sample(p[max(K - 1, 0)], u[K])


SIMULATED = {  # rules.py's speculative rules, as replacements of reference.py functions
    "spec": {},
    "residual-from-p": {"residual": lambda p_i, q_i: p_i},
    "ratio-inverted": {"acceptance": lambda p_x, q_x: 1.0 if p_x == 0 else min(1.0, q_x / p_x)},
    "bonus-from-previous-row": {"accept_speculative": accept_bonus_from_previous_row},
}


def simulated_server(scenario, spec, repetition, patches):
    """The scenario's requests decoded by reference.py under `patches` (seeds moved by the repetition) -> (requests,
    answers as check-server's, ids only)."""
    saved = {name: getattr(R, name) for name in patches}
    requests, answers = expand(scenario, spec, spec.cfg.max_position_embeddings, None), []
    try:
        for name, wrong in patches.items():
            setattr(R, name, wrong)
        for _, r in requests:
            rng, answer, sampling = np.random.default_rng([repetition, r.seed]), Answer(), sampling_of(r)
            if r.draft in (None, "none"):
                answer.ids = R.generate(spec.params, spec.cfg, r.prompt, r.max_tokens, sampling, rng)[0]
            else:
                drafter = R.mtp_drafter(spec.params, spec.cfg) if r.draft == "mtp" else R.ngram_drafter(
                    spec.cfg.vocab_size)
                answer.ids = R.generate_speculative(spec.params, spec.cfg, r.prompt, r.max_tokens, sampling, rng,
                                                    drafter, r.draft_len or 4)[0]
            answers.append(answer)
    finally:
        for name, original in saved.items():
            setattr(R, name, original)
    return requests, answers


def simulated_power(name, repetitions, margin):
    spec = Spec(R.DEFAULT_MODEL.parent / name)
    for scenario in load_scenarios():
        if not scenario.get("distribution"):
            continue
        for rule, patches in SIMULATED.items():
            failed, statistics, test = 0, [], None
            for repetition in range(repetitions):
                requests, answers = simulated_server(scenario, spec, repetition, patches)
                test = later_tokens_test(scenario["name"], later_uniforms(scenario, requests, answers, spec,
                                                                          margin)[0])
                if test is None:
                    break
                failed += not test["passed"]
                statistics.append(test["statistic"])
            if statistics:
                print(f"{name} {scenario['name']} later-tokens under {rule}: failed {failed} of {len(statistics)} "
                      f"(statistics {np.round(statistics, 1).tolist()}, critical {test['critical']:.4g})", flush=True)


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["--simulate"]:
        from ..format import TOLERANCES
        simulated_power(sys.argv[3] if len(sys.argv) > 3 else "tiny-mtp", int(sys.argv[2]),
                        TOLERANCES["server"]["greedy_margin"]["float32"])
    else:
        for checkpoint in sys.argv[1:] or ("tiny-mtp",):
            report(checkpoint)
