"""The statistical pack: cases for engines that draw with their own random numbers (INTERPRETING.md, section 4).

An engine that cannot take supplied uniforms (llama.cpp, vLLM, SGLang, most others) is asked to draw many times, from
given logits (`sampling_draws`) or through a round of speculative sampling on given drafts and q (`speculative_draws`),
and the runner's `sample` mode compares what it drew with the exact distribution by Pearson's chi-square test. The
goldens are those distributions in closed form (reference.probabilities, reference.speculative_outcomes), with the
test fixed per case: outcomes pooled into bins, the degrees of freedom, the critical value at tolerances.json's
false-alarm rate, and the number of draws, the least of DRAWS for which the test detects every wrong rule
(conformance/rules.py) that changes the case's distribution with tolerances.json's power.
"""

import numpy as np

from .. import diagnosis
from .. import reference as R
from .. import rules
from .. import chisquare
from ..chisquare import TEST, bin_totals, group_bins, pooled_bins
from ..format import Case, Output
from .golden import CANDIDATES, rng_for

DRAWS = (250, 500, 1000, 2000, 4000, 8000, 16000)
V, K = 64, 3                      # a vocabulary of 64 (so few draws fill the bins); K drafts
ATTEMPTS = 100                    # draws of a case's logits (and drafts) tried
SIMULATIONS, CHUNK = 400_000, 50_000   # simulated correct engines that set a case's critical value


def critical_value(P, bins, n, groups, rng):
    """The statistic a correct engine exceeds with tolerances.json's false-alarm rate, from SIMULATIONS simulated
    correct engines (the chi-square distribution's own quantile errs up to 3x in so far a tail at these counts)."""
    return chisquare.critical_value(group_bins(P, bins, groups), [n] * len(groups), rng, SIMULATIONS, CHUNK)


def detection(P0, P1, bins, n, groups, df, critical):
    """The chance that the test fails an engine whose outcomes follow P1 instead of P0 (noncentral chi-square with
    noncentrality n * sum over bins of (P1 - P0)^2 / P0), or that it draws an outcome P0 gives no chance."""
    from scipy import stats           # the generator's only use of scipy
    p0, p1 = bin_totals(P0, bins), bin_totals(P1, bins)
    noncentrality = n * float(((p1 - p0) ** 2 / p0).sum())
    impossible = P1.ravel() * (bins.ravel() < 0)
    clean = np.prod([(1 - impossible[list(group)].sum()) ** n for group in groups])
    return 1 - clean * float(stats.ncx2.cdf(critical, df, noncentrality))


def sized_test(name, P0, alternatives, groups):
    """The least number of draws in DRAWS with which the test detects every alternative distribution with
    tolerances.json's power -> (draws, bins, degrees of freedom, critical value, {rule: detection}), or None."""
    for n in DRAWS:
        bins, count = pooled_bins(P0, n, groups)
        df, critical = count - len(groups), critical_value(P0, bins, n, groups, rng_for(f"{name}#{n}"))
        power = {rule: detection(P0, P1, bins, n, groups, df, critical) for rule, P1 in alternatives.items()}
        if all(p >= TEST["power"] for p in power.values()):
            return n, bins, df, critical, power
    return None


def alternatives(rounds, P0):
    """{rule: its distribution} for the wrong rules whose outcomes on these rounds (rules.Round, one per group of P0)
    are distributed otherwise than P0."""
    found = {}
    for rule in rules.WRONG:
        P1 = np.concatenate([rules.outcomes(rule.parts, r) for r in rounds])
        if rule.distribution and np.abs(P1 - P0).sum() > 1e-9:
            found[rule.name] = P1
    return found


SPECS = {"sampling_draws": "reference.probabilities", "speculative_draws": "reference.speculative_outcomes",
         "tree_draws": "reference.tree_outcomes"}


