"""The self-speculative drafters (partial-mlp, skip-blocks, mixer-reuse, residual-reuse, mtp-shortlist): exact through
the verifier (greedy tokens of plain decoding on dense, MoE and odd checkpoints; the target's distribution when
sampling, by chi-square), drafting what their definitions say (checked against computations written out here), from
their own copy of the target's state, and their --draft forms' one-line errors."""

import json
import re
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import reference as R
from conftest import ROOT, model
from test_speculative import (CHECKPOINTS, NEW_TOKENS, PROMPT, V_SMALL, chi_square_p_value, exact_distribution,
                              oracle_drafter, plain_greedy)
from weights.make_tiny import BASE, random_tensor

# Valid on every checkpoint of CHECKPOINTS (4 or 8 layers); mtp-shortlist: a shortlist file written per checkpoint.
SPECS = ["partial-mlp:0.5", "partial-mlp:0.25:1-2", "skip-blocks:2", "skip-blocks:0,3", "mixer-reuse:1-2",
         "residual-reuse:2", "mtp-shortlist"]


@lru_cache(maxsize=None)
def shortlist_file(checkpoint, size=64):
    """The `size` most frequent tokens of the checkpoint's own greedy text, as a shortlist file (build_shortlist)."""
    cfg, params = model(checkpoint)
    text = [R.generate(params, cfg, [t, t + 1, t + 2], 24, R.Sampling(), np.random.default_rng(0))[0]
            for t in range(0, cfg.vocab_size - 2, cfg.vocab_size // 12)]
    path = Path(tempfile.mkdtemp()) / f"shortlist-{checkpoint}.json"
    path.write_text(json.dumps({"ids": R.build_shortlist(text + [plain_greedy(checkpoint)], size)}))
    return path


def drafter(spec, checkpoint, dtype=np.float32):
    cfg, params = model(checkpoint, dtype)
    return R.make_drafter(f"mtp-shortlist:{shortlist_file(checkpoint)}" if spec == "mtp-shortlist" else spec,
                          params, cfg)


@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_greedy_speculative_equals_plain(checkpoint, spec, rollback):
    cfg, params = model(checkpoint)
    for K in (1, 2, 4, 7):
        tokens, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                               drafter(spec, checkpoint), K, rollback)
        assert tokens == plain_greedy(checkpoint), (K, stats)
        assert stats["accepted"] <= stats["proposed"] <= K * stats["target_calls"]


def test_every_drafter_gets_drafts_accepted_and_rejected():
    """The grid above exercises both paths for every drafter."""
    for spec in SPECS:
        accepted = rejected = 0
        for checkpoint in CHECKPOINTS:
            cfg, params = model(checkpoint)
            _, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                              drafter(spec, checkpoint), 4)
            accepted += stats["accepted"]
            rejected += stats["proposed"] - stats["accepted"]
        assert accepted > 0 and rejected > 0, spec


# --- What each drafts: its definition, computed here without run_layers ------------------------------------------

def target_run(checkpoint, tokens, dtype=np.float64):
    """The target token by token over `tokens`: the state before each position, each position's final-normed hidden
    state, and each layer's input and token-mixer output at each position ({layer: (T, D)})."""
    cfg, params = model(checkpoint, dtype)
    state, states, hidden, inputs, mixed = R.empty_state(cfg), [], [], {}, {}
    for token in tokens:
        states.append(state)
        x, layer_states = params["embed_tokens"][[token]], []
        for i, (kind, layer, layer_state) in enumerate(zip(cfg.layer_types, params["layers"], state.layers)):
            inputs.setdefault(i, []).append(x[0])
            y, layer_state, _ = R.token_mixer(x, kind, layer, layer_state, state.length + np.arange(1), cfg)
            mixed.setdefault(i, []).append(y[0])
            x = x + y
            x = x + R.feed_forward(x, layer, cfg)
            layer_states.append(layer_state)
        hidden.append(R.rms_norm(x, params["norm"], cfg.rms_norm_eps)[0])
        state = R.State(tuple(layer_states), state.length + 1)
    return (states, np.stack(hidden), {i: np.stack(v) for i, v in inputs.items()},
            {i: np.stack(v) for i, v in mixed.items()})


