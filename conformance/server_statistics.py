"""check-server's statistical check of sampled tokens (INTERPRETING.md section 11, "Sampled requests").

A scenario with "distribution": true holds its sampled requests to the spec's distribution under each request's own
sampling settings (temperature, top-k, top-p), by three Pearson chi-square tests at the statistical pack's false-alarm
rate (tolerances.json "draws" alpha), their sizes chosen by `python -m conformance.make.server_statistics` for its
power against the usual wrong rules (conformance/rules.py):

  * first-token: the requests of a group (one prompt, one setting, seeds apart) draw their first token from one
    distribution, P0 = reference.probabilities(the spec's logits after the prompt). Their counts, pooled as the
    statistical pack pools them (chisquare.pooled_bins), against n * P0.
  * second-token: the requests of a group that drew the same first token t0 draw their second from one distribution
    too, the spec's after prompt + t0; the same test over those groups (conditional on how many drew each t0: given
    those counts, each group's second tokens are multinomial). With n-gram drafts on a prompt that repeats one token
    this is one speculative round's verdict, the draft known.
  * later-tokens: every later token t at position j is a draw from p_j = reference.probabilities(the spec's logits
    given the server's own preceding tokens), under speculative decoding too (exactness is that). Its randomised
    probability integral transform u = F_j(t) - p_j(t) + V p_j(t), with F_j the cumulative distribution over the
    tokens in order of decreasing p_j (ties: lower id first) and V uniform from a generator seeded by the scenario
    and the request, is then uniform on [0, 1) given everything before it, so the u of all later tokens are
    independent uniforms. Their counts in BINS equal bins against the uniform. A temperature too high puts u late, a draft kept
    too often puts it where the draft tokens fall.

A sampled token the spec gives no chance fails its request at once (rule "support", check_server.check_answer) unless
raising its logit by the near-tie margin would give it one (a top-k or top-p boundary the server's rounding may
move): such a token is left out of the tests. Critical values are simulated from SIMULATIONS correct servers, as the
statistical pack's are (the chi-square distribution's own quantile errs in so far a tail at small counts).
"""

import zlib

import numpy as np

from . import reference as R
from .chisquare import TEST, bin_totals, chi_square, critical_value, pooled_bins

BINS = 10                  # the later-tokens test's bins of u
SIMULATIONS = 200_000      # simulated correct servers per critical value
SERVER_TOP = 5             # the server's most drawn tokens a failure lists


def rng_for(*parts):
    return np.random.default_rng(zlib.crc32(":".join(map(str, parts)).encode()))


def sampling_of(r):
    return R.Sampling(r.temperature, r.top_k, r.top_p)


def spec_probabilities(z, sampling):
    return R.probabilities(z.astype(np.float64), sampling)


def near_support(z, t, sampling, margin):
    """Whether token t, which the spec's distribution gives no chance, would get one with its logit `margin` higher
    (a boundary of top-k or top-p that the server's own rounding may move)."""
    raised = z.astype(np.float64)
    raised[t] += margin
    return bool(R.probabilities(raised, sampling)[t] > 0)


def transform(p, t, v):
    """The randomised probability integral transform of token t under p, over the tokens in order of decreasing p:
    uniform in [F(t) - p(t), F(t)) for v uniform in [0, 1)."""
    order = np.argsort(-p, kind="stable")
    rank = int(np.flatnonzero(order == t)[0])
    return float(p[order[:rank]].sum() + v * p[t])


# ----------------------------------------------------------------------------------------------------------------
# What the tests are given: per group of requests the first tokens, per request the later ones

def prefix_groups(requests, answers, spec, depth):
    """{(prompt + the first `depth` tokens, sampling): (request indices, P0, the spec's logits there)} over the sampled
    requests that returned more than `depth` tokens and were not cancelled."""
    groups = {}
    for i, ((_, r), a) in enumerate(zip(requests, answers)):
        if r.temperature == 0 or a.error is not None or a.cancelled or len(a.ids) <= depth:
            continue
        key = (tuple(r.prompt) + tuple(a.ids[:depth]), sampling_of(r))
        if key not in groups:
            z = spec.logits(list(key[0]))[-1]
            groups[key] = ([], spec_probabilities(z, key[1]), z)
        groups[key][0].append(i)
    return groups


def later_uniforms(scenario, requests, answers, spec, margin):
    """The transforms u of every sampled token after the first, in request order -> (u, tokens left out at a
    support boundary)."""
    u, boundary = [], 0
    for i, ((_, r), a) in enumerate(zip(requests, answers)):
        if r.temperature == 0 or a.error is not None or a.cancelled or len(a.ids) < 2:
            continue
        P, sampling, v = len(r.prompt), sampling_of(r), rng_for(scenario["name"], i).random(len(a.ids))
        z_all = spec.logits(list(r.prompt) + a.ids)
        for j in range(1, len(a.ids)):
            z, t = z_all[P - 1 + j], a.ids[j]
            p = spec_probabilities(z, sampling)
            if p[t] > 0:
                u.append(transform(p, t, v[j]))
            else:
                boundary += 1
    return np.asarray(u), boundary


# ----------------------------------------------------------------------------------------------------------------
# The tests

