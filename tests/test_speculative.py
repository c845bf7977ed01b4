"""Speculative decoding is exact: the same tokens as plain decoding (greedy), the same distribution (sampling), and
after every commit the same state as plain decoding of the committed tokens, under both rollback strategies."""

import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import reference as R
from conftest import ROOT, model
from weights.make_tiny import BASE, random_tensor

CHECKPOINTS = ["tiny-mtp", "tiny-moe-per-expert-mtp", "tiny-odd"]       # dense, MoE, value/key head ratio 3
DRAFTERS = ["ngram", "mtp", "skip:2", f"model:{ROOT / 'weights' / 'tiny-draft'}"]
PROMPT = [5, 17, 200, 33, 17, 200, 9, 41, 77]
NEW_TOKENS = 24


@lru_cache(maxsize=None)
def plain_greedy(name, prompt=tuple(PROMPT), new_tokens=NEW_TOKENS, dtype=np.float32):
    cfg, params = model(name, dtype)
    return R.generate(params, cfg, list(prompt), new_tokens, R.Sampling(), np.random.default_rng(0))[0]


def oracle_drafter(truth, accept_counts, V):
    """Proposes the plain greedy continuation `truth`, corrupted right after accept_counts[round] tokens, so the
    target accepts exactly that many: every accept length is reachable on demand."""
    def propose(round_index, context, new_hidden, k, sampling, rng):
        start = len(context) - len(PROMPT)
        draft = list(truth[start:start + k])
        want = accept_counts[round_index % len(accept_counts)]
        if want < len(draft):
            draft[want] = (draft[want] + 1) % V
        return draft, R.one_hot(draft, V), round_index + 1
    return R.Drafter("oracle", 0, propose)


@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
@pytest.mark.parametrize("drafter", DRAFTERS + ["oracle"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_greedy_speculative_equals_plain(checkpoint, drafter, rollback):
    cfg, params = model(checkpoint)
    truth = plain_greedy(checkpoint)
    for K in (1, 2, 4, 7):
        if drafter == "oracle":
            draft = oracle_drafter(plain_greedy(checkpoint, new_tokens=NEW_TOKENS + 8), [K, 0, 1, K - 1, 2], cfg.vocab_size)
        else:
            draft = R.make_drafter(drafter, params, cfg)
        tokens, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                               draft, K, rollback)
        assert tokens == truth, (K, stats)
        assert stats["accepted"] <= stats["proposed"] <= K * stats["target_calls"]


def test_drafters_get_drafts_accepted_and_rejected():
    """The greedy-equality grid above must exercise both paths: every drafter gets some drafts rejected, and every
    drafter but the random MTP head gets some accepted (random weights make MTP drafts wrong)."""
    for spec in DRAFTERS:
        accepted, rejected = 0, 0
        for checkpoint in CHECKPOINTS:
            cfg, params = model(checkpoint)
            _, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                              R.make_drafter(spec, params, cfg), 4, "replay")
            accepted += stats["accepted"]
            rejected += stats["proposed"] - stats["accepted"]
        assert rejected > 0 or spec != "mtp"
        assert accepted > 0 or spec == "mtp", spec


@lru_cache(maxsize=None)
def plain_states(name, length, dtype):
    """State of plain decoding after consuming the prompt and the first `length` greedy tokens, for each length."""
    cfg, params = model(name, dtype)
    truth = plain_greedy(name, new_tokens=NEW_TOKENS + 8, dtype=dtype)
    _, _, state, _ = R.forward(params, cfg, PROMPT, R.empty_state(cfg))
    states = [state]
    for token in truth[:length]:
        state = R.forward(params, cfg, [token], state)[2]
        states.append(state)
    return states


def assert_same_state(got, expected, atol):
    assert got.length == expected.length
    for a, b in zip(got.layers, expected.layers):
        assert type(a) is type(b) and all(x.shape == y.shape for x, y in zip(a, b))
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=0, atol=atol)