def first_draft_logits(spec, checkpoint, context):
    """The drafter's distribution for the token after `context` at temperature 1, as generate_speculative calls it:
    observe the target's state after context[:-1], propose with new_hidden of every position before."""
    cfg, params = model(checkpoint, np.float64)
    states, hidden, _, _ = target_run(checkpoint, context)
    d = drafter(spec, checkpoint, np.float64)
    draft_state = d.observe(d.initial_state, states[-1]) if d.observe else d.initial_state
    _, q, _ = d.propose(draft_state, list(context), hidden[:-1], 1, R.Sampling(1.0), np.random.default_rng(0))
    return q[0]


def head_probabilities(params, cfg, x):  # (D,) residual stream after the last layer -> (V,) at temperature 1
    return R.softmax(R.rms_norm(x, params["norm"], cfg.rms_norm_eps) @ params["lm_head"].T)


def run_last_token(params, cfg, states, x, skip=(), reused=None):
    """The last position once more, layer by layer, from the target's state before it: `skip` blocks left out, the
    mixer outputs of `reused` substituted."""
    state = states[-1]
    for i, (kind, layer, layer_state) in enumerate(zip(cfg.layer_types, params["layers"], state.layers)):
        if i in skip:
            continue
        y = reused[i] if reused and i in reused else R.token_mixer(x, kind, layer, layer_state, state.length +
                                                                   np.arange(1), cfg)[0]
        x = x + y
        x = x + R.feed_forward(x, layer, cfg)
    return x[0]


CONTEXT = PROMPT + [3, 99, 17]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_skip_blocks_drafts_the_target_without_those_blocks(checkpoint):
    cfg, params = model(checkpoint, np.float64)
    states, _, _, _ = target_run(checkpoint, CONTEXT)
    want = head_probabilities(params, cfg, run_last_token(params, cfg, states, params["embed_tokens"][CONTEXT[-1:]],
                                                          skip={0, 3}))
    np.testing.assert_allclose(first_draft_logits("skip-blocks:0,3", checkpoint, CONTEXT), want, atol=1e-9)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_mixer_reuse_drafts_with_the_mean_of_the_two_previous_mixer_outputs(checkpoint):
    cfg, params = model(checkpoint, np.float64)
    states, _, _, mixed = target_run(checkpoint, CONTEXT)
    reused = {i: mixed[i][-3:-1].mean(axis=0, keepdims=True) for i in (1, 2)}   # the exact outputs at p-1, p-2
    want = head_probabilities(params, cfg, run_last_token(params, cfg, states, params["embed_tokens"][CONTEXT[-1:]],
                                                          reused=reused))
    np.testing.assert_allclose(first_draft_logits("mixer-reuse:1-2", checkpoint, CONTEXT), want, atol=1e-9)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_residual_reuse_feeds_layer_L_the_embedding_and_the_rms_matched_previous_hidden(checkpoint):
    cfg, params = model(checkpoint, np.float64)
    states, hidden, inputs, _ = target_run(checkpoint, CONTEXT)
    L, prompt = 2, len(CONTEXT) - 1                        # calibrated over the positions the target consumed
    e = params["embed_tokens"][CONTEXT[:prompt]]
    scale = np.mean(np.sqrt(np.mean((inputs[L][:prompt] - e) ** 2, axis=-1)))
    previous = hidden[-2] / np.sqrt(np.mean(hidden[-2] ** 2) + cfg.rms_norm_eps)
    x = params["embed_tokens"][CONTEXT[-1:]] + scale * previous
    want = head_probabilities(params, cfg, run_last_token(params, cfg, states, x, skip=set(range(L))))
    np.testing.assert_allclose(first_draft_logits(f"residual-reuse:{L}", checkpoint, CONTEXT), want, atol=1e-9)


def test_partial_mlp_at_fraction_1_is_the_target():
    """F = 1 keeps every channel: q is the target's own distribution, so every greedy draft is accepted."""
    cfg, params = model("tiny-mtp", np.float64)
    logits = R.forward(params, cfg, CONTEXT, R.empty_state(cfg))[0][-1]
    np.testing.assert_allclose(first_draft_logits("partial-mlp:1", "tiny-mtp", CONTEXT), R.softmax(logits), atol=1e-9)
    cfg, params = model("tiny-mtp")
    _, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                      drafter("partial-mlp:1", "tiny-mtp"), 4)
    assert stats["accepted"] == stats["proposed"] > 0


