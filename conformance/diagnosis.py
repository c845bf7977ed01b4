"""The usual mistakes of an engine, as reference.py with one function replaced, so that a failing case can say which
one the engine's outputs match (INTERPRETING.md section 9 lists them with their signatures).

A mistake is a set of patches: reference functions replaced, for as long as `applied` holds, by a wrong version built
on the original. reference.py's functions find each other by name at call time, so the patched function is used
wherever the spec uses it: a wrong conv window shows in the op case, the DeltaNet layer and every whole-model case.
The runner recomputes a failing case with the reference adapter under each mistake that can show in the case's kind
(runner.diagnose) and names the ones the engine's outputs match within the case's tolerances.
"""

from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

from . import reference as R
from . import rules

# Spec functions the wrong versions below are built on: captured before any patch, so that a wrong version calling
# "the spec's" never calls itself.
SPEC = {name: getattr(R, name) for name in ("rms_norm", "rms_norm_gated", "rope", "causal_conv1d", "gated_attention",
                                            "probabilities", "commit_per_position", "replay",
                                            "gated_delta_tree_chunked", "tree_delta_states", "tree_conv_windows",
                                            "commit_tree", "dflash_taps")}

WHOLE_MODEL = frozenset({"forward", "greedy", "speculative", "tree", "trace", "mtp", "dflash"})
TREE = frozenset({"tree"})
DELTANET = frozenset({"deltanet_layer"}) | WHOLE_MODEL
ATTENTION = frozenset({"attention_layer"}) | WHOLE_MODEL
DECISIONS = frozenset({"speculative", "trace"})
DFLASH = frozenset({"dflash"})


class Mistake(NamedTuple):
    name: str
    description: str
    kinds: frozenset      # the case kinds it can show in
    patches: dict         # reference attribute -> its wrong version


def rollback_tables(replace):
    """reference.py's rollback tables (ROLLBACK, TREE_ROLLBACK) with each function mapped by replace: they hold the
    functions themselves, so a patched module attribute alone would not reach them."""
    return {table: {name: R.Rollback(*(replace(f) for f in strategy)) for name, strategy in getattr(R, table).items()}
            for table in ("ROLLBACK", "TREE_ROLLBACK")}


@contextmanager
def applied(mistake):
    """reference.py with the mistake's functions replaced (in its rollback tables too), restored on the way out."""
    saved = {name: getattr(R, name) for name in mistake.patches}
    wrong_for = {id(saved[name]): wrong for name, wrong in mistake.patches.items()}
    saved_tables = {table: getattr(R, table) for table in ("ROLLBACK", "TREE_ROLLBACK")}
    try:
        for name, wrong in mistake.patches.items():
            setattr(R, name, wrong)
        for table, patched in rollback_tables(lambda f: wrong_for.get(id(f), f)).items():
            setattr(R, table, patched)
        yield
    finally:
        for name, function in saved.items():
            setattr(R, name, function)
        for table, original in saved_tables.items():
            setattr(R, table, original)


# ----------------------------------------------------------------------------------------------------------------
# The gated delta rule

def step_decay_after_write(S, q, k, v, g, beta):
    """The correction computed against the undecayed state and the decay applied after the write."""
    delta = beta[:, None] * (v - np.einsum("hkv,hk->hv", S, k))
    S = np.exp(g)[:, None, None] * (S + np.einsum("hk,hv->hkv", k, delta))
    return np.einsum("hkv,hk->hv", S, q), S, delta


def recurrent_for_every_form(q, k, v, g, beta, initial_state, chunk_size=64):
    """The chunked form replaced by the (patched) per-token loop: a wrong step shows in both forms."""
    return R.gated_delta_recurrent(q, k, v, g, beta, initial_state)


