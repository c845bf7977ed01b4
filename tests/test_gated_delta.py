"""The gated delta rule written three ways agrees with itself, with transformers' kernels, and with the state
reconstructions that rollback uses."""

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule

import reference as R
from conftest import model


def inputs(T, Hk=2, Hv=6, Dk=12, Dv=20, seed=0, dtype=np.float64):
    """Random q, k (L2-normalised), v, g < 0, beta in (0, 1), and a non-zero initial state."""
    rng = np.random.default_rng(seed)
    q = R.l2norm(rng.normal(size=(T, Hk, Dk)))
    k = R.l2norm(rng.normal(size=(T, Hk, Dk)))
    v = rng.normal(size=(T, Hv, Dv))
    g = -np.exp(rng.normal(-1, 1, size=(T, Hv)))
    beta = R.sigmoid(rng.normal(size=(T, Hv)))
    S0 = rng.normal(size=(Hv, Dk, Dv))
    return [x.astype(dtype) for x in (q, k, v, g, beta, S0)]


LENGTHS = [1, 63, 64, 65, 130]


@pytest.mark.parametrize("T", LENGTHS)
def test_chunked_equals_loop(T):
    """Outputs, final state and deltas, from a non-zero initial state, across chunk boundaries (fp64: algebra)."""
    args = inputs(T)
    for a, b in zip(R.gated_delta_recurrent(*args), R.gated_delta_chunked(*args)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("T", LENGTHS)
def test_chunked_equals_loop_fp32(T):
    args = inputs(T, dtype=np.float32)
    loop, chunked = R.gated_delta_recurrent(*args), R.gated_delta_chunked(*args)
    assert all(x.dtype == np.float32 for x in chunked)
    for a, b in zip(loop, chunked):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("split", [1, 40, 64, 100])
def test_two_halves_with_carried_state_equal_one_pass(split):
    q, k, v, g, beta, S0 = inputs(130)
    o, S, delta = R.gated_delta_chunked(q, k, v, g, beta, S0)
    o1, S1, d1 = R.gated_delta_chunked(q[:split], k[:split], v[:split], g[:split], beta[:split], S0)
    o2, S2, d2 = R.gated_delta_chunked(q[split:], k[split:], v[split:], g[split:], beta[split:], S1)
    np.testing.assert_allclose(np.concatenate([o1, o2]), o, atol=1e-10)
    np.testing.assert_allclose(np.concatenate([d1, d2]), delta, atol=1e-10)
    np.testing.assert_allclose(S2, S, atol=1e-10)


def test_step_is_the_paper_equation():
    """One head, Dk = Dv = 1: S = 2, alpha = 1/2, beta = 1/2, k = 1, v = 3, q = 1.
    alpha S = 1; delta = 1/2 (3 - 1) = 1; S = 1 + 1 = 2; o = S q = 2."""
    o, S, delta = R.gated_delta_step(np.array([[[2.0]]]), np.array([[1.0]]), np.array([[1.0]]), np.array([[3.0]]),
                                     np.log(np.array([0.5])), np.array([0.5]))
    assert (o.item(), S.item(), delta.item()) == (2.0, 2.0, 1.0)


@pytest.mark.parametrize("T", [1, 65, 130])
def test_matches_transformers_kernels(T):
    """Same arguments into transformers' torch_{chunk,recurrent}_gated_delta_rule (fp32, GVA ratio 3)."""
    q, k, v, g, beta, S0 = inputs(T, dtype=np.float32)
    torch_args = [torch.from_numpy(x)[None] for x in (q, k, v, g, beta)]
    for hf_rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        o, S = hf_rule(*torch_args, initial_state=torch.from_numpy(S0)[None], output_final_state=True)
        ours = R.gated_delta_chunked(q, k, v, g, beta, S0)
        np.testing.assert_allclose(ours[0], o[0].numpy(), atol=2e-5)
        np.testing.assert_allclose(ours[1], S[0].numpy(), atol=2e-5)


@pytest.mark.parametrize("T", [1, 5, 70])
def test_rollback_reconstructions_equal_the_loop_states(T):
    """delta_states (closed form, per-position rollback) and replay (rank-1 updates, tape rollback) give the state
    after every prefix exactly as the per-token loop does."""
    q, k, v, g, beta, S0 = inputs(T)
    o, S, delta = R.gated_delta_chunked(q, k, v, g, beta, S0)
    tape = R.Tape(qkv=np.zeros((T, 1)), k=k, g=g, delta=delta)
    every = R.delta_states(S0, tape)
    for n in range(1, T + 1):
        loop_state = R.gated_delta_recurrent(q[:n], k[:n], v[:n], g[:n], beta[:n], S0)[1]
        np.testing.assert_allclose(every[n - 1], loop_state, atol=1e-10)
        np.testing.assert_allclose(R.replay(S0, tape, n), loop_state, atol=1e-10)
    np.testing.assert_array_equal(R.replay(S0, tape, 0), S0)


@pytest.mark.parametrize("dtype, relative_tolerance", [(np.float64, 1e-12), (np.float32, 1e-4)])
@pytest.mark.parametrize("checkpoint", ["tiny-mtp", "tiny-moe", "tiny-odd"])
def test_prefill_then_token_by_token_decode_equals_one_full_forward(checkpoint, dtype, relative_tolerance):
    """The state is complete: prefill T tokens, then decode one at a time (the per-token DeltaNet step, the KV cache
    appended), and the logits equal one forward over the whole sequence (the chunked form). Exact in float64 (up to
    1.4e-12 measured); in float32 the two orders of summation differ by up to 3.7e-5 of the largest logit."""
    cfg, params = model(checkpoint, dtype)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 80).tolist()
    full = R.forward(params, cfg, tokens, R.empty_state(cfg))[0]
    for split in (1, 3, 64, 79):
        logits, _, state, _ = R.forward(params, cfg, tokens[:split], R.empty_state(cfg))
        steps = [logits]
        for t in tokens[split:]:
            logits, _, state, _ = R.forward(params, cfg, [t], state)
            steps.append(logits)
        np.testing.assert_allclose(np.concatenate(steps), full, rtol=0, atol=relative_tolerance * np.abs(full).max())
        assert state.length == len(tokens)
