"""Sampling, acceptance, drafters and a request's round, all on device: the whole loop (draft, verify, accept, roll
back, append) is one lax.while_loop over fixed shapes (static K, a token buffer of static size), so nothing
recompiles per step and no token crosses to the host until the end. Mirrors reference.py's section of the same name.

request_step is the one definition of a request's round (and of a prefill chunk): the single-request loop
(decode_device) runs it on one request, the batched server (batch.py) vmaps it over its slots. A round always
computes K drafts; a drafter that found only m < K tokens pads the rest, the pass counts m + 1 of its K + 1 tokens
and acceptance stops at m, so the kept prefix (and the state rolled back to it) is the reference's. Where to add:
a drafter to DRAFTERS, a rollback strategy to rollback.STRATEGIES, a round variant to request_step's section.
Randomness is jax.random: the same distributions as the reference, not its numpy stream.
"""

import time
from collections import OrderedDict
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import dflash, matvec, reference, trees
from .matvec import matmul
from .model import decoder_layer, empty_kv, empty_state, forward_hidden, forward_tapped, lm_head, rms_norm
from .rollback import STRATEGIES
from .sharding import constrain_state, fetch, put, replicated

Sampling, State, Tape = reference.Sampling, reference.State, reference.Tape  # the spec's types

f32, i32 = jnp.float32, jnp.int32


# ----------------------------------------------------------------------------------------------------------------
# Sampling and acceptance

def is_off(setting, off_value):
    """A Python setting equal to its off value costs nothing; a traced one (a batch row's own setting) is computed
    and selected."""
    return isinstance(setting, (int, float)) and setting == off_value


def probabilities(logits, sampling):  # (..., V) -> (..., V)
    """Temperature, then top-k, then top-p, as reference.probabilities. Temperature 0 is a one-hot argmax.
    `sampling`'s fields are Python numbers, or traced scalars where each row of a batch has its own (batch.py)."""
    temperature, top_k, top_p = sampling
    if is_off(temperature, 0):
        return one_hot_argmax(logits)
    traced = not isinstance(temperature, (int, float))
    p = jax.nn.softmax(logits / (jnp.where(temperature == 0, 1, temperature) if traced else f32(temperature)), axis=-1)
    if not is_off(top_k, 0):
        if isinstance(top_k, int):
            kth_largest = jnp.sort(p, axis=-1)[..., -min(top_k, p.shape[-1]), None]
        else:
            rank = p.shape[-1] - jnp.clip(top_k, 1, p.shape[-1])
            kth_largest = jnp.take(jnp.sort(p, axis=-1), rank, axis=-1)[..., None]
        kept = jnp.where(p >= kth_largest, p, 0)
        p = select(top_k > 0, kept / kept.sum(axis=-1, keepdims=True), p)
    if not is_off(top_p, 1):  # keep the smallest top set whose mass reaches top_p
        order = jnp.argsort(-p, axis=-1, stable=True)
        sorted_p = jnp.take_along_axis(p, order, axis=-1)
        keep_sorted = jnp.cumsum(sorted_p, axis=-1) - sorted_p < top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        kept = jnp.where(keep, p, 0)
        p = select(top_p < 1, kept / kept.sum(axis=-1, keepdims=True), p)
    return jnp.where(temperature == 0, one_hot_argmax(logits), p) if traced else p


def argmax(logits):  # (..., V) -> (...,) int32
    """jnp.argmax (the first largest value; the first NaN if any) as two plain reductions: XLA:CPU's fused
    (value, index) reduction took 3x as long over a vocabulary, twice per step of a batch."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where((logits == top) | jnp.isnan(logits), index, logits.shape[-1]), axis=-1)


def one_hot_argmax(logits):
    return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=f32)


def select(condition, on, off):
    """`on` where a setting is on: a Python condition picks one statically, a traced one selects."""
    if isinstance(condition, bool):
        return on if condition else off
    return jnp.where(condition, on, off)


def sample(p, u):  # (V,), uniform in [0, 1) -> token id
    """Inverse-CDF sampling: the token whose cumulative-probability interval contains u."""
    cdf = jnp.cumsum(p)
    return jnp.minimum(jnp.searchsorted(cdf, u * cdf[-1], side="right"), len(p) - 1).astype(jnp.int32)


def draw(logits, sampling, key):  # (V,) -> token, its distribution (V,)
    p = probabilities(logits, sampling)
    top = argmax(logits)
    if is_off(sampling.temperature, 0):  # the argmax, which sample() would find in the one-hot, without its search
        return top, p
    return select(sampling.temperature > 0, sample(p, jax.random.uniform(key)), top), p


def accept_greedy(draft, m, logits):  # (K,), valid drafts m, (K+1, V) -> (accepted drafts, next token)
    """Longest prefix of the first m drafts equal to the target's argmax, then the target's own next token."""
    target = argmax(logits)
    ok = (draft == target[:-1]) & (jnp.arange(len(draft)) < m)
    n = jnp.sum(jnp.cumprod(ok))
    return n, target[n]


def accept_speculative(draft, m, q, p, u):  # (K,), m, (K, V), (K+1, V), (K+1,) uniforms -> (accepted, next token)
    """Leviathan et al. Algorithm 1 over the first m drafts: accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
    at the first rejection sample normalize(max(0, p_i - q_i)); after m acceptances sample the bonus from p_m."""
    K = len(draft)
    p_x = jnp.take_along_axis(p[:K], draft[:, None], axis=1)[:, 0]
    q_x = jnp.take_along_axis(q, draft[:, None], axis=1)[:, 0]
    ok = (u[:K] < jnp.minimum(1, p_x / q_x)) & (jnp.arange(K) < m)
    n = jnp.sum(jnp.cumprod(ok))
    residual = jnp.maximum(p[n] - jnp.concatenate([q, jnp.zeros((1, p.shape[-1]), q.dtype)])[n], 0)
    use_residual = (n < m) & (residual.sum() > 0)
    return n, sample(jnp.where(use_residual, residual, p[n]), u[K])


def accept_tree_greedy(tokens, parents, m, logits):  # (N,), (N,), real nodes m, (N, V) -> (path (N,), its length, token)
    """reference.accept_tree_greedy: from the root, move to the first child carrying the target's argmax while there
    is one. One pass over the nodes in order: a node's children follow it, the first matching one is met first, and
    once the walk moves on no later sibling is a child of the current node. The path's first n entries count."""
    target = argmax(logits)

    def visit(carry, c):
        node, path, n = carry
        move = (parents[c] == node) & (tokens[c] == target[node]) & (c < m)
        return (jnp.where(move, c, node), jnp.where(move, path.at[n].set(c), path), n + move), None
    N = len(tokens)
    (node, path, n), _ = lax.scan(visit, (jnp.int32(0), jnp.zeros(N, i32), jnp.int32(1)), jnp.arange(1, N),
                                  unroll=N <= 16)
    return path, n, target[node]


