"""jax_impl/matvec.py: the CPU kernel for decode's and verify's products is built and used here, agrees with an
fp64 product within fp32's error bound, gives the same bits however its work is split, survives vmap and grad,
decoding through it gives XLA's dot's tokens, and a decode step calls it once per input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_impl
import reference
from bench.jax_profile import breakdown
from jax_impl import matvec


@pytest.fixture
def xla_dot():
    matvec.set_mode("xla")
    yield
    matvec.set_mode("auto")


def random(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


def test_the_kernel_builds_and_serves_decode_and_verify_rows():
    assert matvec.kernel_registered()  # a C++ compiler is part of the set-up: without it decoding is 2x slower
    x, w = jnp.ones((matvec.MAX_ROWS, 8)), jnp.ones((8, 4))
    assert matvec.uses_kernel(x, w) and matvec.uses_kernel(x[0], w)
    assert not matvec.uses_kernel(jnp.ones((matvec.MAX_ROWS + 1, 8)), w)           # prefill: XLA's dot
    assert not matvec.uses_kernel(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))   # bf16: XLA's dot
    assert "qwen35_matvec_f32" in jax.jit(matvec.matmul).lower(x, w).as_text()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, matvec.MAX_ROWS), K=st.integers(1, 700), N=st.integers(1, 300), seed=st.integers(0, 99))
def test_products_within_the_fp32_error_bound(rows, K, N, seed):
    rng = np.random.default_rng(seed)
    x, w = random(rng, rows, K), random(rng, K, N)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    bound = K * 2.0**-24 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)))  # K roundings
    assert np.all(np.abs(np.asarray(jax.jit(matvec.matmul)(x, w)) - exact) <= bound)


def test_same_bits_however_the_work_is_split():
    """A small product runs on one thread alone, on two threads next to a large one; a matrix alone or in a group;
    5 rows (verify: vectors of w shared by the rows) or 1 row at a time: each output is the same bits (one chain of
    fused multiply-adds per chunk of w's rows, the chunks added in order)."""
    rng = np.random.default_rng(0)
    x, large, small, odd = random(rng, 5, 1000), random(rng, 1000, 512), random(rng, 1000, 4), random(rng, 1000, 37)
    alone = [jax.jit(matvec.matmul)(x, w) for w in (large, small, odd)]
    grouped = jax.jit(lambda x, *ws: matvec.matmuls(x, *ws))(x, large, small, odd)
    for a, b in zip(alone, grouped):
        np.testing.assert_array_equal(a, b)
    rows = [jax.jit(matvec.matmul)(x[i:i + 1], large)[0] for i in range(5)]   # one row at a time: same bits
    np.testing.assert_array_equal(np.stack(rows), alone[0])


@pytest.mark.parametrize("rows", [3, 9, matvec.MAX_ROWS])
def test_same_bits_for_a_batch_in_row_tiles_and_column_blocks(rows):
    """A few rows go in chunks of w's rows, more (a batch of requests' rows, batch.py) in blocks of w's columns, in
    tiles of rows and of columns with single vectors and single columns at the edge (2003 columns): each row's sums
    keep their order on every path, so each output is the bits of that row alone."""
    rng = np.random.default_rng(2)
    x, w = random(rng, rows, 1000), random(rng, 1000, 2003)
    together = jax.jit(matvec.matmul)(x, w)
    one = jax.jit(matvec.matmul)
    np.testing.assert_array_equal(np.stack([one(x[i:i + 1], w)[0] for i in range(len(x))]), together)


def test_vmap_and_grad():
    rng = np.random.default_rng(1)
    xs, w, ws = random(rng, 40, 2, 64), random(rng, 64, 32), random(rng, 40, 64, 32)
    exact = np.asarray(xs, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(jax.vmap(matvec.matmul, (0, None))(xs, w), exact, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(jax.vmap(matvec.matmul, (0, 0))(xs, ws),
                               np.einsum("bmk,bkn->bmn", np.asarray(xs, np.float64), np.asarray(ws, np.float64)),
                               rtol=1e-5, atol=1e-4)
    weights = random(rng, 2, 32)  # a loss linear in the product: its gradients are XLA's dots, bit for bit
    loss = lambda product: lambda x, w: jnp.sum(weights * product(x, w))  # noqa: E731
    ours = jax.grad(loss(matvec.matmul), (0, 1))(xs[0], w)
    xla = jax.grad(loss(jnp.matmul), (0, 1))(xs[0], w)
    for a, b in zip(ours, xla):
        np.testing.assert_array_equal(a, b)


def test_decoding_gives_the_tokens_of_xlas_dot(request):
    cfg, params = jax_impl.load("weights/default")
    prompt = [11, 200, 31, 7, 11, 200, 31]
    ours = jax_impl.generate(params, cfg, prompt, 24, draft="ngram", draft_len=3)[0]
    request.getfixturevalue("xla_dot")
    assert jax_impl.generate(params, cfg, prompt, 24, draft="ngram", draft_len=3)[0] == ours


def test_a_bad_mode_is_a_user_error():
    with pytest.raises(reference.UserError, match="JAX_IMPL_MATVEC fast"):
        matvec.set_mode("fast")


def test_a_decode_step_makes_one_kernel_call_per_input():
    """Traced on device (bench/jax_profile.py): each layer's mixer input projections, mixer output, gate/up and
    down projections are one call each, the lm_head one more; the rest of the step is XLA's own ops."""
    cfg, params = jax_impl.load(reference.DEFAULT_MODEL)
    step = breakdown(cfg, params, steps=2)
    assert step.kernel_calls == 4 * cfg.num_hidden_layers + 1
    assert step.kernel_ms > 0 and step.other_ops > 0 and step.other_ms > 0
