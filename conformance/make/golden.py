"""What every golden is built from: the checkpoints in float64, inputs drawn from generators seeded by name, and the
discrete outcomes (greedy steps, accept decisions, sampled tokens) kept clear of the edges where an engine's rounding
could flip them. build.py (the cases), traces.py (the serving traces) and draws.py (the statistical pack) share it."""

import zlib
from functools import lru_cache

import numpy as np

from .. import reference as R
from .. import rules
from ..format import TOLERANCES, Output, checkpoint_dir, state_tensors

DRAFT_LEN = 4                     # K
GREEDY = R.Sampling(0.0, 0, 1.0)


def rng_for(name):
    return np.random.default_rng(zlib.crc32(name.encode()))


def f32(x):
    return np.asarray(x, dtype=np.float32)


def f64(x):
    return np.asarray(x, dtype=np.float64)


def i64(x):
    return np.asarray(x, dtype=np.int64)


@lru_cache(maxsize=None)
def model(checkpoint):
    """(Config, weights in float64): the float32 (or bf16) weights upcast exactly."""
    cfg, params = R.load_model(checkpoint_dir(checkpoint))
    return cfg, R.cast(params, np.float64)


@lru_cache(maxsize=None)
def checkpoint_features(checkpoint):
    """The checkpoint properties (format.FEATURES) that differ from the default model's."""
    folder = checkpoint_dir(checkpoint)
    cfg, names, raw = model(checkpoint)[0], R.read_checkpoint_headers(folder), R.read_json(folder / "config.json")
    ratio = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    tags = [("moe", cfg.is_moe), ("untied_embeddings", not cfg.tie_word_embeddings),
            (f"gva_ratio_{ratio}", ratio != 2),
            ("unequal_head_dims", cfg.linear_key_head_dim != cfg.linear_value_head_dim),
            (f"conv_kernel_{cfg.linear_conv_kernel_dim}", cfg.linear_conv_kernel_dim != 4),
            (f"partial_rotary_{cfg.partial_rotary_factor:g}", cfg.partial_rotary_factor != 0.25),
            ("multimodal_layout", "text_config" in raw),
            ("per_expert_weights", any(R.EXPERT_TENSOR.match(n) for n in names)),
            ("mtp_weights", any(n.startswith("mtp.") for n in names))]
    return tuple(tag for tag, present in tags if present)


def tie_margin(a, b):
    """Two logits closer than this may swap order in a conforming engine: each may be off by the logits tolerance."""
    tol = TOLERANCES["logits"]
    return 2 * (tol["atol"] + tol["rtol"] * max(abs(a), abs(b)))


def runner_up(row):
    """(argmax, second token, whether the two are within tolerance of each other) for one row of logits."""
    first, second = np.argsort(-row, kind="stable")[:2]
    return int(first), int(second), bool(row[first] - row[second] <= tie_margin(row[first], row[second]))


def state_outputs(state):
    return {name: Output("exact" if name == "state.length" else "state", value, requires="state_export")
            for name, value in state_tensors(state).items()}


def middle_of(cdf, j):
    """A uniform in the middle of token j's interval of the (unnormalised) CDF: the draw that picks j with the most
    room on both sides."""
    low = cdf[j - 1] if j else 0.0
    return (low + cdf[j]) / 2 / cdf[-1]


def sampling_attrs(sampling):
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


# ----------------------------------------------------------------------------------------------------------------
# Decisions with supplied uniforms: each one clear of its threshold, and each one telling the usual wrong rules
# (conformance/rules.py) from the spec's.

class Redraw(Exception):
    """No design of these inputs has every decision clear of its edge and telling every wrong rule: the caller starts
    again with other inputs (another prompt, other draws)."""


ROOM = 0.05            # the least distance between an acceptance uniform and the chance min(1, p/q) it is compared with
MIN_SHARE = 1e-3       # the least share of its CDF a drawn token has: the uniform in its middle has half of it as room
DESIGNS = 100          # designs of drafts, q and uniforms tried for one round before the caller redraws its inputs
DRAWS = 20             # tokens tried for the new token of one design
CANDIDATES = 8         # the support of a "candidates" q (DFlash2's selector_top_k)
Q_SHAPES = ("full", "one-hot", "candidates")


def draw_choices(dist, rng):
    """The tokens a uniform may pick from dist (V,), those with at least MIN_SHARE of it, in random order weighted by
    their probability."""
    share = dist / dist.sum()
    ok = np.flatnonzero(share >= MIN_SHARE)
    return rng.choice(ok, size=len(ok), replace=False, p=share[ok] / share[ok].sum()) if len(ok) else ok


def discriminating_draw(r, uniforms, accepted, dist, rng):
    """The last uniform of a round (rules.Round) that accepts `accepted` drafts: in the middle of the interval of a
    token of dist, one with which the spec draws that token and every wrong rule that applies decides the round
    otherwise (rules.undiscriminated, on the float32 inputs an engine gets). -> all the uniforms, or None."""
    cdf, spec, missed = np.cumsum(dist), rules.decider(rules.SPEC, r), rules.undiscriminated_by(r, accepted)
    for j in draw_choices(dist, rng)[:DRAWS]:
        u, outcome = f32(list(uniforms) + [middle_of(cdf, j)]), (accepted, int(j))
        if spec(u) == outcome and not missed(u, outcome):
            return u
    return None