@pytest.mark.parametrize("checkpoint", ["tiny-mtp", "tiny-moe-per-expert-mtp"])
def test_partial_mlp_keeps_the_first_channels_of_every_ffn(checkpoint):
    """The cut FFN equals the whole one with the dropped channels' gate and up rows zeroed (silu(0) * 0 = 0): in a
    dense SwiGLU, and in every routed expert and the shared expert of a MoE, with the router's choices unchanged."""
    cfg, params = model(checkpoint, np.float64)
    cut = R.partial_mlp_params(params, cfg, 0.3, (1,))
    layer, x = params["layers"][1], np.random.default_rng(0).standard_normal((5, cfg.hidden_size))

    def zeroed(m, F, kept, fused=False):
        rows = np.arange(2 * F if fused else F) % F >= kept          # gate rows then up rows when fused
        return np.where(rows[:, None], 0, m)
    mlp = dict(layer["mlp"])
    if cfg.is_moe:
        F, Fs = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        mlp["experts"] = {"gate_up_proj": np.stack([zeroed(w, F, round(0.3 * F), fused=True)
                                                    for w in mlp["experts"]["gate_up_proj"]]),
                          "down_proj": mlp["experts"]["down_proj"]}
        shared = mlp["shared_expert"]
        mlp["shared_expert"] = {**shared, "gate_proj": zeroed(shared["gate_proj"], Fs, round(0.3 * Fs)),
                                "up_proj": zeroed(shared["up_proj"], Fs, round(0.3 * Fs))}
        assert cut["layers"][1]["mlp"]["experts"]["down_proj"].shape[-1] == round(0.3 * F)
    else:
        F = cfg.intermediate_size
        mlp.update(gate_proj=zeroed(mlp["gate_proj"], F, round(0.3 * F)), up_proj=zeroed(mlp["up_proj"], F,
                                                                                          round(0.3 * F)))
        assert cut["layers"][1]["mlp"]["down_proj"].shape == (cfg.hidden_size, round(0.3 * F))
    np.testing.assert_allclose(R.feed_forward(x, cut["layers"][1], cfg), R.feed_forward(x, {**layer, "mlp": mlp}, cfg),
                               atol=1e-12)
    for i in (0, 2, 3):
        assert cut["layers"][i] is params["layers"][i]


def test_mtp_shortlist_drafts_the_heads_argmax_among_the_shortlist():
    """q is the head's softmax over the shortlist's rows and zero outside; greedy drafts its argmax there."""
    cfg, params = model("tiny-mtp", np.float64)
    ids = json.loads(shortlist_file("tiny-mtp").read_text())["ids"]
    states, hidden, _, _ = target_run("tiny-mtp", CONTEXT)
    d = drafter("mtp-shortlist", "tiny-mtp", np.float64)
    head_logits = R.mtp_forward(params, cfg, CONTEXT[1:], hidden[:-1], d.initial_state)[0][-1]
    want = np.zeros(cfg.vocab_size)
    want[ids] = R.softmax(head_logits[ids])
    q = first_draft_logits("mtp-shortlist", "tiny-mtp", CONTEXT)
    np.testing.assert_allclose(q, want, atol=1e-9)
    tokens, q, _ = d.propose(d.initial_state, CONTEXT, hidden[:-1], 3, R.Sampling(), np.random.default_rng(0))
    assert tokens[0] == ids[int(np.argmax(head_logits[ids]))] and all(t in ids for t in tokens)
    assert np.all(q[:, [t for t in range(cfg.vocab_size) if t not in ids]] == 0)


@pytest.mark.parametrize("spec", SPECS)
def test_drafting_leaves_the_targets_state_untouched(spec):
    """A drafter writes its draft positions into states of its own: the observed target state is the same after."""
    cfg, params = model("tiny-mtp")
    logits, hidden, state, _ = R.forward(params, cfg, CONTEXT[:-1], R.empty_state(cfg))
    before = [np.copy(a) for layer in state.layers for a in layer]
    d = drafter(spec, "tiny-mtp")
    draft_state = d.observe(d.initial_state, state) if d.observe else d.initial_state
    for seed in range(2):
        tokens, _, _ = d.propose(draft_state, CONTEXT, hidden, 4, R.Sampling(1.0), np.random.default_rng(seed))
        assert len(tokens) == 4
    assert state.length == len(CONTEXT) - 1
    for a, b in zip([a for layer in state.layers for a in layer], before):
        np.testing.assert_array_equal(a, b)


