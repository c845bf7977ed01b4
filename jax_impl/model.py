"""The Qwen3.5 hybrid model in JAX: pure functions over the weights pytree (reference.load_model's nested dict, as jax
arrays) and an explicit state pytree (reference.State / DeltaState / AttnState with static shapes), plus the
jit-compiled entry points prefill, decode, verify and commit. Reads side by side with reference.py; the axis
letters are its legend (T tokens, S cache positions, D hidden, ...).

Differences from the reference, all forced by fixed shapes:
  * AttnState.k / .v are preallocated buffers of `capacity` positions; State.length says how many are live. Truncating a
    KV cache is setting the length: positions past it are never visible (causal mask by position) and are overwritten
    by the next call. Keys are (Hkv, S, Dh) and values (Hkv, Dh, S), where the reference has (S, Hkv, Dh): each
    attention dot then contracts its operands' last axis, which XLA:CPU reads in place; with the reference's layout
    it copied both whole caches every step (30% of a decode step at 2000 tokens of context).
  * forward takes `valid`: only the first `valid` of the T tokens count (prompt padded to a bucket). The padding
    gets beta = g = 0, which leaves the DeltaNet state unchanged, and the conv window is cut at `valid`.
  * Activations take the weights' dtype (fp32 or bf16); the DeltaNet rule, its state and the logits stay fp32.
  * 2-D weights come transposed, (in, out) (see weights.py), so the reference's `x @ W.T` reads `matmul(x, W)` here
    (matvec.py: XLA's dot, or on a CPU the threaded kernel for decode's and verify's few rows).
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from . import reference, rollback, trees
from .gated_delta import gated_delta_chunked, gated_delta_step, gated_delta_tree, value_head_queries_keys
from .matvec import matmul, matmuls

AttnState, DeltaState, State, Tape = reference.AttnState, reference.DeltaState, reference.State, reference.Tape  # the spec's types

f32 = jnp.float32


# ----------------------------------------------------------------------------------------------------------------
# Primitives (statistics in fp32, result in the input dtype)

def rms_norm(x, weight, eps):  # (..., N) -> (..., N)
    """Zero-centred RMSNorm: the checkpoint stores w, the scale is (1 + w)."""
    x32 = x.astype(f32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * (1 + weight.astype(f32))).astype(x.dtype)


def rms_norm_gated(x, z, weight, eps):  # (T, Hv, Dv) fp32, (T, Hv, Dv) -> (T, Hv, Dv) in z's dtype
    """DeltaNet output norm: plain weight (no +1), normalise first, then gate with SiLU(z)."""
    y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(f32)
    return (y * jax.nn.silu(z.astype(f32))).astype(z.dtype)


def l2norm(x, eps=1e-6):  # (..., N) -> (..., N)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def rope(x, positions, theta, rotary_dim):  # (T, H, Dh), (T,) -> (T, H, Dh)
    """NeoX-style partial RoPE: dims [0, R) rotate in pairs (i, i + R/2), dims [R, Dh) pass through."""
    R = rotary_dim
    inv_freq = f32(theta) ** -(jnp.arange(0, R, 2, dtype=f32) / f32(R))                       # (R/2,)
    angles = positions.astype(f32)[:, None] * inv_freq                                          # (T, R/2)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]                           # (T, 1, R)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    x_rot, x_pass = x[..., :R].astype(f32), x[..., R:]
    rotated_half = jnp.concatenate([-x_rot[..., R // 2:], x_rot[..., :R // 2]], axis=-1)        # (T, H, R)
    return jnp.concatenate([(x_rot * cos + rotated_half * sin).astype(x.dtype), x_pass], axis=-1)


def causal_conv1d(x, window, weight, valid):  # (T, C), (W-1, C), (C, W) -> (T, C), (W-1, C)
    """Depthwise causal conv, the last tap on the current token; the returned window ends at input `valid`."""
    T, W = x.shape[0], weight.shape[1]
    padded = jnp.concatenate([window, x])                                                       # (W-1+T, C)
    # the reference's einsum over the taps, tap by tap: stacking the taps made XLA:CPU copy them with the rows of a
    # batch innermost (a tenth of a batched decode step's time outside the products)
    y = sum(padded[i:i + T].astype(f32) * weight[:, i].astype(f32) for i in range(W))           # (T, C)
    return y.astype(x.dtype), rollback.conv_window(window, x, valid)


def tree_conv1d(x, window, weight, tree):  # (N, C), (W-1, C), (C, W) -> (N, C)
    """causal_conv1d along each node's root-to-node path (reference.tree_conv1d)."""
    W = weight.shape[1]
    padded = jnp.concatenate([window, x])                                                       # (W-1+N, C)
    rows = trees.tree_conv_rows(tree, window.shape[0], W)
    y = sum(padded[rows[:, i]].astype(f32) * weight[:, i].astype(f32) for i in range(W))       # (N, C)
    return y.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# State

