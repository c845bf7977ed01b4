"""jax_impl's model against reference.py: the gated delta rule forms, rollback primitives, logits of every tiny
checkpoint, prefill + decode continuation, verify + rollback (both strategies, every kept length), the MTP head,
bf16. fp32 tolerances are relative to the logit scale: on `default` the fp32 reference itself is 8e-4 away from
a float64 run (logits up to ~40), and jax_impl is closer to float64 than that (test_closer_to_float64)."""

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


def assert_close(actual, expected, tol=1e-5):
    """max |actual - expected| <= tol * max(1, max |expected|), with the numbers in the message."""
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
    o, S, delta = reference.gated_delta_recurrent(*inputs)
    for got in (jax.jit(jax_impl.gated_delta_recurrent)(*inputs),
                jax.jit(jax_impl.gated_delta_chunked, static_argnums=6)(*inputs, chunk_size)):
        for a, b in zip(got, (o, S, delta)):
            assert_close(a, b, 2e-5)


def test_rollback_primitives_match_reference():
    q, k, v, g, beta, S0 = delta_inputs(6)
    _, _, delta = reference.gated_delta_recurrent(q, k, v, g, beta, S0)
    qkv = np.random.default_rng(1).normal(size=(6, 7)).astype(np.float32)
    tape, window = reference.Tape(qkv, k, g, delta), np.ones((3, 7), np.float32)
    assert_close(jax_impl.delta_states(S0, tape), reference.delta_states(S0, tape))
    assert_close(jax_impl.conv_windows(window, qkv), reference.conv_windows(window, qkv), 0)
    replay = jax.jit(jax_impl.replay)
    for n in range(7):
        assert_close(replay(S0, tape, n), reference.replay(S0, tape, n))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_prefill_logits_match_reference(models, name):
    cfg, params, jparams = models[name]
    logits, hidden, _, _ = reference.forward(params, cfg, PROMPT, reference.empty_state(cfg))
    jlogits, jhidden, state, _ = jax_impl.prefill(jparams, cfg, jnp.array(PROMPT), jax_impl.empty_state(cfg, 32))
    assert_close(jlogits, logits, 5e-5)
    assert_close(jhidden, hidden, 5e-5)
    assert int(state.length) == len(PROMPT)


def test_closer_to_float64(models):
    cfg, params, jparams = models["tiny-mtp"]
    params64 = jax.tree.map(lambda a: a.astype(np.float64), params)
    empty = reference.empty_state(cfg)
    empty64 = reference.State(tuple(type(s)(*(a.astype(np.float64) for a in s)) for s in empty.layers), 0)
    exact = reference.forward(params64, cfg, PROMPT, empty64)[0]
    reference_err = np.abs(reference.forward(params, cfg, PROMPT, empty)[0] - exact).max()
    jax_err = np.abs(np.asarray(jax_impl.prefill(jparams, cfg, jnp.array(PROMPT), jax_impl.empty_state(cfg, 32))[0])
                     - exact).max()
    assert jax_err <= 2 * reference_err, (jax_err, reference_err)


@pytest.mark.parametrize("name", ["tiny-odd", "tiny-moe"])
def test_padded_prefill_then_decode_matches_full_forward(models, name):
    """A prompt padded to a bucket (valid < T), then one-step decodes, gives the logits of one full forward."""
    cfg, params, jparams = models[name]
    more = [11, 250, 3]
    full = reference.forward(params, cfg, PROMPT + more, reference.empty_state(cfg))[0]
    padded = jnp.array(PROMPT + [0] * (32 - len(PROMPT)))
    logits, _, state, _ = jax_impl.prefill(jparams, cfg, padded, jax_impl.empty_state(cfg, 64), len(PROMPT))
    assert_close(logits[len(PROMPT) - 1], full[len(PROMPT) - 1], 2e-5)
    for i, token in enumerate(more):
        logits, _, state = jax_impl.decode(jparams, cfg, jnp.int32(token), state)
        assert_close(logits, full[len(PROMPT) + i], 2e-5)


@pytest.mark.parametrize("rollback", reference.ROLLBACK_STRATEGIES)
def test_verify_then_rollback_equals_fresh_run(models, rollback):
    """For every kept length n in 1..K+1: the rolled-back state is the state of a fresh run over the kept tokens."""
    cfg, params, jparams = models["tiny-odd"]
    verified = [7, 8, 9, 100, 31]                                   # last committed token + K = 4 drafts
    _, _, before, _ = jax_impl.prefill(jparams, cfg, jnp.array(PROMPT[:-1]), jax_impl.empty_state(cfg, 32))
    logits, _, after, kept = jax_impl.verify(jparams, cfg, jnp.array(verified), before, rollback)
    fresh_logits, _, _, _ = reference.forward(params, cfg, PROMPT[:-1] + verified, reference.empty_state(cfg))
    assert_close(logits, fresh_logits[-5:], 2e-5)
    for n in range(1, len(verified) + 1):
        state = jax_impl.commit(rollback, before, after, kept, jnp.int32(n))
        _, _, fresh, _ = reference.forward(params, cfg, PROMPT[:-1] + verified[:n], reference.empty_state(cfg))
        assert int(state.length) == fresh.length
        for got, want in zip(state.layers, fresh.layers):
            if isinstance(want, reference.DeltaState):
                assert_close(got.S, want.S, 2e-5)
                assert_close(got.conv, want.conv, 2e-5)
            else:
                got = jax_impl.kv_to_reference(got, fresh.length)
                assert_close(got.k, want.k, 2e-5)
                assert_close(got.v, want.v, 2e-5)


@pytest.mark.parametrize("name", ["tiny-mtp", "tiny-moe-per-expert-mtp"])
def test_mtp_head_matches_reference(models, name):
    cfg, params, jparams = models[name]
    _, hidden, _, _ = reference.forward(params, cfg, PROMPT, reference.empty_state(cfg))
    Hkv, Dh = cfg.num_key_value_heads, cfg.head_dim
    empty = reference.State((reference.AttnState(np.zeros((0, Hkv, Dh), np.float32), np.zeros((0, Hkv, Dh), np.float32)),), 0)
    logits, out, _ = reference.mtp_forward(params, cfg, PROMPT[1:], hidden[:-1], empty)
    jempty = reference.State((jax_impl.empty_kv(cfg, 32),), jnp.int32(0))
    jout, _ = jax.jit(jax_impl.mtp_hidden, static_argnums=1)(jparams, cfg, jnp.array(PROMPT[1:]), hidden[:-1], jempty)
    assert_close(jout, out, 2e-5)
    assert_close(jax_impl.lm_head(jparams, jout), logits, 2e-5)


def test_bfloat16_logits_near_reference(models):
    """bf16 weights and activations, fp32 DeltaNet state and logits: ~1% of the logit scale."""
    cfg, params, _ = models["tiny-dense"]
    logits = reference.forward(params, cfg, PROMPT, reference.empty_state(cfg))[0]
    bf16 = jax_impl.to_jax(params, "bfloat16")
    state = jax_impl.empty_state(cfg, 32, jnp.bfloat16)
    jlogits, _, state, _ = jax_impl.prefill(bf16, cfg, jnp.array(PROMPT), state)
    assert jlogits.dtype == jnp.float32 and state.layers[0].S.dtype == jnp.float32
    assert state.layers[0].conv.dtype == jnp.bfloat16
    assert_close(jlogits, logits, 2e-2)
