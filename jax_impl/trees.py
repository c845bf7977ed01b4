"""Draft trees on device, as reference.py's section "Tree verification" (docs/trees.md): a tree's masks from its
parents, and the two rollback strategies over a tree (what a tree's verify pass keeps, how the accepted path is
committed). model.forward_hidden(..., tree=) is the pass itself; spec_decode.py accepts a tree and runs its round.

N nodes, parents (N,) topologically ordered, node 0 the root (the last committed token, parent -1). A tree of fewer
nodes is padded with nodes whose parent is the root: no real node has them as ancestors, so they change nothing a
real node computes, and acceptance never reaches them (it is told how many nodes are real). An accepted path is
(N,) node indices of which the first n count (the root first).
"""

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import reference
from .rollback import conv_window, replay

AttnState, DeltaState, KeptStates, State, Tape = (reference.AttnState, reference.DeltaState, reference.KeptStates,
                                                  reference.State, reference.Tape)  # the spec's types
f32, i32 = jnp.float32, jnp.int32


class Tree(NamedTuple):
    """What a pass over a draft tree reads, from its parents: traceable, no loop."""
    mask: jax.Array      # (N, N) bool: mask[i, j] = j is i or an ancestor of i (reference.ancestor_mask)
    depth: jax.Array     # (N,) i32: the root 0; a node's RoPE position is the prefix length + its depth
    on: object = True    # whether the tokens are a tree: a batch row's traced bool (a chain's or a prefill chunk's
                         # row passes its tokens as a chain of parents, and its DeltaNet layers run the sequence's
                         # rules: per_row)


def per_row(on, as_tree, as_sequence):
    """What a pass computes (as_tree, as_sequence: thunks): over a tree (on True), over a sequence (False), or, for a
    batch row (on traced), both, the row's own selected. So a chain row beside tree rows in one step computes what it
    computes in a step without them, and a tree row what it computes alone."""
    if on is True or on is False:
        return as_tree() if on else as_sequence()
    return jax.tree.map(partial(jnp.where, on), as_tree(), as_sequence())


def chain_parents(T):  # -> (T,) i32: -1, 0, 1, ...: a sequence as a tree (its ancestor mask the causal one)
    return jnp.arange(T, dtype=jnp.int32) - 1


def tree_of(parents):  # (N,) i32, parents[0] = -1 -> Tree
    """The ancestor mask by repeated squaring of (I + parent edges): after s squarings it holds the ancestors up to
    2^s levels up, so ceil(log2 N) of them hold all."""
    N = parents.shape[0]
    nodes = jnp.arange(N)
    reach = (nodes[:, None] == nodes[None, :]) | (parents[:, None] == nodes[None, :])
    for _ in range(max(N - 1, 1).bit_length()):
        reach = jnp.einsum("ij,jk->ik", reach.astype(f32), reach.astype(f32)) > 0
    return Tree(reach, (reach.sum(axis=1) - 1).astype(jnp.int32))


def tree_conv_rows(tree, window_len, width):  # -> (N, width) i32: rows of concatenate([window, x (N, C)])
    """The last `width` conv inputs along each node's root-to-node path, oldest first (reference.tree_conv_windows):
    d levels up, the ancestor at depth depth_i - d; above the root, the committed window's (window_len rows) last."""
    rows = []
    for d in range(width - 1, -1, -1):
        ancestor = jnp.argmax(tree.mask & (tree.depth[None, :] == tree.depth[:, None] - d), axis=1)   # (N,)
        rows.append(jnp.where(d <= tree.depth, window_len + ancestor, window_len - d + tree.depth))
    return jnp.stack(rows, axis=1).astype(jnp.int32)