def gva_heads_modulo(x, num_value_heads):
    """Value head h reads key head h % Hk (tiled) instead of h // (Hv / Hk) (repeated)."""
    return np.tile(x, (1, num_value_heads // x.shape[1], 1))


def queries_keys_unscaled(q, k, num_value_heads):
    return R.gva_heads(q, num_value_heads), R.gva_heads(k, num_value_heads)


def l2norm_eps_outside(x, eps=1e-6):
    return x / (np.sqrt(np.sum(x * x, axis=-1, keepdims=True)) + eps)


# ----------------------------------------------------------------------------------------------------------------
# The conv, RoPE, norms, attention

def conv_taps_reversed(x, window, weight):
    return SPEC["causal_conv1d"](x, window, weight[:, ::-1])


def conv_output_lagged(x, window, weight):
    """Each output reads the W inputs before its token, not the W ending at it."""
    y, _ = SPEC["causal_conv1d"](np.concatenate([window[-1:], x[:-1]]),
                                 np.concatenate([np.zeros_like(window[:1]), window[:-1]]), weight)
    return y, SPEC["causal_conv1d"](x, window, weight)[1]


def conv_window_lagged(x, window, weight):
    """The carried window ends one input before the last (it misses the call's last token)."""
    y, _ = SPEC["causal_conv1d"](x, window, weight)
    padded = np.concatenate([window, x])
    return y, padded[len(padded) - weight.shape[1]:-1]


def rope_interleaved(x, positions, theta, rotary_dim):
    """GPT-J style: dims (2i, 2i+1) rotate together instead of (i, i + R/2)."""
    half_split = np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)])
    order = np.concatenate([half_split, np.arange(rotary_dim, x.shape[-1])])
    y = SPEC["rope"](x[..., order], positions, theta, rotary_dim)
    return y[..., np.argsort(order)]


def rope_full_dims(x, positions, theta, rotary_dim):
    """partial_rotary_factor ignored: every dim rotates."""
    return SPEC["rope"](x, positions, theta, x.shape[-1])


def rope_frequencies_over_head_dim(x, positions, theta, rotary_dim):
    """The right dims rotate, at frequencies theta^(-2i/Dh) instead of theta^(-2i/R)."""
    return SPEC["rope"](x, positions, float(theta) ** (rotary_dim / x.shape[-1]), rotary_dim)


def rms_norm_plain_weight(x, weight, eps):
    return SPEC["rms_norm"](x, weight - 1, eps)


def gated_norm_one_plus_weight(x, z, weight, eps):
    return SPEC["rms_norm_gated"](x, z, 1 + weight, eps)


def gated_norm_gate_first(x, z, weight, eps):
    """SiLU(z) applied before the norm instead of after it."""
    return SPEC["rms_norm"](x * R.silu(z), weight - 1, eps)


def attention_gqa_modulo(x, state, positions, cfg, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, parents=None):
    """Query head h reads KV head h % Hkv instead of h // (Hq / Hkv): the spec's grouping given the heads reordered."""
    Hq, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    order = [h for kv in range(Hkv) for h in range(Hq) if h % Hkv == kv]
    q_rows = q_proj.reshape(Hq, 2 * Dh, -1)[order].reshape(q_proj.shape)
    o_cols = o_proj.reshape(len(o_proj), Hq, Dh)[:, order].reshape(o_proj.shape)
    return SPEC["gated_attention"](x, state, positions, cfg, q_rows, k_proj, v_proj, o_cols, q_norm, k_norm, parents)


def attention_gate_halves(x, state, positions, cfg, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, parents=None):
    """q_proj's output split in two halves (all queries, then all gates) instead of [query | gate] per head."""
    Hq, Dh = cfg.num_attention_heads, cfg.head_dim
    per_head = q_proj.reshape(2, Hq, Dh, -1).swapaxes(0, 1).reshape(q_proj.shape)
    return SPEC["gated_attention"](x, state, positions, cfg, per_head, k_proj, v_proj, o_proj, q_norm, k_norm,
                                   parents)


# ----------------------------------------------------------------------------------------------------------------
# Sampling and acceptance