# The committed state must equal plain decoding's. This is checked in float64, to 1e-9 (the issue asks 1e-6 for S),
# so that a rollback error cannot hide under rounding. In float32 the two differ by rounding alone, because verify runs
# the chunked form and batched matmuls where plain decoding runs one-token steps: measured up to 6.5e-6 on S and 2e-5
# on keys of magnitude 3.5 through these 8-layer random models; the float32 paths are checked end to end (tokens).
STATE_ATOL = 1e-9


@settings(max_examples=50, deadline=None)
@given(checkpoint=st.sampled_from(CHECKPOINTS), K=st.integers(1, 7), rollback=st.sampled_from(R.ROLLBACK_STRATEGIES),
       accepts=st.lists(st.integers(0, 7), min_size=1, max_size=5))
def test_state_after_every_commit_equals_plain_decoding(checkpoint, K, rollback, accepts):
    """Drive rounds by hand with chosen accept counts; after each commit compare S, conv window and KV."""
    cfg, params = model(checkpoint, np.float64)
    truth = plain_greedy(checkpoint, new_tokens=NEW_TOKENS + 8, dtype=np.float64)
    expected = plain_states(checkpoint, NEW_TOKENS, np.float64)
    tokens, state = truth[:1], expected[0]
    for want in accepts:
        want = min(want, K)
        if len(tokens) + K + 1 > NEW_TOKENS:
            break
        draft = list(truth[len(tokens):len(tokens) + K])
        if want < K:
            draft[want] = (draft[want] + 1) % cfg.vocab_size
        logits, _, after, tapes = R.forward(params, cfg, tokens[-1:] + draft, state)
        accepted, token = R.accept_greedy(draft, logits)
        assert (accepted, token) == (want, truth[len(tokens) + want])
        if rollback == "per-position":
            state = R.commit_per_position(state, after, R.keep_per_position(state, tapes), accepted + 1)
        else:
            state = R.commit_replay(state, after, tapes, accepted + 1)
        tokens += draft[:accepted] + [token]
        assert_same_state(state, expected[len(tokens) - 1], STATE_ATOL)


# --- Sampling: the output distribution is the target's, whatever the drafter ------------------------------------

V_SMALL = 4


