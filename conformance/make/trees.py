"""Draft-tree cases (INTERPRETING.md section 4, "Draft trees"): a prefill, one verify pass over a draft tree, the
accepted root-to-node path committed, the new token decoded. The goldens hold for either rollback strategy, so the
runner runs each case under both (as a trace with drafts).

Each tree is designed so that the path the spec accepts ends where the case's name says (the root, an inner node, a
deepest leaf, a leaf of a short branch), every decision clear of its edge (greedy: no near-tie where the walk looks;
sampled: each uniform 0.05 from its chance, the drawn token's uniform 2.5e-4 from its interval's ends), and so that
an engine making one of the usual tree mistakes (diagnosis.py: a node's state or conv window from the previous packed
row, position by row, a causal mask over the rows, the commit indexed by the path's length, the chain rule on
siblings) fails the case."""

import numpy as np

from .. import diagnosis
from .. import reference as R
from ..format import Case, Output
from . import golden as G

PROMPT_LEN = 24
ATTEMPTS = 20                   # prompts tried for one greedy case before giving up
BINARY = [-1, 0, 0, 1, 1, 2, 2]
DEEP_NARROW = [-1, 0, 0, 1, 3, 4, 5]      # a leaf at depth 1 beside a branch five deep


def random_tree(name, nodes=9):
    rng = G.rng_for(f"tree-topology-{name}")
    return [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]


RANDOM = random_tree("random")
# (label, parents, the node the accepted path ends at, nodes that carry their parent's argmax off the path)
GREEDY_TREES = (
    ("chain-deepest-leaf", [-1, 0, 1, 2, 3], 4, ()),
    ("star-root-only", [-1, 0, 0, 0, 0], 0, ()),
    ("binary-inner-node", BINARY, 2, ()),
    ("binary-deepest-leaf", BINARY, 6, ()),
    ("deep-narrow-short-branch-leaf", DEEP_NARROW, 2, ()),
    ("deep-narrow-deepest-leaf", DEEP_NARROW, 6, ()),
    ("random", RANDOM, max(range(len(RANDOM)), key=lambda i: (len(R.tree_path(RANDOM, i)), i)), ()),
    # two siblings with the target's token: the first wins, although only the second's child would be accepted
    ("equal-siblings-first-wins", [-1, 0, 0, 1, 2], 1, (2, 4)),
)
GREEDY_CHECKPOINTS = {"tiny-mtp": [t[0] for t in GREEDY_TREES], "tiny-odd": ["binary-deepest-leaf"]}

# (label, parents, siblings: "top-k" (the drafter's most likely tokens, one-hot q) or "iid" (drawn from the drafter,
# q its distribution), sampling, the toy drafter's noise: its logits are the target's plus this much Gaussian noise)
SAMPLED_TREES = (
    ("top-k-one-hot", [-1, 0, 0, 0, 1, 2, 2, 3], "top-k", R.Sampling(0.5, 0, 1.0), 0.6),
    ("iid-full-q", [-1, 0, 0, 0, 1, 2, 3], "iid", R.Sampling(1.0, 0, 0.9), 1.0),
)
SAMPLED_CHECKPOINT = "tiny-dense"   # logits spread over many tokens: sampled decisions tell the rules apart
UNIFORM_DRAWS = 2000               # uniforms tried for one sampled tree before drawing another
DRAW_ROOM = 2.5e-4                  # the final draw's uniform moved by this much draws the same token


def prefilled(checkpoint, rng):
    cfg, params = G.model(checkpoint)
    prompt = G.i64(rng.integers(0, min(cfg.vocab_size, 256), PROMPT_LEN))
    logits, _, state, _ = R.forward(params, cfg, prompt, R.empty_state(cfg))
    return prompt, state, int(np.argmax(logits[-1]))


def node_row(params, cfg, state, tokens, parents, node):
    """The target's logits after node's root-to-node path: row `node` of a verify pass over the tree so far."""
    return R.tree_forward(params, cfg, tokens, parents[:len(tokens)], state)[0][node]


