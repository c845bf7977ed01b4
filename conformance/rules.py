"""Drawing and speculative sampling as the spec defines them, and the usual ways engines get them wrong.

A rule is the spec's round (reference.probabilities, then each draft's acceptance test, then the new token drawn by
inverse CDF: reference.accept_speculative, reference.sample) with one part replaced (`Parts`). The generator uses the
wrong rules twice: every decision taken with supplied uniforms in the goldens must come out otherwise under each wrong
rule that applies to it (`undiscriminated` names those that would not), and the statistical pack draws enough rounds
for its chi-square test to detect each wrong rule's distribution (`outcomes`, in closed form). The tests run each
rule as an engine. INTERPRETING.md, section 4, lists them.
"""

from typing import Callable, NamedTuple

import numpy as np

from . import reference as R


class Parts(NamedTuple):
    """How a rule computes each part of a round; the defaults are the spec's. probabilities: (logits, Sampling) -> p;
    acceptance: (p_i, q_i, draft) -> the chance of keeping the draft; accepts: (u, chance) -> kept?; residual:
    (p_i, q_i, draft) -> what the token after rejecting the draft is drawn from; bonus_row: K -> the row the token after
    K accepted drafts is drawn from; new_token_uniform: (u, i) -> the uniform that draws the token after rejecting
    draft i; draw: (distribution, u) -> token; matches: (draft, logits) -> the drafts greedy acceptance keeps."""
    probabilities: Callable = R.probabilities
    acceptance: Callable = lambda p, q, x: R.acceptance(p[x], q[x])
    accepts: Callable = lambda u, chance: u < chance
    residual: Callable = lambda p, q, x: R.residual(p, q)
    bonus_row: Callable = lambda K: K
    new_token_uniform: Callable = lambda u, i: u[-1]
    draw: Callable = R.sample
    matches: Callable = lambda draft, logits: R.accept_greedy(draft, logits)[0]


SPEC = Parts()    # the wrong parts below call the spec's through it (diagnosis.py patches reference.py's)


class Round(NamedTuple):
    """What a rule is asked about: one draw (no drafts) or one round of speculative decoding, as the engine gets it."""
    draft: list                    # (K,)
    q: np.ndarray | None           # (K, V); None without drafts or at temperature 0
    logits: np.ndarray             # (K+1, V)
    sampling: R.Sampling


def decider(parts, r):
    """The round under `parts` as a function of its supplied uniforms: u (K+1,) -> (accepted drafts, next token);
    reference.accept under SPEC. The probabilities are computed once."""
    K = len(r.draft)
    if r.sampling.temperature == 0:
        accepted = parts.matches(r.draft, r.logits)
        token = int(np.argmax(r.logits[accepted if accepted < K else parts.bonus_row(K)]))
        return lambda u: (accepted, token)
    p = parts.probabilities(r.logits, r.sampling)

    def decide(u):
        for i, x in enumerate(r.draft):
            if not parts.accepts(u[i], parts.acceptance(p[i], r.q[i], x)):
                return i, int(parts.draw(parts.residual(p[i], r.q[i], x), parts.new_token_uniform(u, i)))
        return K, int(parts.draw(p[parts.bonus_row(K)], u[K]))
    return decide


def decide(parts, r, u):
    return decider(parts, r)(u)


def outcomes(parts, r):
    """The round's outcome over uniforms drawn independently, in closed form: (K+1, V), entry [n, t] the chance of
    accepting n drafts, then t. Only the parts that change the distribution count: `accepts` differs from the spec's
    on a set of uniforms of measure zero, and `draw` and `new_token_uniform` change which uniform gives which token."""
    p, K = parts.probabilities(r.logits, r.sampling), len(r.draft)
    return R.round_outcomes([parts.acceptance(p[i], r.q[i], x) for i, x in enumerate(r.draft)],
                            [parts.residual(p[i], r.q[i], x) for i, x in enumerate(r.draft)], p[parts.bonus_row(K)])


# ----------------------------------------------------------------------------------------------------------------
# The wrong parts

def temperature_last(logits, sampling):
    """Top-k and top-p on softmax(logits), the temperature applied afterwards over the tokens kept (llama.cpp's and
    mlx-lm's sampler order)."""
    if sampling.temperature == 0:
        return SPEC.probabilities(logits, sampling)
    kept = SPEC.probabilities(logits, sampling._replace(temperature=1.0)) > 0
    return R.softmax(np.where(kept, logits / np.float32(sampling.temperature), -np.inf))


def temperature_ignored(logits, sampling):
    return SPEC.probabilities(logits, sampling._replace(temperature=1.0 if sampling.temperature else 0.0))


def in_probability_order(p, u):
    """Inverse CDF over the tokens in order of decreasing probability (a sampler that draws from its sorted top-p
    list), lower ids first among equals."""
    order = np.argsort(-p, kind="stable")
    return int(order[SPEC.draw(p[order], u)])


def count_matches(draft, logits):
    """Greedy acceptance counting every draft equal to its row's argmax, not only the longest matching prefix."""
    return sum(int(x == t) for x, t in zip(draft, logits.argmax(axis=-1)))


def matches_after_mismatch(r, accepted):
    """A greedy round in which a draft after the first rejected one equals its row's argmax again."""
    target = r.logits.argmax(axis=-1)
    return any(r.draft[i] == target[i] for i in range(accepted + 1, len(r.draft)))


