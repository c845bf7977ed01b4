"""jax_impl's n-gram tree drafter (trees.ngram_tree) against reference.ngram_tree: the same nodes in the same order,
within a static budget or a request's own smaller one (traced), depths cut to the room left; and jax_impl's tree
rounds with it against reference.generate_tree_speculative, greedy and sampled, and on the command line."""

import dataclasses
import json
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_impl
import reference as R
from jax_impl.spec_decode import buffer_sizes, generate_device
from jax_impl.trees import ngram_tree
from test_jax_generate import ROOT, WEIGHTS, chi_square_pvalue, run_cli, second_token_law

BUFFER = 96                          # the drafter's buffer: the context, then tokens it must not read
BRANCHY = [3, 1, 2, 5, 6, 1, 2, 5, 7, 1, 2, 4, 6, 8, 1, 2]     # [1, 2] followed by 5 6, 5 7, 4 6: siblings


@partial(jax.jit, static_argnums=2)
def device_tree(buf, ntok, budget, own, room):  # own: a TreeBudget of traced scalars
    return ngram_tree(buf, ntok, budget, own, room)


def drafted(context, budget, own=None, room=None, rng=None):
    """trees.ngram_tree over the context in a longer buffer (its tail random: never read) -> tokens, parents as
    lists of the real nodes; checks the padding and the shapes."""
    own, room = own or budget, budget.depth if room is None else room
    tail = (rng or np.random.default_rng(0)).integers(0, max(context) + 2, BUFFER - len(context))
    buf = jnp.asarray(np.concatenate([context, tail]), jnp.int32)
    tokens, parents, m = device_tree(buf, jnp.int32(len(context)), budget, R.TreeBudget(*map(jnp.int32, own)),
                                     jnp.int32(room))
    tokens, parents, m = np.asarray(tokens), np.asarray(parents), int(m)
    assert tokens.shape == parents.shape == (budget.nodes + 1,)
    assert (tokens[m:] == 0).all() and (parents[m:] == 0).all()          # padding: token 0, children of the root
    return tokens[:m].tolist(), parents[:m].tolist()


def reference_tree(context, own, room):
    return R.ngram_tree(list(context), own._replace(depth=min(own.depth, room)))


def assert_same_tree(context, budget, own=None, room=None, rng=None):
    own, room = own or budget, budget.depth if room is None else room
    want = reference_tree(context, own, room)
    assert drafted(context, budget, own, room, rng) == (list(want[0]), list(want[1])), (context, budget, own, room)
    return want


BUDGETS = [R.TreeBudget(8, 4, 2), R.TreeBudget(6, 3, 3), R.TreeBudget(16, 8, 1), R.TreeBudget(12, 6, 8)]


@pytest.mark.parametrize("budget", BUDGETS)
def test_random_contexts_give_the_reference_trees(budget):
    """Small vocabularies, so suffixes repeat with several continuations; the buffer's tail is never read."""
    rng = np.random.default_rng(budget.nodes)
    grew = 0
    for _ in range(60):
        context = rng.integers(0, int(rng.integers(2, 7)), int(rng.integers(1, BUFFER + 1)))
        grew += len(assert_same_tree(context, budget, rng=rng)[0]) > 2
    assert grew > 30                                  # most trees have more than one drafted node


def test_a_context_without_a_match_drafts_nothing():
    for context in ([7], [1, 2, 3, 4, 5], list(range(40, 0, -1))):
        assert drafted(np.asarray(context), BUDGETS[0]) == ([context[-1]], [-1]) == reference_tree(context,
                                                                                                   BUDGETS[0], 4)


def test_a_suffix_seen_many_times_fills_the_branch_and_node_budgets():
    """The suffix [1, 2] occurs 12 times, followed by 12 different continuations sharing first tokens: the branch
    budget refuses children (refused continuations stop there; later ones, whose first tokens are in, still grow)
    and the node budget cuts the trie."""
    rng = np.random.default_rng(5)
    context = np.concatenate([np.concatenate([[1, 2], rng.integers(3, 6, 3), [9]]) for _ in range(12)] + [[1, 2]])
    binding = set()
    for budget in (R.TreeBudget(64, 3, 2), R.TreeBudget(10, 3, 3), R.TreeBudget(64, 16, 1), R.TreeBudget(5, 2, 8)):
        want = assert_same_tree(context, budget)
        binding |= {field for field in ("nodes", "branch")           # the reference's tree grows without it
                    if R.ngram_tree(list(context), budget._replace(**{field: 64})) != want}
    assert binding == {"nodes", "branch"}


def test_the_depth_is_cut_to_the_room_left():
    context = np.array([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 8, 9, 1, 2, 3])
    budget = R.TreeBudget(16, 6, 2)
    for room in range(0, 8):
        tokens, parents = assert_same_tree(context, budget, room=room)
        assert max(R.tree_depths(parents)) == min(room, 6)                 # 4 5 6 7 1 2 after the first 1 2 3


def test_a_request_budget_below_the_static_one_traced():
    """own (traced) smaller than the static budget in each field, and all of them: the reference's tree of own."""
    rng = np.random.default_rng(11)
    budget = R.TreeBudget(16, 8, 4)
    for _ in range(60):
        context = rng.integers(0, int(rng.integers(2, 5)), int(rng.integers(2, BUFFER + 1)))
        own = R.TreeBudget(*(int(rng.integers(1, field + 1)) for field in budget))
        assert_same_tree(context, budget, own, room=int(rng.integers(0, 10)), rng=rng)
    for own in (R.TreeBudget(2, 8, 4), R.TreeBudget(16, 1, 4), R.TreeBudget(16, 8, 1)):    # each field binds
        assert len(assert_same_tree(np.array(BRANCHY), budget, own)[0]) < len(reference_tree(BRANCHY, budget, 8)[0])