def draws_case(name, kind, feature, description, sampling, inputs, P0, rounds, groups, axes, attrs, wrong=None):
    """The case, its test sized for the wrong rules (`wrong`: {name: distribution}, by default the rules.py rules'
    on `rounds`; None if no number of draws in DRAWS detects them all)."""
    sized = sized_test(name, P0, alternatives(rounds, P0) if wrong is None else wrong, groups)
    if sized is None:
        return None
    n, bins, df, critical, power = sized
    test = {"axes": axes, "degrees_of_freedom": df, "critical": round(critical, 6), "bins": bins,
            "detects": {rule: round(p, 4) for rule, p in sorted(power.items())}}
    return Case(name, kind, SPECS[kind], description, (feature,), {**sampling._asdict(), "draws": n, **attrs}, inputs,
                {"outcomes": Output("draws", P0, test=test)})


# ----------------------------------------------------------------------------------------------------------------
# The pack

SAMPLED = {
    "draws-sampling-t0.6-topk20": R.Sampling(0.6, 20, 1.0),
    "draws-sampling-t0.7-topp0.8": R.Sampling(0.7, 0, 0.8),
    "draws-sampling-t1.3-topk50-topp0.9": R.Sampling(1.3, 50, 0.9),
}


def sampling_draws_case(name, sampling, rows=2):
    rng = rng_for(name)
    for _ in range(ATTEMPTS):
        logits = rng.normal(0, 2.5, (rows, V)).astype(np.float32)
        P0 = R.probabilities(logits.astype(np.float64), sampling)
        case = draws_case(name, "sampling_draws", "draws", "temperature, top-k and top-p, then draws with the "
                          f"engine's own random numbers, from each of {rows} rows", sampling, {"logits": logits}, P0,
                          [rules.Round([], None, row[None], sampling) for row in logits.astype(np.float64)],
                          [range(i * V, (i + 1) * V) for i in range(rows)], ["row", "token"], {})
        if case:
            return case
    raise AssertionError(f"{name}: no draw of logits lets {DRAWS[-1]} draws detect every wrong rule")


# q: a draft model's (full), an n-gram drafter's (one-hot), DFlash2's selector (spread over its top candidates:
# sglang#35371, vllm#52816), under sampling that truncates, or not, and one with the temperature and top-p that
# tell the sampler order
SPECULATIVE = {
    "draws-spec-full-q": (R.Sampling(0.8, 20, 1.0), "full"),
    "draws-spec-one-hot-q": (R.Sampling(0.8, 20, 1.0), "one-hot"),
    "draws-spec-candidates-q": (R.Sampling(1.0, 0, 1.0), "candidates"),
    "draws-spec-full-q-topp": (R.Sampling(0.7, 0, 0.9), "full"),
}
MIN_REACH = 0.05                  # every accept count 0..K has at least this chance, so each is drawn often


def round_design(sampling, shape, rng):
    """Verify logits (K+1, V), drafts (K,) drawn from q (K, V): the target's logits plus noise, as a drafter's."""
    logits = rng.normal(0, 2.5, (K + 1, V)).astype(np.float32)
    noisy = logits[:K] / max(sampling.temperature, 1.0) + rng.normal(0, 1.0, (K, V))
    if shape == "candidates":
        noisy = np.where(np.argsort(np.argsort(-noisy, axis=-1), axis=-1) < CANDIDATES, noisy, -np.inf)
    q = R.softmax(noisy.astype(np.float64))
    draft = [int(rng.choice(V, p=row)) for row in q]
    if shape == "one-hot":
        p = R.probabilities(logits.astype(np.float64), sampling)
        draft = [int(rng.choice(V, p=row)) for row in p[:K]]      # an n-gram's guess: often the target's own
        q = R.one_hot(draft, V).astype(np.float64)
    return logits, draft, q.astype(np.float32)