def residual_unnormalised(p, q, x):
    """max(0, p - q) searched with u itself instead of u times its total: a u beyond the total runs past the end and
    is clamped to the last token."""
    leftover = np.maximum(p - q, 0)
    leftover[-1] += max(0.0, 1.0 - float(leftover.sum()))
    return leftover


def without(p, x):
    """p with token x removed: what a rejected draft leaves when q is taken as one-hot (p itself if nothing is left)."""
    rest = np.where(np.arange(len(p)) == x, 0, p)
    return rest if rest.sum() > 0 else p


def residual_on_support(p, q, x):
    """max(0, p - q) over q's support only: the tokens the draft had no mass on are dropped."""
    leftover = np.where(q > 0, np.maximum(p - q, 0), 0)
    return leftover if leftover.sum() > 0 else p


def inverted(p, q, x):
    return 1.0 if p[x] == 0 else min(1.0, q[x] / p[x])


# ----------------------------------------------------------------------------------------------------------------
# The rules. `applies(r, p, accepted)` says where a supplied-uniform decision can tell the rule from the spec's (p: the
# spec's probabilities); `supplied`: the rule differs only in how uniforms map to outcomes, so only supplied uniforms
# can tell it; `distribution`: its outcomes have another distribution, which the statistical pack can detect.

def sampled(r):
    return r.sampling.temperature > 0


def rejected(r, accepted):
    return sampled(r) and accepted < len(r.draft)


def decreasing(p):  # over its support, in token order: then the order of decreasing probability is the same
    return (np.diff(p[p > 0]) <= 0).all()


def tempered(r):
    return r.sampling.temperature not in (0, 1)


class Rule(NamedTuple):
    name: str
    description: str
    parts: Parts
    applies: Callable
    distribution: bool = True


WRONG = [
    Rule("residual-unnormalised", "the token after a rejection drawn from max(0, p - q) by an inverse CDF that does "
         "not scale u by the residual's total (u past the total falls on the last token)",
         Parts(residual=residual_unnormalised), lambda r, p, a: rejected(r, a)),
    Rule("residual-from-p", "the token after a rejection drawn from p instead of max(0, p - q)",
         Parts(residual=lambda p, q, x: p), lambda r, p, a: rejected(r, a)),
    Rule("bonus-from-previous-row", "after K accepted drafts the new token taken from row K-1 instead of row K",
         Parts(bonus_row=lambda K: max(K - 1, 0)), lambda r, p, a: sampled(r) and 0 < len(r.draft) == a),
    Rule("ratio-inverted", "a draft kept with chance min(1, q/p) instead of min(1, p/q)",
         Parts(acceptance=inverted), lambda r, p, a: sampled(r) and len(r.draft) > 0),
    Rule("q-as-one-hot", "q taken as one-hot on the draft (sample from p and compare; llama.cpp, vLLM without draft "
         "probabilities): kept with chance p(x), the token after a rejection drawn from p without x",
         Parts(acceptance=lambda p, q, x: p[x], residual=lambda p, q, x: without(p, x)),
         lambda r, p, a: sampled(r) and len(r.draft) > 0 and not (np.sort(r.q, axis=-1)[:, -2] == 0).all()),
    Rule("residual-on-support", "the residual max(0, p - q) taken over q's support only (a q over a few candidates)",
         Parts(residual=residual_on_support), lambda r, p, a: rejected(r, a) and (r.q[a] == 0).any()),
    Rule("temperature-last", "the temperature applied after top-k and top-p instead of before",
         Parts(probabilities=temperature_last), lambda r, p, a: tempered(r) and r.sampling.top_p < 1),
    Rule("temperature-ignored", "the temperature left out (drawn at temperature 1)",
         Parts(probabilities=temperature_ignored), lambda r, p, a: tempered(r)),
    Rule("accept-at-equality", "a draft kept when u <= min(1, p/q) instead of u < min(1, p/q) (differs where p(x) = 0 "
         "and u = 0)", Parts(accepts=lambda u, chance: u <= chance),
         lambda r, p, a: rejected(r, a) and p[a, r.draft[a]] == 0, distribution=False),
    Rule("rejecting-uniform", "the token after rejecting draft i drawn with u[i] instead of u[K]",
         Parts(new_token_uniform=lambda u, i: u[i]), lambda r, p, a: rejected(r, a), distribution=False),
    Rule("probability-order", "tokens drawn by inverse CDF over decreasing probability instead of token ids",
         Parts(draw=in_probability_order), lambda r, p, a: sampled(r) and not all(map(decreasing, p)),
         distribution=False),
    Rule("count-the-matches", "greedy: as many drafts kept as match their row's argmax anywhere, not the longest "
         "matching prefix", Parts(matches=count_matches), lambda r, p, a: not sampled(r) and matches_after_mismatch(r, a),
         distribution=False),
]
RULES = {rule.name: rule for rule in WRONG}


def applicable(r, accepted):
    """The wrong rules a decision with supplied uniforms can tell from the spec's."""
    p = R.probabilities(r.logits, r.sampling) if sampled(r) else None
    return [rule for rule in WRONG if rule.applies(r, p, accepted)]


def undiscriminated_by(r, accepted):
    """-> (u, outcome) -> the wrong rules that apply to a round accepting `accepted` drafts and would decide it as
    `outcome` (accepted, next token) too: none, for a golden whose decisions tell every usual mistake."""
    deciders = [(rule.name, decider(rule.parts, r)) for rule in applicable(r, accepted)]
    return lambda u, outcome: [name for name, decide in deciders if decide(u) == tuple(outcome)]


def undiscriminated(r, u, outcome):
    return undiscriminated_by(r, outcome[0])(u, outcome)