# --- Sampling: the target's distribution, whatever the drafter ---------------------------------------------------

@lru_cache(maxsize=None)
def small_model_with_mtp():
    """test_speculative's 4-token model (two layers, DeltaNet then attention) with an MTP head, at the weights' own
    scale: its next-token distributions are broad (3 tokens: entropy 3.7 nats of 4.16), so a wrong q shows."""
    raw = {**BASE, "vocab_size": V_SMALL, "hidden_size": 16, "num_hidden_layers": 2, "full_attention_interval": 2,
           "intermediate_size": 16, "head_dim": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
           "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "eos_token_id": None, "mtp_num_hidden_layers": 1}
    cfg = R.config_from_dict(raw)
    rng = np.random.default_rng(3)
    shapes = R.checkpoint_shapes(cfg, with_mtp=True)
    return cfg, R.nested_params({n: random_tensor(n, s, rng).astype(np.float32) for n, s in shapes.items()})


SMALL_SPECS = ["partial-mlp:0.25", "skip-blocks:0", "mixer-reuse:1", "residual-reuse:1", "mtp-shortlist"]
SAMPLING_RUNS = 2_000
SAMPLING = R.Sampling(1.0)


def small_drafter(spec, cfg, params):
    if spec == "mtp-shortlist":                     # token 1 outside: q is zero there
        return R.mtp_drafter(params, cfg, np.array([0, 2, 3]), spec)
    return R.make_drafter(spec, params, cfg)


def output_counts(cfg, params, drafter, sampling, runs, prompt=(1, 2, 3, 1, 2)):
    counts = {}
    for seed in range(runs):
        tokens, _ = R.generate_speculative(params, cfg, list(prompt), 3, sampling, np.random.default_rng(seed),
                                           drafter, 2)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts


# End to end for two drafters only (a state copy; q zero outside a shortlist), about 20 s each in CI: every drafter's
# exactness also follows from the three checks each one gets here, at a fraction of the cost: the target's state is
# untouched, each draft is drawn from the q reported with it, and the verifier is exact for any such q (test_speculative).
END_TO_END_SPECS = ["skip-blocks:0", "mtp-shortlist"]


@pytest.mark.parametrize("spec", END_TO_END_SPECS)
def test_speculative_sampling_with_the_drafter_preserves_the_distribution(spec):
    """The first 3 generated tokens over 2,000 seeded runs follow plain sampling's exact distribution."""
    cfg, params = small_model_with_mtp()
    counts = output_counts(cfg, params, small_drafter(spec, cfg, params), SAMPLING, SAMPLING_RUNS)
    dist = exact_distribution(cfg, params, [1, 2, 3, 1, 2], 3, SAMPLING)
    assert chi_square_p_value(counts, dist, SAMPLING_RUNS) > 1e-3


def test_the_sampling_check_catches_a_shortlist_q_that_is_not_zero_outside():
    """The check above has power at its run count: a shortlist drafter that reports the head's softmax over the
    whole vocabulary as q, while drawing among the shortlist, fails it."""
    cfg, params = small_model_with_mtp()
    sampling, ids = SAMPLING, np.array([0, 2, 3])
    honest = R.mtp_drafter(params, cfg, ids, "shortlist")

    def wrong_q(draft_state, context, new_hidden, k, sampling, rng):
        tokens, _, after = honest.propose(draft_state, context, new_hidden, k, sampling, rng)
        full = R.mtp_drafter(params, cfg).propose(draft_state, context, new_hidden, k, sampling,
                                                  np.random.default_rng(0))[1]
        return tokens, np.maximum(full, 1e-3), after   # > 0 at the drafts, as checked_propose() requires
    counts = output_counts(cfg, params, honest._replace(propose=wrong_q), sampling, SAMPLING_RUNS)
    dist = exact_distribution(cfg, params, [1, 2, 3, 1, 2], 3, sampling)
    assert chi_square_p_value(counts, dist, SAMPLING_RUNS) < 1e-6


@pytest.mark.parametrize("spec", SMALL_SPECS)
def test_the_drafts_follow_the_q_the_drafter_reports(spec):
    """Speculative sampling is exact only if each draft is drawn from the q reported with it: over 2,000 draws from
    one state, the first draft's frequencies fit q[0], and the second's fit q[1] given the first."""
    cfg, params = small_model_with_mtp()
    prompt = [1, 2, 3, 1, 2, 0]
    _, hidden, state, _ = R.forward(params, cfg, prompt[:-1], R.empty_state(cfg))
    d = small_drafter(spec, cfg, params)
    draft_state = d.observe(d.initial_state, state) if d.observe else d.initial_state
    firsts, seconds, q_first, q_second = {}, {}, None, {}
    for seed in range(2_000):
        tokens, q, _ = d.propose(draft_state, prompt, hidden, 2, R.Sampling(1.0), np.random.default_rng(seed))
        q_first = q[0] if q_first is None else q_first
        np.testing.assert_allclose(q[0], q_first, atol=1e-6)
        np.testing.assert_allclose(q[1], q_second.setdefault(tokens[0], q[1]), atol=1e-6)
        firsts[tokens[0]] = firsts.get(tokens[0], 0) + 1
        seconds.setdefault(tokens[0], {}).setdefault(tokens[1], 0)
        seconds[tokens[0]][tokens[1]] += 1
    assert chi_square_p_value({(t,): n for t, n in firsts.items()}, {(t,): p for t, p in enumerate(q_first)},
                              2_000) > 1e-3
    for first, counts in seconds.items():
        n = sum(counts.values())
        if n >= 200:
            assert chi_square_p_value({(t,): c for t, c in counts.items()},
                                      {(t,): p for t, p in enumerate(q_second[first])}, n) > 1e-3


# --- Edge cases --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_draft_length_zero_is_plain_decoding(spec):
    cfg, params = model("tiny-odd")
    tokens, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                           drafter(spec, "tiny-odd"), 0)
    assert tokens == plain_greedy("tiny-odd") and stats["proposed"] == 0
    assert stats["target_calls"] == NEW_TOKENS - 1