def accept_tree_speculative(tokens, parents, m, q, p, u):  # q (N-1, V), p (N, V), u (N,) -> (path (N,), length, token)
    """reference.accept_tree_speculative (multi-draft speculative sampling, recursive rejection over the siblings) as
    one pass over the nodes in order (accept_tree_greedy's walk): at a child c of the current node with distribution
    p', accept with chance min(1, p'(x_c) / q[c-1](x_c)) (uniform u[c-1]), moving to p[c]; a rejection makes p' the
    residual max(0, p' - q[c-1]) (p' itself if that is all zero), normalised before the next sibling is tried. After
    the walk the token is drawn from p' with u[N-1] (the last uniform: a tree padded past its m real nodes puts its
    final uniform there)."""
    N = len(tokens)

    def visit(carry, c):
        node, target, tried, path, n = carry
        child = (parents[c] == node) & (c < m)
        target = jnp.where(child & tried, target / target.sum(), target)
        x = tokens[c]
        ok = child & (u[c - 1] < jnp.minimum(1, target[x] / q[c - 1, x]))
        leftover = jnp.maximum(target - q[c - 1], 0)
        rejected = jnp.where(leftover.sum() > 0, leftover, target)
        target = jnp.where(ok, p[c], jnp.where(child, rejected, target))
        tried = jnp.where(ok, False, tried | child)
        return (jnp.where(ok, c, node), target, tried, jnp.where(ok, path.at[n].set(c), path), n + ok), None
    start = (jnp.int32(0), p[0], jnp.bool_(False), jnp.zeros(N, i32), jnp.int32(1))
    (node, target, _, path, n), _ = lax.scan(visit, start, jnp.arange(1, N), unroll=N <= 16)
    return path, n, sample(target, u[N - 1])



# ----------------------------------------------------------------------------------------------------------------
# Drafters. reference.Drafter is one propose function that sees the whole context and returns a variable number of
# drafts; inside the on-device loop shapes are fixed, so a DeviceDrafter is pure functions over its own state
# pytree, always proposing K drafts of which the first m are valid:
#   empty(params, cfg, arrays, capacity, dtype) -> draft_state    before any token (fixed shapes; None: no state)
#   propose(params, cfg, arrays, draft_state, state, buf, ntok, K, want, sampling, key) -> drafts (K,), q (K, V), m
#   update(params, cfg, arrays, draft_state, tokens, hidden, n) -> draft_state    the target kept n positions of a pass
#   prepare(params, cfg, spec, K, ngram_table) -> the constant arrays it reads (None: none), on the host once per run;
#                                                it checks the --draft spec and the checkpoint (reference.UserError)
#   taps(arrays) -> the target layers whose outputs it reads as `hidden`, () for the final-normed hidden states
# `buf[:ntok]` is the context, `state` the target's committed state (it has consumed all of it but the last token);
# want <= K is the request's own draft length (a batch row's, traced; K, static, in the single-request loop).
# `tokens` (T,) holds the token after each position of the pass, `hidden` (T, D) the target's final-normed hidden
# states there, or with taps those layers' outputs concatenated (T, len(taps) D) (the prompt's after the prefill).
# A new drafter is a DeviceDrafter in DRAFTERS: the single-request loop and the batched server then both run it
# through request_step.

class DeviceDrafter(NamedTuple):
    empty: Callable
    propose: Callable
    update: Callable
    prepare: Callable
    taps: Callable = lambda arrays: ()


def no_state(params, cfg, arrays, capacity, dtype):
    return None


def same_state(params, cfg, arrays, draft_state, tokens, hidden, n):
    return draft_state


def prompt_lookup(buf, length, K, max_ngram=3, want=None):  # (L,), context length -> drafts (K,), count
    """Copy from buf[:length]: the longest suffix (<= max_ngram) that occurred before; what followed its latest
    occurrence followed by `want` (default K) tokens, else its earliest occurrence (followed by the most), as the
    reference with k = want. K is the static width of the result; a batch row asks for its own want <= K."""
    want = K if want is None else want
    starts = jnp.arange(len(buf))
    found, copy_from = jnp.bool_(False), jnp.int32(0)
    for n in range(max_ngram, 0, -1):
        suffix = lax.dynamic_slice_in_dim(buf, jnp.maximum(length - n, 0), n)
        match = starts <= length - n - 1                     # an earlier occurrence, followed by a token
        for j in range(n):
            match &= jnp.roll(buf, -j) == suffix[j]
        full = match & (starts <= length - n - want)         # ... followed by `want` tokens
        start = jnp.where(full.any(), jnp.max(jnp.where(full, starts, -1)), jnp.min(jnp.where(match, starts, len(buf))))
        hit = ~found & (n <= length - 1) & match.any()
        copy_from = jnp.where(hit, start + n, copy_from)
        found |= hit
    return lax.dynamic_slice_in_dim(buf, copy_from, K), jnp.where(found, jnp.minimum(want, length - copy_from), 0)


def table_arrays(table, K):
    """reference.build_ngram_table's {"n", "table"} -> (keys (M, n), phrases cut to K (M, K), lengths (M,)), or None."""
    items = [([int(t) for t in key.split()], phrase[:K]) for key, phrase in table["table"].items()] if table else []
    if not items:
        return None
    phrases = np.zeros((len(items), K), np.int32)
    for row, (_, phrase) in enumerate(items):
        phrases[row, :len(phrase)] = phrase
    keys = np.array([key for key, _ in items], np.int32).reshape(len(items), table["n"])
    return keys, phrases, np.array([len(p) for _, p in items], np.int32)


def table_lookup(table, buf, length, K, want):  # -> drafts (K,), count: the phrase stored for the last n tokens
    keys, phrases, lengths = table
    n = keys.shape[1]
    hit = jnp.all(keys == lax.dynamic_slice_in_dim(buf, jnp.maximum(length - n, 0), n), axis=1) & (length >= n)
    row = jnp.argmax(hit)
    return phrases[row, :K], jnp.where(hit.any(), jnp.minimum(lengths[row], want), 0)


def ngram_propose(params, cfg, table, draft_state, state, buf, ntok, K, want, sampling, key):
    """Copy from the context (prompt lookup); else the offline table (arrays). q is one-hot."""
    drafts, m = prompt_lookup(buf, ntok, K, want=want)
    if table is not None:
        table_drafts, table_m = table_lookup(table, buf, ntok, K, want)
        drafts, m = jnp.where(m > 0, drafts, table_drafts), jnp.where(m > 0, m, table_m)
    return drafts, jax.nn.one_hot(drafts, cfg.vocab_size, dtype=f32), m


NGRAM = DeviceDrafter(no_state, ngram_propose, same_state,
                      lambda params, cfg, spec, K, ngram_table: table_arrays(ngram_table, K))


def mtp_hidden(params, cfg, tokens, hidden, state, valid=None):  # (T,), (T, D) -> hidden (T, D), State
    """reference.mtp_forward up to mtp.norm (the shared lm_head is applied by the caller to the rows it needs)."""
    m, valid = params["mtp"], tokens.shape[0] if valid is None else valid
    e = rms_norm(params["embed_tokens"][tokens], m["pre_fc_norm_embedding"], cfg.rms_norm_eps)
    h = rms_norm(hidden, m["pre_fc_norm_hidden"], cfg.rms_norm_eps)
    x = matmul(jnp.concatenate([e, h], axis=-1), m["fc"])                                  # (T, D)
    positions = state.length + jnp.arange(len(x), dtype=jnp.int32)
    x, layer_state, _ = decoder_layer(x, "full_attention", m["layers"][0], state.layers[0], positions, valid, cfg)
    return rms_norm(x, m["norm"], cfg.rms_norm_eps), State((layer_state,), state.length + valid)


def mtp_empty(params, cfg, arrays, capacity, dtype):
    """The MTP head's state: (its own State, its last output hidden state (D,))."""
    return State((empty_kv(cfg, capacity, dtype),), jnp.int32(0)), jnp.zeros(cfg.hidden_size, dtype)