def tree_delta_states(S0, tape, tree):  # (Hv, Dk, Dv), Tape of N nodes, Tree -> (N, Hv, Dk, Dv)
    """Every node's state from the tape (reference.tree_delta_states): S_i = e^prefix_i S_0 + sum over i's path of
    e^(prefix_i - prefix_j) k_j delta_j^T, prefix_i the sum of g over i's path."""
    Hv = tape.g.shape[1]
    k = jnp.repeat(tape.k, Hv // tape.k.shape[1], axis=1)                                  # (N, Hv, Dk)
    prefix = jnp.einsum("ij,jh->ih", tree.mask.astype(f32), tape.g)                       # (N, Hv)
    decay = jnp.exp(jnp.where(tree.mask[..., None], prefix[:, None] - prefix[None, :], -jnp.inf))  # (N, N, Hv)
    return jnp.exp(prefix)[..., None, None] * S0 + jnp.einsum("ijh,jhk,jhv->ihkv", decay, k, tape.delta)


def keep_per_node(before, tapes, tree):
    """Per-position strategy over a tree, at verify time: every node's conv window and state (None for attention)."""
    def kept(layer, tape):
        W1 = layer.conv.shape[0]
        windows = jnp.concatenate([layer.conv, tape.qkv])[tree_conv_rows(tree, W1, W1)]   # (N, W-1, C)
        return KeptStates(windows, tree_delta_states(layer.S, tape, tree))
    return [None if tape is None else kept(layer, tape) for layer, tape in zip(before.layers, tapes)]


def commit_path_per_position(before, kept, path, n):  # a DeltaNet layer: the last accepted node's kept state
    node = path[n - 1]                         # index by the node, never by the path length (sglang#27463)
    return DeltaState(kept.conv[node], kept.S[node])


def commit_path_replay(before, tape, path, n):  # a DeltaNet layer: the path's tape rows replayed from before
    tape = Tape(*(x[path] for x in tape))
    return DeltaState(conv_window(before.conv, tape.qkv, n), replay(before.S, tape, n))


class TreeStrategy(NamedTuple):
    """rollback.Strategy over a tree."""
    keep: Callable       # (state before the pass, its per-layer Tapes, Tree) -> what the pass keeps
    commit: Callable     # (a DeltaNet layer's state before, what was kept for it, path (N,), n) -> its DeltaState


TREE_STRATEGIES = {"per-position": TreeStrategy(keep_per_node, commit_path_per_position),
                   "replay": TreeStrategy(lambda before, tapes, tree: tapes, commit_path_replay)}
assert tuple(TREE_STRATEGIES) == tuple(reference.TREE_ROLLBACK)


def commit_tree(strategy, before, after, kept, path, n):
    """The state after consuming the accepted path's n nodes path[:n] (reference.commit_tree): attention keeps the
    prefix and moves the path's KV rows behind it, in path order (rows past the new length are never visible); a
    DeltaNet layer is rebuilt by the strategy from what the tree's verify pass kept."""
    rows = before.length + path                                                           # (N,)
    layers = []
    for b, a, k in zip(before.layers, after.layers, kept):
        if isinstance(a, AttnState):
            keys = jax.lax.dynamic_update_slice_in_dim(a.k, jnp.take(a.k, rows, axis=1), before.length, 1)
            values = jax.lax.dynamic_update_slice_in_dim(a.v, jnp.take(a.v, rows, axis=2), before.length, 2)
            layers.append(AttnState(keys, values))
        else:
            layers.append(TREE_STRATEGIES[strategy].commit(b, k, path, n))
    return State(tuple(layers), before.length + n)


# The n-gram tree drafter (reference.ngram_tree) without its sequential insertions. Its trie holds prefixes of the
# continuations, each created at its first appearance (occurrences latest first, then by depth) unless refused,
# and a refusal is final: a full node stays full, a full tree stays full. So a prefix is a node iff its parent is
# one and it is among the parent's first BRANCH children by first appearance, and the tree is the first NODES such
# prefixes in creation order. Continuations sorted lexicographically put each prefix's occurrences in one run.

def longest_suffix_match(buf, ntok, max_ngram):  # -> starts (L,) bool, n: the occurrences of the longest suffix
    """The earlier occurrences (each followed by a token) of the longest suffix of buf[:ntok], <= max_ngram tokens,
    that has any (reference.ngram_tree's n); none: no start and n = 0."""
    positions = jnp.arange(len(buf))
    starts, n = jnp.zeros(len(buf), bool), jnp.int32(0)
    for size in range(1, max_ngram + 1):                                 # the longest with a match wins
        suffix = lax.dynamic_slice_in_dim(buf, jnp.maximum(ntok - size, 0), size)
        match = positions <= ntok - size - 1
        for j in range(size):
            match &= jnp.roll(buf, -j) == suffix[j]
        starts, n = jnp.where(match.any(), match, starts), jnp.where(match.any(), size, n)
    return starts, n


def ngram_tree(buf, ntok, budget, own, room, max_ngram=3):
    """reference.ngram_tree(buf[:ntok], own with its depth cut to `room`) on device, padded to budget.nodes + 1
    nodes -> tokens (N,) (the root buf[ntok-1]), parents (N,), real nodes m (the root included). budget: static
    TreeBudget (the shapes), own: its fields traced, each <= budget's."""
    L, D, N = len(buf), budget.depth, budget.nodes + 1
    starts, n = longest_suffix_match(buf, ntok, max_ngram)
    positions = jnp.arange(L)
    follows = positions + n                                              # (L,) where each continuation starts
    lengths = jnp.where(starts, jnp.clip(jnp.minimum(jnp.minimum(own.depth, room), ntok - follows), 0, D), 0)
    levels = jnp.arange(D)
    cont = jnp.where(levels < lengths[:, None], buf[jnp.clip(follows[:, None] + levels, 0, L - 1)], -1)  # (L, D)

    # sorted lexicographically (-1 past a continuation's end), the occurrences of a prefix of length d are a run
    *columns, pos, lengths = lax.sort((*cont.T, positions, lengths), num_keys=D)
    cont = jnp.stack(columns, axis=1)                                    # (L, D) in sorted order
    same = (cont[1:] == cont[:-1]) & (levels < jnp.minimum(lengths[1:], lengths[:-1])[:, None])
    common = jnp.concatenate([jnp.zeros(1, i32), jnp.cumprod(same, axis=1).sum(axis=1)])   # (L,) with the previous
    depths = jnp.arange(D + 1)[:, None]                                  # prefix length d = 0 .. D (0: the root)
    run = jnp.cumsum((positions == 0) | (common < depths), axis=1) - 1   # (D+1, L) run index of the d-prefix
    member = lengths >= depths                                           # (D+1, L) has a prefix of length d
    flat_run = (run + depths * L).reshape(-1)                            # runs of different depths apart
    first = jax.ops.segment_max(jnp.where(member, pos, -1).reshape(-1), flat_run, (D + 1) * L)[flat_run]
    first = first.reshape(D + 1, L)                                      # the prefix's latest occurrence
    head = member & (pos == first)                                       # (D+1, L) one entry per prefix

    # a prefix is kept if its parent is and it is among the parent's first own.branch children (the runs of length d
    # inside its parent's run, by first appearance): the latest first appearances, one child a parent per pass
    parent_run = (run[:-1] + depths[:-1] * L).reshape(-1)                # (D L,) depths 1..D: the parent's run
    heads, latest = head[1:].reshape(-1), first[1:].reshape(-1)
    rank, taken = jnp.full(D * L, budget.branch), jnp.zeros(D * L, bool)
    for child in range(budget.branch):
        best = jax.ops.segment_max(jnp.where(heads & ~taken, latest, -1), parent_run, D * L)[parent_run]
        now = heads & ~taken & (latest == best)
        rank, taken = jnp.where(now, child, rank), taken | now
    flat_run = flat_run[L:] - L                                          # the prefix's own run, depths 1..D
    rank = jax.ops.segment_min(jnp.where(heads, rank, budget.branch), flat_run, D * L)[flat_run].reshape(D, L)
    kept = head[1:] & jnp.cumprod(member[1:] & (rank < own.branch), axis=0).astype(bool)   # (D, L) and its ancestors

    # creation order: latest first appearance first, then the shallower. A prefix's head is the entry of its latest
    # occurrence, so an occurrence's new prefixes are one entry's kept heads, consecutive from the shallowest.
    new_nodes = jnp.zeros(L, i32).at[pos].set(kept.sum(axis=0))         # (L,) by position
    before = (jnp.cumsum(new_nodes[::-1]) - new_nodes[::-1])[::-1]       # created at later positions
    node = 1 + before[pos] + jnp.cumsum(kept, axis=0) - 1                # (D, L) a kept head's node
    real = kept & (node <= own.nodes)
    entry_of = jnp.zeros(L, i32).at[pos].set(positions)                  # position -> its sorted entry
    parent_node = jnp.concatenate([jnp.zeros((1, L), i32), node[:-1][levels[:-1, None], entry_of[first[1:-1]]]])
    at = jnp.where(real, node, N).reshape(-1)                            # N: dropped
    tokens = jnp.zeros(N, i32).at[at].set(cont.T.reshape(-1), mode="drop").at[0].set(buf[ntok - 1])
    parents = jnp.zeros(N, i32).at[at].set(parent_node.reshape(-1), mode="drop").at[0].set(-1)
    return tokens, parents, 1 + real.sum()
