"""bench/tree_speed.py's bookkeeping: the rounds' widths and reached depths it feeds the cost model and the plot."""

import numpy as np

import reference as R
from bench import tree_speed as T
from conftest import model
from test_speculative import PROMPT


def test_chain_widths_and_depths_come_back_from_the_position_counts():
    # 5 rounds proposing 0, 2, 2, 3, 3 drafts, accepting 0, 1, 2, 0, 3
    stats = {"target_calls": 5, "proposed_by_position": [4, 4, 2], "accepted_by_position": [3, 2, 1]}
    assert sorted(T.chain_widths(stats)) == [0, 2, 2, 3, 3]
    assert T.chain_depths(stats) == [0.6, 0.4, 0.2]
    assert T.reached([0, 1, 2, 0, 3], 3) == [0.6, 0.4, 0.2]


def test_a_chain_runs_widths_are_what_it_proposed():
    cfg, params = model("tiny-mtp")
    _, stats, _, depths = T.run_chain(params, cfg, PROMPT, 16, "ngram", 4)
    assert sum(stats["drafted_nodes"]) == stats["proposed"] and len(stats["drafted_nodes"]) == stats["target_calls"]
    _, tree, _, tree_depths = T.run_tree(params, cfg, PROMPT, 16, "ngram", R.TreeBudget(4, 4, 1))
    assert tree["tokens_per_call"] == stats["tokens_per_call"] and np.allclose(tree_depths, depths)
