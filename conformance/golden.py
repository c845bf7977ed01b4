"""What every golden is built from: the checkpoints in float64, inputs drawn from generators seeded by name, and the
discrete outcomes (greedy steps, accept decisions, sampled tokens) kept clear of the edges where an engine's rounding
could flip them. conformance/generate.py (the cases) and conformance/traces.py (the serving traces) share it."""

import zlib
from functools import lru_cache

import numpy as np

import reference as R
from conformance.format import TOLERANCES, Output, checkpoint_dir, state_tensors

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


def sampled_drafts(params, cfg, state, last, k, accept, sampling, rng):
    """Drafts, q and uniforms so that speculative sampling accepts exactly `accept` of the k drafts after `last`,
    each decision with room to spare: an accept has u = ratio / 2, the rejection u = (1 + ratio) / 2, the final draw
    sits mid-interval of its CDF. -> (drafts, q (k, V), uniforms (k+1,))"""
    V = cfg.vocab_size
    drafts, q, uniforms = [], [], []
    for i in range(k):
        logits = R.forward(params, cfg, [last] + drafts, state)[0][-1]
        p = R.probabilities(logits, sampling)
        q_i = R.softmax(logits / max(sampling.temperature, 1.0) + rng.normal(0, 2.0, V))
        ratio = p / q_i
        if i < accept:
            pool = ratio >= 0.3
        elif i == accept:
            pool = (ratio > 0) & (ratio <= 0.7) if ((ratio > 0) & (ratio <= 0.7)).any() else ratio <= 0.7
        else:
            pool = np.ones(V, bool)
        x = int(rng.choice(V, p=np.where(pool, q_i, 0) / np.where(pool, q_i, 0).sum()))
        r = min(1.0, ratio[x])
        drafts.append(x)
        q.append(q_i)
        uniforms.append(r / 2 if i < accept else (1 + r) / 2 if i == accept else rng.uniform())
    p = R.probabilities(R.forward(params, cfg, [last] + drafts, state)[0], sampling)
    final = np.maximum(p[accept] - f32(q[accept]), 0) if accept < k else p[accept]
    final = final if final.sum() > 0 else p[accept]
    j = int(rng.choice(V, p=final / final.sum()))
    uniforms.append(middle_of(np.cumsum(final), j))
    return drafts, np.array(q).reshape(k, V), uniforms