def empty_kv(cfg, capacity, dtype=f32):
    """An attention layer's zero KV buffers: keys (Hkv, S, Dh), values (Hkv, Dh, S)."""
    Hkv, Dh = cfg.num_key_value_heads, cfg.head_dim
    return AttnState(jnp.zeros((Hkv, capacity, Dh), dtype), jnp.zeros((Hkv, Dh, capacity), dtype))


def kv_from_reference(kv):  # the reference's (S, Hkv, Dh) keys and values -> jax_impl's layout
    return AttnState(kv.k.swapaxes(0, 1), kv.v.transpose(1, 2, 0))


def kv_to_reference(kv, n):  # jax_impl's layout -> the reference's (n, Hkv, Dh): the first n positions
    return AttnState(kv.k[:, :n].swapaxes(0, 1), kv.v[:, :, :n].transpose(2, 0, 1))


def empty_state(cfg, capacity, dtype=f32):
    """Zero state with `capacity` attention positions; DeltaNet S is fp32, conv windows and KV in the model dtype."""
    C, W = cfg.conv_dim, cfg.linear_conv_kernel_dim
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    layers = tuple(DeltaState(jnp.zeros((W - 1, C), dtype), jnp.zeros((Hv, Dk, Dv), f32))
                   if kind == "linear_attention" else empty_kv(cfg, capacity, dtype) for kind in cfg.layer_types)
    return State(layers, jnp.int32(0))


# ----------------------------------------------------------------------------------------------------------------
# Layers

def gated_deltanet(x, state, valid, cfg, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log,
                   norm, out_proj, tree=None):  # (T, D) -> (T, D), DeltaState, Tape
    """tree: the tokens are a draft tree's nodes (Tree); each node's conv window and recurrence come from its own
    path, and the returned DeltaState is the one before the pass (a tree leaves no single state: the commit
    rebuilds it, trees.TREE_STRATEGIES). A batch row whose Tree is off (a chain beside tree rows) runs the
    sequence's rules (trees.per_row)."""
    T = x.shape[0]
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv, z, b, a = matmuls(x, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)   # (T, C), (T, Hv*Dv), (T, Hv), (T, Hv)
    on = False if tree is None else tree.on
    mixed, conv = trees.per_row(on, lambda: (tree_conv1d(qkv, state.conv, conv1d[:, 0, :], tree), state.conv),
                                lambda: causal_conv1d(qkv, state.conv, conv1d[:, 0, :], valid))   # (T, C), (W-1, C)
    mixed = jax.nn.silu(mixed.astype(f32))
    q = l2norm(mixed[:, :Hk * Dk].reshape(T, Hk, Dk))                          # (T, Hk, Dk)
    k = l2norm(mixed[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk))               # (T, Hk, Dk)
    v = mixed[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)                              # (T, Hv, Dv)
    live = (jnp.arange(T) < valid)[:, None]                                    # (T, 1)  padding writes nothing
    beta = jnp.where(live, jax.nn.sigmoid(b.astype(f32)), 0)                   # (T, Hv)  write strength
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))  # (T, Hv) log decay, < 0
    g = jnp.where(live, g, 0)
    def from_parents():                                                        # each node from its parent's state
        o, delta = gated_delta_tree(q, k, v, g, beta, state.S, tree.mask)
        return o, state.S, delta

    def in_sequence():
        if T == 1:                                                             # decode: the one-step recurrence
            q1, k1 = value_head_queries_keys(q, k, Hv)
            o, S, delta = gated_delta_step(state.S, q1[0], k1[0], v[0], g[0], beta[0])
            return o[None], S, delta[None]
        return gated_delta_chunked(q, k, v, g, beta, state.S)                  # prefill, verify: chunked (T, Hv, Dv)
    o, S, delta = trees.per_row(on, from_parents, in_sequence)
    z = z.reshape(T, Hv, Dv)                                                   # (T, Hv, Dv)  output gate
    y = rms_norm_gated(o, z, norm, cfg.rms_norm_eps).reshape(T, Hv * Dv)
    return matmul(y, out_proj), DeltaState(conv, S), Tape(qkv, k, g, delta)