def greedy_tokens(params, cfg, state, root, parents, end, argmax_nodes):
    """Tokens for the tree: the path to `end` and `argmax_nodes` carry their parent's argmax, every other child of a
    node the walk looks at a token clearly below it (the parent's 2nd, 3rd, ... most likely), the rest any token.
    Raises Redraw where the walk would look at a near-tie."""
    path, tokens, rows, ranked = set(R.tree_path(parents, end)), [root], {}, {}
    looked_at = path | {parents[n] for n in argmax_nodes}
    for i in range(1, len(parents)):
        parent = parents[i]
        if parent not in rows:
            rows[parent] = node_row(params, cfg, state, tokens, parents, parent)
            ranked[parent] = [int(t) for t in np.argsort(-rows[parent], kind="stable")]
        row, order = rows[parent], ranked[parent]
        if parent in looked_at and G.runner_up(row)[2]:
            raise G.Redraw(f"near-tie after node {parent}")
        if i in path or i in argmax_nodes:
            tokens.append(order[0])
        else:
            others = sum(1 for c in R.tree_children(parents, parent) if c < i and c not in path
                         and c not in argmax_nodes)
            tokens.append(order[1 + others])
            if parent in looked_at and row[order[0]] - row[tokens[-1]] <= G.tie_margin(row[order[0]], row[tokens[-1]]):
                raise G.Redraw(f"node {i}'s token within a tie of its parent's argmax")
    if G.runner_up(node_row(params, cfg, state, tokens, parents, end))[2]:
        raise G.Redraw("near-tie at the end of the path")
    return tokens


def tree_case(checkpoint, label, prompt, state, tokens, parents, q, uniforms, sampling, end):
    """The case, its decisions checked against the design, both rollbacks committing the same state."""
    cfg, params = G.model(checkpoint)
    logits, _, verified = R.verify_tree(params, cfg, state, tokens, parents, "per-position")
    path, token = R.accept_tree(tokens, parents, q, logits, sampling, uniforms)
    assert path[-1] == end, f"{checkpoint} {label}: the walk ended at node {path[-1]}, designed to end at {end}"
    committed = R.commit_tree(verified, path)
    replayed = R.commit_tree(R.verify_tree(params, cfg, state, tokens, parents, "replay")[2], path)
    for a, b in zip(G.state_outputs(committed).values(), G.state_outputs(replayed).values()):
        np.testing.assert_allclose(a.value, b.value, rtol=0, atol=1e-9)
    next_logits = R.forward(params, cfg, [token], committed)[0]
    mode = "greedy" if sampling.temperature == 0 else "sampling"
    inputs = {"prompt": prompt, "tree_tokens": G.i64(tokens), "tree_parents": G.i64(parents)}
    if mode == "sampling":
        inputs.update(q=G.f32(q), uniforms=G.f32(uniforms))
    where = "the root only" if end == 0 else f"node {end}"
    return Case(f"tree-{checkpoint}-{mode}-{label}", "tree",
                "reference.verify_tree, reference.accept_tree_" + ("greedy" if mode == "greedy" else "speculative")
                + ", reference.commit_tree",
                f"prefill the prompt, verify a {len(tokens)}-node tree (parents {list(parents)}) in one pass, accept "
                f"the path {path} (to {where}), commit it, then decode the new token",
                ("prefill", "decode", "tree") + ("accept:tree-sampling",) * (mode == "sampling")
                + G.checkpoint_features(checkpoint),
                G.sampling_attrs(sampling), inputs,
                {"tree_logits": Output("logits", logits), "path": Output("decision", G.i64(path)),
                 "committed": Output("decision", G.i64([tokens[n] for n in path[1:]] + [token])),
                 **G.state_outputs(committed), "next_logits": Output("logits", next_logits)},
                checkpoint)


def greedy_tree_case(checkpoint, label, parents, end, argmax_nodes):
    cfg, params = G.model(checkpoint)
    for attempt in range(ATTEMPTS):
        prompt, state, root = prefilled(checkpoint, G.rng_for(f"tree-{checkpoint}-{label}#{attempt}"))
        try:
            tokens = greedy_tokens(params, cfg, state, root, parents, end, argmax_nodes)
        except G.Redraw:
            continue
        return tree_case(checkpoint, label, prompt, state, tokens, parents, None, None, G.GREEDY, end)
    raise AssertionError(f"{checkpoint} {label}: every prompt tried puts a near-tie where the walk looks")


