"""jax_impl's model against reference.py: the gated delta rule forms, rollback primitives, logits of every tiny
checkpoint, prefill + decode continuation, verify + rollback (both strategies, every kept length), the MTP head,
bf16. Float32 results are compared with the reference run in float64, and jax_impl may be off by float32 rounding
only: at most three times the float32 reference's own distance from float64 on the same quantity (plus 1e-6 of the
scale). Both differ from float64 by an amount that depends on the BLAS, the CPU and the thread count, so a fixed
bound between two float32 runs would hold on one machine and not on another."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_impl
import reference

WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
CHECKPOINTS = ["tiny-dense", "tiny-moe", "tiny-odd", "tiny-multimodal", "tiny-mtp", "tiny-moe-per-expert-mtp"]
PROMPT = [5, 17, 42, 99, 3, 17, 42, 7, 8, 9, 100, 200, 17, 42, 7]


def f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def assert_rounding_only(actual, float32, float64, factor=3):
    """jax_impl's `actual` is as close to the float64 result as the float32 reference is, up to `factor`."""
    actual, float32, float64 = (np.asarray(x, np.float64) for x in (actual, float32, float64))
    assert actual.shape == float64.shape
    err, own = np.abs(actual - float64).max(initial=0), np.abs(float32 - float64).max(initial=0)
    bound = factor * own + 1e-6 * max(1.0, np.abs(float64).max(initial=0))
    assert err <= bound, f"max abs diff from float64 {err:.3g} > {factor} x the float32 reference's {own:.3g} (+1e-6 scale)"