def gated_attention(x, state, positions, cfg, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm,
                    tree=None):  # (T, D) -> (T, D); tree: a draft tree's nodes (Tree), written from positions[0] on
    T, Hq, Hkv, Dh = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    query_gate, k, v = matmuls(x, q_proj, k_proj, v_proj)
    query_gate = query_gate.reshape(T, Hq, 2 * Dh)                # per head: [query | gate]
    q = rms_norm(query_gate[..., :Dh], q_norm, cfg.rms_norm_eps)  # (T, Hq, Dh)
    gate = query_gate[..., Dh:].reshape(T, Hq * Dh)               # (T, Hq*Dh)
    k = rms_norm(k.reshape(T, Hkv, Dh), k_norm, cfg.rms_norm_eps)  # (T, Hkv, Dh)
    v = v.reshape(T, Hkv, Dh)                                     # (T, Hkv, Dh)
    q, k = rope(q, positions, cfg.rope_theta, cfg.rotary_dim), rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
    new = kv_from_reference(AttnState(k, v))                     # (Hkv, T, Dh), (Hkv, Dh, T)
    keys = lax.dynamic_update_slice_in_dim(state.k, new.k.astype(state.k.dtype), positions[0], 1)
    values = lax.dynamic_update_slice_in_dim(state.v, new.v.astype(state.v.dtype), positions[0], 2)
    if tree is None:
        visible = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]      # (T, S) causal; hides stale positions
    else:                                                                       # the prefix and own ancestors
        row = jnp.arange(keys.shape[1]) - positions[0]                          # (S,) the node written there
        visible = (row < 0)[None, :] | (row < T)[None, :] & tree.mask[:, jnp.clip(row, 0, T - 1)]
    out = gqa_attention(q, keys, values, visible).reshape(T, Hq * Dh)           # (T, Hq*Dh)
    return matmul(out * jax.nn.sigmoid(gate), o_proj), AttnState(keys, values)


