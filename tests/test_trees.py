"""Tree verification is exact: every node's logits are those of decoding its root-to-node path alone, the chunked
DeltaNet form equals the per-node recurrence, the committed state equals plain decoding of the accepted path under
both rollbacks, greedy trees give plain decoding's tokens, sampled trees the target's distribution, and a chain tree
is the chain round."""

import numpy as np
import pytest

import reference as R
from conformance import diagnosis
from conftest import model
from test_speculative import PROMPT, chi_square_p_value, plain_greedy

TOPOLOGIES = {                                   # parents; node 0 the root
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1, 0, 0, 0, 0],
    "binary": [-1, 0, 0, 1, 1, 2, 2],
    "deep-and-narrow": [-1, 0, 1, 2, 2, 4, 5],
    "random": [-1, 0, 0, 2, 1, 2, 5, 3],
}
CHECKPOINT = "tiny-mtp"
ATOL64 = 1e-9            # float64: a wrong mask, decay or parent shows far above rounding


def random_tokens(parents, V, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, V, len(parents))]


def prefix_state(cfg, params):
    return R.forward(params, cfg, PROMPT[:-1], R.empty_state(cfg))[2]


def rule_inputs(N, Hk=2, Hv=4, Dk=8, Dv=6, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (R.l2norm(rng.standard_normal((N, Hk, Dk))) for _ in range(2))
    return (q, k, rng.standard_normal((N, Hv, Dv)), -rng.uniform(0.01, 1.5, (N, Hv)), rng.uniform(0.05, 1, (N, Hv)),
            rng.standard_normal((Hv, Dk, Dv)))


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_chunked_tree_rule_equals_per_node_recurrence(topology):
    parents = TOPOLOGIES[topology]
    q, k, v, g, beta, S0 = rule_inputs(len(parents))
    o, delta, states = R.gated_delta_tree_recurrent(q, k, v, g, beta, S0, parents)
    o_chunked, delta_chunked = R.gated_delta_tree_chunked(q, k, v, g, beta, S0, parents)
    np.testing.assert_allclose(o_chunked, o, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(delta_chunked, delta, rtol=0, atol=ATOL64)
    folded = R.tree_delta_states(S0, R.Tape(None, k, g, delta_chunked), parents)
    np.testing.assert_allclose(folded, states, rtol=0, atol=ATOL64)
    for i in range(len(parents)):          # and each node's state is the chain recurrence over its path
        path = R.tree_path(parents, i)
        _, S, _ = R.gated_delta_recurrent(q[path], k[path], v[path], g[path], beta[path], S0)
        np.testing.assert_allclose(states[i], S, rtol=0, atol=ATOL64)


def test_chain_tree_rule_is_the_chain_chunked_form():
    parents = TOPOLOGIES["chain"]
    q, k, v, g, beta, S0 = rule_inputs(len(parents), seed=1)
    o, _, delta = R.gated_delta_chunked(q, k, v, g, beta, S0)
    o_tree, delta_tree = R.gated_delta_tree_chunked(q, k, v, g, beta, S0, parents)
    np.testing.assert_allclose(o_tree, o, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(delta_tree, delta, rtol=0, atol=ATOL64)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_tree_logits_equal_decoding_each_path(topology):
    cfg, params = model(CHECKPOINT, np.float64)
    parents, state = TOPOLOGIES[topology], prefix_state(cfg, params)
    tokens = [PROMPT[-1]] + random_tokens(parents, cfg.vocab_size, 7)[1:]
    logits, hidden, _, _ = R.tree_forward(params, cfg, tokens, parents, state)
    for i in range(len(parents)):
        path_logits, path_hidden, _, _ = R.forward(params, cfg, [tokens[j] for j in R.tree_path(parents, i)], state)
        np.testing.assert_allclose(logits[i], path_logits[-1], rtol=0, atol=ATOL64)
        np.testing.assert_allclose(hidden[i], path_hidden[-1], rtol=0, atol=ATOL64)


def assert_same_state(got, expected):
    assert got.length == expected.length
    for a, b in zip(got.layers, expected.layers):
        assert type(a) is type(b)
        for x, y in zip(a, b):
            assert x.shape == y.shape
            np.testing.assert_allclose(x, y, rtol=0, atol=ATOL64)


@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
@pytest.mark.parametrize("topology", ["binary", "deep-and-narrow", "random"])
def test_commit_equals_plain_decoding_of_the_accepted_path(topology, rollback):
    """Every node as the last accepted one (root only, inner nodes, leaves of short and deep branches)."""
    cfg, params = model(CHECKPOINT, np.float64)
    parents, state = TOPOLOGIES[topology], prefix_state(cfg, params)
    tokens = [PROMPT[-1]] + random_tokens(parents, cfg.vocab_size, 8)[1:]
    _, _, verified = R.verify_tree(params, cfg, state, tokens, parents, rollback)
    for last in range(len(parents)):
        path = R.tree_path(parents, last)
        expected = R.forward(params, cfg, [tokens[j] for j in path], state)[2]
        assert_same_state(R.commit_tree(verified, path), expected)


@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
def test_greedy_tree_decoding_equals_plain(rollback):
    """Rounds of binary trees of depth 3 around the greedy continuation, the true branch placed differently each
    round (first child, second child, absent from some depth): the tokens are plain greedy decoding's."""
    cfg, params = model(CHECKPOINT)
    truth = plain_greedy(CHECKPOINT)
    state = R.forward(params, cfg, PROMPT[:-1], R.empty_state(cfg))[2]
    out, rng, r = [PROMPT[-1]], np.random.default_rng(0), 0
    parents = [-1, 0, 0, 1, 1, 3, 3]            # depth 3 on the left, 1 on the right
    while len(out) - 1 < len(truth) - 4:
        n = len(out) - 1
        wrong = [int(t) for t in (np.asarray(truth[n:n + 3]) + 1 + rng.integers(0, 5, 3)) % cfg.vocab_size]
        right_first = r % 2 == 0
        good, bad = (1, 2) if right_first else (2, 1)
        tokens = [out[-1]] * 7
        tokens[good], tokens[bad] = truth[n], wrong[0]
        tokens[3], tokens[4] = (truth[n + 1], wrong[1]) if r % 3 else (wrong[1], wrong[1])
        tokens[5], tokens[6] = wrong[2], truth[n + 2]
        logits, _, verified = R.verify_tree(params, cfg, state, tokens, parents, rollback)
        path, token = R.accept_tree_greedy(tokens, parents, logits)
        state = R.commit_tree(verified, path)
        out += [tokens[j] for j in path[1:]] + [token]
        r += 1
    assert out[1:] == truth[:len(out) - 1]


def test_chain_tree_is_the_chain_round():
    """parents -1, 0, 1, ...: the chain's logits (float bounds), its decisions and outcome distribution (exactly)."""
    cfg, params = model(CHECKPOINT)
    state, K = prefix_state(cfg, params), 4
    tokens = [PROMPT[-1]] + random_tokens(range(K), cfg.vocab_size, 3)
    chain = list(range(-1, K))
    logits, _, _ = R.verify(params, cfg, state, tokens, "replay")
    tree_logits, _, _ = R.verify_tree(params, cfg, state, tokens, chain, "replay")
    np.testing.assert_allclose(tree_logits, logits, rtol=0, atol=2e-5)   # float32: cumsum vs path sums
    rng, V = np.random.default_rng(5), 6
    for trial in range(200):
        draft = [int(t) for t in rng.integers(0, V, K)]
        q, p = rng.dirichlet(np.ones(V) * 0.5, K), rng.dirichlet(np.ones(V) * 0.5, K + 1)
        q[np.arange(K), draft] += 1e-3
        q /= q.sum(axis=1, keepdims=True)
        u = rng.random(K + 1)
        n, token = R.accept_speculative(draft, q, p, u)
        path, tree_token = R.accept_tree_speculative([0] + draft, chain, q, p, u)
        assert (path, tree_token) == (list(range(n + 1)), token)
        assert R.accept_tree_greedy([0] + draft, chain, p) == (list(range(R.accept_greedy(draft, p)[0] + 1)),
                                                              R.accept_greedy(draft, p)[1])
        np.testing.assert_allclose(R.tree_outcomes([0] + draft, chain, q, p), R.speculative_outcomes(draft, q, p),
                                   rtol=0, atol=1e-12)


# --- Sampling: a toy target whose next-token distribution depends on the last token (a Markov chain) -----------

V_TOY = 4
TARGET = np.array([[.4, .3, .2, .1], [.1, .1, .1, .7], [.25, .25, .25, .25], [.6, .05, .05, .3]])
DRAFT = np.array([[.1, .2, .3, .4], [.5, .2, .2, .1], [.7, .1, .1, .1], [.3, .3, .3, .1]])
BRANCH, DEPTH, LENGTH = 2, 2, 3


def toy_tree(root, siblings, rng):
    """A full tree of BRANCH children per node to DEPTH; siblings 'iid': drawn independently from DRAFT[parent],
    q = DRAFT[parent]; 'top-k': DRAFT[parent]'s BRANCH most likely tokens, q one-hot (deterministic drafts);
    'top-k-marginal': the same tokens with q = DRAFT[parent] (what a tree from a drafter's top-k marginals claims)."""
    tokens, parents, q = [root], [-1], []
    for node in range(sum(BRANCH ** d for d in range(DEPTH))):
        row = DRAFT[tokens[node]]
        picks = (rng.choice(V_TOY, BRANCH, p=row) if siblings == "iid" else np.argsort(-row, kind="stable")[:BRANCH])
        for x in picks:
            tokens.append(int(x))
            parents.append(node)
            q.append(R.one_hot([x], V_TOY)[0] if siblings == "top-k" else row)
    return tokens, parents, np.array(q)


def toy_generate(siblings, rule, seed):
    rng, out = np.random.default_rng(seed), [0]
    while len(out) <= LENGTH:
        tokens, parents, q = toy_tree(out[-1], siblings, rng)
        path, token = rule(tokens, parents, q, TARGET[tokens], rng.random(len(tokens)))
        out += [tokens[j] for j in path[1:]] + [token]
    return tuple(out[1:LENGTH + 1])


def markov_distribution(length):
    dist = {}
    for seq in np.ndindex(*(V_TOY,) * length):
        dist[seq] = float(np.prod([TARGET[a, b] for a, b in zip((0,) + seq[:-1], seq)]))
    return dist


RUNS = 8_000


@pytest.mark.parametrize("siblings", ["iid", "top-k"])
def test_multi_draft_sampling_follows_the_target(siblings):
    counts = {}
    for seed in range(RUNS):
        seq = toy_generate(siblings, R.accept_tree_speculative, seed)
        counts[seq] = counts.get(seq, 0) + 1
    assert chi_square_p_value(counts, markov_distribution(LENGTH), RUNS) > 1e-3


def test_chain_rule_on_top_k_siblings_is_caught_as_biased():
    counts = {}
    for seed in range(RUNS):
        seq = toy_generate("top-k-marginal", diagnosis.tree_chain_rule_on_siblings, seed)
        counts[seq] = counts.get(seq, 0) + 1
    assert chi_square_p_value(counts, markov_distribution(LENGTH), RUNS) < 1e-6


@pytest.mark.parametrize("siblings", ["iid", "top-k"])
def test_tree_outcomes_give_the_target_distribution(siblings):
    """In closed form, for fixed trees with deterministic drafts (and averaged over i.i.d. draws for 'iid' is what the
    chi-square test checks): the first committed token's distribution is the target's at the root."""
    rng = np.random.default_rng(1)
    for root in range(V_TOY):
        tokens, parents, q = toy_tree(root, siblings, rng)
        outcomes = R.tree_outcomes(tokens, parents, q, TARGET[tokens])
        assert outcomes.sum() == pytest.approx(1, abs=1e-12)
        if siblings == "top-k":
            first = np.zeros(V_TOY)
            for last in range(len(tokens)):
                path = R.tree_path(parents, last)
                if len(path) > 1:
                    first[tokens[path[1]]] += outcomes[last].sum()
                else:
                    first += outcomes[last]
            np.testing.assert_allclose(first, TARGET[root], rtol=0, atol=1e-12)


def test_tree_outcomes_match_the_empirical_rule():
    rng = np.random.default_rng(2)
    tokens, parents, q = toy_tree(1, "iid", rng)
    p = TARGET[tokens]
    outcomes, counts, runs = R.tree_outcomes(tokens, parents, q, p), {}, 20_000
    for _ in range(runs):
        path, token = R.accept_tree_speculative(tokens, parents, q, p, rng.random(len(tokens)))
        counts[(path[-1], token)] = counts.get((path[-1], token), 0) + 1
    dist = {(i, t): float(outcomes[i, t]) for i in range(len(tokens)) for t in range(V_TOY)}
    assert chi_square_p_value(counts, dist, runs) > 1e-3


def test_bad_tree_is_an_error():
    for parents in ([], [0, 0], [-1, 1], [-1, 0, 3, 1]):
        with pytest.raises(R.UserError):
            R.check_tree(parents)


def test_ngram_tree_merges_continuations_within_the_budget():
    context = [1, 2, 3, 1, 2, 4, 1, 2, 5, 6, 1, 2]
    tokens, parents = R.ngram_tree(context, R.TreeBudget(nodes=4, depth=2, branch=2))
    assert tokens[0] == 2 and R.check_tree(parents)
    assert len(tokens) - 1 <= 4 and max(R.tree_depths(parents)) <= 2
    assert all(len(R.tree_children(parents, i)) <= 2 for i in range(len(tokens)))
    assert sorted(tokens[c] for c in R.tree_children(parents, 0)) == [4, 5]      # the two latest continuations


@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
def test_greedy_ngram_tree_generation_equals_plain(rollback):
    cfg, params = model(CHECKPOINT)
    tokens, stats = R.generate_tree_speculative(params, cfg, PROMPT, 24, R.Sampling(), np.random.default_rng(0),
                                                R.NGRAM_TREE, R.TreeBudget(8, 4, 3), rollback)
    assert tokens == plain_greedy(CHECKPOINT) and stats["target_calls"] < 23   # some round accepted a draft


def test_top_k_tree_keeps_the_likeliest_nodes_as_a_tree():
    # depth 1: tokens 0, 1, 2 at 0.5, 0.3, 0.2; depth 2 (after the spine's 0): token 3 at 0.9, token 1 at 0.1
    depth_logits = np.log([[0.5, 0.3, 0.2, 1e-9], [1e-9, 0.1, 1e-9, 0.9]])
    tokens, parents = R.top_k_tree(7, depth_logits, R.TreeBudget(nodes=3, depth=2, branch=2))
    # reach: 0 -> .5, 1 -> .3, (0, 3) -> .45, (0, 1) -> .05; keep the three likeliest, by depth then rank
    assert (tokens, parents) == ([7, 0, 1, 3], [-1, 0, 0, 1])
    tokens, parents = R.top_k_tree(7, depth_logits, R.TreeBudget(nodes=4, depth=1, branch=3))
    assert (tokens, parents) == ([7, 0, 1, 2], [-1, 0, 0, 0])
    assert R.top_k_tree(7, depth_logits, R.TreeBudget(nodes=2, depth=2, branch=1)) == ([7, 0, 3], [-1, 0, 1])


@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
def test_greedy_mtp_tree_generation_equals_plain(rollback):
    cfg, params = model(CHECKPOINT)
    tokens, stats = R.generate_tree_speculative(params, cfg, PROMPT, 24, R.Sampling(), np.random.default_rng(0),
                                                R.mtp_tree_drafter(params, cfg), R.TreeBudget(8, 4, 3), rollback)
    assert tokens == plain_greedy(CHECKPOINT) and len(stats["accepted_depths"]) == stats["target_calls"]


def test_an_mtp_chain_tree_is_the_mtp_chain_and_a_wider_tree_accepts_more():
    """On the trained default model (its head drafts well): a tree of one child per node makes as many target calls
    as the MTP chain of the same depth; with top-3 siblings at each depth (12 nodes) fewer."""
    cfg, params = model("default")
    prompt, n = PROMPT[:16], 24
    plain = R.generate(params, cfg, prompt, n, R.Sampling(), np.random.default_rng(0))[0]
    chain_tokens, chain = R.generate_speculative(params, cfg, prompt, n, R.Sampling(), np.random.default_rng(0),
                                                 R.mtp_drafter(params, cfg), 4)
    tree_tokens, tree = R.generate_tree_speculative(params, cfg, prompt, n, R.Sampling(), np.random.default_rng(0),
                                                    R.mtp_tree_drafter(params, cfg), R.TreeBudget(4, 4, 1))
    wide_tokens, wide = R.generate_tree_speculative(params, cfg, prompt, n, R.Sampling(), np.random.default_rng(0),
                                                    R.mtp_tree_drafter(params, cfg), R.TreeBudget(12, 4, 3))
    assert plain == chain_tokens == tree_tokens == wide_tokens
    assert tree["target_calls"] == chain["target_calls"] and wide["target_calls"] < tree["target_calls"]


def run_cli(*args):
    import subprocess
    import sys
    from conftest import ROOT
    return subprocess.run([sys.executable, str(ROOT / "reference.py"), "--model", str(ROOT / "weights" / CHECKPOINT),
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--json", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_tree_gives_plain_greedy_tokens_and_rejects_bad_budgets():
    import json
    done = run_cli("--draft", "ngram", "--tree", "8:4:2")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens"] == plain_greedy(CHECKPOINT)[:12]
    done = run_cli("--draft", "mtp", "--tree", "6:3:2", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens"] == plain_greedy(CHECKPOINT)[:12]
    assert json.loads(done.stdout)["stats"]["drafter"] == "mtp"
    for bad in (["--draft", "ngram", "--tree", "x"], ["--draft", "ngram", "--tree", "0"],
                ["--draft", "ngram", "--tree", "4:2:2:1"], ["--draft", "ngram", "--tree", "4:99"],
                ["--tree", "4"], ["--draft", "model:weights/tiny-draft", "--tree", "4"]):
        done = run_cli(*bad)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--tree" in done.stderr, bad