def sampled_tree(params, cfg, state, root, parents, siblings, sampling, noise, rng):
    """Tokens and q from a toy drafter (the target's logits plus noise) at each node: its most likely tokens with a
    one-hot q (top-k), or tokens drawn from it with q its distribution (iid); and the target's probabilities."""
    tokens, q, V = [root], [], cfg.vocab_size
    for node in range(len(parents)):
        children = R.tree_children(parents, node)
        if not children:
            continue
        noisy = node_row(params, cfg, state, tokens, parents, node) + rng.normal(0, noise, V)
        d = R.probabilities(noisy, sampling._replace(top_k=0, top_p=1.0))
        picks = np.argsort(-d, kind="stable")[:len(children)] if siblings == "top-k" else rng.choice(V, len(children), p=d)
        for c, x in zip(children, picks):
            assert len(tokens) == c                  # children come in node order, each after its parent
            tokens.append(int(x))
            q.append(R.one_hot([x], V)[0] if siblings == "top-k" else d)
    logits = R.tree_forward(params, cfg, tokens, parents, state)[0]
    return tokens, np.array(q), R.probabilities(logits, sampling)


def clear_uniforms(tokens, parents, q, p, rng):
    """Uniforms for which the spec's walk goes two nodes deep, through a second or later sibling, every decision is clear of its
    edge (moving any one uniform by ROOM, or the final draw's by DRAW_ROOM, changes nothing), and the chain rule on
    siblings decides otherwise; None if UNIFORM_DRAWS tries find none."""
    def outcome(u):
        path, token = R.accept_tree_speculative(tokens, parents, q, p, u)
        return path, int(token)
    for _ in range(UNIFORM_DRAWS):
        u = rng.random(len(tokens))
        path, token = outcome(u)
        if len(path) < 3 or all(path[i + 1] == R.tree_children(parents, path[i])[0] for i in range(len(path) - 1)):
            continue                    # below depth 2, or the first sibling every time: nothing for the residual
        moved = [np.where(np.arange(len(u)) == i, np.clip(u[i] + d, 0, 1 - 1e-9), u)
                 for i in range(len(u) - 1) for d in (-G.ROOM, G.ROOM)]
        moved += [np.where(np.arange(len(u)) == len(u) - 1, np.clip(u[-1] + d, 0, 1 - 1e-9), u)
                  for d in (-DRAW_ROOM, DRAW_ROOM)]
        if any(outcome(v) != (path, token) for v in moved):
            continue
        wrong = diagnosis.tree_chain_rule_on_siblings(tokens, parents, q, p, u)
        if (wrong[0], int(wrong[1])) != (path, token):
            return G.f32(u)
    return None


def sampled_tree_case(label, parents, siblings, sampling, noise):
    cfg, params = G.model(SAMPLED_CHECKPOINT)
    for attempt in range(ATTEMPTS):
        rng = G.rng_for(f"tree-{SAMPLED_CHECKPOINT}-{label}#{attempt}")
        prompt, state, root = prefilled(SAMPLED_CHECKPOINT, rng)
        tokens, q, p = sampled_tree(params, cfg, state, root, parents, siblings, sampling, noise, rng)
        u = clear_uniforms(tokens, parents, G.f32(q), p, rng)
        if u is not None:
            end = R.accept_tree_speculative(tokens, parents, G.f32(q), p, u)[0][-1]
            return tree_case(SAMPLED_CHECKPOINT, label, prompt, state, tokens, parents, G.f32(q), u, sampling, end)
    raise AssertionError(f"{label}: no design with clear decisions that tells the chain rule apart")


def tree_cases():
    trees = {t[0]: t for t in GREEDY_TREES}
    for checkpoint, labels in GREEDY_CHECKPOINTS.items():
        for label in labels:
            yield greedy_tree_case(checkpoint, *trees[label])
    for sampled in SAMPLED_TREES:
        yield sampled_tree_case(*sampled)