@lru_cache(maxsize=None)
def small_vocab_model():
    raw = {**BASE, "vocab_size": V_SMALL, "hidden_size": 16, "num_hidden_layers": 2, "full_attention_interval": 2,
           "intermediate_size": 16, "head_dim": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
           "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "eos_token_id": None}
    cfg = R.config_from_dict(raw)
    rng = np.random.default_rng(3)
    shapes = R.checkpoint_shapes(cfg, with_mtp=False)
    return cfg, R.nested_params({n: (3 * random_tensor(n, s, rng)).astype(np.float32) for n, s in shapes.items()})


def exact_distribution(cfg, params, prompt, n, sampling):
    """P(first n generated tokens) under plain sampling, by enumerating every sequence (V^n of them)."""
    dist = {}
    for seq in itertools.product(range(cfg.vocab_size), repeat=n):
        logits = R.forward(params, cfg, list(prompt) + list(seq[:-1]), R.empty_state(cfg))[0]
        p = R.probabilities(logits[len(prompt) - 1:], sampling)
        dist[seq] = float(np.prod([p[i, t] for i, t in enumerate(seq)]))
    return dist


def chi_square_p_value(counts, dist, runs):
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled. p = Q(dof/2, stat/2)."""
    expected = {seq: p * runs for seq, p in dist.items()}
    big = [seq for seq in dist if expected[seq] >= 5]
    observed = [counts.get(seq, 0) for seq in big] + [runs - sum(counts.get(seq, 0) for seq in big)]
    wanted = [expected[seq] for seq in big] + [runs - sum(expected[seq] for seq in big)]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    return torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2), torch.tensor(stat / 2)).item()


def biased_drafter(V, q):
    """Ignores the context and drafts from a fixed, deliberately wrong distribution q."""
    def propose(draft_state, context, new_hidden, k, sampling, rng):
        tokens = [R.sample(q, rng.random()) for _ in range(k)]
        return tokens, np.tile(q, (k, 1)), draft_state
    return R.Drafter("biased", None, propose)


# Seeded runs per drafter, for CI's time: the general case (a wrong q) at 10,000; the one-hot q at 5,000 (its round
# is the same rule with q a unit vector, also held by the pack's one-hot cases). Both above the 2,000 at which the
# wrong rule below is caught; the verifier's law in closed form is tests/test_statistical_pack.py's.
RUNS = {"biased": 10_000, "ngram": 5_000}


@pytest.mark.parametrize("drafter, sampling", [
    ("ngram", R.Sampling(1.0, top_p=0.9)),                        # one-hot q copied from the context; top-p
    ("biased", R.Sampling(0.8, top_k=3)),                         # a wrong q; p shaped by temperature and top-k
])
def test_speculative_sampling_preserves_the_distribution(drafter, sampling):
    """The first 3 generated tokens over RUNS seeded runs follow plain sampling's exact distribution."""
    cfg, params = small_vocab_model()
    prompt = [1, 2, 3, 1, 2]
    draft = (biased_drafter(cfg.vocab_size, np.array([0.05, 0.05, 0.1, 0.8])) if drafter == "biased" else
             R.make_drafter(drafter, params, cfg))
    counts = {}
    for seed in range(RUNS[drafter]):
        tokens, _ = R.generate_speculative(params, cfg, prompt, 3, sampling, np.random.default_rng(seed), draft, 2)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    assert chi_square_p_value(counts, exact_distribution(cfg, params, prompt, 3, sampling), RUNS[drafter]) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    """The distribution test has power: accepting every draft (no rejection step) fails it."""
    cfg, params = small_vocab_model()
    sampling, q = R.Sampling(0.8, top_k=3), np.array([0.05, 0.05, 0.1, 0.8])
    wrong_accept = lambda draft, q_, p, u: (len(draft), R.sample(p[len(draft)], u[-1]))  # noqa: E731
    original, R.accept_speculative = R.accept_speculative, wrong_accept
    try:
        counts = {}
        for seed in range(2_000):
            tokens, _ = R.generate_speculative(params, cfg, [1, 2, 3, 1, 2], 3, sampling, np.random.default_rng(seed),
                                               biased_drafter(V_SMALL, q), 2)
            counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    finally:
        R.accept_speculative = original
    assert chi_square_p_value(counts, exact_distribution(cfg, params, [1, 2, 3, 1, 2], 3, sampling), 2_000) < 1e-6


def test_draft_equal_to_target_always_accepts():
    """q == p exactly (the target's own distributions as the draft): every draft is accepted."""
    cfg, params = small_vocab_model()
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = R.probabilities(rng.normal(size=(5, V_SMALL)).astype(np.float32), R.Sampling(1.0))
        draft = [R.sample(p[i], rng.random()) for i in range(4)]
        accepted, _ = R.accept_speculative(draft, p[:4], p, rng.random(5))
        assert accepted == 4


def test_disjoint_support_always_rejects():
    """A draft token the target gives probability 0 (outside its top-k) is always rejected, and the replacement
    comes from the target's support."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = R.probabilities(rng.normal(size=(3, 6)).astype(np.float32), R.Sampling(1.0, top_k=2))
        outside = [int(np.flatnonzero(p[i] == 0)[0]) for i in range(2)]
        accepted, token = R.accept_speculative(outside, R.one_hot(outside, 6), p, rng.random(3))
        assert accepted == 0 and p[0, token] > 0


# --- Edge cases --------------------------------------------------------------------------------------------------

def test_draft_length_zero_is_plain_decoding():
    cfg, params = model("tiny-mtp")
    tokens, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                           R.make_drafter("ngram", params, cfg), 0)
    assert tokens == plain_greedy("tiny-mtp") and stats["proposed"] == 0
    assert stats["target_calls"] == NEW_TOKENS - 1


def test_draft_that_hits_eos_stops_there():
    """EOS inside an accepted draft ends the output at EOS, as plain decoding does; drafts after it are dropped."""
    cfg, params = model("tiny-odd")
    truth = plain_greedy("tiny-odd")
    eos = truth[6]
    cfg = R.replace(cfg, eos_token_id=(eos,))
    plain, _ = R.generate(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0))
    assert plain[-1] == eos and len(plain) == truth.index(eos) + 1
    for K in (1, 4, 7):
        spec, _ = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                         oracle_drafter(truth + [0] * 8, [K], cfg.vocab_size), K)
        assert spec == plain


@pytest.mark.parametrize("limit", ["max_new_tokens", "max_position_embeddings"])
def test_draft_running_past_the_length_limit_is_cut(limit):
    cfg, params = model("tiny-mtp")
    truth = plain_greedy("tiny-mtp")
    new_tokens = 5
    if limit == "max_position_embeddings":
        cfg, new_tokens = R.replace(cfg, max_position_embeddings=len(PROMPT) + 5), NEW_TOKENS
    for K in (4, 7):
        spec, stats = R.generate_speculative(params, cfg, PROMPT, new_tokens, R.Sampling(), np.random.default_rng(0),
                                             oracle_drafter(truth, [K], cfg.vocab_size), K)
        assert spec == truth[:5]
        assert stats["proposed"] <= 4      # after the prefill's token, at most 4 more fit


def test_empty_proposal_falls_back_to_one_token_per_round():
    cfg, params = model("tiny-mtp")
    empty = R.Drafter("empty", None, lambda s, c, h, k, sampling, rng: ([], np.zeros((0, cfg.vocab_size)), s))
    tokens, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                           empty, 4)
    assert tokens == plain_greedy("tiny-mtp") and stats["target_calls"] == NEW_TOKENS - 1


def test_drafter_proposing_ids_outside_the_vocabulary_is_an_error():
    cfg, params = model("tiny-mtp")
    bad = R.Drafter("bad", None, lambda s, c, h, k, sampling, rng: ([cfg.vocab_size], R.one_hot([0], cfg.vocab_size), s))
    with pytest.raises(R.UserError, match=r"drafter bad proposed \[272\].*\[0, 272\)"):
        R.generate_speculative(params, cfg, PROMPT, 8, R.Sampling(), np.random.default_rng(0), bad, 2)


def test_mtp_drafter_needs_mtp_weights():
    cfg, params = model("tiny-dense")
    with pytest.raises(R.UserError, match="needs mtp.. weights"):
        R.make_drafter("mtp", params, cfg)


def test_rollback_memory_per_strategy():
    """Per-position keeps K+1 states per DeltaNet layer; the tape keeps K+1 vectors: far less."""
    cfg, params = model("tiny-mtp")
    sizes = {}
    for rollback in R.ROLLBACK_STRATEGIES:
        _, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                          oracle_drafter(plain_greedy("tiny-mtp", new_tokens=40), [7], cfg.vocab_size), 7,
                                          rollback)
        sizes[rollback] = stats["rollback_bytes"]
    linear_layers = cfg.layer_types.count("linear_attention")
    state_bytes = 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    conv_bytes = 4 * (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim
    assert sizes["per-position"] == 8 * linear_layers * (state_bytes + conv_bytes)
    assert sizes["replay"] < sizes["per-position"]


def test_prompt_lookup_copies_what_followed_the_longest_suffix():
    assert R.prompt_lookup([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]   # latest match with k tokens
    assert R.prompt_lookup([5, 1, 2, 5, 1], 4) == [2, 5, 1]                         # the longest continuation
    assert R.prompt_lookup([1, 2, 3], 2) == []


def test_offline_ngram_table_drafts_the_most_frequent_phrase():
    table = R.build_ngram_table([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7, 7], [9, 1, 2, 3, 4, 5]], n=2, length=2)
    assert table["table"]["2 3"] == [4, 5]
    drafter = R.ngram_drafter(10, table)
    tokens, q, _ = drafter.propose(None, [8, 2, 3], None, 4, R.Sampling(), None)   # no match in the context itself
    assert tokens == [4, 5] and q.shape == (2, 10) and q[0, 4] == 1


def test_drafter_q_must_cover_its_own_proposals_when_sampling():
    cfg, params = model("tiny-mtp")
    zero_q = R.Drafter("zero-q", None, lambda s, c, h, k, sampling, rng: ([3], np.zeros((1, cfg.vocab_size)), s))
    with pytest.raises(R.UserError, match="drafter zero-q: q must be"):
        R.generate_speculative(params, cfg, PROMPT, 8, R.Sampling(1.0), np.random.default_rng(0), zero_q, 2)