def mtp_step(params, cfg, token, h, state):  # (), (D,) -> the head's output hidden (D,), State
    """One step of the chain: the head fed its own output hidden state and the token drafted from it."""
    out, state = mtp_hidden(params, cfg, token[None], h[None], state)
    return out[0], state


def mtp_update(params, cfg, draft_state, tokens, hidden, n):
    """The head consumes the pairs (hidden at each kept position, the token after it); n = 0 leaves it as it was."""
    out, state = mtp_hidden(params, cfg, tokens, hidden, draft_state[0], valid=n)
    return state, jnp.where(n > 0, out[jnp.maximum(n - 1, 0)], draft_state[1])


def mtp_chain(params, cfg, draft_state, K, key, pick):
    """Chain the head K times on its own output hidden state and the token pick(h, key) -> (token, q (V,)) drafts from
    it; the chain's KV is dropped (the kept state covers committed pairs only; later writes overwrite it). The K-th
    forward is unused, a fixed-shape cost. The chain is unrolled: K is small and static, and a loop iteration costs a
    round trip to the host on a GPU. -> drafts (K,), q (K, V)"""
    def step(carry, key):
        h, head = carry
        token, q = pick(h, key)
        return mtp_step(params, cfg, token, h, head), (token, q)
    head, h = draft_state
    _, (drafts, q) = lax.scan(step, (h, head), jax.random.split(key, K), unroll=True)
    return drafts, q


def mtp_propose(params, cfg, arrays, draft_state, state, buf, ntok, K, want, sampling, key):
    """The MTP head's chain, each draft drawn from the shared lm_head's logits."""
    drafts, q = mtp_chain(params, cfg, draft_state, K, key, lambda h, key: draw(lm_head(params, h), sampling, key))
    return drafts, q, want


def mtp_prepare(params, cfg, spec, K, ngram_table):
    reference.mtp_drafter(params, cfg)  # the reference's checks: MTP weights present, one MTP layer


def mtp_round_update(params, cfg, arrays, draft_state, tokens, hidden, n):
    return mtp_update(params, cfg, draft_state, tokens, hidden, n)


MTP = DeviceDrafter(mtp_empty, mtp_propose, mtp_round_update, mtp_prepare)


def shortlist_prepare(params, cfg, spec, K, ngram_table):
    """reference's mtp-shortlist:PATH: the shortlist ids (S,) and their lm_head columns (D, S), the head's output
    projection."""
    mtp_prepare(params, cfg, spec, K, ngram_table)
    ids = reference.read_shortlist(spec.partition(":")[2], cfg.vocab_size)
    return jnp.asarray(ids, i32), params["lm_head"][:, ids]


def shortlist_propose(params, cfg, arrays, draft_state, state, buf, ntok, K, want, sampling, key):
    """The MTP head over a vocabulary shortlist: each draft is drawn among the S shortlist ids from the head's logits
    over them; q is that distribution on the vocabulary, zero outside (which keeps acceptance exact)."""
    ids, head = arrays

    def pick(h, key):
        index, p = draw(matmul(h, head, preferred_element_type=f32), sampling, key)
        return ids[index], jnp.zeros(cfg.vocab_size, f32).at[ids].set(p)
    drafts, q = mtp_chain(params, cfg, draft_state, K, key, pick)
    return drafts, q, want


MTP_SHORTLIST = DeviceDrafter(mtp_empty, shortlist_propose, mtp_round_update, shortlist_prepare)


def partial_mlp_prepare(params, cfg, spec, K, ngram_table):
    """reference's partial-mlp:F[:LAYERS]: per layer its SwiGLUs cut to the first round(F * their width) (at least 1)
    intermediate channels (None: a layer kept whole), as reference.partial_mlp_params cuts them (weights stored
    (in, out) here: the first columns of gate_proj and up_proj, the first rows of down_proj; MoE: every routed expert
    and the shared expert alike, the router whole)."""
    fraction, layers = reference.partial_mlp_setting(spec, spec.partition(":")[2], cfg)

    def kept(F):
        return max(1, round(fraction * F))

    def swiglu(m):
        f = kept(m["gate_proj"].shape[1])
        return {"gate_proj": m["gate_proj"][:, :f], "up_proj": m["up_proj"][:, :f], "down_proj": m["down_proj"][:f]}

    def moe(m):
        gate_up, down = m["experts"]["gate_up_proj"], m["experts"]["down_proj"]        # (E, 2F, D), (E, D, F)
        F = down.shape[-1]
        f = kept(F)
        experts = {"gate_up_proj": jnp.concatenate([gate_up[:, :f], gate_up[:, F:F + f]], axis=1),
                   "down_proj": down[..., :f]}
        return {**m, "experts": experts, "shared_expert": swiglu(m["shared_expert"])}
    cut = moe if cfg.is_moe else swiglu
    return tuple(cut(layer["mlp"]) if i in layers else None for i, layer in enumerate(params["layers"]))


def partial_mlp_propose(params, cfg, cut, draft_state, state, buf, ntok, K, want, sampling, key):
    """Draft through the target's layers with the cut SwiGLUs, from the target's committed state: the draft
    positions' writes go to the drafter's copy of it, dropped after the round (the next round starts from the
    target's state again, reference.cheapened_drafter's observe)."""
    cheap = {**params, "layers": [layer if m is None else {**layer, "mlp": m}
                                  for layer, m in zip(params["layers"], cut)]}

    def step(carry, key):
        token, own = carry
        hidden, own, _ = forward_hidden(cheap, cfg, token[None], own)
        token, q = draw(lm_head(params, hidden[0]), sampling, key)
        return (token, own), (token, q)
    _, (drafts, q) = lax.scan(step, (buf[ntok - 1], state), jax.random.split(key, K), unroll=True)
    return drafts, q, want


PARTIAL_MLP = DeviceDrafter(no_state, partial_mlp_propose, same_state, partial_mlp_prepare)


def dflash_empty(params, cfg, arrays, capacity, dtype):
    return dflash.empty(arrays.dcfg, capacity, dtype)


def dflash_update(params, cfg, arrays, draft_state, tokens, tapped, n):
    """The target kept n positions of a pass: their features (tapped: the drafter's target layers' outputs) join
    the drafter's context (reference.dflash_extend)."""
    return dflash.extend(arrays, draft_state, tapped, n)


def dflash_propose(params, cfg, arrays, draft_state, state, buf, ntok, K, want, sampling, key):
    """The block [buf[ntok - 1], MASK x K] after the context (the drafter's cache covers positions [0, ntok - 1)):
    argmax drafts with a one-hot q (dflash:DIR), or each slot drawn from its distribution under `sampling`, q that
    distribution (dflash-sampled:DIR), as reference.dflash_drafter. The block is always K + 1 long: the reference's
    last rounds of a generation run a shorter one (their drafts may differ; the tokens are exact either way)."""
    block = jnp.concatenate([buf[ntok - 1][None], jnp.full(K, arrays.dcfg.mask_token_id, i32)])
    logits = dflash.block_logits(params, arrays, draft_state, block)
    if not arrays.sampled:
        drafts = argmax(logits)
        return drafts, jax.nn.one_hot(drafts, cfg.vocab_size, dtype=f32), want
    drafts, q = jax.vmap(lambda row, key: draw(row, sampling, key))(logits, jax.random.split(key, K))
    return drafts, q, want


