"""jax_impl's draft trees against reference.py (the whole-model tree cases are the conformance goldens', run by
tests/test_conformance_jax.py): a node's DeltaNet recurrence and conv window come from its own ancestors, never from
the previous packed row. Float32 against the reference in float64, off by float32 rounding only."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_impl
import reference as R
from conformance.diagnosis import packed_as_chain
from jax_impl.trees import tree_conv_rows, tree_delta_states, tree_of
from test_jax_model import assert_rounding_only
from test_trees import TOPOLOGIES, rule_inputs

PARENTS = TOPOLOGIES["random"]      # [-1, 0, 0, 2, 1, 2, 5, 3]: siblings packed next to each other's subtrees


@jax.jit
def jax_tree(q, k, v, g, beta, S0, window, x, parents):
    """jax_impl's tree rule, every node's state (the per-position commit's) and conv windows (width W-1 = 3)."""
    tree = tree_of(parents)
    o, delta = jax_impl.gated_delta_tree(q, k, v, g, beta, S0, tree.mask)
    states = tree_delta_states(S0, R.Tape(None, k, g, delta), tree)
    windows = jnp.concatenate([window, x])[tree_conv_rows(tree, len(window), len(window))]
    return o, delta, states, windows, tree.depth


def test_a_tree_node_starts_from_its_parent_not_the_previous_row():
    inputs = rule_inputs(len(PARENTS), seed=3)
    rng = np.random.default_rng(4)
    window, x = rng.standard_normal((3, 5)), rng.standard_normal((len(PARENTS), 5))
    o, delta, states, windows, depth = jax_tree(*(jnp.asarray(a, jnp.float32) for a in (*inputs, window, x)),
                                                jnp.asarray(PARENTS, jnp.int32))
    for rows in (PARENTS, packed_as_chain(PARENTS)):        # the spec's parents, then the packed rows as a chain
        f64 = R.gated_delta_tree_recurrent(*inputs, rows)
        f32 = R.gated_delta_tree_recurrent(*(a.astype(np.float32) for a in inputs), rows)
        if rows is PARENTS:
            for actual, a32, a64 in zip((o, delta, states), f32, f64):
                assert_rounding_only(actual, a32, a64)
            np.testing.assert_array_equal(windows, R.tree_conv_windows(window.astype(np.float32),
                                                                       x.astype(np.float32), PARENTS, 3))
            np.testing.assert_array_equal(depth, R.tree_depths(PARENTS))
        else:                                                # a node from the previous row is far off, not rounding
            assert np.abs(np.asarray(o, np.float64) - f64[0]).max() > 0.05
            assert np.abs(np.asarray(states, np.float64) - f64[2]).max() > 0.05
            assert not np.array_equal(windows, R.tree_conv_windows(window.astype(np.float32), x.astype(np.float32),
                                                                   rows, 3))


def oracle_tree(truth, V):
    """A tree drafter that knows the greedy continuation `truth` (the whole sequence): at each depth a wrong token
    first, then the right one, whose node the next depth's two hang off. The accepted path is then every second
    node (2, 4, 6): a node whose packed previous row is its wrong sibling."""
    def propose(params, cfg, draft_state, buf, ntok, budget, own, room):   # own: budget (the single loop)
        right = jax.lax.dynamic_slice_in_dim(truth, ntok, budget.depth)
        wrong = (right + 1) % V
        tokens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.stack([wrong, right], axis=1).reshape(-1)])
        parents = jnp.array([-1, 0, 0] + [p for d in range(1, budget.depth) for p in (2 * d, 2 * d)], jnp.int32)
        return tokens, parents, 1 + 2 * jnp.minimum(room, budget.depth)
    return propose


def test_greedy_tree_rounds_give_plain_decoding_and_accept_down_the_second_siblings(monkeypatch):
    """jax_impl's single-request loop with tree rounds (spec_decode.request_step's tree variant): plain greedy
    tokens, every drafted level accepted (as many target calls as the reference's tree rounds make with the same
    trees), both siblings verified in one pass."""
    name, prompt, new = "tiny-odd", [5, 17, 42, 99, 3, 17, 42, 7], 16
    cfg, params = R.load_model(f"weights/{name}")
    plain = R.generate(params, cfg, prompt, new, R.Sampling(), np.random.default_rng(0))[0]
    truth = np.array(prompt + plain + [0] * 64, np.int32)
    budget = R.TreeBudget(6, 3, 2)

    def reference_oracle(state, context, new_hidden, room):           # the same trees, as a reference TreeDrafter
        right = truth[len(context):len(context) + room.depth]
        tokens = [int(context[-1])] + [int(t) for r in right for t in ((r + 1) % cfg.vocab_size, r)]
        parents = [-1, 0, 0] + [p for d in range(1, room.depth) for p in (2 * d, 2 * d)]
        return tokens, parents[:len(tokens)], state
    _, want = R.generate_tree_speculative(params, cfg, prompt, new, R.Sampling(), np.random.default_rng(0),
                                          R.TreeDrafter("oracle", None, reference_oracle), budget)

    from jax_impl import spec_decode
    monkeypatch.setitem(spec_decode.TREE_DRAFTERS, "ngram", oracle_tree(jnp.asarray(truth), cfg.vocab_size))
    monkeypatch.setattr(spec_decode, "_compiled", spec_decode.OrderedDict())                 # this drafter's program, compiled apart
    tokens, stats = jax_impl.generate(jax_impl.to_jax(params), cfg, prompt, new, draft="ngram", tree=budget)
    assert tokens == plain
    assert stats["target_calls"] == want["target_calls"] == 4         # 1 + 3 rounds of 4 tokens + a round of 3
    assert stats["accepted"] == sum(want["accepted_depths"]) == new - 1 - stats["target_calls"]