def prefix_test(name, test, groups, answers, depth, margin):
    """The chi-square test of the tokens at `depth` against each group's P0 -> (the test's record: statistic,
    critical value, degrees of freedom, draws; the worst group's evidence), or None where no group has draws enough
    for two bins."""
    statistic, ns, probabilities, df, evidence = 0.0, [], [], 0, None
    for (prefix, sampling), (indices, P0, z) in groups.items():
        tokens = [answers[i].ids[depth] for i in indices]
        tokens = [t for t in tokens if P0[t] > 0 or not near_support(z, t, sampling, margin)]
        n = len(tokens)
        bins, count = pooled_bins(P0[None], n, [range(len(P0))])
        if count < 2:
            continue
        counts = np.bincount(tokens, minlength=len(P0))[None].astype(np.float64)
        s, impossible = chi_square(counts, P0[None], bins, n)
        statistic, df = statistic + s, df + count - 1
        ns.append(n)
        probabilities.append(bin_totals(P0[None], bins))
        if evidence is None or s > evidence["statistic"]:
            evidence = {"statistic": s, "requests": indices, "prefix": list(prefix), "sampling": sampling, "P0": P0,
                        "z": z, "counts": counts[0], "depth": depth}
    if not ns:
        return None
    critical = critical_value(probabilities, ns, rng_for(name, test, *ns), SIMULATIONS)
    return {"test": test, "statistic": round(statistic, 4), "critical": round(critical, 4), "degrees_of_freedom": df,
            "draws": sum(ns), "groups": len(ns), "passed": statistic <= critical}, evidence


def later_tokens_test(name, u):
    n = len(u)
    if n < TEST["min_expected"] * BINS:
        return None
    counts = np.bincount(np.minimum((u * BINS).astype(int), BINS - 1), minlength=BINS).astype(np.float64)
    uniform = np.full(BINS, 1.0 / BINS)
    statistic = float(((counts - n * uniform) ** 2 / (n * uniform)).sum())
    critical = critical_value([uniform], [n], rng_for(name, "later-tokens", n), SIMULATIONS)
    return {"test": "later-tokens", "statistic": round(statistic, 4), "critical": round(critical, 4),
            "degrees_of_freedom": BINS - 1, "draws": n, "passed": statistic <= critical,
            "observed": counts.astype(int).tolist(), "expected_per_bin": round(n / BINS, 2)}


PREFIX_TESTS = (("first-token", 0), ("second-token", 1))


def check(spec, scenario, requests, answers, margin):
    """The distribution tests of a scenario -> (their records, failures in check_server.failure's shape)."""
    name, records, failures = scenario["name"], [], []
    for test, depth in PREFIX_TESTS:
        found = prefix_test(name, test, prefix_groups(requests, answers, spec, depth), answers, depth, margin)
        if found is not None:
            record, evidence = found
            records.append(record)
            if not record["passed"]:
                failures.append(group_failure(name, record, evidence))
    u, boundary = later_uniforms(scenario, requests, answers, spec, margin)
    later = later_tokens_test(name, u)
    if later is not None:
        later["left_out_at_a_boundary"] = boundary
        records.append(later)
        if not later["passed"]:
            worst = int(np.argmax(np.abs(np.asarray(later["observed"]) - later["expected_per_bin"])))
            failures.append({"scenario": name, "request": None, "rule": "distribution", "position": None,
                             "prefix_tail": [], "spec_top": [], "server_token": None, "server_token_logit": None,
                             "test": later, "detail": f"later tokens: chi-square {later['statistic']:.4g} > critical "
                             f"{later['critical']:.4g} ({later['degrees_of_freedom']} degrees of freedom, "
                             f"{later['draws']} tokens; alpha {TEST['alpha']}): their transforms u fall "
                             f"{later['observed'][worst]} times in [{worst / BINS:.1f}, {(worst + 1) / BINS:.1f}), "
                             f"{later['expected_per_bin']} expected"})
    return records, failures


def group_failure(name, record, e):
    top = np.argsort(-e["P0"], kind="stable")[:SERVER_TOP]
    drawn = np.argsort(-e["counts"], kind="stable")[:SERVER_TOP]
    n = int(e["counts"].sum())
    return {"scenario": name, "request": e["requests"], "rule": "distribution", "position": e["depth"],
            "prefix_tail": e["prefix"][-8:], "spec_top": [[int(t), round(float(e["z"][t]), 5)] for t in top],
            "spec_top_probabilities": [[int(t), round(float(e["P0"][t]), 5)] for t in top],
            "server_top_counts": [[int(t), int(e["counts"][t])] for t in drawn],
            "server_token": int(drawn[0]), "server_token_logit": round(float(e["z"][drawn[0]]), 5), "test": record,
            "detail": f"{record['test']}s: chi-square {record['statistic']:.4g} > critical {record['critical']:.4g} "
                      f"({record['degrees_of_freedom']} degrees of freedom, {record['draws']} draws; alpha "
                      f"{TEST['alpha']}); the worst group ({n} requests at {e['sampling']}) drew "
                      + ", ".join(f"{int(t)} {int(e['counts'][t])} times ({n * e['P0'][t]:.1f} expected)"
                                  for t in drawn[:3] if e["counts"][t])}