def masked(logits, keep):
    return np.where(keep, logits, -np.inf)


def top_k_exactly_k(logits, sampling):
    """Exactly k tokens kept (the highest, lower ids first among equals): ties at the k-th are cut."""
    if sampling.temperature == 0 or not sampling.top_k:
        return SPEC["probabilities"](logits, sampling)
    order = np.argsort(-logits, axis=-1, kind="stable")
    keep = np.zeros(logits.shape, bool)
    np.put_along_axis(keep, order[..., :sampling.top_k], True, axis=-1)
    return SPEC["probabilities"](masked(logits, keep), sampling._replace(top_k=0))


def top_p_without_crossing(logits, sampling):
    """Top-p keeps the tokens whose mass up to and including them is <= top_p: the one that crosses it is dropped
    (the most probable is always kept)."""
    if sampling.temperature == 0 or sampling.top_p >= 1:
        return SPEC["probabilities"](logits, sampling)
    p = SPEC["probabilities"](logits, sampling._replace(top_p=1.0))
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    inside = np.cumsum(sorted_p, axis=-1) <= sampling.top_p
    inside[..., 0] = True
    keep = np.zeros(p.shape, bool)
    np.put_along_axis(keep, order, inside, axis=-1)
    return SPEC["probabilities"](masked(logits, keep & (p > 0)), sampling._replace(top_k=0, top_p=1.0))


def top_p_ties_higher_id_first(logits, sampling):
    """Top-p's order of decreasing probability breaks ties by higher token id first, not lower."""
    if sampling.temperature == 0 or sampling.top_p >= 1:
        return SPEC["probabilities"](logits, sampling)
    flipped = SPEC["probabilities"](logits[..., ::-1], sampling)
    return flipped[..., ::-1]


def accepting_by(parts):
    """reference.accept with rules.py's parts: a wrong rule of greedy acceptance or speculative sampling."""
    def accept(draft, q, logits, sampling, u):
        return rules.decide(parts, rules.Round(list(draft), q, logits, sampling), u)
    return accept


def rule_mistake(rule):
    """A wrong rule of rules.py as a mistake. One that changes the probabilities or the draw also shows in plain
    draws (sampling cases, trace rows without drafts)."""
    patches = {"accept": accepting_by(rule.parts)}
    kinds = DECISIONS
    if rule.parts.probabilities is not rules.SPEC.probabilities:
        patches["probabilities"], kinds = rule.parts.probabilities, kinds | {"sampling"}
    if rule.parts.draw is not rules.SPEC.draw:
        patches["sample"], kinds = rule.parts.draw, kinds | {"sampling"}
    return Mistake(rule.name, rule.description, kinds, patches)


# ----------------------------------------------------------------------------------------------------------------
# Rollback

def per_position_index_one_ahead(before, after, kept, n):
    """Per-position: the DeltaNet state and conv window read at index n instead of n - 1 (the KV is right)."""
    shifted = [None if k is None else R.KeptStates(k.conv[np.minimum(np.arange(len(k.S)) + 1, len(k.S) - 1)],
                                                   k.S[np.minimum(np.arange(len(k.S)) + 1, len(k.S) - 1)])
               for k in kept]
    return SPEC["commit_per_position"](before, after, shifted, n)


def replay_steps(offset):
    def replay(S0, tape, n):
        return SPEC["replay"](S0, tape, min(max(n + offset, 0), len(tape.g)))
    return replay


# ----------------------------------------------------------------------------------------------------------------
# Draft trees: the verify pass treating the packed nodes as a sequence somewhere, the commit indexed by the path's
# length, the chain rule on siblings

def packed_as_chain(parents):
    """The parents an engine that treats the packed tree rows as a sequence uses: each node's the row before it."""
    return [-1] + list(range(len(parents) - 1))


def tree_rule_from_previous_row(q, k, v, g, beta, initial_state, parents):
    return SPEC["gated_delta_tree_chunked"](q, k, v, g, beta, initial_state, packed_as_chain(parents))


