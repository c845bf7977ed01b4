"""DDTree (reference.ddtree, a draft tree from a DFlash block's per-position marginals): it keeps the NODES most
likely prefixes under the factorised marginals (checked by brute force), greedy decoding with it gives plain
decoding's tokens under both rollbacks, and with its one-hot q the multi-draft acceptance's closed-form outcome
puts the target's own distribution on the first token (a marginal q instead is caught)."""

import itertools

import numpy as np
import pytest

import reference as R
from test_self_speculative import small_model_with_mtp
from weights.make_tiny_dflash import random_dflash_tensors


def test_ddtree_keeps_the_most_likely_prefixes():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 5)) * 2
    budget = R.TreeBudget(7, 3, 3)
    tokens, parents = R.ddtree(9, logits, budget)
    R.check_tree(parents)
    log_q = np.log(R.softmax(logits))
    top = np.argsort(-log_q, axis=-1)[:, :3]
    prefixes = [p for d in (1, 2, 3) for p in itertools.product(*[top[i] for i in range(d)])]
    best = sorted(prefixes, key=lambda p: -sum(log_q[i, t] for i, t in enumerate(p)))[:7]
    kept = {tuple(tokens[j] for j in R.tree_path(parents, n)[1:]) for n in range(1, len(tokens))}
    assert kept == set(best) and len(tokens) == 8 and tokens[0] == 9


def tree_drafter():  # test_dflash's small random drafter as a DDTree drafter
    cfg, params = small_model_with_mtp()
    dcfg = R.DFlashConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          intermediate_size=16, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=(1, 0),
                          mask_token_id=3, block_size=3)
    dparams = R.nested_params(random_dflash_tensors(cfg, dcfg, seed=5))
    return cfg, params, R.dflash_tree_drafter("dflash", params, cfg, dparams, dcfg)


@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
def test_greedy_ddtree_equals_plain(rollback):
    cfg, params, tree = tree_drafter()
    prompt = [1, 2, 3, 1, 2]
    plain, _ = R.generate(params, cfg, prompt, 30, R.Sampling(), np.random.default_rng(0))
    for budget in (R.TreeBudget(1, 1, 1), R.TreeBudget(4, 2, 2), R.TreeBudget(6, 3, 3)):
        tokens, stats = R.generate_tree_speculative(params, cfg, prompt, 30, R.Sampling(), np.random.default_rng(0),
                                                    tree, budget, rollback)
        assert tokens == plain, (budget, stats)
        assert 0 < sum(stats["accepted_depths"]) < sum(stats["drafted_nodes"]), stats


def test_one_hot_q_is_exact_and_a_marginal_q_is_caught():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 4)) * 2
    tokens, parents = R.ddtree(0, logits, R.TreeBudget(5, 2, 3))
    p = R.softmax(rng.normal(size=(len(tokens), 4)))
    first = lambda out: first_token(out, tokens, parents)
    exact = R.tree_outcomes(tokens, parents, R.one_hot(tokens[1:], 4), p)
    assert np.allclose(first(exact), p[0], atol=1e-12)
    marginal = R.softmax(logits)[[R.tree_depths(parents)[n] - 1 for n in range(1, len(tokens))]]
    assert not np.allclose(first(R.tree_outcomes(tokens, parents, marginal, p)), p[0], atol=1e-3)


def first_token(out, tokens, parents):  # outcome rows (N, V) -> the distribution of the round's first committed token
    dist = out[0].copy()
    for n in range(1, len(tokens)):
        path = R.tree_path(parents, n)
        dist[tokens[path[1]]] += out[n].sum()
    return dist