def test_eos_inside_a_draft_stops_there():
    """With EOS = a token that first comes 6th or later in the default model's plain continuation, every drafter's
    output ends there as plain decoding's does, and drafts reach EOS (the drafts after it are dropped). (The random
    checkpoints repeat one token, so their EOS would come before any draft.)"""
    base, params = model("default")
    prompt = R.load_tokenizer(ROOT / "weights" / "default").encode("def f(x):\n    return").ids
    truth = R.generate(params, base, prompt, 16, R.Sampling(), np.random.default_rng(0))[0]
    eos = next(t for i, t in enumerate(truth) if i >= 5 and t not in truth[:i])
    cfg = R.replace(base, eos_token_id=(eos,))
    plain, _ = R.generate(params, cfg, prompt, 16, R.Sampling(), np.random.default_rng(0))
    assert plain[-1] == eos and len(plain) == truth.index(eos) + 1 >= 6
    drafted_eos = set()
    for spec in SPECS:
        d = drafter(spec, "default")

        def propose(*args, d=d, spec=spec):
            tokens, q, state = d.propose(*args)
            if eos in tokens[:-1]:
                drafted_eos.add(spec)
            return tokens, q, state
        for K in (2, 4):
            tokens, _ = R.generate_speculative(params, cfg, prompt, 16, R.Sampling(), np.random.default_rng(0),
                                               d._replace(propose=propose), K)
            assert tokens == plain, (spec, K)
    assert len(drafted_eos) >= 3, drafted_eos


@pytest.mark.parametrize("limit", ["max_new_tokens", "max_position_embeddings"])
@pytest.mark.parametrize("spec", SPECS)
def test_drafts_past_the_length_limit_are_cut(spec, limit):
    cfg, params = model("tiny-mtp")
    new_tokens = 5
    if limit == "max_position_embeddings":
        cfg, new_tokens = R.replace(cfg, max_position_embeddings=len(PROMPT) + 5), NEW_TOKENS
    d, room = drafter(spec, "tiny-mtp"), []

    def propose(draft_state, context, *args):   # what fits after the drafts: the target's own token at least
        tokens, q, draft_state = d.propose(draft_state, context, *args)
        room.append(len(PROMPT) + 5 - len(context) - len(tokens) - 1)
        return tokens, q, draft_state
    for K in (4, 7):
        tokens, _ = R.generate_speculative(params, cfg, PROMPT, new_tokens, R.Sampling(), np.random.default_rng(0),
                                           d._replace(propose=propose), K)
        assert tokens == plain_greedy("tiny-mtp")[:5]
    assert min(room) == 0