def assert_close(actual, expected, tol):
    """max |actual - expected| <= tol * max(1, max |expected|): for bf16, whose error dwarfs float32 rounding."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err, scale = np.abs(actual - expected).max(initial=0), max(1.0, np.abs(expected).max(initial=0))
    assert err <= tol * scale, f"max abs diff {err:.3g} > {tol} * {scale:.3g}"


@pytest.fixture(scope="module")
def models():
    """name -> (cfg, numpy params, jax params), loaded once."""
    out = {}
    for name in CHECKPOINTS:
        cfg, params = reference.load_model(WEIGHTS / name)
        out[name] = cfg, params, jax_impl.to_jax(params)
    return out


def params64(params):
    return reference.cast(params, np.float64)


def delta_inputs(T, Hk=2, Hv=6, Dk=12, Dv=20, seed=0):  # GVA ratio 3, odd head dims
    rng = np.random.default_rng(seed)
    q, k = (reference.l2norm(rng.normal(size=(T, Hk, Dk))).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(T, Hv, Dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2, size=(T, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, size=(T, Hv)).astype(np.float32)
    return q, k, v, g, beta, rng.normal(size=(Hv, Dk, Dv)).astype(np.float32)


@pytest.mark.parametrize("T, chunk_size", [(1, 64), (5, 64), (70, 32)])  # 70 = 3 chunks of 32, the last padded
def test_gated_delta_forms_match_reference(T, chunk_size):
    inputs = delta_inputs(T)
    ref32, ref64 = reference.gated_delta_recurrent(*inputs), reference.gated_delta_recurrent(*f64(inputs))
    for got in (jax.jit(jax_impl.gated_delta_recurrent)(*inputs),
                jax.jit(jax_impl.gated_delta_chunked, static_argnums=6)(*inputs, chunk_size)):
        for a, b, c in zip(got, ref32, ref64):
            assert_rounding_only(a, b, c)


def test_rollback_primitives_match_reference():
    q, k, v, g, beta, S0 = delta_inputs(6)
    _, _, delta = reference.gated_delta_recurrent(q, k, v, g, beta, S0)
    qkv = np.random.default_rng(1).normal(size=(6, 7)).astype(np.float32)
    tape, window = reference.Tape(qkv, k, g, delta), np.ones((3, 7), np.float32)
    assert_rounding_only(jax_impl.delta_states(S0, tape), reference.delta_states(S0, tape),
                         reference.delta_states(*f64((S0, tape))))
    np.testing.assert_array_equal(jax_impl.conv_windows(window, qkv), reference.conv_windows(window, qkv))  # copies
    replay = jax.jit(jax_impl.replay)
    for n in range(7):
        assert_rounding_only(replay(S0, tape, n), reference.replay(S0, tape, n), reference.replay(*f64((S0, tape)), n))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_prefill_logits_match_reference(models, name):
    cfg, params, jparams = models[name]
    logits, hidden, _, _ = reference.forward(params, cfg, PROMPT, reference.empty_state(cfg))
    logits64, hidden64, _, _ = reference.forward(params64(params), cfg, PROMPT, reference.empty_state(cfg))
    jlogits, jhidden, state, _ = jax_impl.prefill(jparams, cfg, jnp.array(PROMPT), jax_impl.empty_state(cfg, 32))
    assert_rounding_only(jlogits, logits, logits64)
    assert_rounding_only(jhidden, hidden, hidden64)
    assert int(state.length) == len(PROMPT)


@pytest.mark.parametrize("name", ["tiny-odd", "tiny-moe"])
def test_padded_prefill_then_decode_matches_full_forward(models, name):
    """A prompt padded to a bucket (valid < T), then one-step decodes, gives the logits of one full forward."""
    cfg, params, jparams = models[name]
    more = [11, 250, 3]
    full = reference.forward(params, cfg, PROMPT + more, reference.empty_state(cfg))[0]
    full64 = reference.forward(params64(params), cfg, PROMPT + more, reference.empty_state(cfg))[0]
    padded = jnp.array(PROMPT + [0] * (32 - len(PROMPT)))
    logits, _, state, _ = jax_impl.prefill(jparams, cfg, padded, jax_impl.empty_state(cfg, 64), len(PROMPT))
    assert_rounding_only(logits[len(PROMPT) - 1], full[len(PROMPT) - 1], full64[len(PROMPT) - 1])
    for i, token in enumerate(more):
        logits, _, state = jax_impl.decode(jparams, cfg, jnp.int32(token), state)
        assert_rounding_only(logits, full[len(PROMPT) + i], full64[len(PROMPT) + i])


@pytest.mark.parametrize("rollback", reference.ROLLBACK_STRATEGIES)
def test_verify_then_rollback_equals_fresh_run(models, rollback):
    """For every kept length n in 1..K+1: the rolled-back state is the state of a fresh run over the kept tokens."""
    cfg, params, jparams = models["tiny-odd"]
    verified = [7, 8, 9, 100, 31]                                   # last committed token + K = 4 drafts
    _, _, before, _ = jax_impl.prefill(jparams, cfg, jnp.array(PROMPT[:-1]), jax_impl.empty_state(cfg, 32))
    logits, _, after, kept = jax_impl.verify(jparams, cfg, jnp.array(verified), before, rollback)

    def fresh(tokens, params):
        return reference.forward(params, cfg, PROMPT[:-1] + tokens, reference.empty_state(cfg))
    assert_rounding_only(logits, fresh(verified, params)[0][-5:], fresh(verified, params64(params))[0][-5:])
    for n in range(1, len(verified) + 1):
        state = jax_impl.commit(rollback, before, after, kept, jnp.int32(n))
        want32, want64 = fresh(verified[:n], params)[2], fresh(verified[:n], params64(params))[2]
        assert int(state.length) == want32.length
        for got, layer32, layer64 in zip(state.layers, want32.layers, want64.layers):
            if isinstance(layer32, reference.AttnState):
                got = jax_impl.kv_to_reference(got, want32.length)
            for a, b, c in zip(got, layer32, layer64):                 # (conv, S) or (k, v)
                assert_rounding_only(a, b, c)


@pytest.mark.parametrize("name", ["tiny-mtp", "tiny-moe-per-expert-mtp"])
def test_mtp_head_matches_reference(models, name):
    cfg, params, jparams = models[name]
    _, hidden, _, _ = reference.forward(params, cfg, PROMPT, reference.empty_state(cfg))
    Hkv, Dh = cfg.num_key_value_heads, cfg.head_dim
    empty = reference.State((reference.AttnState(np.zeros((0, Hkv, Dh), np.float32), np.zeros((0, Hkv, Dh), np.float32)),), 0)
    logits, out, _ = reference.mtp_forward(params, cfg, PROMPT[1:], hidden[:-1], empty)
    logits64, out64, _ = reference.mtp_forward(params64(params), cfg, PROMPT[1:], f64(hidden[:-1]), empty)
    jempty = reference.State((jax_impl.empty_kv(cfg, 32),), jnp.int32(0))
    jout, _ = jax.jit(jax_impl.mtp_hidden, static_argnums=1)(jparams, cfg, jnp.array(PROMPT[1:]), hidden[:-1], jempty)
    assert_rounding_only(jout, out, out64)
    assert_rounding_only(jax_impl.lm_head(jparams, jout), logits, logits64)


def test_bfloat16_logits_near_reference(models):
    """bf16 weights and activations, fp32 DeltaNet state and logits. bf16 rounds activations as coarsely as weights,
    so over a dozen prompts the logits' distance from the float32 reference is at most twice that of the reference
    run on bf16-rounded weights alone (measured 1.3x; one fixed bound of 2% of the scale failed the weights' rounding
    alone on this checkpoint, and held for jax_impl on a lucky prompt only)."""
    cfg, params, _ = models["tiny-dense"]
    bf16 = jax_impl.to_jax(params, "bfloat16")
    rounded = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
                           if isinstance(a, np.ndarray) and a.dtype == np.float32 else a, params)
    rng = np.random.default_rng(1)
    ours, weights_only = [], []
    for prompt in [PROMPT] + [list(rng.integers(0, cfg.vocab_size, 15)) for _ in range(11)]:
        logits = reference.forward(params, cfg, prompt, reference.empty_state(cfg))[0]
        state = jax_impl.empty_state(cfg, 32, jnp.bfloat16)
        jlogits, _, state, _ = jax_impl.prefill(bf16, cfg, jnp.array(prompt), state)
        assert jlogits.dtype == jnp.float32 and state.layers[0].S.dtype == jnp.float32
        assert state.layers[0].conv.dtype == jnp.bfloat16
        ours.append(np.abs(np.asarray(jlogits, np.float64) - logits).max())
        rounded_logits = reference.forward(rounded, cfg, prompt, reference.empty_state(cfg))[0]
        weights_only.append(np.abs(rounded_logits - logits).max())
    assert np.mean(ours) <= 2 * np.mean(weights_only), (np.mean(ours), np.mean(weights_only))