def dflash_prepare(params, cfg, spec, K, ngram_table):
    return dflash.load(params, cfg, spec)


DFLASH = DeviceDrafter(dflash_empty, dflash_propose, dflash_update, dflash_prepare,
                       lambda arrays: tuple(arrays.dcfg.target_layer_ids))


# Tree drafters (reference.TreeDrafter): propose(params, cfg, draft_state, buf, ntok, budget, own, room) -> tokens
# (N,) with the root at 0 (filled in by the round), parents (N,), real nodes m (the root included), N = budget.nodes
# + 1; nodes past m are padding (children of the root). Drafts are deterministic: q is one-hot. buf[:ntok] is the
# context (DeviceDrafter.propose's), `room` (traced) the depth that still fits the length limit. `budget` (static)
# fixes the shapes; `own` (a TreeBudget, traced in a batch, each field <= budget's) is the request's, and the tree is
# the one its own budget gives, padded: a batch row's tree is its single run's. The drafter's state and its update
# are its DeviceDrafter's.

def top_k_tree(depth_logits, budget, own, room):  # (D, V) logits at depths 1..D of an argmax chain -> tokens, parents, m
    """reference.top_k_tree on device: at depth d up to BRANCH of its most likely tokens are children of the spine's
    node at depth d - 1 (the spine: the argmax chain); the NODES candidates most likely to be reached (the product
    along the spine times the token's chance; ties: the shallower, then the higher ranked), depths past `room` left
    out, ordered by depth and rank. Within `own`: candidates past its depth and branch score -1, and its first NODES
    by score are kept (a candidate's order is the same in the wider budget: depth first, then rank)."""
    D, B, nodes = budget.depth, budget.branch, budget.nodes
    q = jax.nn.softmax(depth_logits.astype(f32), axis=-1)
    chance, token = lax.top_k(q, B)                                                    # (D, B) ties: lower id first
    reach = jnp.concatenate([jnp.ones(1, f32), jnp.cumprod(chance[:, 0])])[:D]         # of the spine's node above
    inside = (jnp.arange(D) < jnp.minimum(room, own.depth))[:, None] & (jnp.arange(B) < own.branch)[None, :]
    score = jnp.where(inside, reach[:, None] * chance, -1).reshape(-1)                 # (D B,)
    best, index = lax.top_k(score, min(nodes, D * B))                                  # ties: lower index first
    best = jnp.where(jnp.arange(len(best)) < own.nodes, best, -1)
    kept = jnp.sort(jnp.where(best >= 0, index, D * B))                                # by depth, rank; left out last
    real = kept < D * B
    node_of = jnp.zeros(D * B + 1, i32).at[kept].set(jnp.arange(1, len(kept) + 1))    # candidate -> its node
    depth, rank = kept // B, kept % B
    parents = jnp.where(real & (depth > 0), node_of[jnp.clip(depth - 1, 0, D - 1) * B], 0)
    tokens = jnp.where(real, token.reshape(-1)[jnp.clip(kept, 0, D * B - 1)], 0)
    pad = nodes - len(kept)
    return (jnp.pad(jnp.concatenate([jnp.zeros(1, i32), tokens]), (0, pad)),
            jnp.pad(jnp.concatenate([jnp.full(1, -1, i32), parents]), (0, pad)), 1 + real.sum())


def mtp_tree_propose(params, cfg, draft_state, buf, ntok, budget, own, room):
    """reference.mtp_tree_drafter: the head chains DEPTH times on its argmax (mtp_chain, from the state its update
    left), and its logits at each depth make the tree (top_k_tree)."""
    def pick(h, key):
        logits = lm_head(params, h)
        return argmax(logits), logits
    _, depth_logits = mtp_chain(params, cfg, draft_state, budget.depth, jax.random.key(0), pick)
    return top_k_tree(depth_logits, budget, own, room)


TREE_DRAFTERS = {"ngram": lambda params, cfg, draft_state, buf, ntok, budget, own, room:
                 trees.ngram_tree(buf, ntok, budget, own, room),
                 "mtp": mtp_tree_propose}      # --draft NAME with a tree budget (the state: DRAFTERS[NAME]'s)

# name (a --draft spec's part before ":") -> DeviceDrafter: the drafters jax_impl runs on device
DRAFTERS = {"ngram": NGRAM, "mtp": MTP, "mtp-shortlist": MTP_SHORTLIST, "partial-mlp": PARTIAL_MLP,
            "dflash": DFLASH, "dflash-sampled": DFLASH}
DRAFTER_NAMES = ("none", *DRAFTERS)              # a request's drafter; a batch row holds its index here
TAKE_ARGUMENTS = {*reference.SELF_SPECULATIVE, "dflash", "dflash-sampled"}   # their --draft specs are NAME:ARGS


def drafter_name(spec):
    """A --draft spec's drafter: partial-mlp:0.25 -> partial-mlp; None when jax_impl runs no such form (a name that
    takes arguments without them, or the other way round)."""
    name, _, args = spec.partition(":")
    return name if name in DRAFTER_NAMES and bool(args) == (name in TAKE_ARGUMENTS) else None


def empty_drafts(params, cfg, drafters, capacity, dtype, arrays=None):
    """{name: empty state} of the drafters (names) that keep one; arrays: {name: its constant arrays}."""
    arrays = arrays or {}
    states = {name: DRAFTERS[name].empty(params, cfg, arrays.get(name), capacity, dtype) for name in drafters}
    return {name: state for name, state in states.items() if state is not None}


def drafter_taps(drafters, arrays):
    """The target layers the compiled drafters (arrays: {name: its constant arrays}) read the outputs of (one drafter
    with taps at most: () for none)."""
    arrays = arrays or {}
    return next((taps for taps in (DRAFTERS[name].taps(arrays.get(name)) for name in drafters) if taps), ())


def one_drafter_arrays(draft, arrays):
    """The single-request loop's one drafter's constant arrays (DeviceDrafter.prepare's), by name as request_step
    takes them: {} for none."""
    return {} if draft == "none" or arrays is None else {drafter_name(draft): arrays}


# ----------------------------------------------------------------------------------------------------------------
# A request's step: the one definition of a speculative round (and of a prefill chunk) on the device, used by the
# single-request loop (decode_device: one Row in a lax.while_loop) and the batched server (batch.step: request_step
# vmapped over the slots). Per request:
#   * keys: a plain step splits its key in two (key, draw key), a speculative round in three (key, draft key,
#     accept key); the prompt's last chunk draws the first token with the two-way split. A request that does not
#     sample (no row of the step samples: features.sample) keeps its key. The accept uniforms are drawn for the
#     round's width K and the request reads its own K+1 of them (uniforms_for).
#   * drafts: its drafter's (DRAFTERS), at most its own K (round_draft_len) and the tokens left after the target's.
#   * one target pass (target_pass) over [last committed token, drafts], valid = m + 1, keeping what the rollback
#     strategy needs (rollback.STRATEGIES); a prefill chunk is the same pass over prompt tokens.
#   * acceptance (decide): greedy, or speculative sampling with its own temperature, top-k, top-p; the committed
#     tokens end at its first stop id.
#   * commit (commit_kept): one verified position per committed token (reference.run_trace's rule); a pass whose
#     every consumed position is kept (a prefill chunk, a full accept) keeps its own state.
#   * its drafter's state consumes the kept positions (DeviceDrafter.update); statistics count the round.
# A round variant (a tree of drafts, a block drafter's round) is written here once, for both.