def speculative_draws_case(name, sampling, shape):
    rng = rng_for(name)
    for _ in range(ATTEMPTS):
        logits, draft, q = round_design(sampling, shape, rng)
        P0 = R.speculative_outcomes(draft, q.astype(np.float64), R.probabilities(logits.astype(np.float64), sampling))
        if P0.sum(axis=1).min() < MIN_REACH:
            continue
        case = draws_case(name, "speculative_draws", "accept:draws", f"speculative sampling of {K} given drafts (q "
                          f"{shape}) with the engine's own random numbers: the drafts accepted and the next token",
                          sampling, {"verify_logits": logits, "drafts": np.array(draft, np.int64), "q": q}, P0,
                          [rules.Round(draft, q.astype(np.float64), logits.astype(np.float64), sampling)],
                          [range(P0.size)], ["accepted", "token"],
                          {"q": shape})
        if case:
            return case
    raise AssertionError(f"{name}: no design reaches every accept count and lets {DRAWS[-1]} draws detect every "
                         "wrong rule")


# Trees: siblings a drafter's top-k (deterministic: one-hot q) or drawn from it independently (q its distribution),
# accepted by multi-draft speculative sampling; the wrong rule is the chain rule on each edge (diagnosis.py), biased
# for top-k siblings (warpfront/hipfire#483)
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2]       # three children of the root, two under the first, one under the second
TREES = {
    "draws-tree-top-k-one-hot-q": (R.Sampling(0.8, 0, 1.0), "top-k"),
    "draws-tree-iid-full-q": (R.Sampling(1.0, 0, 0.9), "iid"),
}
MIN_END, MIN_ENDS = 0.01, 4      # at least 4 nodes each end at least 1% of the walks


def tree_design(sampling, siblings, rng):
    """Verify logits (N, V), the tree's tokens (the root any token) and q (N-1, V): each node's children from a
    drafter, the target's logits at the node plus noise."""
    logits = rng.normal(0, 2.5, (len(TREE_PARENTS), V)).astype(np.float32)
    tokens, q = [int(rng.integers(V))], []
    for node in range(len(TREE_PARENTS)):
        children = R.tree_children(TREE_PARENTS, node)
        d = R.softmax(logits[node].astype(np.float64) / max(sampling.temperature, 1.0) + rng.normal(0, 1.0, V))
        picks = (np.argsort(-d, kind="stable")[:len(children)] if siblings == "top-k" else
                 rng.choice(V, len(children), p=d))
        for x in picks:
            tokens.append(int(x))
            q.append(R.one_hot([x], V)[0] if siblings == "top-k" else d)
    return logits, tokens, np.array(q, np.float32)


def tree_draws_case(name, sampling, siblings):
    rng = rng_for(name)
    for _ in range(ATTEMPTS):
        logits, tokens, q = tree_design(sampling, siblings, rng)
        p, q64 = R.probabilities(logits.astype(np.float64), sampling), q.astype(np.float64)
        P0 = R.tree_outcomes(tokens, TREE_PARENTS, q64, p)
        if (P0.sum(axis=1) >= MIN_END).sum() < MIN_ENDS:
            continue
        wrong = {"tree-chain-rule-on-siblings": diagnosis.tree_chain_rule_outcomes(tokens, TREE_PARENTS, q64, p)}
        case = draws_case(name, "tree_draws", "accept:tree-draws", f"multi-draft speculative sampling of a given "
                          f"{len(tokens)}-node tree ({siblings} siblings) with the engine's own random numbers: the "
                          "last accepted node and the next token", sampling,
                          {"tree_logits": logits, "tree_tokens": np.array(tokens, np.int64),
                           "tree_parents": np.array(TREE_PARENTS, np.int64), "q": q}, P0, None, [range(P0.size)],
                          ["node", "token"], {"siblings": siblings}, wrong)
        if case:
            return case
    raise AssertionError(f"{name}: no design ends walks at {MIN_ENDS} nodes and lets {DRAWS[-1]} draws detect the "
                         "chain rule on siblings")


def draws_cases():
    for name, sampling in SAMPLED.items():
        yield sampling_draws_case(name, sampling)
    for name, (sampling, shape) in SPECULATIVE.items():
        yield speculative_draws_case(name, sampling, shape)
    for name, (sampling, siblings) in TREES.items():
        yield tree_draws_case(name, sampling, siblings)
