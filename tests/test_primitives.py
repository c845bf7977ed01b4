"""Hand-checkable literal cases for the primitives."""

import numpy as np

import reference as R


def test_rms_norm_scales_by_one_plus_weight():
    # rms([3, 4]) = sqrt(12.5); weight offsets [0, 1] scale by [1, 2]
    y = R.rms_norm(np.array([3.0, 4.0]), np.array([0.0, 1.0]), eps=0.0)
    np.testing.assert_allclose(y, [3 / np.sqrt(12.5), 2 * 4 / np.sqrt(12.5)])


def test_gated_rms_norm_uses_the_plain_weight_and_silu_gate():
    x = np.array([[[3.0, 4.0]]])
    y = R.rms_norm_gated(x, z=np.array([[[0.0, 1.0]]]), weight=np.array([2.0, 2.0]), eps=0.0)
    np.testing.assert_allclose(y, [[[0.0, 2 * 4 / np.sqrt(12.5) * (1 / (1 + np.exp(-1)))]]])


def test_l2norm():
    np.testing.assert_allclose(R.l2norm(np.array([3.0, 4.0]), eps=0.0), [0.6, 0.8])


def test_softplus_sigmoid_silu():
    np.testing.assert_allclose(R.softplus(np.array([0.0, 30.0])), [np.log(2), 30.0])
    np.testing.assert_allclose(R.sigmoid(np.array([0.0])), [0.5])
    np.testing.assert_allclose(R.silu(np.array([2.0])), [2 / (1 + np.exp(-2))])


def test_partial_rope_rotates_pairs_i_and_i_plus_half_and_passes_the_rest():
    x = np.arange(1.0, 7.0, dtype=np.float32).reshape(1, 1, 6)        # (T, H, Dh) = (1, 1, 6), R = 4
    y = R.rope(x, np.array([1]), theta=100.0, rotary_dim=4)
    a0, a1 = 1.0, 100.0 ** -0.5                                        # angles of pairs (0, 2) and (1, 3)
    expected = [1 * np.cos(a0) - 3 * np.sin(a0), 2 * np.cos(a1) - 4 * np.sin(a1),
                3 * np.cos(a0) + 1 * np.sin(a0), 4 * np.cos(a1) + 2 * np.sin(a1), 5, 6]
    np.testing.assert_allclose(y[0, 0], expected, rtol=1e-6)
    np.testing.assert_array_equal(R.rope(x, np.array([0]), 100.0, 4), x)


def test_causal_conv1d_last_tap_is_the_current_token():
    x = np.array([[1.0], [2.0], [3.0]])                                # (T, C) = (3, 1)
    w = np.array([[10.0, 100.0, 1000.0]])                              # (C, W) = (1, 3)
    y, window = R.causal_conv1d(x, np.zeros((2, 1)), w)
    np.testing.assert_array_equal(y[:, 0], [1000, 100 + 2000, 10 + 200 + 3000])
    np.testing.assert_array_equal(window[:, 0], [2, 3])
    y2, _ = R.causal_conv1d(np.array([[4.0]]), window, w)               # continues from the window
    np.testing.assert_array_equal(y2[:, 0], [20 + 300 + 4000])


def test_layer_types_from_interval():
    assert R.layer_types_from_interval(8, 4) == ("linear_attention",) * 3 + ("full_attention",) + \
        ("linear_attention",) * 3 + ("full_attention",)


def test_sample_is_inverse_cdf():
    p = np.array([0.25, 0.0, 0.75])
    assert [R.sample(p, u) for u in (0.0, 0.2499, 0.25, 0.9999)] == [0, 0, 2, 2]


def test_probabilities_top_k_top_p_and_greedy():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    np.testing.assert_allclose(R.probabilities(logits, R.Sampling(1.0)), [0.5, 0.3, 0.15, 0.05], rtol=1e-6)
    np.testing.assert_allclose(R.probabilities(logits, R.Sampling(1.0, top_k=2)), [0.625, 0.375, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(R.probabilities(logits, R.Sampling(1.0, top_p=0.75)), [0.625, 0.375, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(R.probabilities(logits, R.Sampling(1.0, top_p=0.81)), np.array([0.5, 0.3, 0.15, 0]) / 0.95,
                               rtol=1e-6)
    np.testing.assert_array_equal(R.probabilities(logits, R.Sampling(0.0)), [1, 0, 0, 0])
    hot = R.probabilities(logits, R.Sampling(0.5))                     # temperature sharpens: p^2 normalised
    np.testing.assert_allclose(hot, np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365, rtol=1e-5)