def test_observe_hands_over_the_committed_state_before_every_round():
    cfg, params = model("tiny-mtp")
    seen = []
    d = drafter("skip-blocks:2", "tiny-mtp")
    observe = d.observe
    d = d._replace(observe=lambda draft_state, target_state: seen.append(target_state.length) or
                   observe(draft_state, target_state))
    tokens, stats = R.generate_speculative(params, cfg, PROMPT, 12, R.Sampling(), np.random.default_rng(0), d, 3)
    assert tokens == plain_greedy("tiny-mtp")[:12] and len(seen) == stats["target_calls"]
    assert seen[0] == len(PROMPT) and seen == sorted(set(seen))


# --- The command line ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--draft", "partial-mlp:0"], r"--draft partial-mlp:0: F must be a fraction in \(0, 1\]"),
    (["--draft", "partial-mlp:1.5"], r"--draft partial-mlp:1.5: F must be a fraction in \(0, 1\]"),
    (["--draft", "partial-mlp:nan"], r"F must be a fraction in \(0, 1\]"),
    (["--draft", "partial-mlp:half"], r"F must be a fraction in \(0, 1\]"),
    (["--draft", "partial-mlp:0.5:9"], r"partial-mlp:0.5:9: 9 is not a layer .* of the target's layers \[0, 7\]"),
    (["--draft", "partial-mlp:0.5:"], r"layers '' must be 0-based indices and ranges"),
    (["--draft", "skip-blocks:3-1"], r"skip-blocks:3-1: 3-1 is not a layer or a range A-B \(A <= B\) of the"),
    (["--draft", "skip-blocks:1;2"], r"layers '1;2' must be 0-based indices and ranges"),
    (["--draft", "skip-blocks:"], r"layers '' must be"),
    (["--draft", "mixer-reuse:2-8"], r"2-8 is not a layer or a range"),
    (["--draft", "residual-reuse:0"], r"--draft residual-reuse:0: L must be a layer in \[1, 7\]"),
    (["--draft", "residual-reuse:8"], r"L must be a layer in \[1, 7\]"),
    (["--draft", "mtp-shortlist:/nowhere.json"], "/nowhere.json: cannot read JSON"),
    (["--draft", "mtp-shortlist:{bad}"], r"not a shortlist \(expected"),
    (["--draft", "mtp-shortlist:{outside}"], r"not a shortlist"),
    (["--draft", "mtp-shortlist:{fine}", "--model", str(ROOT / "weights" / "tiny-dense")], "needs mtp.. weights"),
    (["--draft", "partial-mlp"], r"--draft partial-mlp: F must be a fraction"),
    (["--draft", "partial"], "--draft 'partial': expected none, ngram, mtp, skip:N, model:DIR, partial-mlp:F"),
])
def test_bad_draft_specs_are_one_line_and_exit_2(args, message, tmp_path, capsys):
    files = {"bad": {"ids": [1, 1]}, "outside": {"ids": [4096]}, "fine": {"ids": [1, 2]}}
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    args = [a.format(**{name: tmp_path / f"{name}.json" for name in files}) for a in args]
    assert R.main(["--prompt-ids", "1,2", "--max-new-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_the_command_line_runs_a_self_speculative_drafter(tmp_path):
    path = tmp_path / "shortlist.json"
    path.write_text(json.dumps({"ids": list(range(0, 4096, 3))}))
    base = [sys.executable, "reference.py", "--prompt", "def f(x):\n", "--max-new-tokens", "10", "--json"]
    plain = json.loads(subprocess.run(base, cwd=ROOT, capture_output=True, text=True, check=True).stdout)["tokens"]
    for spec in ("partial-mlp:0.25:1-6", f"mtp-shortlist:{path}"):
        run = subprocess.run(base + ["--draft", spec, "--draft-len", "2"], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["tokens"] == plain and "accepted" in run.stderr


def test_jax_impl_refuses_the_self_speculative_drafters_it_does_not_run_in_one_line():
    """jax_impl runs partial-mlp and mtp-shortlist (tests/test_jax_self_speculative.py), not the others."""
    run = subprocess.run([sys.executable, "-m", "jax_impl", "--prompt-ids", "1,2", "--draft", "skip-blocks:2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert "--draft skip-blocks:2: jax_impl runs none, ngram, mtp, mtp-shortlist, partial-mlp, dflash and dflash-sampled on device" in run.stderr