def undiscriminated(draft, q, logits, sampling, u):
    """The wrong rules that would decide a round (as stored: float32 inputs) as the spec does: none in a golden."""
    r = rules.Round(list(draft), None if q is None else f32(q), f32(logits), sampling)
    u = None if u is None else f32(u)
    return rules.undiscriminated(r, u, rules.decide(rules.SPEC, r, u))


def discriminating_rows(logits, sampling, rng):
    """Tokens and uniforms for plain draws from each row of logits (N, V): each drawn token has room, and each row's
    draw tells every wrong rule that applies. -> (tokens (N,), uniforms (N,))"""
    p = R.probabilities(f64(logits), sampling)
    tokens, uniforms = [], []
    for row, dist in zip(f32(logits), p):
        u = discriminating_draw(rules.Round([], None, row[None], sampling), [], 0, dist, rng)
        if u is None:
            raise Redraw(f"no token of this row tells every wrong rule apart ({sampling})")
        tokens.append(R.sample(dist, u[0]))
        uniforms.append(u[0])
    return i64(tokens), f32(uniforms)


def draft_distribution(logits, sampling, shape, rng):
    """A drafter's q for one position, correlated with the target's logits: the target's logits (at temperature 1 or
    above) plus noise; "candidates" keeps the CANDIDATES tokens this ranks first (DFlash2's selector: q over its
    top-K candidates, zero elsewhere); "one-hot" is made by the caller from the token it drafts."""
    noisy = logits / max(sampling.temperature, 1.0) + rng.normal(0, 2.0, len(logits))
    if shape == "candidates":
        noisy = np.where(np.argsort(np.argsort(-noisy)) < CANDIDATES, noisy, -np.inf)
    return R.softmax(noisy)


def clearly_cut(logits, sampling, p):
    """Tokens that top-k / top-p cut (p = 0) and that are well below the last token kept, so that no rounding can
    keep them: a draft there is rejected whatever its uniform."""
    untruncated = R.probabilities(logits, R.Sampling(sampling.temperature))
    return (p == 0) & (untruncated < 0.5 * untruncated[p > 0].min())


def design_draft(logits, sampling, role, shape, zero_p, rng):
    """One draft position -> (token, q row, uniform) that `role` ("accept", "reject" or "any") decides with ROOM to
    spare, or None when no token can. A rejection with zero_p drafts a token outside the truncated support with
    u = 0: only that tells u <= chance from u < chance."""
    V, p = len(logits), R.probabilities(logits, sampling)
    q = None if shape == "one-hot" else draft_distribution(logits, sampling, shape, rng)
    # what the draft is drawn from; one-hot q: the drafter's token (likely ones to be accepted), q(x) = 1 there
    weight = q if q is not None else p if role == "accept" else np.ones(V)
    ratio = p / (np.ones(V) if q is None else np.where(q > 0, q, np.inf))
    if role == "accept":
        pool = ratio >= 2 * ROOM
    elif role == "reject" and zero_p:
        pool = clearly_cut(logits, sampling, p)
    elif role == "reject":
        pool = (ratio > 0) & (ratio <= 1 - 2 * ROOM)
    else:
        pool = np.ones(V, bool)
    pool &= weight > 0
    if not pool.any():
        return None
    x = int(rng.choice(V, p=np.where(pool, weight, 0) / np.where(pool, weight, 0).sum()))
    q = R.one_hot([x], V)[0] if q is None else q
    chance = R.acceptance(p[x], q[x])
    # anywhere ROOM clear of the chance: spread over the allowed range, so that a wrong rule's chance often falls on
    # the other side of it
    u = (rng.uniform(0, chance - ROOM) if role == "accept" else 0.0 if role == "reject" and zero_p else
         rng.uniform(chance + ROOM, 1) if role == "reject" else rng.uniform())
    return x, q, u


def sampled_drafts(params, cfg, state, last, k, accept, sampling, rng, shape="full", zero_p=None):
    """Drafts, q and uniforms so that speculative sampling accepts exactly `accept` of the k drafts after `last`, each
    decision clear of its edge (acceptance uniforms ROOM from their chance, the new token's interval at least
    MIN_SHARE wide with the uniform in its middle) and every wrong rule that applies deciding otherwise. shape: the
    drafter's q (Q_SHAPES); zero_p: whether the rejected draft is one the target's top-k / top-p cut, with u = 0
    (None: at random, where the sampling truncates). -> (drafts, q (k, V), uniforms (k+1,))"""
    assert shape in Q_SHAPES, shape
    truncates = sampling.top_k > 0 or sampling.top_p < 1
    for _ in range(DESIGNS):
        zero = truncates and accept < k and (rng.random() < 0.5 if zero_p is None else zero_p)
        drafts, q, uniforms = [], [], []
        for i in range(k):
            logits = R.forward(params, cfg, [last] + drafts, state)[0][-1]
            role = "accept" if i < accept else "reject" if i == accept else "any"
            designed = design_draft(logits, sampling, role, shape, zero, rng)
            if designed is None:
                break
            drafts.append(designed[0])
            q.append(designed[1])
            uniforms.append(designed[2])
        else:
            q = f32(np.array(q).reshape(k, cfg.vocab_size))
            logits = R.forward(params, cfg, [last] + drafts, state)[0]
            p = R.probabilities(logits, sampling)
            dist = R.residual(p[accept], q[accept]) if accept < k else p[accept]
            u = discriminating_draw(rules.Round(drafts, q, f32(logits), sampling), uniforms, accept, dist, rng)
            if u is not None:
                return drafts, q, u
    raise Redraw(f"no design of {k} drafts accepting {accept} tells every wrong rule apart ({sampling}, q {shape})")