FREE, PREFILL, DECODE, DONE, PAUSED = range(5)       # a request's phase (PAUSED: at the position the host asked for)


class Stats(NamedTuple):
    target_calls: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    proposed_by_position: jax.Array     # (K,)
    accepted_by_position: jax.Array     # (K,)


class Settings(NamedTuple):
    """A request's settings: Python values in the single-request loop (what they leave out is not compiled), (B,)
    arrays in a batch (one row per slot, written when a request takes the slot)."""
    temperature: object       # f32; 0 = greedy
    top_k: object             # i32; 0 = off
    top_p: object             # f32; 1 = off
    drafter: object           # a name in DRAFTER_NAMES, or (batch) i32 its index there
    draft_len: object         # i32: K of its rounds, round_draft_len
    limit: object             # i32: tokens to generate at most (reference.token_limit)
    prompt_len: object        # i32
    stop: object              # (MAX_STOP_IDS,) i32 stop ids, -1 padded
    tree: object = None       # a reference.TreeBudget: its rounds verify draft trees (draft_len = its nodes); in a
                              # batch of i32 fields, nodes 0 for a chain request. None: a chain (single loop)


class Features(NamedTuple):
    """What a step compiles in (static). A feature no row uses is left out: its cost and its compilation."""
    sample: bool = False      # some row samples (temperature > 0)
    top_k: bool = False       # ... with top-k
    top_p: bool = False       # ... with top-p
    mtp: bool = False         # some row drafts with the MTP head
    logprobs: bool = False    # some row reports its tokens' log-probabilities (a log-softmax over the vocabulary a
                              # position: at B = 1 part of what the server's step did beyond the single loop's)
    dflash: bool = False      # some row drafts with the server's DFlash block drafter


class Row(NamedTuple):
    """A request on the device between steps (batch.Slots holds one per slot)."""
    state: State              # the target's
    drafts: dict              # {drafter name: its state}, for the drafters compiled in that keep one
    buf: jax.Array            # (L,) i32: prompt, then generated tokens
    ntok: jax.Array           # tokens in buf; the state has consumed all but the last once decoding
    prefill_to: jax.Array     # a prefilling request consumes its prompt up to here (then PAUSED if short of it)
    phase: jax.Array          # i32
    key: jax.Array            # jax.random key
    stats: Stats              # by-position counts over the widest K it may run
    logprob: jax.Array = None  # (L,) f32 beside buf: each generated token's log-probability under the target's raw
                               # logits (None: not kept; the server keeps them)


def row_sampling(settings, features):
    """The request's Sampling, each part its setting where some row uses it (a traced value in a batch), else the
    off value."""
    return Sampling(settings.temperature if features.sample else 0.0, settings.top_k if features.top_k else 0,
                    settings.top_p if features.top_p else 1.0)


def drafts_with(settings, name):
    """Whether the request drafts with `name`: a Python bool in the single-request loop, traced in a batch."""
    if isinstance(settings.drafter, str):
        return settings.drafter == name
    return settings.drafter == DRAFTER_NAMES.index(name)


def propose(params, cfg, row, settings, arrays, K, sampling, key, drafters):
    """The request's drafts (K,), their distributions q (K, V) and how many count: its drafter's, among the drafters
    compiled in (each computed only if compiled in; arrays: {name: its constant arrays}), at most its own K and the
    tokens left after the target's."""
    drafts, q, m = jnp.zeros(K, i32), jnp.zeros((K, cfg.vocab_size), f32), jnp.int32(0)
    for name in drafters if K else ():
        theirs = DRAFTERS[name].propose(params, cfg, arrays.get(name), row.drafts.get(name), row.state, row.buf,
                                        row.ntok, K, settings.draft_len, sampling, key)
        use = drafts_with(settings, name)
        drafts, q, m = (select(use, new, old) for new, old in zip(theirs, (drafts, q, m)))
    return drafts, q, jnp.minimum(m, settings.limit - (row.ntok - settings.prompt_len) - 1)


def propose_tree(params, cfg, row, settings, budget, drafters):
    """The request's draft tree within its own budget (settings.tree) in the step's `budget` (reference.TreeBudget,
    static): its tree drafter's (TREE_DRAFTERS), depths cut to the tokens left after the target's -> drafts (K,) =
    nodes 1..K, parents (K+1,), one-hot q (K, V), how many drafted nodes count (K = budget.nodes)."""
    K, room = budget.nodes, settings.limit - (row.ntok - settings.prompt_len) - 1
    tokens, parents, m = jnp.zeros(K + 1, i32), jnp.pad(jnp.full(1, -1, i32), (0, K)), jnp.int32(1)
    for name in (name for name in drafters if name in TREE_DRAFTERS):
        theirs = TREE_DRAFTERS[name](params, cfg, row.drafts.get(name), row.buf, row.ntok, budget, settings.tree, room)
        use = drafts_with(settings, name)
        tokens, parents, m = (select(use, new, old) for new, old in zip(theirs, (tokens, parents, m)))
    return tokens[1:], parents, jax.nn.one_hot(tokens[1:], cfg.vocab_size, dtype=f32), m - 1


class KeptBoth(NamedTuple):
    """What a batch row's pass keeps when the row may be a tree or a sequence (trees.per_row): both, each from the
    row's own tapes; the row's commit reads its own."""
    chain: object
    tree: object


def target_pass(params, cfg, state, tokens, valid, pick, K, rollback, parents=None, taps=(), as_tree=True):
    """The request's pass over tokens (T,) of which `valid` count -> logits (K+1, V) at positions `pick` (K+1,),
    hidden (T, D), the state after the valid tokens, what `rollback` keeps for the first K+1 positions, and the
    outputs of the layers `taps` (T, len(taps) D) (None without taps). With `parents` (K+1,) those positions are a
    draft tree's nodes (trees.py; the rest of the T, padding, hang off the root), and what is kept is the tree
    strategy's (trees.TREE_STRATEGIES). as_tree traced (a batch row beside tree rows): parents (T,), a chain's
    (trees.chain_parents) where the row's tokens are a sequence, and what is kept is KeptBoth."""
    tree = None if parents is None else trees.tree_of(jnp.pad(parents, (0, len(tokens) - len(parents))))
    tree = tree if tree is None else tree._replace(on=as_tree)
    hidden, after, tapes, tapped = forward_tapped(params, cfg, tokens, state, valid, taps, tree)
    tapes = [None if t is None else Tape(*(x[:K + 1] for x in t)) for t in tapes]
    logits = lm_head(params, hidden[pick])
    if tree is None:
        return logits, hidden, after, STRATEGIES[rollback].keep(state, tapes) if K else tapes, tapped
    kept = trees.TREE_STRATEGIES[rollback].keep(state, tapes, trees.Tree(tree.mask[:K + 1, :K + 1], tree.depth[:K + 1]))
    if as_tree is not True:
        kept = KeptBoth(STRATEGIES[rollback].keep(state, tapes), kept)
    return logits, hidden, after, kept, tapped