def test_a_long_context():
    """Thousands of tokens, the suffix seen about a hundred times: one sort of the continuations, no loop over
    them."""
    rng = np.random.default_rng(2)
    context = rng.integers(0, 3, 3000)
    for budget in (R.TreeBudget(64, 16, 8), R.TreeBudget(8, 4, 2)):
        buf = jnp.asarray(np.pad(context, (0, 96)), jnp.int32)
        tokens, parents, m = device_tree(buf, jnp.int32(len(context)), budget, budget, jnp.int32(budget.depth))
        want = R.ngram_tree(list(context), budget)
        assert (np.asarray(tokens)[:int(m)].tolist(), np.asarray(parents)[:int(m)].tolist()) == want
        assert int(m) == budget.nodes + 1


# End to end: jax_impl's single-request loop with n-gram tree rounds
PROMPT = [5, 17, 42, 99, 3, 17, 42, 7, 8, 9, 100, 200, 17, 42, 7]


@pytest.mark.parametrize("name, prompt, budget, sampling, rollback", [
    ("tiny-mtp", PROMPT, R.TreeBudget(8, 4, 2), R.Sampling(), "replay"),
    ("tiny-odd", BRANCHY, R.TreeBudget(16, 16, 2), R.Sampling(), "per-position"),
    ("tiny-mtp", BRANCHY, R.TreeBudget(6, 3, 3), R.Sampling(temperature=1.0, top_k=1), "replay"),
])
def test_tree_generation_gives_the_reference_tokens_and_counts(name, prompt, budget, sampling, rollback):
    """Tokens, target calls, drafted nodes and accepted depths of reference.generate_tree_speculative with its
    n-gram trees, the last rounds' depths cut by the length limit. Sampled: top-k 1, so that the sampling path's
    acceptance (multi-draft, one-hot q) decides the same whatever the random numbers."""
    cfg, params = R.load_model(WEIGHTS / name)
    want_tokens, want = R.generate_tree_speculative(params, cfg, prompt, 30, sampling, np.random.default_rng(0),
                                                    R.NGRAM_TREE, budget, rollback)
    tokens, stats = jax_impl.generate(jax_impl.to_jax(params), cfg, prompt, 30, sampling, draft="ngram",
                                      tree=budget, rollback=rollback)
    assert tokens == want_tokens
    assert stats["target_calls"] == want["target_calls"]
    assert stats["proposed"] == sum(want["drafted_nodes"]) and stats["accepted"] == sum(want["accepted_depths"])
    assert stats["accepted"] > 0


def test_sampled_tree_rounds_give_the_target_law():
    """Temperature 2, top-k 2, vmapped over 3000 keys: the 2nd token's law is the target's (chi-square). The prompt
    holds each likely first token twice, followed by different tokens, one of them among the likely second tokens:
    the first round's tree is two siblings, and the second one is often accepted after the first is rejected."""
    name, sampling, runs = "tiny-multimodal", R.Sampling(temperature=2.0, top_k=2), 3000
    cfg, params = R.load_model(WEIGHTS / name)
    cfg = dataclasses.replace(cfg, eos_token_id=())
    prompt = [212, 65, 212, 187, 156, 226, 156, 105, 103, 186, 258, 176]
    law = second_token_law(name, sampling, tuple(prompt))
    budget = R.TreeBudget(4, 2, 2)
    P, capacity = buffer_sizes(len(prompt), 3, max(budget.nodes, budget.depth))
    run = partial(generate_device, jax_impl.to_jax(params), cfg, jnp.array(prompt + [0] * (P - len(prompt))),
                  len(prompt), 3, sampling=sampling, draft="ngram", K=budget.nodes, rollback="replay",
                  capacity=capacity, tree=budget)
    buf, ntok, stats = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(7), runs))
    assert (ntok == len(prompt) + 3).all()
    assert (np.asarray(stats.proposed) >= 2).all()                    # the first round drafted two siblings
    accepted = np.asarray(stats.accepted) > 0
    assert 0.1 * runs < accepted.sum() < 0.9 * runs                   # both: a sibling accepted, none accepted
    second, support = np.asarray(buf[:, len(prompt) + 1]), np.flatnonzero(law)    # top-k 2: a few tokens
    assert np.isin(second, support).all()
    assert chi_square_pvalue(np.searchsorted(support, second), law[support], runs) > 1e-3


def test_cli_ngram_tree_matches_the_reference_cli(tmp_path):
    args = ["--model", str(WEIGHTS / "tiny-mtp"), "--prompt-ids", ",".join(map(str, BRANCHY)), "--max-new-tokens",
            "12", "--json", "--draft", "ngram", "--tree", "8:4:2"]
    ours = run_cli(*args)
    assert ours.returncode == 0, ours.stderr
    ref = subprocess.run([sys.executable, "reference.py", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert ref.returncode == 0, ref.stderr
    ours_stats, ref_stats = json.loads(ours.stdout)["stats"], json.loads(ref.stdout)["stats"]
    assert json.loads(ours.stdout)["tokens"] == json.loads(ref.stdout)["tokens"]
    assert ours_stats["target_calls"] == ref_stats["target_calls"]
    assert ours_stats["accepted"] == sum(ref_stats["accepted_depths"]) > 0
    (tmp_path / "table.json").write_text(json.dumps(R.build_ngram_table([BRANCHY])))
    table = run_cli(*args, "--ngram-table", str(tmp_path / "table.json"))          # trees take no offline table
    assert table.returncode == 2 and len(table.stderr.strip().splitlines()) == 1 and "--tree" in table.stderr