def tree_states_from_previous_row(S0, tape, parents):
    return SPEC["tree_delta_states"](S0, tape, packed_as_chain(parents))


def tree_conv_along_rows(window, x, parents, width):
    return SPEC["tree_conv_windows"](window, x, packed_as_chain(parents), width)


def positions_by_row(parents):
    """Every node's depth taken as its row index (position = prefix length + row instead of + depth)."""
    return np.arange(len(parents))


def attention_causal_over_rows(x, state, positions, cfg, *weights, parents=None, **named):
    """The tree rows attend causally (every earlier row visible) instead of through the ancestor mask."""
    return SPEC["gated_attention"](x, state, positions, cfg, *weights, **named,
                                   parents=None if parents is None else packed_as_chain(parents))


def commit_tree_by_accept_length(verified, path):
    """The DeltaNet layers committed as if the accepted nodes were the first len(path) rows (per-position: node
    len(path) - 1's state, `accept_lens - 1`; replay: the tape's first rows); the attention KV along the path."""
    right, wrong = SPEC["commit_tree"](verified, path), SPEC["commit_tree"](verified, list(range(len(path))))
    return right._replace(layers=tuple(w if isinstance(w, R.DeltaState) else r
                                       for r, w in zip(right.layers, wrong.layers)))


def tree_chain_rule_on_siblings(tokens, parents, q, p, u):
    """The chain rule on every edge: child c kept with chance min(1, p(x_c) / q_c(x_c)) with its parent's own p (no
    residual between siblings), the next token drawn from the residual of the first child only."""
    path = [0]
    while True:
        children = R.tree_children(parents, path[-1])
        child = next((c for c in children if u[c - 1] < R.acceptance(p[path[-1], tokens[c]], q[c - 1, tokens[c]])),
                     None)
        if child is None:
            leftover = p[path[-1]] if not children else R.residual(p[path[-1]], q[children[0] - 1])
            return path, R.sample(leftover, u[len(tokens) - 1])
        path.append(child)


def tree_chain_rule_outcomes(tokens, parents, q, p):  # (N,), (N,), (N-1, V), (N, V) -> (N, V)
    """tree_chain_rule_on_siblings's outcome distribution in closed form (reference.tree_outcomes' counterpart):
    entry [L, t] is the chance that the walk ends at node L and draws t."""
    reach, rows = np.zeros(len(tokens)), np.zeros(p.shape)
    reach[0] = 1.0
    for node in range(len(tokens)):
        children, stay = R.tree_children(parents, node), reach[node]
        for c in children:
            kept = R.acceptance(p[node, tokens[c]], q[c - 1, tokens[c]])
            reach[c], stay = stay * kept, stay * (1 - kept)
        leftover = p[node] if not children else R.residual(p[node], q[children[0] - 1])
        rows[node] = stay * leftover / leftover.sum()
    return rows


# ----------------------------------------------------------------------------------------------------------------
# A DFlash drafter (none of these changes a token under exact verification: they lose acceptance only)

def dflash_mask_in_first_slot(context, k, mask_token_id):
    """The block is [MASK x (k + 1)]: the last committed token not put in its first slot."""
    return [mask_token_id] * (k + 1)


def dflash_not_cropped(draft_state, length):
    """The block's keys and values kept in the drafter's cache after the round."""
    return draft_state


def dflash_taps_one_early(dcfg):
    """Each tapped layer's input instead of its output: Hugging Face's hidden_states[i] for layer i, not [i + 1]."""
    return tuple(i - 1 for i in SPEC["dflash_taps"](dcfg))


def dflash_taps_sorted(dcfg):
    """The right layers concatenated in ascending order instead of the order the config lists them."""
    return tuple(sorted(SPEC["dflash_taps"](dcfg)))


def dflash_features_without_norm(dparams, dcfg, tapped):
    """The projected features fed to the drafter layers without hidden_norm."""
    return tapped @ dparams["fc"].T