def decide(drafts, m, q, logits, sampling, u, stop, features, parents=None, as_tree=True):
    """Accept the first m drafts (K,) against logits (K+1, V): greedy, or speculative sampling with uniforms u (K+1,)
    (u[K] draws the target's token) -> (accepted, the target's token, committed tokens (K+1,), how many: the
    accepted drafts and the token, ending at the first stop id; whether a stop id ended them; the accepted path).
    With `parents` (K+1,) the drafts are a tree's nodes 1..K (its first m + 1 nodes real): the tree's acceptance
    (multi-draft sampling, one-hot or given q), and the accepted drafts are the accepted path's (K+1,), of which
    accepted + 1 count (None for a chain). as_tree traced (a batch row beside tree rows): the row's own rule, a
    chain's path being 0, 1, ..., K."""
    def chain():
        accepted, token = accept_greedy(drafts, m, logits)
        if features.sample:
            sampled = accept_speculative(drafts, m, q, probabilities(logits, sampling), u)
            accepted, token = (select(sampling.temperature > 0, s, g) for s, g in zip(sampled, (accepted, token)))
        return accepted, token, drafts, jnp.arange(len(drafts) + 1)

    def tree():
        nodes = jnp.concatenate([jnp.zeros(1, i32), drafts])
        path, length, token = accept_tree_greedy(nodes, parents, m + 1, logits)
        if features.sample:
            sampled = accept_tree_speculative(nodes, parents, m + 1, q, probabilities(logits, sampling), u)
            path, length, token = (select(sampling.temperature > 0, s, g)
                                   for s, g in zip(sampled, (path, length, token)))
        return length - 1, token, nodes[path[1:]], path
    accepted, token, drafts, path = trees.per_row(parents is not None and as_tree, tree, chain)
    path = None if parents is None else path
    positions = jnp.arange(len(drafts) + 1)
    new = jnp.where(positions < accepted, jnp.append(drafts, 0), token)
    stops = jnp.isin(new, stop) & (positions <= accepted)
    return accepted, token, new, jnp.where(stops.any(), jnp.argmax(stops) + 1, accepted + 1), stops.any(), path


def commit_kept(rollback, before, after, kept, n, K):
    """The state after the first n positions of a pass: the pass's own state when it consumed exactly n (a prefill
    chunk, a full accept, an idle request's n = 0), else the strategy's commit from the first K+1 positions' kept
    states. With K = 0 every request keeps what it consumed (one token, a prefill chunk, nothing). Attention layers
    keep the pass's buffers either way (the length hides what was not kept): only DeltaNet states are selected."""
    if K == 0:
        return after
    rebuilt = STRATEGIES[rollback].commit(before, after, kept, jnp.clip(n, 1, K + 1))
    whole = n == after.length - before.length
    layers = tuple(a if isinstance(a, reference.AttnState) else jax.tree.map(partial(jnp.where, whole), a, r)
                   for a, r in zip(after.layers, rebuilt.layers))
    return State(layers, jnp.where(whole, after.length, rebuilt.length))


def uniforms_for(key, K, own_k):
    """The accept uniforms of a round of the request's own K (own_k) drawn as (K+1,): u[:own_k] decide the drafts and
    u[K] (accept_speculative's) is the request's u[own_k]."""
    u = jax.random.uniform(key, (K + 1,))
    return jnp.where(jnp.arange(K + 1) == K, u[own_k], u)


def counted(stats, decoding, m, accepted):
    """Stats after a step in which the request verified m drafts (if decoding) and accepted some."""
    on = decoding.astype(i32)
    positions = jnp.arange(stats.proposed_by_position.shape[-1])
    return Stats(stats.target_calls + on, stats.proposed + on * m, stats.accepted + on * accepted,
                 stats.proposed_by_position + on * (positions < m),
                 stats.accepted_by_position + on * (positions < accepted))


def request_step(params, cfg, row, settings, arrays=None, *, T, K, rollback, features, drafters, prefills, tree=None):
    """One step of one request -> its Row after it: a speculative round of width K (or a plain step, K = 0) when
    DECODE, a prompt chunk of up to T tokens when PREFILL (compiled in only if `prefills`: some row may prefill),
    nothing otherwise. drafters: the names compiled in (DRAFTERS); arrays: {name: its constant arrays}
    (DeviceDrafter.prepare) for those that have them.
    tree: a reference.TreeBudget (static; K = its nodes, the widest of the rows' own settings.tree): a tree
    request's round verifies a draft tree of its drafter's (TREE_DRAFTERS) and commits the accepted path; in a batch
    the other rows (chains, prefill chunks) run beside it by their own rules (trees.per_row)."""
    st, c, arrays = settings, row.state.length, arrays or {}
    prefilling, decoding = (row.phase == PREFILL) if prefills else False, row.phase == DECODE
    sampling = row_sampling(st, features)
    plain = drafts_with(st, "none")
    (key2, draw_key), (key3, draft_key, accept_key) = jax.random.split(row.key), jax.random.split(row.key, 3)
    # whether the row's pass is over a draft tree: Python in the single loop, traced in a batch
    as_tree = tree is not None and st.tree.nodes > 0
    as_tree = as_tree & ~prefilling if prefills and tree is not None else as_tree

    def chain():
        return propose(params, cfg, row, st, arrays, K, sampling, draft_key, drafters) + (trees.chain_parents(K + 1),)

    def drafted_tree():
        drafts, parents, q, m = propose_tree(params, cfg, row, st, tree, drafters)
        return drafts, q, m, parents
    drafts, q, m, parents = trees.per_row(as_tree, drafted_tree, chain)
    verify_tokens = jnp.pad(jnp.concatenate([row.buf[row.ntok - 1][None], drafts]), (0, T - K - 1))
    tokens = select(prefilling, lax.dynamic_slice_in_dim(row.buf, c, T), verify_tokens)
    valid = select(prefilling, jnp.clip(row.prefill_to - c, 0, T), jnp.where(decoding, m + 1, 0))
    pick = select(prefilling, jnp.maximum(valid - 1, 0), jnp.arange(K + 1))
    taps = drafter_taps(drafters, arrays)
    # a batch row's parents over the whole width: its tree's (padding off the root), or a chain's
    pass_parents = None if tree is None else trees.per_row(as_tree, lambda: jnp.pad(parents, (0, T - K - 1)),
                                                           lambda: trees.chain_parents(T))
    logits, hidden, after, kept, tapped = target_pass(params, cfg, row.state, tokens, valid, pick, K, rollback,
                                                      pass_parents, taps, as_tree)

    u = select(plain, jnp.broadcast_to(jax.random.uniform(draw_key), (K + 1,)),
               uniforms_for(accept_key, K, st.draft_len))
    accepted, _, new, n_decode, stopped, path = decide(drafts, m, q, logits, sampling, u, st.stop, features,
                                                       None if tree is None else parents, as_tree)
    n = jnp.where(decoding, n_decode, select(prefilling, valid, 0))
    if tree is None:
        state = commit_kept(rollback, row.state, after, kept, n, K)
    else:  # the accepted path's positions: their logits, hidden states and committed state
        def tree_commit():
            committed = trees.commit_tree(rollback, row.state, after, kept.tree if isinstance(kept, KeptBoth) else kept,
                                          path, jnp.maximum(n, 1))
            return jax.tree.map(partial(jnp.where, n > 0), committed, row.state)
        state = trees.per_row(as_tree, tree_commit, lambda: commit_kept(rollback, row.state, after, kept.chain, n, K))
        rows = trees.per_row(as_tree, lambda: jnp.pad(path, (0, T - K - 1)), lambda: jnp.arange(T))
        logits, hidden = logits[rows[:K + 1]], hidden[rows]
    buf = jnp.where(decoding, lax.dynamic_update_slice_in_dim(row.buf, new, row.ntok, 0), row.buf)
    ntok = row.ntok + jnp.where(decoding, n_decode, 0)
    prompt_done = False
    if prefills:  # a prompt's last chunk draws the first generated token
        first, _ = draw(logits[0], sampling, draw_key)
        prompt_done = prefilling & (c + valid == st.prompt_len)
        buf = jnp.where(prompt_done, buf.at[row.ntok].set(first), buf)
        ntok = ntok + prompt_done.astype(i32)
        stopped = jnp.where(decoding, stopped, jnp.isin(first, st.stop))

    logprob = row.logprob
    if logprob is not None and features.logprobs:  # row i's log-probabilities for the token after it
        logprobs = jax.nn.log_softmax(logits.astype(f32), axis=-1)
        logprob = jnp.where(decoding, lax.dynamic_update_slice_in_dim(
            logprob, jnp.take_along_axis(logprobs, new[:, None], axis=1)[:, 0], row.ntok, 0), logprob)
        if prefills:
            logprob = jnp.where(prompt_done, logprob.at[row.ntok].set(logprobs[0, first]), logprob)

    after_tokens = lax.dynamic_slice_in_dim(buf, c + 1, T)     # the token after each position of the pass
    drafts_state = {name: DRAFTERS[name].update(params, cfg, arrays.get(name), draft_state, after_tokens,
                                                tapped if DRAFTERS[name].taps(arrays.get(name)) else hidden,
                                                jnp.where(drafts_with(st, name), n, 0))
                    for name, draft_state in row.drafts.items()}

    finished = (decoding | prompt_done) & (stopped | (ntok - st.prompt_len >= st.limit))
    phase = jnp.where(finished, DONE, row.phase)
    if prefills:
        paused = prefilling & ~prompt_done & (c + valid == row.prefill_to)
        phase = jnp.where(finished, DONE, jnp.where(prompt_done, DECODE, jnp.where(paused, PAUSED, row.phase)))
    key = row.key
    if features.sample:  # a greedy request never draws with its key: in a step without sampling none advances
        key = jnp.where(decoding, select(plain, key2, key3), select(prefills, jnp.where(prompt_done, key2, key), key))
    return Row(state, drafts_state, buf, ntok, row.prefill_to, phase, key, counted(row.stats, decoding, m, accepted),
               logprob)


