"""jax_impl's self-speculative drafters (partial-mlp:F[:LAYERS], mtp-shortlist:PATH): greedy, each drafts, accepts
and verifies exactly as reference.py's drafter of the same spec does (same tokens, target calls and acceptance by
position, so greedy speculative == plain); sampled, the law of the 2nd generated token matches the target's exact
law (chi-square over 3000 vmapped keys), through the on-device loop."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_impl
import reference
from jax_impl.spec_decode import buffer_sizes, generate_device
from test_jax_generate import PROMPT, SPEC_KEYS, WEIGHTS, chi_square_pvalue, second_token_law
from test_self_speculative import shortlist_file


def spec_of(spec, checkpoint):
    return f"mtp-shortlist:{shortlist_file(checkpoint)}" if spec == "mtp-shortlist" else spec


# each drafter setting once (a compilation each, 20-40 s in CI, whose time is near its limit), both rollbacks
@pytest.mark.parametrize("checkpoint, spec, K, rollback", [
    ("tiny-mtp", "partial-mlp:0.25:1-2", 3, "per-position"),
    ("tiny-moe", "partial-mlp:0.5", 2, "replay"), ("tiny-mtp", "partial-mlp:1", 4, "replay"),
    ("tiny-multimodal", "mtp-shortlist", 2, "per-position"),
])
def test_greedy_matches_reference(checkpoint, spec, K, rollback):
    cfg, params = reference.load_model(WEIGHTS / checkpoint)
    spec = spec_of(spec, checkpoint)
    tokens, stats = jax_impl.generate(jax_impl.to_jax(params), cfg, PROMPT, 24, draft=spec, draft_len=K,
                                      rollback=rollback)
    drafter = reference.make_drafter(spec, params, cfg)
    want_tokens, want = reference.generate_speculative(params, cfg, PROMPT, 24, reference.Sampling(),
                                                       np.random.default_rng(0), drafter, K, rollback)
    plain, _ = reference.generate(params, cfg, PROMPT, 24, reference.Sampling(), np.random.default_rng(0))
    assert tokens == want_tokens == plain
    assert {k: stats[k] for k in SPEC_KEYS} == {k: want[k] for k in SPEC_KEYS}
    if spec == "partial-mlp:1":           # the whole MLP: the target itself drafts, every draft is accepted
        assert stats["accepted"] == stats["proposed"] > 0


@pytest.mark.parametrize("spec, K", [("partial-mlp:0.25", 2), ("mtp-shortlist", 2)])
def test_sampling_distribution(spec, K):
    """As test_jax_generate's: temperature 2, whole vocabulary; the shortlist's q is zero outside it."""
    cfg, params = reference.load_model(WEIGHTS / "tiny-multimodal")
    cfg = dataclasses.replace(cfg, eos_token_id=())
    jparams, spec = jax_impl.to_jax(params), spec_of(spec, "tiny-multimodal")
    sampling, runs, prompt = reference.Sampling(temperature=2.0), 3000, [1, 2, 3, 1, 2, 3, 1, 2]
    law = second_token_law("tiny-multimodal", sampling, tuple(prompt))
    P, capacity = buffer_sizes(len(prompt), 3, K)
    drafter = jax_impl.DRAFTERS[spec.partition(":")[0]]
    arrays = drafter.prepare(jparams, cfg, spec, K, None)
    run = partial(generate_device, jparams, cfg, jnp.array(prompt + [0] * (P - len(prompt))), len(prompt), 3,
                  arrays=arrays, sampling=sampling, draft=spec, K=K, rollback="replay", capacity=capacity)
    buf, ntok, stats = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(7), runs))
    assert (ntok == len(prompt) + 3).all()
    assert 0 < int(stats.accepted.sum()) < int(stats.proposed.sum())
    assert chi_square_pvalue(buf[:, len(prompt) + 1], law, runs) > 1e-3