def gqa_attention(q, keys, values, visible):  # (T, Hq, Dh), (Hkv, S, Dh), (Hkv, Dh, S), (T, S) bool -> (T, Hq, Dh)
    """Softmax attention scaled by Dh^-0.5; query head h reads key/value head h // (Hq / Hkv)."""
    (T, Hq, Dh), Hkv = q.shape, keys.shape[0]
    q = q.reshape(T, Hkv, Hq // Hkv, Dh)                          # (T, Hkv, G, Dh)  GQA groups
    scores = jnp.einsum("tkgd,ksd->kgts", q, keys, preferred_element_type=f32) * f32(Dh ** -0.5)  # (Hkv, G, T, S)
    weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("kgts,kds->tkgd", weights.astype(values.dtype), values).reshape(T, Hq, Dh)


def mlp(x, gate_proj, up_proj, down_proj):  # (T, D) -> (T, D)
    gate, up = matmuls(x, gate_proj, up_proj)
    return matmul(jax.nn.silu(gate) * up, down_proj)


def sparse_moe(x, cfg, gate, experts, shared_expert, shared_expert_gate):  # (T, D) -> (T, D)
    """Softmax router, top-k renormalised, plus a gated shared expert. Each token gathers only its k experts'
    weights (e indexes the chosen ones), so a decode step reads k experts, not E."""
    top, top_weights = route(matmul(x, gate), cfg.num_experts_per_tok)       # (T, k) x2
    F = experts["down_proj"].shape[-1]                                        # moe_intermediate_size
    gate_up = jnp.einsum("td,tefd->tef", x, experts["gate_up_proj"][top])    # (T, k, 2F)  gate rows first
    y = jax.nn.silu(gate_up[..., :F]) * gate_up[..., F:]                     # (T, k, F)
    out = jnp.einsum("te,tef,tedf->td", top_weights.astype(x.dtype), y, experts["down_proj"][top])
    return out + jax.nn.sigmoid(matmul(x, shared_expert_gate)) * mlp(x, **shared_expert)


def route(logits, k):  # (T, E) router logits -> expert ids (T, k), their weights (T, k)
    """Softmax over all experts in fp32, the k most probable (ties go to the lower index), weights renormalised."""
    probs = jax.nn.softmax(logits.astype(f32), axis=-1)                     # (T, E)
    top_weights, top = lax.top_k(probs, k)
    return top, top_weights / top_weights.sum(axis=-1, keepdims=True)


def decoder_layer(x, kind, layer, state, positions, valid, cfg, tree=None):  # (T, D) -> (T, D), state, Tape or None
    h = rms_norm(x, layer["input_layernorm"], cfg.rms_norm_eps)
    if kind == "linear_attention":
        y, state, tape = gated_deltanet(h, state, valid, cfg, **layer["linear_attn"], tree=tree)
    else:
        (y, state), tape = gated_attention(h, state, positions, cfg, **layer["self_attn"], tree=tree), None
    x = x + y
    h = rms_norm(x, layer["post_attention_layernorm"], cfg.rms_norm_eps)
    return x + (sparse_moe(h, cfg, **layer["mlp"]) if cfg.is_moe else mlp(h, **layer["mlp"])), state, tape


def lm_head(params, hidden):  # (..., D) -> (..., V) fp32
    return matmul(hidden, params["lm_head"], preferred_element_type=f32)


def forward_tapped(params, cfg, tokens, state, valid=None, taps=(), tree=None):
    """forward_hidden, and the outputs of the layers `taps` (the residual stream after each) concatenated in that
    order, (T, len(taps) D): what a DFlash drafter reads (reference.forward's taps)."""
    valid = tokens.shape[0] if valid is None else valid
    positions = state.length + (jnp.arange(tokens.shape[0], dtype=jnp.int32) if tree is None else tree.depth)
    x = params["embed_tokens"][tokens]                                          # (T, D)
    layer_states, tapes, outputs = [], [], []
    for kind, layer, layer_state in zip(cfg.layer_types, params["layers"], state.layers):
        x, layer_state, tape = decoder_layer(x, kind, layer, layer_state, positions, valid, cfg, tree)
        layer_states.append(layer_state)
        tapes.append(tape)
        outputs.append(x)
    tapped = jnp.concatenate([outputs[i] for i in taps], axis=-1) if taps else None
    return (rms_norm(x, params["norm"], cfg.rms_norm_eps), State(tuple(layer_states), state.length + valid), tapes,
            tapped)


def forward_hidden(params, cfg, tokens, state, valid=None, tree=None):
    """(T,) token ids after `state` -> final-normed hidden (T, D), new State, per-layer Tapes (None for attention).
    With `tree` (Tree) the tokens are a draft tree's nodes (reference.tree_forward): the State's attention layers
    hold every node's KV in node order after the prefix, its DeltaNet layers are the ones before the pass."""
    return forward_tapped(params, cfg, tokens, state, valid, (), tree)[:3]


def forward(params, cfg, tokens, state, valid=None):
    """(T,) token ids after `state` -> logits (T, V), hidden (T, D), new State, Tapes: reference.forward's contract."""
    hidden, state, tapes = forward_hidden(params, cfg, tokens, state, valid)
    return lm_head(params, hidden), hidden, state, tapes


# ----------------------------------------------------------------------------------------------------------------
# Verify: one target pass keeping what the rollback strategy needs (rollback.py commits the kept positions).

def verify_forward(params, cfg, tokens, state, strategy):
    """One target pass over [last committed token, K drafts] -> logits (K+1, V), hidden (K+1, D), the state after
    all K+1, and what the rollback `strategy` needs: the K+1 kept states ("per-position") or the tapes ("replay")."""
    logits, hidden, after, tapes = forward(params, cfg, tokens, state)
    return logits, hidden, after, rollback.STRATEGIES[strategy].keep(state, tapes)


def tree_forward(params, cfg, tokens, parents, state):
    """One target pass over a draft tree, tokens and parents (N,) (reference.tree_forward) -> logits (N, V), hidden
    (N, D), the state after it (attention: every node's KV after the prefix; DeltaNet: the state before) and the
    per-layer Tapes (one row per node)."""
    hidden, after, tapes = forward_hidden(params, cfg, tokens, state, tree=trees.tree_of(parents))
    return lm_head(params, hidden), hidden, after, tapes


def keep_tree(strategy, before, tapes, parents):
    """What the rollback `strategy` keeps of a tree's pass (trees.TREE_STRATEGIES: per-node states, or the tapes)."""
    return trees.TREE_STRATEGIES[strategy].keep(before, tapes, trees.tree_of(parents))


# ----------------------------------------------------------------------------------------------------------------
# Jit-compiled entry points (the conformance adapter's verbs). cfg and rollback strategy names are static.

prefill = jax.jit(forward, static_argnames="cfg")


@partial(jax.jit, static_argnames="cfg", donate_argnames="state")
def decode(params, cfg, token, state):  # () token -> logits (V,), hidden (D,), State; the old state is donated
    hidden, state, _ = forward_hidden(params, cfg, token[None], state)
    return lm_head(params, hidden[0]), hidden[0], state


verify = jax.jit(verify_forward, static_argnames=("cfg", "strategy"))
commit = jax.jit(rollback.commit, static_argnames="strategy")  # (strategy, before, after, kept, n) -> State
tree_pass = jax.jit(tree_forward, static_argnames="cfg")
keep_tree_compiled = jax.jit(keep_tree, static_argnames="strategy")


def verify_tree(params, cfg, tokens, parents, state, strategy):
    """reference.verify_tree: tree_forward, then what `strategy` keeps -> logits, hidden, state after, kept. Two
    programs, so that both strategies share one compiled pass per model and tree size."""
    logits, hidden, after, tapes = tree_pass(params, cfg, tokens, parents, state)
    return logits, hidden, after, keep_tree_compiled(strategy, state, tapes, parents)


commit_tree = jax.jit(trees.commit_tree, static_argnames="strategy")  # (strategy, before, after, kept, path, n)