# ----------------------------------------------------------------------------------------------------------------
# The single-request loop

class Prefilled(NamedTuple):
    state: State
    first: jax.Array      # the first generated token
    hidden: jax.Array     # (P, D) the padded prompt's final-normed hidden states (the MTP head reads them)
    key: jax.Array
    tapped: jax.Array = None   # (P, len(taps) D) the outputs of the layers `taps` (a DFlash drafter reads them)


def prefill_device(params, cfg, prompt, prompt_len, key, *, sampling, capacity, mesh=None, taps=()):
    """Prefill the padded prompt (P,) of which prompt_len tokens are real, and draw the first token."""
    state = constrain_state(empty_state(cfg, capacity, params["embed_tokens"].dtype), mesh)
    hidden, state, _, tapped = forward_tapped(params, cfg, prompt, state, prompt_len, taps)
    key, sub = jax.random.split(key)
    first, _ = draw(lm_head(params, hidden[prompt_len - 1]), sampling, sub)
    return Prefilled(constrain_state(state, mesh), first, hidden, key, tapped)


def decode_device(params, cfg, buf, prompt_len, limit, pre, arrays=None, *, sampling, draft, K, rollback, mesh=None,
                  tree=None):
    """Generate up to `limit` tokens after the prompt in buf[:prompt_len] -> (buf, token count, Stats): request_step
    in a lax.while_loop, its settings static (greedy compiles no sampling, a plain run no drafting). tree: a
    reference.TreeBudget (K = its nodes): each round verifies a draft tree (request_step)."""
    stop = jnp.array(cfg.eos_token_id or (-1,), i32)
    settings = Settings(*sampling, drafter_name(draft), K, limit, prompt_len, stop, tree)
    features = Features(sample=sampling.temperature > 0, top_k=sampling.temperature > 0 and sampling.top_k > 0,
                        top_p=sampling.temperature > 0 and sampling.top_p < 1)
    name = drafter_name(draft)
    drafters = () if name == "none" else (name,)
    arrays = one_drafter_arrays(draft, arrays)
    buf = buf.at[prompt_len].set(pre.first)
    prompt_pairs = buf[1:len(pre.hidden) + 1]       # the token after each prompt position
    empty = empty_drafts(params, cfg, drafters, len(buf), params["embed_tokens"].dtype, arrays)
    drafts = {name: DRAFTERS[name].update(params, cfg, arrays.get(name), draft_state, prompt_pairs,
                                          pre.tapped if DRAFTERS[name].taps(arrays.get(name)) else pre.hidden,
                                          prompt_len)
              for name, draft_state in empty.items()}
    zero = jnp.int32(0)
    phase = jnp.where(jnp.isin(pre.first, stop) | (limit <= 1), DONE, DECODE)
    start = Row(pre.state, drafts, buf, prompt_len + 1, prompt_len, phase, pre.key,
                Stats(zero, zero, zero, jnp.zeros(K, i32), jnp.zeros(K, i32)))

    def step(row):
        row = request_step(params, cfg, row, settings, arrays, T=K + 1, K=K, rollback=rollback, features=features,
                           drafters=drafters, prefills=False, tree=tree)
        return row._replace(state=constrain_state(row.state, mesh))

    end = lax.while_loop(lambda row: row.phase == DECODE, step, start)
    return end.buf, end.ntok, end.stats


def generate_device(params, cfg, prompt, prompt_len, limit, key, arrays=None, *, sampling, draft, K, rollback,
                    capacity, mesh=None, tree=None):
    """prefill_device then decode_device in one traceable function (vmap it over keys to sample many runs)."""
    taps = () if draft == "none" else drafter_taps((drafter_name(draft),), one_drafter_arrays(draft, arrays))
    pre = prefill_device(params, cfg, prompt, prompt_len, key, sampling=sampling, capacity=capacity, mesh=mesh,
                         taps=taps)
    buf = jnp.zeros(capacity, jnp.int32).at[:len(prompt)].set(prompt)
    return decode_device(params, cfg, buf, prompt_len, limit, pre, arrays, sampling=sampling, draft=draft, K=K,
                         rollback=rollback, mesh=mesh, tree=tree)


# ----------------------------------------------------------------------------------------------------------------
# Host entry point: pad to buckets, compile ahead of time (timed apart), run, unpack.