CATALOGUE = (
    Mistake("decay-after-write", "the delta rule decays the state after writing the correction (the correction "
            "computed against the undecayed state)", frozenset({"gated_delta_rule"}) | DELTANET,
            {"gated_delta_step": step_decay_after_write, "gated_delta_chunked": recurrent_for_every_form}),
    Mistake("gva-modulo", "value head h reads key head h % Hk instead of h // (Hv / Hk)",
            frozenset({"gated_delta_rule"}) | DELTANET, {"gva_heads": gva_heads_modulo}),
    Mistake("q-scale-missing", "the delta rule's q is not scaled by Dk^-1/2", frozenset({"gated_delta_rule"}) | DELTANET,
            {"value_head_queries_keys": queries_keys_unscaled}),
    Mistake("l2norm-eps-outside-sqrt", "l2norm divides by sqrt(sum x^2) + eps, or by the norm alone (torch's "
            "F.normalize), instead of sqrt(sum x^2 + eps): the two agree to 1e-4 on the rows where eps matters",
            frozenset({"l2norm"}) | DELTANET, {"l2norm": l2norm_eps_outside}),
    Mistake("conv-taps-reversed", "the conv weight's taps applied in reverse (the first tap on the current token)",
            frozenset({"causal_conv1d"}) | DELTANET, {"causal_conv1d": conv_taps_reversed}),
    Mistake("conv-output-lagged", "the conv output at t reads the W inputs before t, one position behind",
            frozenset({"causal_conv1d"}) | DELTANET, {"causal_conv1d": conv_output_lagged}),
    Mistake("conv-window-lagged", "the carried conv window ends one input before the last (it misses the call's "
            "last token)", frozenset({"causal_conv1d"}) | DELTANET, {"causal_conv1d": conv_window_lagged}),
    Mistake("rope-interleaved", "RoPE rotates pairs (2i, 2i+1) (GPT-J) instead of (i, i + R/2) (NeoX)",
            frozenset({"rope"}) | ATTENTION, {"rope": rope_interleaved}),
    Mistake("rope-full-dims", "RoPE rotates every head dim, ignoring partial_rotary_factor",
            frozenset({"rope"}) | ATTENTION, {"rope": rope_full_dims}),
    Mistake("rope-frequencies-over-head-dim", "RoPE rotates the first R dims at frequencies theta^(-2i/Dh) "
            "instead of theta^(-2i/R)", frozenset({"rope"}) | ATTENTION, {"rope": rope_frequencies_over_head_dim}),
    Mistake("rms-norm-plain-weight", "a zero-centred RMSNorm scaled by w instead of (1 + w)",
            frozenset({"rms_norm", "attention_layer"}) | WHOLE_MODEL, {"rms_norm": rms_norm_plain_weight}),
    Mistake("gated-norm-one-plus-weight", "the DeltaNet output norm scaled by (1 + w) instead of its plain w",
            frozenset({"rms_norm_gated"}) | DELTANET, {"rms_norm_gated": gated_norm_one_plus_weight}),
    Mistake("gated-norm-gate-first", "the DeltaNet output gate SiLU(z) applied before the norm instead of after",
            frozenset({"rms_norm_gated"}) | DELTANET, {"rms_norm_gated": gated_norm_gate_first}),
    Mistake("attention-gqa-modulo", "query head h reads KV head h % Hkv instead of h // (Hq / Hkv)", ATTENTION,
            {"gated_attention": attention_gqa_modulo}),
    Mistake("attention-gate-halves", "q_proj's output read as all queries then all gates instead of [query | gate] "
            "per head", ATTENTION, {"gated_attention": attention_gate_halves}),
    Mistake("top-k-ties-cut", "top-k keeps exactly k tokens: ties at the k-th largest are cut",
            frozenset({"sampling"}) | DECISIONS, {"probabilities": top_k_exactly_k}),
    Mistake("top-p-drops-crossing-token", "top-p keeps the tokens whose mass including them is <= top_p: the token "
            "that reaches top_p is dropped", frozenset({"sampling"}) | DECISIONS,
            {"probabilities": top_p_without_crossing}),
    Mistake("top-p-ties-higher-id-first", "top-p orders equal probabilities by higher token id first",
            frozenset({"sampling"}) | DECISIONS, {"probabilities": top_p_ties_higher_id_first}),
    *(rule_mistake(rule) for rule in rules.WRONG),
    Mistake("per-position-index-one-ahead", "per-position: the committed DeltaNet state and conv window read one "
            "position ahead (the KV truncated right)", DECISIONS,
            {"commit_per_position": per_position_index_one_ahead}),
    Mistake("replay-one-step-short", "replay: n - 1 steps of S replayed (the conv window and the KV right)",
            DECISIONS, {"replay": replay_steps(-1)}),
    Mistake("replay-one-step-long", "replay: n + 1 steps of S replayed (the conv window and the KV right)",
            DECISIONS, {"replay": replay_steps(+1)}),
    Mistake("tree-state-from-previous-row", "a tree node's DeltaNet recurrence starts from the previous packed row's "
            "state instead of its parent's (the tree verified as a chain: sglang's lightning-attention path)", TREE,
            {"gated_delta_tree_chunked": tree_rule_from_previous_row,
             "tree_delta_states": tree_states_from_previous_row}),
    Mistake("tree-conv-along-rows", "a tree node's conv window holds the previous packed rows' inputs instead of its "
            "ancestors'", TREE, {"tree_conv_windows": tree_conv_along_rows}),
    Mistake("tree-position-by-row", "a tree node's RoPE position is prefix length + its row instead of + its depth",
            TREE, {"tree_depths": positions_by_row}),
    Mistake("tree-attention-causal", "the tree's rows attend causally to every earlier row instead of to their "
            "ancestors only", TREE, {"gated_attention": attention_causal_over_rows}),
    Mistake("tree-commit-by-accept-length", "the DeltaNet state committed from the first rows of the tree as if "
            "they were the accepted path (per-position: node `accept_lens - 1`'s state instead of the last accepted "
            "node's, sglang#27463; replay: the tape's first rows); the KV right", TREE,
            {"commit_tree": commit_tree_by_accept_length}),
    Mistake("tree-chain-rule-on-siblings", "tree acceptance by the chain rule min(1, p/q) on each edge with the "
            "parent's own p (no residual between siblings): biased for a drafter's top-k (warpfront/hipfire#483)",
            TREE, {"accept_tree_speculative": tree_chain_rule_on_siblings}),
    Mistake("dflash-mask-in-first-slot", "DFlash: the block's first slot holds a mask token instead of the last "
            "committed token", DFLASH, {"dflash_block_tokens": dflash_mask_in_first_slot}),
    Mistake("dflash-not-cropped", "DFlash: the block's keys and values stay in the drafter's cache after the round "
            "(no crop back to the committed length)", DFLASH, {"dflash_crop": dflash_not_cropped}),
    Mistake("dflash-taps-one-early", "DFlash: each tapped layer's input instead of its output (Hugging Face's "
            "hidden_states[i] instead of hidden_states[i + 1])", DFLASH, {"dflash_taps": dflash_taps_one_early}),
    Mistake("dflash-taps-sorted", "DFlash: the tapped layers concatenated in ascending order instead of the config's "
            "order", DFLASH, {"dflash_taps": dflash_taps_sorted}),
    Mistake("dflash-features-without-norm", "DFlash: the projected target features fed to the drafter without "
            "hidden_norm", DFLASH, {"dflash_features": dflash_features_without_norm}),
)
MISTAKES = {mistake.name: mistake for mistake in CATALOGUE}


def candidates(kind):
    return [mistake for mistake in CATALOGUE if kind in mistake.kinds]