def round_up(n, multiple):
    return -(-n // multiple) * multiple


def buffer_sizes(prompt_len, limit, K):
    """(padded prompt length, token buffer = KV capacity). The buffer has room for a last round's K+1 tokens and
    the MTP chain's K positions past the committed length, so no write is ever clamped."""
    P = round_up(prompt_len, 16)
    return P, round_up(P + limit + 2 * (K + 1), 64)


def round_draft_len(draft, draft_len, limit):
    """The static K of a round: draft_len, but no more than the tokens left after the prefill's (the reference
    limits each round's drafts the same way), so a long draft_len and few new tokens compile a small round."""
    return min(draft_len, max(limit - 1, 0)) if draft != "none" else 0


# compiled programs by key, least recently used first. Bounded: XLA:CPU maps each kernel of an executable's code apart
# (about 1,000 memory maps for one of the server's step programs on tiny-mtp, 1,500 with trees), and an unpinned server
# meets a program per step shape (T, K, features, tree budget); unbounded, check-server's scenarios with varied
# drafters and tree budgets took it past the kernel's limit (vm.max_map_count, 65,530: LLVM "Cannot allocate memory",
# then a segfault) in 11 minutes. So programs are dropped while there are more than MAX_COMPILED or the process holds
# more than MAPS_SHARE of its limit; a dropped program is compiled again when its shape comes back.
MAX_COMPILED, MAPS_SHARE = 64, 0.5
_compiled = OrderedDict()


def memory_maps():
    """(memory maps the process holds, the kernel's limit), or None where /proc tells neither (not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


def too_many_programs():
    if len(_compiled) > MAX_COMPILED:
        return True
    held = memory_maps()
    return held is not None and held[0] > MAPS_SHARE * held[1]


def aval_key(x):
    """What a compiled program's argument must match: shape, dtype and weak type (read off the array: jnp.result_type
    over a server's 165 leaves took 1.5 ms, a tenth of a 16-step sync on the default model)."""
    return np.shape(x), x.dtype, getattr(x, "weak_type", False)


def compiled(fn, donate, cfg, statics, *args):
    """fn(params, cfg, *rest, **statics) jit-compiled for cfg, the statics, the argument shapes and the matvec mode
    -> (executable taking the arguments but cfg, whether it was compiled now)."""
    key = (fn, cfg, matvec.mode, tuple(statics.items()), jax.tree.structure(args),
           tuple(map(aval_key, jax.tree.leaves(args))))
    fresh = key not in _compiled
    if fresh:
        jitted = jax.jit(lambda params, *rest: fn(params, cfg, *rest, **statics), donate_argnums=donate)
        _compiled[key] = jitted.lower(*args).compile()
        while len(_compiled) > 1 and too_many_programs():
            _compiled.popitem(last=False)
    _compiled.move_to_end(key)
    return _compiled[key], fresh


def prefill_seeded(params, cfg, prompt, prompt_len, seed, **statics):
    return prefill_device(params, cfg, prompt, prompt_len, jax.random.key(seed), **statics)


def generate(params, cfg, prompt, max_new_tokens, sampling=Sampling(), seed=0, draft="none", draft_len=4,
             rollback="replay", mesh=None, ngram_table=None, tree=None):
    """reference.generate / generate_speculative on device -> (tokens, stats). draft: "none", "ngram" (with an
    optional offline table, reference.build_ngram_table's format), "mtp", "partial-mlp:F[:LAYERS]",
    "mtp-shortlist:PATH", "dflash:DIR" or "dflash-sampled:DIR" (reference.py's drafters of those specs). tree: a
    reference.TreeBudget, draft a name in TREE_DRAFTERS: reference.generate_tree_speculative's rounds (draft_len is
    then unused). stats["seconds"] has compile, prefill, decode and total (total leaves compile out)."""
    check_settings(params, cfg, dict(max_new_tokens=max_new_tokens, **sampling._asdict(), seed=seed, draft=draft,
                                     draft_len=draft_len, rollback=rollback))
    if tree is not None and draft not in TREE_DRAFTERS:
        raise reference.UserError(f"a draft tree with --draft {draft}: jax_impl drafts trees with "
                                  f"{', '.join(TREE_DRAFTERS)} only")
    limit = reference.token_limit(cfg, list(prompt), max_new_tokens)
    K = round_draft_len(draft, draft_len, limit) if tree is None else tree.nodes
    P, capacity = buffer_sizes(len(prompt), limit, K if tree is None else max(tree.nodes, tree.depth))
    seconds = dict.fromkeys(("compile", "prefill", "decode"), 0.0)
    tokens, counts = [], {"target_calls": 0, "proposed": 0, "accepted": 0, "proposed_by_position": [],
                          "accepted_by_position": []}
    if limit > 0:
        host = replicated(mesh)
        prompt = np.asarray(prompt, np.int32)
        padded = put(np.pad(prompt, (0, P - len(prompt))), host)
        prompt_len, seed = put(np.int32(len(prompt)), host), put(np.uint32(seed), host)
        arrays = None if draft == "none" else DRAFTERS[drafter_name(draft)].prepare(params, cfg, draft, K, ngram_table)
        arrays = jax.tree.map(lambda x: put(x, host), arrays)
        statics = dict(sampling=sampling, draft=draft, K=K, rollback=rollback, mesh=mesh, tree=tree)

        def run(limit):  # -> (buf, ntok, Stats), timing prefill and decode; decode_device donates the buffer
            buf, limit = put(np.pad(prompt, (0, capacity - len(prompt))), host), put(np.int32(limit), host)
            lap = time.perf_counter()
            pre = jax.block_until_ready(run_prefill(params, padded, prompt_len, seed))
            seconds["prefill"], lap = time.perf_counter() - lap, time.perf_counter()
            out = jax.block_until_ready(run_decode(params, buf, prompt_len, limit, pre, arrays))
            seconds["decode"] = time.perf_counter() - lap
            return out

        start = time.perf_counter()
        taps = () if draft == "none" else drafter_taps((drafter_name(draft),), one_drafter_arrays(draft, arrays))
        run_prefill, fresh = compiled(prefill_seeded, (), cfg, dict(sampling=sampling, capacity=capacity, mesh=mesh,
                                                                    taps=taps), params, padded, prompt_len, seed)
        shapes = (jax.ShapeDtypeStruct((capacity,), jnp.int32), prompt_len, prompt_len,
                  run_prefill.out_info, arrays)
        run_decode, fresh_loop = compiled(decode_device, (1,), cfg, statics, params, *shapes)
        if fresh or fresh_loop:  # the first run sets the executables up (lazily initialised kernels): compile time
            run(min(limit, 2))
        seconds["compile"] = time.perf_counter() - start
        buf, ntok, device_stats = run(limit)
        tokens = [int(t) for t in fetch(buf)[len(prompt):int(fetch(ntok))]]
        counts = {name: fetch(value).tolist() for name, value in device_stats._asdict().items()}
    seconds["total"] = seconds["prefill"] + seconds["decode"]
    return tokens, reference.generation_stats(len(prompt), len(tokens), counts["target_calls"], seconds,
                                              None if draft == "none" else counts,
                                              draft_len if tree is None else tree.nodes, rollback)


ENGINE_DRAFTERS = ("jax_impl", DRAFTER_NAMES)  # what reference.check_settings lets through to this engine


def check_settings(params, cfg, settings, label=str, engine_drafters=ENGINE_DRAFTERS, loaded=()):
    """reference.check_settings for this engine (its drafters: a --draft spec by its drafter's name; the server's
    are fewer), and the MTP drafter's needs (weights, one layer). loaded: drafters a server loaded at its start,
    which its requests name without arguments (its DFlash drafter: "dflash")."""
    draft = settings.get("draft", "none")
    reference.check_settings({**settings, "draft": drafter_name(draft) or draft} if "draft" in settings else settings,
                             label, engine_drafters)
    if isinstance(draft, str) and draft in TAKE_ARGUMENTS and draft not in loaded:  # a form that takes arguments
        raise reference.UserError(f"{label('draft')} {draft}: expected {draft}:{'DIR' if 'dflash' in draft else 'ARGS'}")
    if settings.get("draft") == "mtp":
        reference.mtp_drafter(params, cfg)  # the reference's checks: MTP weights present, one MTP layer
