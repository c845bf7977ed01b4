"""Qwen3.5 hybrid language model (Gated DeltaNet + gated attention) and exact speculative decoding, in NumPy.

This file is the executable spec. It reads top to bottom as one: the config, the primitives, the gated delta rule
(one step, the per-token loop, the chunked form), the layers and the model, sampling, then speculative decoding
(rollback, verify, acceptance, the round and the serving-trace interpreter, drafters) and generation. Loading and
validating checkpoints and the command line come last. Everything is fp32 and batch-free.

Axis legend (shape comments use these letters):
    T   tokens in this call              S   cached + new tokens (attention keys)
    D   hidden size                      V   vocabulary
    Hq  attention query heads            Hkv attention key/value heads      Dh  attention head dim
    Hk  DeltaNet key heads               Hv  DeltaNet value heads            Dk, Dv DeltaNet head dims
    C   DeltaNet conv channels (2*Hk*Dk + Hv*Dv)                             W   conv width
    E   experts                          F   FFN width                       K   draft length

The model, its weights and its pitfalls in prose: docs/architecture.md. Gated DeltaNet: Yang et al. 2024 (arXiv
2412.06464). Speculative sampling: Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318).
"""

import argparse
import contextlib
import heapq
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple

# The command line (python reference.py, qwen35-reference) decodes with one OpenBLAS thread unless told otherwise:
# batch-1 matrix-vector products are too small to share out, and on a busy 2-core machine one thread decoded 70-148
# tok/s against 28-62 with two (python -m bench.blas_threads). Set before NumPy loads OpenBLAS; a program importing
# this module keeps its own setting.
if __name__ == "__main__" or Path(sys.argv[0]).name == "qwen35-reference":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from tokenizers import Tokenizer


class UserError(Exception):
    """Bad input (model files, config, flags, prompt): the command line prints it as one line and exits 2."""


# ----------------------------------------------------------------------------------------------------------------
# Config: the model's hyperparameters, named as the Hugging Face config.json keys (checked when a config is
# loaded: "Loading and validation" below).

@dataclass(frozen=True)
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple                   # "linear_attention" (Gated DeltaNet) or "full_attention", one per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float         # RoPE rotates the first int(head_dim * factor) dims of each head
    max_position_embeddings: int
    tie_word_embeddings: bool
    intermediate_size: int = 0           # dense SwiGLU width (qwen3_5)
    num_experts: int = 0                 # MoE (qwen3_5_moe): every layer's FFN is a routed MoE + shared expert
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    eos_token_id: tuple = ()
    mtp_num_hidden_layers: int = 0       # not read by transformers; vLLM's MTP drafter uses it

    @property
    def is_moe(self):
        return self.model_type.startswith("qwen3_5_moe")

    @property
    def rotary_dim(self):
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self):
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self):
        return self.linear_num_value_heads * self.linear_value_head_dim


# ----------------------------------------------------------------------------------------------------------------
# Primitives

def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0, x)


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rms_norm(x, weight, eps):  # (..., N) -> (..., N)
    """Zero-centred RMSNorm: the checkpoint stores w, the scale is (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + weight)


def rms_norm_gated(x, z, weight, eps):  # (T, Hv, Dv), (T, Hv, Dv) -> (T, Hv, Dv)
    """DeltaNet output norm: plain weight (no +1), normalise first, then gate with SiLU(z)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight * silu(z)


def l2norm(x, eps=1e-6):  # (..., N) -> (..., N)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def rope(x, positions, theta, rotary_dim):  # (T, H, Dh), (T,) -> (T, H, Dh)
    """NeoX-style partial RoPE: dims [0, R) rotate in pairs (i, i + R/2), dims [R, Dh) pass through. The angles are
    float32, as transformers computes them; their cos and sin are taken at x's precision."""
    R = rotary_dim
    inv_freq = np.float32(theta) ** -(np.arange(0, R, 2, dtype=np.float32) / np.float32(R))   # (R/2,)
    angles = (positions.astype(np.float32)[:, None] * inv_freq).astype(x.dtype)               # (T, R/2)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]                             # (T, 1, R)
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
    x_rot, x_pass = x[..., :R], x[..., R:]
    rotated_half = np.concatenate([-x_rot[..., R // 2:], x_rot[..., :R // 2]], axis=-1)         # (T, H, R)
    return np.concatenate([x_rot * cos + rotated_half * sin, x_pass], axis=-1)


def causal_conv1d(x, window, weight):  # (T, C), (W-1, C), (C, W) -> (T, C), (W-1, C)
    """Depthwise causal conv: y_t = sum_i w[:, i] * x_{t-W+1+i}; the last tap multiplies the current token.
    `window` holds the W-1 inputs before x (zeros at the start); the returned window ends at the last input."""
    W = weight.shape[1]
    padded = np.concatenate([window, x])                                                       # (W-1+T, C)
    taps = np.lib.stride_tricks.sliding_window_view(padded, W, axis=0)                         # (T, C, W)
    return np.einsum("tcw,cw->tc", taps, weight), padded[len(padded) - (W - 1):]


# ----------------------------------------------------------------------------------------------------------------
# The gated delta rule, per value head h, with S of shape (Dk, Dv):
#     S_t = alpha_t S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - (alpha_t S_{t-1})^T k_t),   o_t = S_t^T q_t
# with alpha_t = exp(g_t). The three forms below take fla/transformers argument names (q, k, v, g, beta,
# initial_state; q and k already L2-normalised, q scaled by Dk^-0.5 inside) and all return (o, final state, delta):
# delta, the "innovation" each token writes into the state, is what tape-replay rollback records.
# Value head h reads key head h // (Hv / Hk) (grouped value attention).

def gated_delta_step(S, q, k, v, g, beta):  # (Hv, Dk, Dv), (Hv, Dk), (Hv, Dk), (Hv, Dv), (Hv,), (Hv,)
    """One token: decay the state, write the correction of what it predicts for k, read with q."""
    S = np.exp(g)[:, None, None] * S                                   # (Hv, Dk, Dv)  alpha_t S_{t-1}
    delta = beta[:, None] * (v - np.einsum("hkv,hk->hv", S, k))         # (Hv, Dv)
    S = S + np.einsum("hk,hv->hkv", k, delta)                          # (Hv, Dk, Dv)
    o = np.einsum("hkv,hk->hv", S, q)                                  # (Hv, Dv)  read after the update
    return o, S, delta


def gva_heads(x, num_value_heads):  # (T, Hk, Dk) -> (T, Hv, Dk): consecutive value heads share a key head
    return np.repeat(x, num_value_heads // x.shape[1], axis=1)


def value_head_queries_keys(q, k, num_value_heads):  # (T, Hk, Dk) x2 -> (T, Hv, Dk) x2, q scaled by Dk^-1/2
    return gva_heads(q, num_value_heads) * np.float32(q.shape[-1] ** -0.5), gva_heads(k, num_value_heads)


def gated_delta_recurrent(q, k, v, g, beta, initial_state):
    """The literal per-token loop. (T, Hk, Dk) x2, (T, Hv, Dv), (T, Hv) x2, (Hv, Dk, Dv) -> (T, Hv, Dv), S, delta."""
    q, k = value_head_queries_keys(q, k, v.shape[1])
    S, outputs, deltas = initial_state, [], []
    for t in range(len(v)):
        o, S, delta = gated_delta_step(S, q[t], k[t], v[t], g[t], beta[t])
        outputs.append(o)
        deltas.append(delta)
    return np.stack(outputs), S, np.stack(deltas)


def gated_delta_chunked(q, k, v, g, beta, initial_state, chunk_size=64):
    """The chunked (WY / UT transform) form: the same result with matrix products inside each chunk of <= 64 tokens.
    Within a chunk, with gamma_i = sum_{s<=i} g_s and Gamma_ij = exp(gamma_i - gamma_j) for i >= j:
        A     = strictly_lower(diag(beta) K K^T * Gamma)             (C, C)
        U     = (I + A)^-1 diag(beta) V                              "new values"
        Wk    = (I + A)^-1 diag(beta) diag(e^gamma) K                decayed keys that read the old state
        Delta = U - Wk S                                             the deltas of the recurrent form
        O     = diag(e^gamma) Q S + (Q K^T * Gamma) Delta
        S'    = e^gamma_last S + (diag(e^(gamma_last - gamma)) K)^T Delta
    The last chunk is simply shorter (transformers pads it with zeros instead, which changes nothing)."""
    q, k = value_head_queries_keys(q, k, v.shape[1])
    S, outputs, deltas = initial_state, [], []
    for start in range(0, len(v), chunk_size):
        Q, Kc, Vc, G, B = [x[start:start + chunk_size].swapaxes(0, 1) for x in (q, k, v, g, beta)]  # (Hv, C, ...)
        C = G.shape[1]
        lower = np.tril(np.ones((C, C), dtype=bool))                                              # i >= j
        gamma = np.cumsum(G, axis=-1)                                                             # (Hv, C)
        Gamma = np.exp(np.where(lower, gamma[:, :, None] - gamma[:, None, :], -np.inf))          # (Hv, C, C)
        A = np.tril((B[..., None] * Kc) @ Kc.swapaxes(1, 2) * Gamma, -1)                          # (Hv, C, C)
        I_plus_A = np.eye(C, dtype=A.dtype) + A
        U = np.linalg.solve(I_plus_A, B[..., None] * Vc)                                          # (Hv, C, Dv)
        Wk = np.linalg.solve(I_plus_A, (B * np.exp(gamma))[..., None] * Kc)                       # (Hv, C, Dk)
        Delta = U - Wk @ S                                                                        # (Hv, C, Dv)
        O = np.exp(gamma)[..., None] * Q @ S + (Q @ Kc.swapaxes(1, 2) * Gamma) @ Delta             # (Hv, C, Dv)
        decay_to_end = np.exp(gamma[:, -1:] - gamma)[..., None]                                   # (Hv, C, 1)
        S = np.exp(gamma[:, -1])[:, None, None] * S + (decay_to_end * Kc).swapaxes(1, 2) @ Delta   # (Hv, Dk, Dv)
        outputs.append(O.swapaxes(0, 1))
        deltas.append(Delta.swapaxes(0, 1))
    return np.concatenate(outputs), S, np.concatenate(deltas)


# ----------------------------------------------------------------------------------------------------------------
# Layers. State is an explicit value per layer; a layer returns its new state and never mutates the old one.

class DeltaState(NamedTuple):
    conv: np.ndarray     # (W-1, C)  the last W-1 pre-conv inputs
    S: np.ndarray        # (Hv, Dk, Dv)  recurrent state, fp32


class AttnState(NamedTuple):
    k: np.ndarray        # (S, Hkv, Dh)  keys after k_norm and RoPE
    v: np.ndarray        # (S, Hkv, Dh)


class Tape(NamedTuple):
    """What one DeltaNet layer logs in a multi-token pass, enough to rebuild its state after any prefix."""
    qkv: np.ndarray      # (T, C)  pre-conv inputs, to rebuild the conv window
    k: np.ndarray        # (T, Hk, Dk)  normalised keys
    g: np.ndarray        # (T, Hv)  log decays
    delta: np.ndarray    # (T, Hv, Dv)


class State(NamedTuple):
    layers: tuple        # one DeltaState or AttnState per layer
    length: int          # tokens consumed = position of the next token


def empty_state(cfg):
    C, W = cfg.conv_dim, cfg.linear_conv_kernel_dim
    Hv, Dk, Dv, Hkv, Dh = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                           cfg.num_key_value_heads, cfg.head_dim)
    layers = tuple(DeltaState(np.zeros((W - 1, C), np.float32), np.zeros((Hv, Dk, Dv), np.float32))
                   if kind == "linear_attention" else
                   AttnState(np.zeros((0, Hkv, Dh), np.float32), np.zeros((0, Hkv, Dh), np.float32))
                   for kind in cfg.layer_types)
    return State(layers, 0)


def gated_deltanet(x, state, cfg, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm,
                   out_proj, parents=None):  # (T, D) -> (T, D); parents: a draft tree's (tree_forward)
    T = x.shape[0]
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv = x @ in_proj_qkv.T                                                     # (T, C)
    if parents is None:
        mixed, conv = causal_conv1d(qkv, state.conv, conv1d[:, 0, :])           # (T, C), (W-1, C)
    else:                                                                       # windows along ancestor paths
        mixed, conv = tree_conv1d(qkv, state.conv, conv1d[:, 0, :], parents), None
    mixed = silu(mixed)
    q = l2norm(mixed[:, :Hk * Dk].reshape(T, Hk, Dk))                          # (T, Hk, Dk)
    k = l2norm(mixed[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk))               # (T, Hk, Dk)
    v = mixed[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)                              # (T, Hv, Dv)
    beta = sigmoid(x @ in_proj_b.T)                                             # (T, Hv)  write strength
    g = -np.exp(A_log) * softplus(x @ in_proj_a.T + dt_bias)                   # (T, Hv)  log decay, < 0
    if parents is None:
        rule = gated_delta_recurrent if T == 1 else gated_delta_chunked        # decode steps, prefill chunks
        o, S, delta = rule(q, k, v, g, beta, state.S)                          # (T, Hv, Dv)
    else:                                                                       # a tree leaves no single state
        (o, delta), S = gated_delta_tree_chunked(q, k, v, g, beta, state.S, parents), None
    z = (x @ in_proj_z.T).reshape(T, Hv, Dv)                                   # (T, Hv, Dv)  output gate
    y = rms_norm_gated(o, z, norm, cfg.rms_norm_eps).reshape(T, Hv * Dv)
    return y @ out_proj.T, None if S is None else DeltaState(conv, S), Tape(qkv, k, g, delta)


def gated_attention(x, state, positions, cfg, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm,
                    parents=None):  # (T, D) -> (T, D); parents: a draft tree's (tree_forward)
    T, Hq, Hkv, Dh = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    query_gate = (x @ q_proj.T).reshape(T, Hq, 2 * Dh)           # per head: [query | gate]
    q = rms_norm(query_gate[..., :Dh], q_norm, cfg.rms_norm_eps)  # (T, Hq, Dh)
    gate = query_gate[..., Dh:].reshape(T, Hq * Dh)               # (T, Hq*Dh)
    k = rms_norm((x @ k_proj.T).reshape(T, Hkv, Dh), k_norm, cfg.rms_norm_eps)  # (T, Hkv, Dh)
    v = (x @ v_proj.T).reshape(T, Hkv, Dh)                        # (T, Hkv, Dh)
    q, k = rope(q, positions, cfg.rope_theta, cfg.rotary_dim), rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
    keys, values = np.concatenate([state.k, k]), np.concatenate([state.v, v])   # (S, Hkv, Dh)
    if parents is None:
        visible = np.arange(len(keys))[None, :] <= positions[:, None]           # (T, S) causal
    else:                                                                       # the prefix and own ancestors
        visible = np.concatenate([np.ones((T, len(state.k)), bool), ancestor_mask(parents)], axis=1)
    out = gqa_attention(q, keys, values, visible).reshape(T, Hq * Dh)           # (T, Hq*Dh)
    return (out * sigmoid(gate)) @ o_proj.T, AttnState(keys, values)


def gqa_attention(q, keys, values, visible):  # (T, Hq, Dh), (S, Hkv, Dh) x2, (T, S) bool -> (T, Hq, Dh)
    """Softmax attention scaled by Dh^-0.5; query head h reads key/value head h // (Hq / Hkv)."""
    (T, Hq, Dh), Hkv = q.shape, keys.shape[1]
    q = q.reshape(T, Hkv, Hq // Hkv, Dh)                          # (T, Hkv, G, Dh)  GQA groups
    scores = np.einsum("tkgd,skd->kgts", q, keys) * np.float32(Dh ** -0.5)      # (Hkv, G, T, S)
    weights = softmax(np.where(visible, scores, -np.inf))
    return np.einsum("kgts,skd->tkgd", weights, values).reshape(T, Hq, Dh)


def mlp(x, gate_proj, up_proj, down_proj):  # (T, D) -> (T, D)
    return (silu(x @ gate_proj.T) * (x @ up_proj.T)) @ down_proj.T


def sparse_moe(x, cfg, gate, experts, shared_expert, shared_expert_gate):  # (T, D) -> (T, D)
    """Softmax router over E experts, top-k renormalised, plus a shared expert behind a sigmoid gate."""
    top, top_weights = route(x @ gate.T, cfg.num_experts_per_tok)            # (T, k) x2
    out = np.zeros_like(x)
    F = experts["down_proj"].shape[-1]       # moe_intermediate_size (a partial-MLP drafter keeps fewer)
    for e in np.unique(top):
        rows, slot = np.nonzero(top == e)
        gate_up = x[rows] @ experts["gate_up_proj"][e].T                      # (n, 2F)  gate rows first
        y = (silu(gate_up[:, :F]) * gate_up[:, F:]) @ experts["down_proj"][e].T
        out[rows] += top_weights[rows, slot, None] * y
    return out + sigmoid(x @ shared_expert_gate.T) * mlp(x, **shared_expert)


def route(logits, k):  # (T, E) router logits -> expert ids (T, k), their weights (T, k)
    """Softmax over all experts, the k most probable (ties: the lower expert id first), weights renormalised."""
    probs = softmax(logits)                                                  # (T, E)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]                  # (T, k)
    top_weights = np.take_along_axis(probs, top, axis=-1)
    return top, top_weights / top_weights.sum(axis=-1, keepdims=True)


def token_mixer(x, kind, layer, state, positions, cfg, parents=None):  # (T, D) -> (T, D) update, layer state, Tape
    h = rms_norm(x, layer["input_layernorm"], cfg.rms_norm_eps)
    if kind == "linear_attention":
        return gated_deltanet(h, state, cfg, **layer["linear_attn"], parents=parents)
    return (*gated_attention(h, state, positions, cfg, **layer["self_attn"], parents=parents), None)  # KV: no tape


def feed_forward(x, layer, cfg):  # (T, D) -> (T, D) its update
    h = rms_norm(x, layer["post_attention_layernorm"], cfg.rms_norm_eps)
    return sparse_moe(h, cfg, **layer["mlp"]) if cfg.is_moe else mlp(h, **layer["mlp"])


def decoder_layer(x, kind, layer, state, positions, cfg, parents=None):  # (T, D) -> (T, D), layer state, Tape
    y, state, tape = token_mixer(x, kind, layer, state, positions, cfg, parents)
    x = x + y
    return x + feed_forward(x, layer, cfg), state, tape


def forward(params, cfg, tokens, state, taps=None, parents=None):
    """(T,) token ids after `state` -> logits (T, V), hidden, new State, per-layer Tapes. hidden: the final-normed
    hidden state (T, D) (what the MTP head reads); with taps (layer indices), the outputs of those layers (the
    residual stream after each) concatenated in the order given, (T, len(taps) D) (what a DFlash drafter reads).
    With `parents` the tokens are a draft tree's nodes (tree_forward below) and the State's DeltaNet layers are None."""
    tokens = np.asarray(tokens, dtype=np.int64)
    positions = state.length + (np.arange(len(tokens)) if parents is None else tree_depths(parents))
    x = params["embed_tokens"][tokens]                                          # (T, D)
    layer_states, tapes, tapped = [], [], {}
    for i, (kind, layer, layer_state) in enumerate(zip(cfg.layer_types, params["layers"], state.layers)):
        x, layer_state, tape = decoder_layer(x, kind, layer, layer_state, positions, cfg, parents)
        layer_states.append(layer_state)
        tapes.append(tape)
        if taps and i in taps:
            tapped[i] = x
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)                     # (T, D)
    features = hidden if taps is None else np.concatenate([tapped[i] for i in taps], axis=-1)
    return hidden @ params["lm_head"].T, features, State(tuple(layer_states), state.length + len(tokens)), tapes


# ----------------------------------------------------------------------------------------------------------------
# Sampling. Randomness is explicit: callers pass uniforms drawn from a seeded np.random.Generator.

class Sampling(NamedTuple):
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off


def sampling_of(settings):  # {"temperature", "top_k", "top_p"}, any of them missing: its default -> Sampling
    return Sampling(**{field: settings[field] for field in Sampling._fields if field in settings})


def probabilities(logits, sampling):  # (..., V) -> (..., V)
    """The distribution a token is drawn from: temperature, then top-k, then top-p (as transformers orders them).
    Temperature 0 puts all the mass on the argmax."""
    if sampling.temperature == 0:
        return (np.arange(logits.shape[-1]) == logits.argmax(axis=-1)[..., None]).astype(np.float32)
    p = softmax(logits / np.float32(sampling.temperature))
    if sampling.top_k:
        kth_largest = np.sort(p, axis=-1)[..., -min(sampling.top_k, p.shape[-1]), None]
        p = np.where(p >= kth_largest, p, 0)
        p /= p.sum(axis=-1, keepdims=True)
    if sampling.top_p < 1:  # keep the smallest top set whose mass reaches top_p
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep = np.empty_like(p, dtype=bool)
        np.put_along_axis(keep, order, np.cumsum(sorted_p, axis=-1) - sorted_p < sampling.top_p, axis=-1)
        p = np.where(keep, p, 0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def sample(p, u):  # (V,), uniform in [0, 1) -> token id
    """Inverse-CDF sampling: the token whose cumulative-probability interval contains u."""
    cdf = np.cumsum(p)
    # u * total rounds to the total itself for u just below 1; searchsorted would then point past the last token
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(p) - 1))


# ----------------------------------------------------------------------------------------------------------------
# Speculative decoding. A round: the drafter proposes K tokens; one target pass (verify) runs on the last committed
# token plus the K drafts, giving K+1 next-token distributions; acceptance keeps n-1 drafts plus one token of the
# target's; the state must then equal the state after the n kept positions. Attention KV truncates. A DeltaNet state
# has already absorbed all K+1 positions, so it is rebuilt by one of two exact strategies:
#   per-position: at verify time, keep the state and conv window after every position; commit is an index
#                 (vLLM, SGLang). Extra memory: K+1 states per layer.
#   replay:       keep the tape (delta, k, g, qkv) of the verify pass; on a partial accept, start again from the
#                 pre-verify state and apply only rank-1 updates S <- alpha S + k delta^T for the kept steps
#                 (dflash-mlx). No q, no outputs, no model forward. Full acceptance needs no replay.
# ROLLBACK (below) is the table of strategies: what verify keeps, how commit rebuilds (TREE_ROLLBACK: over a tree).


def delta_states(S0, tape):  # (Hv, Dk, Dv), Tape of T steps -> (T, Hv, Dk, Dv)
    """The state after each step, in closed form: S_t = e^gamma_t S_0 + sum_{j<=t} e^(gamma_t - gamma_j) k_j delta_j^T."""
    T, Hv = tape.g.shape
    k = np.repeat(tape.k, Hv // tape.k.shape[1], axis=1)                                    # (T, Hv, Dk)
    gamma = np.cumsum(tape.g, axis=0)                                                       # (T, Hv)
    lower = np.tril(np.ones((T, T), dtype=bool))[..., None]
    decay = np.exp(np.where(lower, gamma[:, None] - gamma[None, :], -np.inf))              # (T, T, Hv)
    return np.exp(gamma)[..., None, None] * S0 + np.einsum("tjh,jhk,jhv->thkv", decay, k, tape.delta)


def replay(S0, tape, n):  # (Hv, Dk, Dv), Tape, steps -> (Hv, Dk, Dv)
    """Rebuild the state after n steps from the tape: decay and rank-1 updates only."""
    k = np.repeat(tape.k, tape.g.shape[1] // tape.k.shape[1], axis=1)                       # (T, Hv, Dk)
    S = S0
    for t in range(n):
        S = np.exp(tape.g[t])[:, None, None] * S + np.einsum("hk,hv->hkv", k[t], tape.delta[t])
    return S


def conv_window(window, qkv, n):  # (W-1, C), (T, C) -> (W-1, C): the conv window after the first n of T steps
    return np.concatenate([window, qkv[:n]])[n:]


def conv_windows(window, qkv):  # (W-1, C), (T, C) -> (T, W-1, C): the conv window after each step
    return np.stack([conv_window(window, qkv, n) for n in range(1, len(qkv) + 1)])


def truncate(attn, length):
    return AttnState(attn.k[:length], attn.v[:length])


class KeptStates(NamedTuple):
    """Per-position strategy: one DeltaNet layer's state after each of the T verified positions."""
    conv: np.ndarray     # (T, W-1, C)
    S: np.ndarray        # (T, Hv, Dk, Dv)


def keep_per_position(before, tapes):
    """Per-position strategy, at verify time: every DeltaNet layer's KeptStates (None for attention layers)."""
    return [None if tape is None else KeptStates(conv_windows(layer.conv, tape.qkv), delta_states(layer.S, tape))
            for layer, tape in zip(before.layers, tapes)]


def commit_per_position(before, after, kept, n):
    """Keep the first n verified positions: an index into the kept states."""
    layers = tuple(truncate(a, before.length + n) if k is None else DeltaState(k.conv[n - 1], k.S[n - 1])
                   for a, k in zip(after.layers, kept))
    return State(layers, before.length + n)


def commit_replay(before, after, tapes, n):
    """Keep the first n verified positions: replay the tape from the pre-verify state (skipped on full accept)."""
    if n == after.length - before.length:            # everything accepted: the verify pass left the right state
        return after
    layers = tuple(truncate(a, before.length + n) if t is None else
                   DeltaState(conv_window(b.conv, t.qkv, n), replay(b.S, t, n))
                   for b, a, t in zip(before.layers, after.layers, tapes))
    return State(layers, before.length + n)


class Rollback(NamedTuple):
    """A rollback strategy: what a verify pass keeps (from the state before it and its tapes), and how commit
    rebuilds the state after the kept positions from that."""
    keep: Callable       # (before, tapes) -> per layer what is kept (None for attention layers)
    commit: Callable     # (before, after, kept, n) -> State


ROLLBACK = {"per-position": Rollback(keep_per_position, commit_per_position),
            "replay": Rollback(lambda before, tapes: tapes, commit_replay)}
ROLLBACK_STRATEGIES = tuple(ROLLBACK)


class Verified(NamedTuple):
    """A verify pass waiting for its commit: the states around it and what its rollback strategy kept."""
    before: State
    after: State
    kept: list           # per layer: KeptStates (per-position) or the Tape (replay); None for attention layers
    rollback: str


def verify(params, cfg, state, tokens, rollback, taps=None):  # (K+1,) -> logits (K+1, V), hidden, Verified
    """One target pass over [last committed token, K drafts], keeping what `rollback` needs to commit any prefix.
    hidden: forward's, (K+1, D) or with taps the tapped layers' outputs (K+1, len(taps) D)."""
    logits, hidden, after, tapes = forward(params, cfg, tokens, state, taps)
    return logits, hidden, Verified(state, after, ROLLBACK[rollback].keep(state, tapes), rollback)


def commit(verified, n):  # Verified, 1 <= n <= K+1 -> State after the first n verified positions
    return ROLLBACK[verified.rollback].commit(verified.before, verified.after, verified.kept, n)


def accept_greedy(draft, logits):  # (K,), (K+1, V) -> (accepted drafts, next token)
    """Longest prefix of the draft equal to the target's argmax, then the target's own next token."""
    target = logits.argmax(axis=-1)
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n, int(target[n])


def acceptance(p_x, q_x):  # the chance that speculative sampling keeps a draft x: min(1, p(x) / q(x))
    return min(1.0, p_x / q_x)


def residual(p_i, q_i):  # (V,), (V,) -> (V,) unnormalised
    """What a rejected position's token is drawn from: max(0, p_i - q_i) (sample() normalises). It is all zero only if
    p_i <= q_i everywhere, i.e. p_i == q_i: then the draft is accepted with probability 1 and only rounding rejects
    it; p_i is then the right distribution to draw from."""
    leftover = np.maximum(p_i - q_i, 0)
    return leftover if leftover.sum() > 0 else p_i


def accept_speculative(draft, q, p, u):  # (K,), (K, V), (K+1, V), (K+1,) uniforms -> (accepted drafts, next token)
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1): accept draft x_i with probability
    min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from normalize(max(0, p_i - q_i)); if all K are
    accepted, sample a bonus token from p_K. The output is distributed exactly as p. u[i] decides draft i;
    u[K] draws the final token."""
    K = len(draft)
    for i, x in enumerate(draft):
        if not u[i] < acceptance(p[i, x], q[i, x]):
            return i, sample(residual(p[i], q[i]), u[K])
    return K, sample(p[K], u[K])


def round_outcomes(kept, draws, bonus):  # (K,) acceptance chances, K draw distributions (V,), (V,) -> (K+1, V)
    """The exact distribution of a round's outcome when draft i is kept with chance kept[i], the token after the
    first rejected draft i is drawn from draws[i] and after K accepted drafts from bonus: entry [n, t] is the
    probability of accepting exactly n drafts and then drawing t. Rows sum to the chance of stopping there."""
    reach = np.cumprod(np.concatenate([[1.0], kept]))              # the chance of getting to draft i
    rows = [reach[i] * (1 - a) * d / d.sum() for i, (a, d) in enumerate(zip(kept, draws))]
    return np.stack(rows + [reach[-1] * bonus / bonus.sum()])


def speculative_outcomes(draft, q, p):  # (K,), (K, V), (K+1, V) -> (K+1, V)
    """accept_speculative's outcome (accepted drafts, next token) over independent uniforms, in closed form (the
    conformance suite's statistical pack compares engines drawing with their own random numbers against it)."""
    return round_outcomes([acceptance(p[i, x], q[i, x]) for i, x in enumerate(draft)],
                          [residual(p[i], q[i]) for i in range(len(draft))], p[len(draft)])


def accept(draft, q, logits, sampling, u):  # -> (accepted drafts, the target's next token)
    """Greedy acceptance at temperature 0, speculative sampling otherwise (q and u are then required)."""
    if sampling.temperature == 0:
        return accept_greedy(draft, logits)
    return accept_speculative(draft, q, probabilities(logits, sampling), u)


def until_stop(tokens, stop):  # committed tokens end at the first stop (EOS) token among them
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
    return tokens[:end]


def finished(committed, stop):  # a request is finished when its committed tokens end at a stop token -> 0 or 1
    return int(bool(committed) and committed[-1] in stop)


# A round, and a serving trace of many, run against a Target: the model being decoded as pure functions over its
# explicit state. reference_target is this file's; the conformance runner wraps an engine under test in one.

class Target(NamedTuple):
    extend: Callable     # (state or None, tokens (T,)) -> logits (T, V), state   (None: a new request's prefill)
    verify: Callable     # (state, tokens (K+1,)) -> logits (K+1, V), hidden (K+1, D) or None, pending commit
    commit: Callable     # (pending, n) -> the state after the first n verified positions
    accept: Callable     # (draft (K,), q (K, V), logits (K+1, V), Sampling, u (K+1,)) -> accepted, next token
    copy: Callable       # state -> a copy that later calls cannot change (a prefix-cache entry)
    # draft trees (tree_round): None for a target that verifies chains only
    verify_tree: Callable = None   # (state, tokens (N,), parents (N,)) -> logits (N, V), hidden or None, pending
    commit_tree: Callable = None   # (pending, path [0, ..., L]) -> the state after consuming the path
    accept_tree: Callable = None   # (tokens, parents, q (N-1, V), logits (N, V), Sampling, u (N,)) -> path, next token


def reference_target(params, cfg, rollback, taps=None):
    def extend(state, tokens):
        logits, _, state, _ = forward(params, cfg, tokens, empty_state(cfg) if state is None else state)
        return logits, state
    return Target(extend, lambda state, tokens: verify(params, cfg, state, tokens, rollback, taps), commit, accept,
                  lambda state: state,   # states are values here: nothing ever changes one
                  lambda state, tokens, parents: verify_tree(params, cfg, state, tokens, parents, rollback, taps),
                  commit_tree, accept_tree)


class Round(NamedTuple):
    logits: np.ndarray   # (K+1, V) of the verify pass
    hidden: object       # (K+1, D) final-normed hidden states (the MTP head reads them), or None
    accepted: int        # accepted drafts (None when the trace forced the kept positions)
    committed: list      # accepted drafts and the target's token, ending at a stop token (None when forced)
    state: object        # after the kept positions: every committed token consumed but the last


def speculative_round(target, state, tokens, q, sampling, u, stop=(), keep=None):
    """Verify [last committed token, K drafts] in one target pass, accept, and roll the state back to the positions
    the committed tokens came from. keep: a forced number of positions to keep instead of the acceptance decision."""
    logits, hidden, pending = target.verify(state, tokens)
    accepted = committed = None
    if keep is None:
        accepted, token = target.accept(list(tokens[1:]), q, logits, sampling, u)
        committed = until_stop(list(tokens[1:accepted + 1]) + [token], stop)
        keep = len(committed)
    return Round(logits, hidden, accepted, committed, target.commit(pending, keep))


class TreeRound(NamedTuple):
    logits: np.ndarray   # (N, V) of the tree's verify pass
    hidden: object       # (N, D) or None, as Round's
    path: list           # the accepted path [0, ..., L] (None when the trace forced the committed path)
    committed: list      # the path's drafts and the target's token, ending at a stop token (None when forced)
    state: object        # after the committed path's nodes


def tree_round(target, state, tokens, parents, q, sampling, u, stop=(), path=None):
    """speculative_round over a draft tree (tokens (N,) with the root = the last committed token, parents (N,)): one
    target pass, accept a root-to-node path, commit the nodes the committed tokens came from. path: a forced path to
    commit instead of the acceptance decision."""
    logits, hidden, pending = target.verify_tree(state, tokens, parents)
    accepted = committed = None
    if path is None:
        accepted, token = target.accept_tree(tokens, parents, q, logits, sampling, u)
        committed = until_stop([int(tokens[node]) for node in accepted[1:]] + [token], stop)
        path = accepted[:len(committed)]
    return TreeRound(logits, hidden, accepted, committed, target.commit_tree(pending, path))


def trace_row(target, state, step):
    """A trace's verify step (a chain of drafts, or none: a plain decoding row) or verify_tree step, and its commit,
    from its request's state -> the step's outputs: logits, the decision (accepted drafts or the accepted path,
    committed tokens, whether the request has finished; none when forced) and the state."""
    rule = step["commit"]
    decide = (rule.get("q"), sampling_of(rule), rule.get("uniforms"), rule.get("stop", ()))
    if step["op"] == "verify":
        r = speculative_round(target, state, step["tokens"], *decide, rule.get("keep"))
        decision = {"accepted": r.accepted}
    else:
        r = tree_round(target, state, step["tokens"], step["parents"], *decide, rule.get("path"))
        decision = {"path": r.path}
    out = {"logits": r.logits, "state": r.state}
    if r.committed is not None:
        out.update(decision, committed=r.committed, finished=finished(r.committed, rule.get("stop", ())))
    return out


def run_trace(target, batches):
    """A serving trace (conformance/INTERPRETING.md, section 4): batches of steps on named requests, run in order.
    Requests map to states and prefix-cache keys to copies of them. Yields (batch, step, outputs) after each step:
    prefill -> the last row's logits; verify or verify_tree (and its commit) -> logits, decisions (accepted drafts or
    the accepted path, committed tokens, whether the request has finished), state; restore -> state."""
    requests, cache = {}, {}
    for b, batch in enumerate(batches):
        for s, step in enumerate(batch):
            name, op, out = step["request"], step["op"], {}
            if op == "prefill":               # a new request, or the next chunk of its prompt
                logits, requests[name] = target.extend(requests.get(name), step["tokens"])
                out["logits"] = logits[-1:]
            elif op in ("verify", "verify_tree"):
                out = trace_row(target, requests[name], step)
                requests[name] = out["state"]
            elif op == "snapshot":
                cache[step["key"]] = target.copy(requests[name])
            elif op == "restore":             # a new request starting from a prefix-cache entry
                requests[name] = out["state"] = target.copy(cache[step["key"]])
            elif op == "release":
                del requests[name]
            else:
                raise ValueError(f"trace step {b}.{s}: unknown op {op!r}")
            yield b, s, out


# ----------------------------------------------------------------------------------------------------------------
# Tree verification. A round may verify a tree of drafts instead of a chain: N nodes as tokens (N,) and parents
# (N,), topologically ordered (parents[i] < i), node 0 the root = the last committed token (parents[0] = -1). One
# target pass computes every node's next-token distribution as if its root-to-node path had been decoded alone:
#   DeltaNet:  each node's recurrence starts from its parent's state (root: the committed state); the chunked form
#              replaces the chain's strictly-lower mask by the proper-ancestor mask and the cumulative decay by the
#              sum along the path. Entries of (I + A)^-1 across branches are zero, so a chain is the chain's form.
#   conv:      each node's window is its ancestors' inputs, padded above the root by the committed window.
#   attention: a node sees the whole prefix, its ancestors and itself, at position prefix length + depth.
# Acceptance walks down from the root and yields the accepted path (root first); only that path is committed, with
# the two rollback strategies of the chain: per-node states kept at verify time, or the path's tape replayed from
# the pre-verify state. A chain (parents = -1, 0, 1, ...) is exactly the chain round. docs/trees.md has more.

def check_tree(parents):  # (N,) -> (N,) ints, or UserError
    parents = [int(p) for p in parents]
    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise UserError(f"draft tree parents {parents}: node 0 is the root (-1), every other node's parent precedes it")
    return parents


def tree_depths(parents):  # (N,) -> (N,): the root 0
    depth = np.zeros(len(parents), np.int64)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def tree_path(parents, node):  # -> [0, ..., node]: the root-to-node path
    path = [node]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return path[::-1]


def tree_children(parents, node):  # -> the node's children, in node order
    return [i for i in range(1, len(parents)) if parents[i] == node]


def ancestor_mask(parents):  # (N,) -> (N, N) bool: P[i, j] = j is i or an ancestor of i
    P = np.zeros((len(parents), len(parents)), bool)
    for i in range(len(parents)):
        P[i, tree_path(parents, i)] = True
    return P


def tree_conv_windows(window, x, parents, width):  # (W-1, C), (N, C) -> (N, width, C)
    """The last `width` conv inputs at each node: its path's inputs after the committed window."""
    return np.stack([np.concatenate([window, x[tree_path(parents, i)]])[-width:] for i in range(len(x))])


def tree_conv1d(x, window, weight, parents):  # (N, C), (W-1, C), (C, W) -> (N, C)
    """causal_conv1d along each node's root-to-node path."""
    return np.einsum("nwc,cw->nc", tree_conv_windows(window, x, parents, weight.shape[1]), weight)


def gated_delta_tree_recurrent(q, k, v, g, beta, initial_state, parents):
    """The readable definition: gated_delta_step from the parent's state. (N, Hk, Dk) x2, (N, Hv, Dv), (N, Hv) x2,
    (Hv, Dk, Dv) -> o (N, Hv, Dv), delta (N, Hv, Dv), every node's state (N, Hv, Dk, Dv)."""
    q, k = value_head_queries_keys(q, k, v.shape[1])
    states, outputs, deltas = [], [], []
    for i, parent in enumerate(parents):
        o, S, delta = gated_delta_step(initial_state if parent < 0 else states[parent], q[i], k[i], v[i], g[i], beta[i])
        states.append(S)
        outputs.append(o)
        deltas.append(delta)
    return np.stack(outputs), np.stack(deltas), np.stack(states)


def gated_delta_tree_chunked(q, k, v, g, beta, initial_state, parents):
    """gated_delta_chunked over a tree in one chunk, with P the inclusive ancestor mask:
    prefix_i = sum of g over P[i] (the path's decay) and Gamma_ij = exp(prefix_i - prefix_j) where P[i, j]:
        A     = diag(beta) K K^T * Gamma on proper ancestors (P minus the diagonal)
        Delta = (I + A)^-1 diag(beta) (V - diag(e^prefix) K S)
        O     = diag(e^prefix) Q S + (Q K^T * Gamma) Delta
    -> o (N, Hv, Dv), delta (N, Hv, Dv). Node states: tree_delta_states."""
    q, k = value_head_queries_keys(q, k, v.shape[1])
    Q, Kn, Vn, G, B = [x.swapaxes(0, 1) for x in (q, k, v, g, beta)]                           # (Hv, N, ...)
    P = ancestor_mask(parents)                                                                 # (N, N)
    prefix = G @ P.T.astype(G.dtype)                                                           # (Hv, N)
    Gamma = np.exp(np.where(P, prefix[:, :, None] - prefix[:, None, :], -np.inf))             # (Hv, N, N)
    A = np.where(P & ~np.eye(len(P), dtype=bool), (B[..., None] * Kn) @ Kn.swapaxes(1, 2) * Gamma, 0)
    S = initial_state
    Delta = np.linalg.solve(np.eye(len(P), dtype=A.dtype) + A,
                            B[..., None] * (Vn - np.exp(prefix)[..., None] * Kn @ S))          # (Hv, N, Dv)
    O = np.exp(prefix)[..., None] * Q @ S + (Q @ Kn.swapaxes(1, 2) * Gamma) @ Delta           # (Hv, N, Dv)
    return O.swapaxes(0, 1), Delta.swapaxes(0, 1)


def tree_delta_states(S0, tape, parents):  # (Hv, Dk, Dv), Tape of N nodes -> (N, Hv, Dk, Dv)
    """Every node's state from the tape (the fold): S_i = e^prefix_i S_0 + sum_{j on i's path} e^(prefix_i - prefix_j)
    k_j delta_j^T; delta_states with the path in place of the prefix."""
    Hv = tape.g.shape[1]
    k = np.repeat(tape.k, Hv // tape.k.shape[1], axis=1)                                    # (N, Hv, Dk)
    P = ancestor_mask(parents)[..., None]                                                   # (N, N, 1)
    prefix = (P * tape.g[None]).sum(axis=1)                                                 # (N, Hv)
    decay = np.exp(np.where(P, prefix[:, None] - prefix[None, :], -np.inf))                # (N, N, Hv)
    return np.exp(prefix)[..., None, None] * S0 + np.einsum("ijh,jhk,jhv->ihkv", decay, k, tape.delta)


def tree_forward(params, cfg, tokens, parents, state, taps=None):
    """One pass over a draft tree after `state` -> logits (N, V), hidden (N, D) (with taps: those layers' outputs,
    as forward), the State (attention: the prefix and every node's KV in node order; DeltaNet: None) and per-layer
    Tapes (one row per node)."""
    return forward(params, cfg, tokens, state, taps, parents=check_tree(parents))


class VerifiedTree(NamedTuple):
    """A tree's verify pass waiting for its commit (Verified's counterpart)."""
    before: State
    after: State
    kept: list           # per layer: KeptStates per node (per-position) or the Tape (replay); None for attention
    rollback: str
    parents: list


def keep_per_node(before, tapes, parents):
    """Per-position strategy over a tree: every node's conv window and state (None for attention layers)."""
    return [None if tape is None else KeptStates(tree_conv_windows(layer.conv, tape.qkv, parents, len(layer.conv)),
                                                 tree_delta_states(layer.S, tape, parents))
            for layer, tape in zip(before.layers, tapes)]


def commit_path_per_position(before, kept, path):  # a DeltaNet layer: the last accepted node's kept state
    return DeltaState(kept.conv[path[-1]], kept.S[path[-1]])    # index by the node, not by the path length


def commit_path_replay(before, tape, path):  # a DeltaNet layer: the path's tape rows replayed from before
    tape, n = Tape(*(x[path] for x in tape)), len(path)
    return DeltaState(conv_window(before.conv, tape.qkv, n), replay(before.S, tape, n))


# ROLLBACK's strategies over a tree: keep (before, tapes, parents) -> kept; commit (a DeltaNet layer's state before,
# what was kept for it, the accepted path) -> its DeltaState after the path
TREE_ROLLBACK = {"per-position": Rollback(keep_per_node, commit_path_per_position),
                 "replay": Rollback(lambda before, tapes, parents: tapes, commit_path_replay)}


def verify_tree(params, cfg, state, tokens, parents, rollback, taps=None):  # -> logits (N, V), hidden, VerifiedTree
    logits, hidden, after, tapes = tree_forward(params, cfg, tokens, parents, state, taps)
    kept = TREE_ROLLBACK[rollback].keep(state, tapes, parents)
    return logits, hidden, VerifiedTree(state, after, kept, rollback, list(parents))


def commit_tree(verified, path):  # VerifiedTree, accepted path [0, ..., L] -> State after consuming the path
    """Keep the path: attention keeps the prefix and the path's KV rows; a DeltaNet layer is rebuilt by the
    strategy (TREE_ROLLBACK) from what verify kept."""
    before, n = verified.before, len(path)
    rows, layers = before.length + np.asarray(path), []
    for b, a, kept in zip(before.layers, verified.after.layers, verified.kept):
        if kept is None:
            layers.append(AttnState(np.concatenate([a.k[:before.length], a.k[rows]]),
                                    np.concatenate([a.v[:before.length], a.v[rows]])))
        else:
            layers.append(TREE_ROLLBACK[verified.rollback].commit(b, kept, path))
    return State(tuple(layers), before.length + n)


def accept_tree_greedy(tokens, parents, logits):  # (N,), (N,), (N, V) -> (accepted path, next token)
    """From the root, move to the first child carrying the target's argmax while there is one."""
    path = [0]
    while True:
        target = int(logits[path[-1]].argmax())
        child = next((c for c in tree_children(parents, path[-1]) if tokens[c] == target), None)
        if child is None:
            return path, target
        path.append(child)


def accept_tree_speculative(tokens, parents, q, p, u):  # q (N-1, V), p (N, V), u (N,) -> (accepted path, next token)
    """Multi-draft speculative sampling (recursive rejection over siblings; SpecInfer, Miao et al. 2023): at a node
    with distribution p', try its children in order: child c (token x drawn from q[c-1]) is accepted with chance
    min(1, p'(x) / q[c-1](x)), uniform u[c-1]; a rejection replaces p' by normalize(max(0, p' - q[c-1])) for the next
    sibling. When no child is accepted the next token is drawn from p' with u[N-1]. Exact when siblings are drawn
    independently from their q (one-hot q: deterministic drafts such as top-k, then p' is p with the tried tokens
    removed). On a chain it is accept_speculative, to the bit."""
    path = [0]
    while True:
        target = p[path[-1]]
        for j, c in enumerate(tree_children(parents, path[-1])):
            if j:                                     # the previous sibling's residual, normalised
                target = target / target.sum()
            if u[c - 1] < acceptance(target[tokens[c]], q[c - 1, tokens[c]]):
                path.append(c)
                break
            target = residual(target, q[c - 1])
        else:
            return path, sample(target, u[len(tokens) - 1])


def tree_outcomes(tokens, parents, q, p):  # (N,), (N,), (N-1, V), (N, V) -> (N, V)
    """accept_tree_speculative's outcome over independent uniforms, in closed form: entry [L, t] is the chance that
    the accepted path ends at node L and t is drawn next (round_outcomes' rows, indexed by the last accepted node)."""
    reach, rows = np.zeros(len(tokens)), [None] * len(tokens)
    reach[0] = 1.0
    for node in range(len(tokens)):
        target, stay = p[node], reach[node]
        for j, c in enumerate(tree_children(parents, node)):
            if j:
                target = target / target.sum()
            kept = acceptance(target[tokens[c]], q[c - 1, tokens[c]])
            reach[c] = stay * kept
            stay *= 1 - kept
            target = residual(target, q[c - 1])
        rows[node] = stay * target / target.sum()
    return np.stack(rows)


def accept_tree(tokens, parents, q, logits, sampling, u):  # -> (accepted path, the target's next token)
    if sampling.temperature == 0:
        return accept_tree_greedy(tokens, parents, logits)
    return accept_tree_speculative(tokens, parents, q, probabilities(logits, sampling), u)


# Drafters. A drafter is a pure function over its own explicit state:
#   propose(draft_state, context, new_hidden, k, sampling, rng) -> (tokens (k',), q (k', V), draft_state), k' <= k
# `context` holds every committed token; the target has consumed all but the last. `new_hidden` (n, D) holds the
# target's final-normed hidden states of the n positions verified since the previous call (the MTP head reads them);
# for a drafter with taps, the outputs of those target layers instead, (n, len(taps) D) (a DFlash drafter).
# A self-speculative drafter (the target's own weights, cheapened) also has observe(draft_state, target_state) ->
# draft_state, called before each propose with a copy of the target's committed state: it drafts from there.

class Drafter(NamedTuple):
    name: str
    initial_state: object
    propose: Callable
    observe: Callable = None
    taps: tuple = None   # target layers whose outputs new_hidden holds (None: the final-normed hidden state)


def checked_propose(drafter, cfg):  # -> the drafter's propose, with what it returns checked
    """Drafts must be at most k ids in the vocabulary and, under sampling, come with a q (k', V) of distributions
    giving each drafted token a probability > 0 (speculative sampling divides by it)."""
    def propose(draft_state, context, new_hidden, k, sampling, rng):
        draft, q, draft_state = drafter.propose(draft_state, context, new_hidden, k, sampling, rng)
        draft = [int(t) for t in draft]
        if len(draft) > k or any(not 0 <= t < cfg.vocab_size for t in draft):
            raise UserError(f"drafter {drafter.name} proposed {draft} for k={k}: ids must be in [0, {cfg.vocab_size})")
        if sampling.temperature and (np.shape(q) != (len(draft), cfg.vocab_size) or
                                     any(q[i, t] <= 0 for i, t in enumerate(draft))):
            raise UserError(f"drafter {drafter.name}: q must be ({len(draft)}, {cfg.vocab_size}) distributions giving "
                            f"each proposed token a probability > 0")
        return draft, q, draft_state
    return propose


def one_hot(tokens, V):  # (k,) -> (k, V)
    return (np.asarray(tokens)[:, None] == np.arange(V)).astype(np.float32)


def prompt_lookup(context, k, max_ngram=3):
    """Copy from the context: find the longest suffix (<= max_ngram tokens) that occurred before, and propose what
    followed it: the latest occurrence followed by k tokens, else the occurrence followed by the most."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        suffix, best = context[-n:], []
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                best = max(best, context[start + n:start + n + k], key=len)
                if len(best) == k:
                    break
        if best:
            return best
    return []


def ngram_drafter(V, table=None):
    """Copy from the context (prompt lookup); else the offline n-gram table. q is one-hot."""
    def propose(draft_state, context, new_hidden, k, sampling, rng):
        tokens = prompt_lookup(context, k)
        if not tokens and table and len(context) >= table["n"]:
            tokens = table["table"].get(" ".join(map(str, context[-table["n"]:])), [])[:k]
        return list(tokens), one_hot(tokens, V), draft_state
    return Drafter("ngram", None, propose)


def draw(logits, sampling, rng):  # (V,) -> token, its distribution (V,)
    p = probabilities(logits, sampling)
    return sample(p, rng.random()), p


def draft_chain(logits, step, k, sampling, rng):  # (V,) -> tokens (k,), q (k, V)
    """Draw k tokens autoregressively: the first from `logits`, each next from step(token) -> logits (V,)."""
    tokens, q = [], []
    for i in range(k):
        token, p = draw(logits, sampling, rng)
        tokens.append(token)
        q.append(p)
        if i < k - 1:
            logits = step(token)
    return tokens, np.stack(q) if q else np.zeros((0, len(logits)), np.float32)


def first_layers(params, cfg, n):
    """The model cut after its first n layers (then final norm and lm_head): a self-speculative drafter."""
    return {**params, "layers": params["layers"][:n]}, replace(cfg, num_hidden_layers=n, layer_types=cfg.layer_types[:n])


def model_drafter(params, cfg, name):
    """A smaller model (or the target's first N layers) drafting autoregressively with its own state. The state after
    each drafted token is kept, so after a partial accept the drafter resumes from the longest accepted prefix."""
    def propose(draft_state, context, new_hidden, k, sampling, rng):
        history, checkpoints = draft_state        # checkpoints[n]: state after consuming history[:n]
        if k == 0:
            return [], np.zeros((0, cfg.vocab_size), np.float32), draft_state
        # Resume from the latest checkpoint on the committed context: `same` tokens of the last round's history are
        # still in it (the accepted drafts); the last context token is never consumed, it feeds the next forward.
        same = next((i for i, (a, b) in enumerate(zip(history, context)) if a != b), min(len(history), len(context)))
        resume = max(n for n in checkpoints if n <= min(same, len(context) - 1))
        logits, _, state, _ = forward(params, cfg, context[resume:], checkpoints[resume])
        checkpoints = {len(context): state}

        def step(token):
            nonlocal state
            logits, _, state, _ = forward(params, cfg, [token], state)
            checkpoints[max(checkpoints) + 1] = state
            return logits[-1]
        tokens, q = draft_chain(logits[-1], step, k, sampling, rng)
        return tokens, q, (list(context) + tokens[:-1], checkpoints)
    return Drafter(name, ([], {0: empty_state(cfg)}), propose)


def mtp_forward(params, cfg, tokens, hidden, state):  # (T,), (T, D) -> logits (T, V), hidden (T, D), State
    """Qwen3.5's multi-token-prediction head: the pair (target hidden h_p, token x_{p+1}) at position p predicts
    x_{p+2}. fc over [norm(embedding); norm(hidden)] (embedding first), one full-attention decoder layer with its own
    KV cache, mtp.norm, and the target's shared lm_head."""
    m = params["mtp"]
    e = rms_norm(params["embed_tokens"][np.asarray(tokens)], m["pre_fc_norm_embedding"], cfg.rms_norm_eps)
    h = rms_norm(hidden, m["pre_fc_norm_hidden"], cfg.rms_norm_eps)
    x = np.concatenate([e, h], axis=-1) @ m["fc"].T                                         # (T, D)
    positions = state.length + np.arange(len(x))
    x, layer_state, _ = decoder_layer(x, "full_attention", m["layers"][0], state.layers[0], positions, cfg)
    out = rms_norm(x, m["norm"], cfg.rms_norm_eps)
    return out @ params["lm_head"].T, out, State((layer_state,), state.length + len(x))


def mtp_chain(params, cfg, state, tokens, hidden, k, pick):  # (n,), (n, D) -> logits (k, V), hidden (k, D), State
    """The MTP head as a drafter: over the newly verified pairs (the target's final-normed hidden state at each kept
    position and the token after it), then chained k - 1 times on its own output hidden state and the token
    pick(logits) takes from the previous depth's logits. -> each depth's logits and output hidden state, and the
    head's state after the new pairs only (the chain's KV is dropped: the next round's pairs replace it)."""
    logits, h, state = mtp_forward(params, cfg, tokens, hidden, state)
    committed, depth_logits, depth_hidden = state, [logits[-1]], [h[-1]]
    for _ in range(k - 1):
        logits, h, state = mtp_forward(params, cfg, [pick(depth_logits[-1])], h[-1:], state)
        depth_logits.append(logits[-1])
        depth_hidden.append(h[-1])
    return np.stack(depth_logits), np.stack(depth_hidden), committed


def mtp_drafter(params, cfg, shortlist=None, name="mtp"):
    """Catch the MTP head up on the newly verified positions, then chain it K times, feeding its own output hidden
    state and drafted token (mtp_chain). With a shortlist (S token ids) the head's output projection is those S rows
    of lm_head and every draft is drawn among them: q is zero outside (mtp-shortlist:PATH, below)."""
    if params["mtp"] is None:
        raise UserError("the MTP drafter needs mtp.* weights, which the checkpoint does not have")
    if cfg.mtp_num_hidden_layers > 1:
        raise UserError(f"the MTP drafter runs one MTP layer; the checkpoint has mtp_num_hidden_layers="
                        f"{cfg.mtp_num_hidden_layers}")

    head = params if shortlist is None else {**params, "lm_head": np.ascontiguousarray(params["lm_head"][shortlist])}

    def propose(draft_state, context, new_hidden, k, sampling, rng):
        start, drawn = draft_state.length, []     # MTP pairs exist for positions [0, start)

        def pick(logits):                         # logits over the head's rows: the vocabulary or the shortlist
            token, p = draw(logits, sampling, rng)
            drawn.append((token, p) if shortlist is None else on_vocabulary(token, p, shortlist, cfg.vocab_size))
            return drawn[-1][0]
        depth_logits, _, committed = mtp_chain(head, cfg, draft_state, context[start + 1:start + 1 + len(new_hidden)],
                                               new_hidden, k, pick)
        if k:
            pick(depth_logits[-1])                # the last draft, drawn from the deepest logits, is not fed back
        q = np.stack([p for _, p in drawn]) if drawn else np.zeros((0, cfg.vocab_size), np.float32)
        return [token for token, _ in drawn], q, committed
    Hkv, Dh = cfg.num_key_value_heads, cfg.head_dim
    empty = AttnState(np.zeros((0, Hkv, Dh), np.float32), np.zeros((0, Hkv, Dh), np.float32))
    return Drafter(name, State((empty,), 0), propose)


# ----------------------------------------------------------------------------------------------------------------
# Self-speculative drafters: the target's own weights, cheapened (the experiments docs/self-speculative.md
# describes). Each drafts from its own copy of the target's committed state (observe) through the target's layers
# with parts left out or reused; the states its draft positions write are its own, dropped at the next observe:
#   partial-mlp:F[:LAYERS]  each SwiGLU keeps the first fraction F of its intermediate dimension, in LAYERS (all by
#                           default); MoE: every routed expert and the shared expert alike, the router whole
#   skip-blocks:LAYERS      the blocks of LAYERS left out (the identity); their states stay as they were
#   mixer-reuse:LAYERS      the token mixers of LAYERS replaced by the mean of their outputs at the two previous
#                           positions (the committed ones exact, then the drafter's own)
#   residual-reuse:L        layers [0, L) left out: layer L takes the token's embedding plus the previous position's
#                           final hidden state, RMS-matched to the update layers [0, L) make on the prompt
#   mtp-shortlist:PATH      the MTP head over a vocabulary shortlist (mtp_drafter above; build_shortlist below)
# LAYERS: 0-based layer indices and inclusive ranges, e.g. 1-3,6. Every draft is verified as any other: exact.

def run_layers(params, cfg, x, state, skip=(), reused=None):  # (T, D) -> (T, D), State, {layer: (T, D)}
    """The decoder layers over the residual stream x from `state`: the blocks in `skip` left out, and for each layer
    in `reused` ({layer: (T, D)}) that array as its token mixer's output, the mixer not run (both keep their state
    as it was). -> the residual stream after the last layer, the new State, each run layer's token-mixer output."""
    positions = state.length + np.arange(len(x))
    layer_states, mixed = [], {}
    for i, (kind, layer, layer_state) in enumerate(zip(cfg.layer_types, params["layers"], state.layers)):
        if i not in skip:
            if reused and i in reused:
                mixed[i] = reused[i]
            else:
                mixed[i], layer_state, _ = token_mixer(x, kind, layer, layer_state, positions, cfg)
            x = x + mixed[i]
            x = x + feed_forward(x, layer, cfg)
        layer_states.append(layer_state)
    return x, State(tuple(layer_states), state.length + len(x)), mixed


def lm_head(params, cfg, x):  # (T, D) residual stream -> logits (T, V), final-normed hidden (T, D)
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return hidden @ params["lm_head"].T, hidden


def no_drafts(cfg):
    return [], np.zeros((0, cfg.vocab_size), np.float32)


def draft_from(cfg, step, token, k, sampling, rng):  # -> tokens (k,), q (k, V)
    """A self-speculative chain: step(token) -> logits (V,) of the position after it, from the last context token."""
    return draft_chain(step(token), step, k, sampling, rng) if k else no_drafts(cfg)


def cheapened_drafter(name, params, cfg, skip=()):
    """Drafts through the layers of `params` (the target's, or cheapened ones) but `skip`, from the observed state."""
    def propose(draft_state, context, new_hidden, k, sampling, rng):
        state = draft_state

        def step(token):
            nonlocal state
            x, state, _ = run_layers(params, cfg, params["embed_tokens"][[token]], state, skip)
            return lm_head(params, cfg, x)[0][-1]
        return *draft_from(cfg, step, context[-1], k, sampling, rng), draft_state
    return Drafter(name, None, propose, observe=lambda draft_state, target_state: target_state)


def partial_mlp_params(params, cfg, fraction, layers):
    """Each SwiGLU of `layers` cut to the first round(fraction * F) (at least 1) of its F intermediate channels: the
    first rows of gate_proj and up_proj, the first columns of down_proj. MoE: every routed expert and the shared
    expert alike (routing is the target's). Copied contiguous, as a kernel for the smaller network would hold them."""
    def kept(F):
        return max(1, round(fraction * F))

    def swiglu(m):
        f = kept(m["gate_proj"].shape[0])
        return {"gate_proj": m["gate_proj"][:f].copy(), "up_proj": m["up_proj"][:f].copy(),
                "down_proj": np.ascontiguousarray(m["down_proj"][:, :f])}

    def moe(m):
        gate_up, down = m["experts"]["gate_up_proj"], m["experts"]["down_proj"]        # (E, 2F, D), (E, D, F)
        F = down.shape[-1]
        f = kept(F)
        experts = {"gate_up_proj": np.concatenate([gate_up[:, :f], gate_up[:, F:F + f]], axis=1),
                   "down_proj": np.ascontiguousarray(down[..., :f])}
        return {**m, "experts": experts, "shared_expert": swiglu(m["shared_expert"])}
    cut = moe if cfg.is_moe else swiglu
    return {**params, "layers": [{**layer, "mlp": cut(layer["mlp"])} if i in layers else layer
                                 for i, layer in enumerate(params["layers"])]}


class MixerReuse(NamedTuple):
    state: object        # the copy of the target's committed state
    shadow: State        # the exact layers [0, last window layer] over every token the target consumed
    last_two: dict       # {window layer: (<= 2, D)} its token mixer's outputs at the last consumed positions


def mixer_reuse_drafter(name, params, cfg, window):
    """Each window layer's token mixer output is the mean of its outputs at the two previous positions. The target's
    verify pass computes the committed positions' outputs but does not keep them, so this drafter keeps its own: a
    shadow of the exact layers up to the window's last, run over each newly committed token (the work an engine
    would save by having its verify keep the window's last two mixer outputs; the lab times it apart)."""
    shadow_params, shadow_cfg = first_layers(params, cfg, max(window) + 1)

    def catch_up(draft_state, consumed):  # the shadow and the records over the tokens the target has consumed
        new = consumed[draft_state.shadow.length:]
        if not new:
            return draft_state
        _, shadow, mixed = run_layers(shadow_params, shadow_cfg, params["embed_tokens"][new], draft_state.shadow)
        return draft_state._replace(shadow=shadow, last_two={i: np.concatenate([draft_state.last_two[i], mixed[i]])[-2:]
                                                             for i in window})

    def propose(draft_state, context, new_hidden, k, sampling, rng):
        if not k:
            return *no_drafts(cfg), draft_state
        draft_state = catch_up(draft_state, context[:-1])
        state, last_two = draft_state.state, draft_state.last_two

        def step(token):
            nonlocal state, last_two
            reused = {i: last_two[i].mean(axis=0, keepdims=True) for i in window}
            x, state, _ = run_layers(params, cfg, params["embed_tokens"][[token]], state, reused=reused)
            last_two = {i: np.concatenate([last_two[i], reused[i]])[-2:] for i in window}
            return lm_head(params, cfg, x)[0][-1]
        return *draft_from(cfg, step, context[-1], k, sampling, rng), draft_state
    D = cfg.hidden_size
    start = MixerReuse(None, empty_state(shadow_cfg), {i: np.zeros((0, D), np.float32) for i in window})
    return Drafter(name, start, propose,
                   observe=lambda draft_state, target_state: draft_state._replace(state=target_state))


class ResidualReuse(NamedTuple):
    state: object        # the copy of the target's committed state
    scale: object        # the RMS of the update layers [0, L) make to the residual stream, over the prompt (float)


def residual_reuse_drafter(name, params, cfg, L):
    """Layers [0, L) left out: layer L's input is the token's embedding plus r * h / rms(h), with h the previous
    position's final-normed hidden state (the target's at the first draft, new_hidden; then the drafter's own) and r
    the RMS of what layers [0, L) add to the embedding, measured once per request over the prompt."""
    bottom_params, bottom_cfg = first_layers(params, cfg, L)

    def calibrate(prompt):
        e = params["embed_tokens"][prompt]
        x, _, _ = run_layers(bottom_params, bottom_cfg, e, empty_state(bottom_cfg))
        return float(np.sqrt(np.mean((x - e) ** 2, axis=-1)).mean())

    def propose(draft_state, context, new_hidden, k, sampling, rng):
        if not k:
            return *no_drafts(cfg), draft_state
        if draft_state.scale is None:          # the first call: the target has consumed the prompt
            draft_state = draft_state._replace(scale=calibrate(context[:-1]))
        state, previous = draft_state.state, new_hidden[-1]

        def step(token):
            nonlocal state, previous
            x = params["embed_tokens"][[token]] + draft_state.scale * rms_norm(previous, 0, cfg.rms_norm_eps)
            x, state, _ = run_layers(params, cfg, x, state, skip=range(L))
            logits, hidden = lm_head(params, cfg, x)
            previous = hidden[-1]
            return logits[-1]
        return *draft_from(cfg, step, context[-1], k, sampling, rng), draft_state
    return Drafter(name, ResidualReuse(None, None), propose,
                   observe=lambda draft_state, target_state: draft_state._replace(state=target_state))


def on_vocabulary(token, p, shortlist, V):  # a draw among S shortlist ids, p (S,) -> its id, p over V (zero outside)
    full = np.zeros(V, p.dtype)
    full[shortlist] = p
    return int(shortlist[token]), full


# ----------------------------------------------------------------------------------------------------------------
# DFlash block drafter (z-lab/dflash; docs/dflash.md): a few decoder layers of its own, no embedding or head of its
# own (the target's are used), conditioned on the target's features: the outputs of the target layers
# target_layer_ids, concatenated, projected by fc and normed. Every drafter layer attends from the block [last
# committed token, MASK x K] to the context features' keys and values (its own k_proj and v_proj applied to the
# features, cached) followed by the block's; a full-attention layer without a mask, a sliding one (the published
# Qwen3.5 drafters have them) causally within its window, as z-lab reads its config (dflash_visible). One drafter
# pass proposes all K drafts: the logits of the K mask slots through the target's lm_head. After each round the
# cache keeps the context only, up to the last committed token (the block's keys and values are dropped: the
# crop); the features of the positions the round verified and kept are appended at the next propose. The drafter
# is a Qwen3 model: plain RMSNorm weights (no +1), q/k norms, full RoPE, no output gate.

@dataclass(frozen=True)
class DFlashConfig:
    num_hidden_layers: int       # the drafter's own decoder layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: tuple      # the target layers whose outputs are the features, in this order
    mask_token_id: int           # fills the block's slots after the first
    block_size: int              # the block length it was trained for: 1 + the drafts per round it expects
    layer_types: tuple = ()      # per drafter layer "full_attention" (default) or "sliding_attention"
    sliding_window: int = None   # a sliding layer's keys: positions within this distance of the query's
    is_causal: bool = None       # None: as z-lab reads it, sliding layers causal, full ones not


def dflash_visible(dcfg, i, queries, keys):  # layer i, positions (B,), (S + B,) -> (B, S + B) the keys each sees
    """No mask in a full-attention layer (the DFlash block is bidirectional). z-lab's mask for the others: causal
    where the layer is (sliding layers, unless is_causal says otherwise), within the window where it has one."""
    sliding = i < len(dcfg.layer_types) and dcfg.layer_types[i] == "sliding_attention"
    causal = sliding if dcfg.is_causal is None else dcfg.is_causal
    query, key = queries[:, None], keys[None, :]
    visible = np.ones((len(queries), len(keys)), bool)
    if causal:
        visible &= key <= query
    if sliding:
        visible &= (query - key < dcfg.sliding_window) & (causal | (key - query < dcfg.sliding_window))
    return visible


class DFlashState(NamedTuple):
    layers: tuple        # one AttnState per drafter layer: the context features' keys (k_norm, RoPE) and values
    length: int          # context positions cached = the position of the next features to append


def plain_rms_norm(x, weight, eps):  # (..., N) -> (..., N): Qwen3's RMSNorm, scale w (not 1 + w)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def dflash_features(dparams, dcfg, tapped):  # (n, len(taps) D) target layer outputs -> (n, D)
    return plain_rms_norm(tapped @ dparams["fc"].T, dparams["hidden_norm"], dcfg.rms_norm_eps)


def dflash_keys_values(x, positions, dcfg, k_proj, v_proj, k_norm):  # (T, D) -> keys, values (T, Hkv, Dh)
    T, Hkv, Dh = len(x), dcfg.num_key_value_heads, dcfg.head_dim
    k = plain_rms_norm((x @ k_proj.T).reshape(T, Hkv, Dh), k_norm, dcfg.rms_norm_eps)
    return rope(k, positions, dcfg.rope_theta, Dh), (x @ v_proj.T).reshape(T, Hkv, Dh)


def dflash_extend(dparams, dcfg, draft_state, tapped):  # DFlashState, (n, len(taps) D) -> DFlashState
    """Append the features of the next n context positions to every layer's cache (the same projected features
    feed every layer; each layer keys and values them with its own k_proj and v_proj)."""
    features = dflash_features(dparams, dcfg, tapped)
    positions = draft_state.length + np.arange(len(features))
    layers = []
    for layer, cache in zip(dparams["layers"], draft_state.layers):
        a = layer["self_attn"]
        k, v = dflash_keys_values(features, positions, dcfg, a["k_proj"], a["v_proj"], a["k_norm"])
        layers.append(AttnState(np.concatenate([cache.k, k]), np.concatenate([cache.v, v])))
    return DFlashState(tuple(layers), draft_state.length + len(features))


def dflash_attention(h, positions, cache, visible, dcfg, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm):
    """(B, D) block -> its update (B, D) and the layer's cache with the block's keys and values appended: the
    block's queries over [cached context; block] keys, `visible` (B, S + B) (dflash_visible)."""
    B, Hq, Hkv, Dh = len(h), dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    q = rope(plain_rms_norm((h @ q_proj.T).reshape(B, Hq, Dh), q_norm, dcfg.rms_norm_eps), positions,
             dcfg.rope_theta, Dh)
    k, v = dflash_keys_values(h, positions, dcfg, k_proj, v_proj, k_norm)
    keys, values = np.concatenate([cache.k, k]), np.concatenate([cache.v, v])          # (S + B, Hkv, Dh)
    q = q.reshape(B, Hkv, Hq // Hkv, Dh)
    scores = np.einsum("tkgd,skd->kgts", q, keys) * np.float32(Dh ** -0.5)              # (Hkv, G, B, S + B)
    weights = softmax(np.where(visible, scores, -np.inf))
    out = np.einsum("kgts,skd->tkgd", weights, values).reshape(B, Hq * Dh) @ o_proj.T
    return out, AttnState(keys, values)


def dflash_block_tokens(context, k, mask_token_id):  # -> [last committed token, MASK x k]
    return [context[-1]] + [mask_token_id] * k


def dflash_block(params, dparams, dcfg, draft_state, block):  # (B,) tokens -> logits (B - 1, V), DFlashState
    """One drafter pass over the block at positions [draft_state.length, + B) -> the logits of its last B - 1 slots,
    and the cache with the block's keys and values appended (what dflash_crop takes back out)."""
    positions = draft_state.length + np.arange(len(block))
    x, layers = params["embed_tokens"][np.asarray(block)], []                           # (B, D)
    for i, (layer, cache) in enumerate(zip(dparams["layers"], draft_state.layers)):
        visible = dflash_visible(dcfg, i, positions, np.concatenate([np.arange(len(cache.k)), positions]))
        update, cache = dflash_attention(plain_rms_norm(x, layer["input_layernorm"], dcfg.rms_norm_eps), positions,
                                         cache, visible, dcfg, **layer["self_attn"])
        x = x + update
        x = x + mlp(plain_rms_norm(x, layer["post_attention_layernorm"], dcfg.rms_norm_eps), **layer["mlp"])
        layers.append(cache)
    logits = plain_rms_norm(x[1:], dparams["norm"], dcfg.rms_norm_eps) @ params["lm_head"].T
    return logits, DFlashState(tuple(layers), draft_state.length + len(block))


def dflash_crop(draft_state, length):  # DFlashState -> the cache of its first `length` positions (the context)
    return DFlashState(tuple(truncate(cache, length) for cache in draft_state.layers), length)


def dflash_taps(dcfg):  # -> the target layers whose outputs are the features, in the order fc reads them
    return tuple(dcfg.target_layer_ids)


def dflash_empty_state(dcfg):  # -> DFlashState with nothing cached
    Hkv, Dh = dcfg.num_key_value_heads, dcfg.head_dim
    empty = AttnState(np.zeros((0, Hkv, Dh), np.float32), np.zeros((0, Hkv, Dh), np.float32))
    return DFlashState((empty,) * dcfg.num_hidden_layers, 0)


def dflash_round(params, dparams, dcfg, draft_state, tapped, last_token, k):
    """One drafting round: append the features of the newly verified positions (tapped, their target layer outputs),
    run the block [last_token, MASK x k] at the next positions, crop the block back out -> (logits of the k mask
    slots (k, V), DFlashState covering the context only). What the conformance kit's dflash cases check."""
    draft_state = dflash_extend(dparams, dcfg, draft_state, tapped)
    if not k:
        return np.zeros((0, len(params["lm_head"])), np.float32), draft_state
    logits, with_block = dflash_block(params, dparams, dcfg, draft_state,
                                      dflash_block_tokens([last_token], k, dcfg.mask_token_id))
    return logits, dflash_crop(with_block, draft_state.length)   # the block's keys and values never stay


def check_dflash_features(draft_state, context, new_hidden):  # features for every committed position but the last
    if draft_state.length + len(new_hidden) != len(context) - 1:
        raise ValueError(f"DFlash: features for {draft_state.length + len(new_hidden)} positions, the context has "
                         f"{len(context)}")


def dflash_drafter(name, params, cfg, dparams, dcfg, sampled=False):
    """Each round: append the newly verified positions' features (new_hidden, the target's tapped layer outputs),
    run the block [last committed token, MASK x k], propose. argmax with a one-hot q (sampled=False, as vLLM does),
    or each slot drawn independently from the drafter's distribution under the round's sampling, q that
    distribution (sampled=True: exact too, but the slots are not conditioned on each other's draws)."""
    def propose(draft_state, context, new_hidden, k, sampling, rng):
        check_dflash_features(draft_state, context, new_hidden)
        logits, draft_state = dflash_round(params, dparams, dcfg, draft_state, new_hidden, context[-1], k)
        if not k:
            return *no_drafts(cfg), draft_state
        if sampled:
            drawn = [draw(row, sampling, rng) for row in logits]
            return [token for token, _ in drawn], np.stack([p for _, p in drawn]), draft_state
        tokens = [int(t) for t in logits.argmax(axis=-1)]
        return tokens, one_hot(tokens, cfg.vocab_size), draft_state
    return Drafter(name, dflash_empty_state(dcfg), propose, taps=dflash_taps(dcfg))


# ----------------------------------------------------------------------------------------------------------------
# Generation

def check_prompt(cfg, prompt):
    if not len(prompt):
        raise UserError("the prompt is empty")
    if len(prompt) > cfg.max_position_embeddings:
        raise UserError(f"the prompt has {len(prompt)} tokens, more than max_position_embeddings={cfg.max_position_embeddings}")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UserError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")


def token_limit(cfg, prompt, max_new_tokens):
    """How many tokens may be generated: max_new_tokens, cut where the sequence fills max_position_embeddings."""
    check_prompt(cfg, prompt)
    return min(max_new_tokens, cfg.max_position_embeddings - len(prompt))


def generation_stats(prompt_tokens, new_tokens, target_calls, seconds, drafts=None, draft_len=0, rollback=None,
                     **more):
    """A request's stats, as every engine and front end reports them (--json's "stats", jax_impl.generate's, the
    server's results; docs/cli.md): the counts, tokens per target call after the prefill's, `seconds` as the engine
    timed them. Speculative decoding (drafts: a mapping with proposed, accepted and the by-position counts, these cut
    or zero-padded to draft_len entries) adds them and the rollback strategy; `more`: what else an engine reports."""
    stats = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "target_calls": target_calls,
             "tokens_per_call": (new_tokens - 1) / target_calls if target_calls else 0.0}
    if drafts is not None:
        stats.update(proposed=drafts["proposed"], accepted=drafts["accepted"], rollback=rollback)
        for name in ("proposed_by_position", "accepted_by_position"):
            stats[name] = (list(drafts[name]) + [0] * draft_len)[:draft_len]
    return {**stats, **more, "seconds": seconds}


def generate(params, cfg, prompt, max_new_tokens, sampling, rng, on_tokens=lambda new: None):
    """Plain decoding: prefill the prompt, then one forward per token. Stops at EOS or the length limit."""
    limit, tokens, start = token_limit(cfg, prompt, max_new_tokens), [], time.perf_counter()
    logits, _, state, _ = forward(params, cfg, prompt, empty_state(cfg))
    prefill_done = time.perf_counter()
    while len(tokens) < limit:
        if tokens:
            logits, _, state, _ = forward(params, cfg, tokens[-1:], state)
        tokens.append(sample(probabilities(logits[-1], sampling), rng.random()))
        on_tokens(tokens[-1:])
        if tokens[-1] in cfg.eos_token_id:
            break
    end = time.perf_counter()
    return tokens, generation_stats(len(prompt), len(tokens), max(len(tokens) - 1, 0),
                                    {"prefill": prefill_done - start, "decode": end - prefill_done, "total": end - start})


def generate_speculative(params, cfg, prompt, max_new_tokens, sampling, rng, drafter, draft_len, rollback="replay",
                         on_tokens=lambda new: None):
    """Speculative decoding: the same tokens as `generate` under greedy decoding, the same distribution under
    sampling. Each round: the drafter proposes, then speculative_round verifies, accepts and rolls back."""
    limit, tokens = token_limit(cfg, prompt, max_new_tokens), []
    stats = SpeculationStats(len(prompt), draft_len, rollback)
    target = stats.observe(reference_target(params, cfg, rollback, drafter.taps))
    propose = stats.timed("draft", checked_propose(drafter, cfg))
    if limit > 0:
        logits, new_hidden, state, _ = stats.timed("prefill", forward)(params, cfg, prompt, empty_state(cfg),
                                                                         drafter.taps)
        tokens.append(sample(probabilities(logits[-1], sampling), rng.random()))
        on_tokens(tokens[-1:])
    draft_state = drafter.initial_state
    while tokens and tokens[-1] not in cfg.eos_token_id and len(tokens) < limit:
        k = min(draft_len, limit - len(tokens) - 1)        # room for the target's own token after the drafts
        if drafter.observe:
            draft_state = drafter.observe(draft_state, target.copy(state))
        draft, q, draft_state = propose(draft_state, list(prompt) + tokens, new_hidden, k, sampling, rng)
        u = rng.random(len(draft) + 1) if sampling.temperature else None
        r = speculative_round(target, state, tokens[-1:] + draft, q, sampling, u, cfg.eos_token_id)
        state, new_hidden = r.state, r.hidden[:len(r.committed)]
        stats.count(len(draft), r.accepted)
        tokens += r.committed
        on_tokens(r.committed)
    return tokens, stats.result(len(tokens))

# Tree drafting and generation (docs/trees.md). A tree budget bounds a round's drafted nodes (the root excluded),
# their depth and each node's children.

class TreeBudget(NamedTuple):
    nodes: int
    depth: int
    branch: int


def add_path(tree_tokens, parents, continuation, budget):  # grow the trie [root] + nodes along a continuation
    node, depth = 0, 0
    for token in continuation[:budget.depth]:
        children = tree_children(parents, node)
        match = next((c for c in children if tree_tokens[c] == token), None)
        if match is None:
            if len(children) >= budget.branch or len(tree_tokens) - 1 >= budget.nodes:
                return
            tree_tokens.append(int(token))
            parents.append(node)
            match = len(tree_tokens) - 1
        node, depth = match, depth + 1


def ngram_tree(context, budget, max_ngram=3):  # -> tokens (N,) with the root context[-1], parents (N,)
    """Several continuations from the context: for the longest suffix (<= max_ngram tokens) seen before, what followed
    each earlier occurrence, latest first, merged into a trie within the budget. One-hot q: the drafts are
    deterministic."""
    tokens, parents = [int(context[-1])], [-1]
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        suffix = list(context[-n:])
        starts = [s for s in range(len(context) - n - 1, -1, -1) if list(context[s:s + n]) == suffix]
        for start in starts:
            add_path(tokens, parents, list(context[start + n:start + n + budget.depth]), budget)
        if starts:
            break
    return tokens, parents


class TreeDrafter(NamedTuple):
    """A drafter of trees, a pure function over its own explicit state (Drafter's counterpart):
    propose(draft_state, context, new_hidden, budget) -> tokens (N,) (the root context[-1]), parents (N,),
    draft_state. Its drafts are deterministic: q is one-hot (accept_tree_speculative is then exact). taps: as
    Drafter's (new_hidden then holds those target layers' outputs; a DFlash tree drafter)."""
    name: str
    initial_state: object
    propose: Callable
    taps: tuple = None


NGRAM_TREE = TreeDrafter("ngram", None, lambda state, context, new_hidden, budget: (*ngram_tree(context, budget),
                                                                                      state))


def top_k_tree(root, depth_logits, budget):  # (D, V) logits at depths 1..D of an argmax chain -> tokens, parents
    """A drafter's top-k at each depth as a tree: the spine is its argmax chain, and at depth d up to BRANCH of depth
    d's most likely tokens (the first the spine's own) are children of the spine's node at depth d - 1. Of these the
    NODES most likely to be reached under the drafter's own distribution (softmax of its logits; a node's chance
    is the product along the spine to its parent times its token's) are kept. A parent is at least as likely as its
    child and comes first among equals, so what is kept is a tree."""
    q, reach, candidates = softmax(np.asarray(depth_logits[:budget.depth], np.float64)), 1.0, []
    for depth, row in enumerate(q, 1):
        order = np.argsort(-row, kind="stable")[:budget.branch]
        candidates += [(-reach * row[t], depth, rank, int(t)) for rank, t in enumerate(order)]
        reach *= row[order[0]]
    kept = sorted(sorted(candidates)[:budget.nodes], key=lambda c: c[1:3])     # most likely, then by depth and rank
    tokens, parents, spine = [int(root)], [-1], {0: 0}                          # spine: depth -> its node
    for _, depth, rank, token in kept:
        tokens.append(token)
        parents.append(spine[depth - 1])
        if rank == 0:
            spine[depth] = len(tokens) - 1
    return tokens, parents


def mtp_tree_drafter(params, cfg):
    """The MTP head's top-k at each depth (top_k_tree): the head catches up on the newly verified positions and
    chains DEPTH times on its argmax (mtp_chain), so a tree costs the head what a chain of DEPTH drafts does."""
    initial = mtp_drafter(params, cfg).initial_state          # (checks that the checkpoint has a usable head)

    def propose(draft_state, context, new_hidden, budget):
        start = draft_state.length                            # MTP pairs exist for positions [0, start)
        depth_logits, _, committed = mtp_chain(params, cfg, draft_state,
                                               context[start + 1:start + 1 + len(new_hidden)], new_hidden,
                                               max(budget.depth, 1), lambda logits: int(np.argmax(logits)))
        return (*top_k_tree(context[-1], depth_logits, budget), committed)
    return TreeDrafter("mtp", initial, propose)


def ddtree(root, block_logits, budget):  # (L, V) logits of a DFlash block's mask slots -> tokens (N,), parents (N,)
    """DDTree (Ringel and Romano, "Accelerating speculative decoding with block diffusion draft trees"; Luce-Org
    lucebox, dflash-mlx): one block pass gives per-position marginals q_1..q_L (softmax of the slots' logits; slot d
    drafts depth d). Score a root-to-node path x_1..x_d by the factorised model's chance that the target walks it,
    prod_i q_i(x_i), and keep the NODES best prefixes: best-first from the root over a heap, where popping a node
    (depth d, x_d the rank-r token of q_d) pushes its next sibling (rank r + 1 of q_d, same parent) and its first
    child (rank 0 of q_{d+1}). Only the BRANCH most likely tokens of each q_d are candidates, depth at most DEPTH.
    A child scores at most its parent and is pushed only once the parent is in, so the result is a tree in
    topological order, siblings distinct. Ties go to the earlier push. Deterministic given the logits: q per node
    is one-hot (the tree drafters' contract, docs/trees.md)."""
    L = min(budget.depth, len(block_logits))
    if not L:
        return [int(root)], [-1]
    log_q = np.log(softmax(np.asarray(block_logits[:L], np.float64)))                   # (L, V)
    order = np.argsort(-log_q, axis=-1, kind="stable")[:, :budget.branch]              # (L, BRANCH) candidates per depth
    tokens, parents, pushes = [int(root)], [-1], 1
    heap = [(-log_q[0, order[0, 0]], 0, 0.0, 0, 1, 0)]          # (-score, push order, parent's score, parent, d, rank)
    while heap and len(tokens) - 1 < budget.nodes:
        neg, _, base, parent, d, rank = heapq.heappop(heap)
        tokens.append(int(order[d - 1, rank]))
        parents.append(parent)
        node, score = len(tokens) - 1, -neg
        nexts = [(base, parent, d, rank + 1)] if rank + 1 < order.shape[1] else []
        nexts += [(score, node, d + 1, 0)] if d < L else []
        for b, p, dd, r in nexts:
            heapq.heappush(heap, (-(b + log_q[dd - 1, order[dd - 1, r]]), pushes, b, p, dd, r))
            pushes += 1
    return tokens, parents


def dflash_tree_drafter(name, params, cfg, dparams, dcfg):
    """DDTree over a DFlash drafter: each round one block [last committed token, MASK x DEPTH] (dflash_round, the
    chain drafter's pass: same features, same crop), then ddtree over its slots' logits within the budget."""
    def propose(draft_state, context, new_hidden, budget):
        check_dflash_features(draft_state, context, new_hidden)
        logits, draft_state = dflash_round(params, dparams, dcfg, draft_state, new_hidden, context[-1], budget.depth)
        return (*ddtree(context[-1], logits, budget), draft_state)
    return TreeDrafter(name, dflash_empty_state(dcfg), propose, taps=dflash_taps(dcfg))


def generate_tree_speculative(params, cfg, prompt, max_new_tokens, sampling, rng, drafter, budget,
                              rollback="replay", on_tokens=lambda new: None):
    """Speculative decoding with a draft tree per round from a TreeDrafter (one-hot q: deterministic drafts), within
    the budget. -> the tokens and generate's stats, with the drafted nodes and the accepted depth of every round."""
    limit, tokens, calls, start = token_limit(cfg, prompt, max_new_tokens), [], 0, time.perf_counter()
    prefill_done, draft_state, drafted, accepted, draft_s = start, drafter.initial_state, [], [], 0.0
    target = reference_target(params, cfg, rollback, drafter.taps)
    if limit > 0:
        logits, new_hidden, state, _ = forward(params, cfg, prompt, empty_state(cfg), drafter.taps)
        prefill_done = time.perf_counter()
        tokens.append(sample(probabilities(logits[-1], sampling), rng.random()))
        on_tokens(tokens[-1:])
    while tokens and tokens[-1] not in cfg.eos_token_id and len(tokens) < limit:
        room = budget._replace(depth=min(budget.depth, limit - len(tokens) - 1))   # room for the target's token
        drafting = time.perf_counter()
        tree, parents, draft_state = drafter.propose(draft_state, list(prompt) + tokens, new_hidden, room)
        draft_s += time.perf_counter() - drafting
        u = rng.random(len(tree)) if sampling.temperature else None
        r = tree_round(target, state, tree, parents, one_hot(tree[1:], cfg.vocab_size), sampling, u, cfg.eos_token_id)
        state, new_hidden = r.state, r.hidden[r.path[:len(r.committed)]]
        tokens += r.committed
        drafted.append(len(tree) - 1)
        accepted.append(len(r.path) - 1)
        on_tokens(r.committed)
        calls += 1
    end = time.perf_counter()
    return tokens, generation_stats(len(prompt), len(tokens), calls, {"prefill": prefill_done - start, "draft": draft_s,
                                    "decode": end - prefill_done, "total": end - start}, tree=budget._asdict(),
                                    drafter=drafter.name, drafted_nodes=drafted, accepted_depths=accepted)


TREE_LIMITS = {"nodes": 64, "depth": 16, "branch": 8}
TREE_DRAFTERS = {"ngram": lambda params, cfg: NGRAM_TREE, "mtp": mtp_tree_drafter}     # --draft NAME --tree


def parse_tree_budget(text, name="--tree"):  # "NODES[:DEPTH[:BRANCH]]" -> TreeBudget; depth, branch default to nodes
    if not isinstance(text, str):
        raise UserError(f"{name}: expected NODES[:DEPTH[:BRANCH]] as a string")
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3:
        raise UserError(f"{name} {text!r}: expected NODES[:DEPTH[:BRANCH]], integers")
    nodes = values[0]
    values += [min(nodes, TREE_LIMITS["depth"]), min(nodes, TREE_LIMITS["branch"])][len(values) - 1:]
    budget = TreeBudget(*values)
    for field, value in budget._asdict().items():
        if not 1 <= value <= TREE_LIMITS[field]:
            raise UserError(f"{name} {text!r}: {field} must be in [1, {TREE_LIMITS[field]}]")
    return budget


# ----------------------------------------------------------------------------------------------------------------
# Loading and validation: config.json and safetensors as the published checkpoints store them, strictly
# checked (sizes before anything is allocated), weights upcast to fp32.

# Sane bounds, checked before anything is built from a config: every published Qwen3.5 model is well inside them,
# and positions stay exact in float32 (RoPE angles) and int32 (jax_impl) up to max_position_embeddings.
CONFIG_LIMITS = {
    "vocab_size": (1, 2**20), "hidden_size": (1, 2**16), "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024), "head_dim": (1, 1024),
    "linear_num_key_heads": (1, 1024), "linear_num_value_heads": (1, 1024), "linear_key_head_dim": (1, 1024),
    "linear_value_head_dim": (1, 1024), "linear_conv_kernel_dim": (2, 64), "max_position_embeddings": (1, 2**24),
    "rms_norm_eps": (1e-12, 1.0), "rope_theta": (1.0, 1e12), "partial_rotary_factor": (0.0, 1.0),
    "intermediate_size": (1, 2**18), "num_experts": (1, 4096), "num_experts_per_tok": (1, 4096),
    "moe_intermediate_size": (1, 2**18), "shared_expert_intermediate_size": (1, 2**18),
    "mtp_num_hidden_layers": (0, 1024)}


def check_limit(field, value):
    low, high = CONFIG_LIMITS[field]
    if not low <= value <= high:  # also false for nan
        raise UserError(f"config: {field}={value!r} must be in [{low}, {high}]")


def check_config(cfg):
    """What a Config must satisfy beyond its fields' own bounds: consistent head counts, layer types, rotary dims."""
    def check(ok, field, value, why):
        if not ok:
            raise UserError(f"config: {field}={value!r} {why}")
    unused = ("intermediate_size",) if cfg.is_moe else (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    for field in CONFIG_LIMITS:
        if field not in unused:
            check_limit(field, getattr(cfg, field))
    check(len(cfg.layer_types) == cfg.num_hidden_layers, "layer_types", len(cfg.layer_types),
          f"entries, expected num_hidden_layers={cfg.num_hidden_layers}")
    for kind in cfg.layer_types:
        check(kind in ("linear_attention", "full_attention"), "layer_types", kind, "is not a known layer type")
    check(cfg.num_attention_heads % cfg.num_key_value_heads == 0, "num_key_value_heads",
          cfg.num_key_value_heads, f"does not divide num_attention_heads={cfg.num_attention_heads}")
    check(cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0, "linear_num_key_heads",
          cfg.linear_num_key_heads, f"does not divide linear_num_value_heads={cfg.linear_num_value_heads}")
    check(cfg.rotary_dim % 2 == 0 and 0 < cfg.rotary_dim <= cfg.head_dim, "partial_rotary_factor",
          cfg.partial_rotary_factor, f"gives rotary dim {cfg.rotary_dim}, not even and in (0, {cfg.head_dim}]")
    if cfg.is_moe:
        check(0 < cfg.num_experts_per_tok <= cfg.num_experts, "num_experts_per_tok", cfg.num_experts_per_tok,
              f"must be in [1, num_experts={cfg.num_experts}]")
    for token in cfg.eos_token_id:
        check(0 <= token < cfg.vocab_size, "eos_token_id", token,
              f"is outside the vocabulary [0, {cfg.vocab_size})")


MODEL_TYPES = {"qwen3_5_text": None, "qwen3_5": "text_config", "qwen3_5_moe_text": None, "qwen3_5_moe": "text_config"}


def layer_types_from_interval(num_layers, interval):
    """Every `interval`-th layer is full attention: interval 4 gives linear, linear, linear, full, ..."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))


def config_from_dict(raw, generation_config=None):
    """config.json (flat text config, or multimodal with `text_config`) -> Config."""
    if not isinstance(raw, dict):
        raise UserError(f"config: expected a JSON object, got {type(raw).__name__}")
    if not isinstance(generation_config, (dict, type(None))):
        raise UserError(f"generation config: expected a JSON object, got {type(generation_config).__name__}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise UserError(f"config: model_type={model_type!r} is not one of {sorted(MODEL_TYPES)}")
    text = raw.get(MODEL_TYPES[model_type]) if MODEL_TYPES[model_type] else raw
    if not isinstance(text, dict):
        raise UserError(f"config: text_config={text!r} is not an object")
    moe = model_type.startswith("qwen3_5_moe")

    def get(key, default=None, kind=int, source=text):
        if key not in source and default is None:
            raise UserError(f"config: required field {key!r} is missing")
        value = source.get(key, default)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise UserError(f"config: {key}={value!r} has the wrong type, expected {getattr(kind, '__name__', 'number')}")
        return value

    def optional(key, kind):  # a field that may be absent or null
        return get(key, None, kind) if text.get(key) is not None else None

    if get("hidden_act", "silu", str) != "silu":
        raise UserError(f"config: hidden_act={text['hidden_act']!r} is not supported (only 'silu')")
    if get("attention_bias", False, bool):
        raise UserError("config: attention_bias=true is not supported (no released Qwen3.5 model has it)")
    # RoPE: `rope_parameters` (transformers v5) or the legacy top-level rope_theta / rope_scaling fields.
    rope = dict(optional("rope_scaling", dict) or {})
    rope.update({k: text[k] for k in ("rope_theta", "partial_rotary_factor") if k in text})
    rope.update(optional("rope_parameters", dict) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UserError(f"config: rope_type={rope_type!r} is not supported (only 'default')")
    # (Text-only input puts the same position in all three mRoPE sections, which is exactly 1-D RoPE.)
    num_layers, interval = get("num_hidden_layers"), get("full_attention_interval", 4)
    check_limit("num_hidden_layers", num_layers)  # before a list of that many layer types is built
    if interval < 1:
        raise UserError(f"config: full_attention_interval={interval} must be >= 1")
    layer_types = optional("layer_types", list) or layer_types_from_interval(num_layers, interval)
    eos = set()
    for source in (text, raw, generation_config or {}):
        value = source.get("eos_token_id")
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"config: eos_token_id={value!r} must be an integer or a list of integers")
        eos.update(ids)
    fields = dict(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"), num_hidden_layers=num_layers, layer_types=tuple(layer_types),
        num_attention_heads=get("num_attention_heads"), num_key_value_heads=get("num_key_value_heads"),
        head_dim=get("head_dim"), linear_num_key_heads=get("linear_num_key_heads"),
        linear_num_value_heads=get("linear_num_value_heads"), linear_key_head_dim=get("linear_key_head_dim"),
        linear_value_head_dim=get("linear_value_head_dim"), linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
        rms_norm_eps=get("rms_norm_eps", 1e-6, (int, float)), max_position_embeddings=get("max_position_embeddings"),
        rope_theta=get("rope_theta", 10000.0, (int, float), rope),
        partial_rotary_factor=get("partial_rotary_factor", 0.25, (int, float), rope),  # transformers' Qwen3.5 default
        tie_word_embeddings=get("tie_word_embeddings", get("tie_word_embeddings", False, bool), bool, raw),
        eos_token_id=tuple(sorted(eos)), mtp_num_hidden_layers=get("mtp_num_hidden_layers", 0))
    if moe:
        fields.update(num_experts=get("num_experts"), num_experts_per_tok=get("num_experts_per_tok"),
                      moe_intermediate_size=get("moe_intermediate_size"),
                      shared_expert_intermediate_size=get("shared_expert_intermediate_size"))
    else:
        fields.update(intermediate_size=get("intermediate_size"))
    cfg = Config(**fields)
    check_config(cfg)
    return cfg


MAX_JSON_BYTES = 2**26  # config, generation config, shard index, n-gram table


def read_json(path):
    """A JSON file of at most MAX_JSON_BYTES (checked before reading it)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise UserError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} a JSON file may have")
            return json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, an integer too long
        raise UserError(f"{path}: cannot read JSON ({e})") from None


def load_config(model_dir):
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"model directory {model_dir} does not exist")
    generation = model_dir / "generation_config.json"
    return config_from_dict(read_json(model_dir / "config.json"), read_json(generation) if generation.exists() else None)


# Weights: the tensors every checkpoint must hold, then reading them.

def decoder_layer_shapes(prefix, kind, cfg):
    """Tensor name -> shape for one decoder layer, as Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM name them."""
    D, Dh, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
    if kind == "linear_attention":
        C, Hv, W = cfg.conv_dim, cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
        shapes.update({
            "linear_attn.in_proj_qkv.weight": (C, D), "linear_attn.in_proj_z.weight": (cfg.value_dim, D),
            "linear_attn.in_proj_b.weight": (Hv, D), "linear_attn.in_proj_a.weight": (Hv, D),
            "linear_attn.conv1d.weight": (C, 1, W), "linear_attn.dt_bias": (Hv,), "linear_attn.A_log": (Hv,),
            "linear_attn.norm.weight": (cfg.linear_value_head_dim,), "linear_attn.out_proj.weight": (D, cfg.value_dim)})
    else:
        shapes.update({
            "self_attn.q_proj.weight": (2 * Hq * Dh, D), "self_attn.k_proj.weight": (Hkv * Dh, D),
            "self_attn.v_proj.weight": (Hkv * Dh, D), "self_attn.o_proj.weight": (D, Hq * Dh),
            "self_attn.q_norm.weight": (Dh,), "self_attn.k_norm.weight": (Dh,)})
    if cfg.is_moe:
        E, F, Fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes.update({
            "mlp.gate.weight": (E, D), "mlp.experts.gate_up_proj": (E, 2 * F, D), "mlp.experts.down_proj": (E, D, F),
            "mlp.shared_expert.gate_proj.weight": (Fs, D), "mlp.shared_expert.up_proj.weight": (Fs, D),
            "mlp.shared_expert.down_proj.weight": (D, Fs), "mlp.shared_expert_gate.weight": (1, D)})
    else:
        F = cfg.intermediate_size
        shapes.update({"mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)})
    return {prefix + name: shape for name, shape in shapes.items()}


def checkpoint_shapes(cfg, with_mtp):
    """Every tensor a text checkpoint must hold (canonical `model.` prefix), with its shape."""
    D, V = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i, kind in enumerate(cfg.layer_types):
        shapes.update(decoder_layer_shapes(f"model.layers.{i}.", kind, cfg))
    if with_mtp:  # MTP: fc over [norm(embedding); norm(hidden)], full-attention decoder layer(s), final norm
        shapes.update({"mtp.fc.weight": (D, 2 * D), "mtp.pre_fc_norm_embedding.weight": (D,),
                       "mtp.pre_fc_norm_hidden.weight": (D,), "mtp.norm.weight": (D,)})
        for j in range(max(cfg.mtp_num_hidden_layers, 1)):
            shapes.update(decoder_layer_shapes(f"mtp.layers.{j}.", "full_attention", cfg))
    return shapes


# The dtypes a checkpoint may store, little-endian as safetensors writes them; bf16 is read as its 16 bits.
SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8")}


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


class StoredTensor(NamedTuple):
    """Where one tensor lies in a .safetensors file. Its bytes are read only after the whole checkpoint's names,
    dtypes, shapes and byte ranges are checked."""
    path: Path
    dtype: str           # a SAFETENSORS_DTYPES key
    shape: tuple
    offset: int          # of its first byte in the file


def read_header(path):
    """A .safetensors file's header -> {name: StoredTensor}, checked against the format and the file's size (the
    tensors' byte ranges must tile the data section exactly, as the format requires). Reads no tensor data."""
    def error(why):
        return UserError(f"{path}: cannot read safetensors ({why})")
    try:
        with open(path, "rb") as f:
            size, length = os.fstat(f.fileno()).st_size, int.from_bytes(f.read(8), "little")
            if size < 8 or length > min(size - 8, MAX_HEADER_BYTES):
                raise error(f"header length {length}: more than the {size} - 8 bytes of the file or "
                            f"the format's limit of {MAX_HEADER_BYTES}")
            text = f.read(length)
    except (OSError, ValueError) as e:  # ValueError: a path with a NUL byte
        raise error(e) from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise error(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise error("the header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, tensors, spans = 8 + length, {}, []
    for name, entry in header.items():
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        if not (isinstance(dtype, str) and is_int_list(shape) and min(shape, default=0) >= 0 and
                is_int_list(offsets) and len(offsets) == 2):
            raise error(f"tensor {name}: expected a dtype, a shape and two data_offsets, got {entry!r:.200}")
        if dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {dtype}, supported: {sorted(SAFETENSORS_DTYPES)}")
        begin, end = offsets
        if end - begin != math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize:
            raise error(f"tensor {name}: data_offsets {offsets} do not hold a {dtype} tensor of shape {shape}")
        tensors[name] = StoredTensor(Path(path), dtype, tuple(shape), data_start + begin)
        spans.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise error(f"tensor {name} starts at data byte {begin}, expected {covered} (no gaps, no overlaps)")
        covered = end
    if covered != size - data_start:
        raise error(f"the tensors cover {covered} data bytes, the file holds {size - data_start}")
    return tensors


def is_int_list(value):
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def read_tensor(tensor):
    """Map one checked StoredTensor and copy it out as fp32. bf16 is the top half of an fp32, so it upcasts exactly."""
    if not math.prod(tensor.shape):
        return np.zeros(tensor.shape, np.float32)
    stored = np.asarray(np.memmap(tensor.path, SAFETENSORS_DTYPES[tensor.dtype], "r", tensor.offset, tensor.shape))
    if tensor.dtype != "BF16":
        return stored.astype(np.float32)
    bits = stored.astype(np.uint32)
    bits <<= 16
    return bits.view(np.float32)


def read_checkpoint_headers(model_dir):
    """model.safetensors, or the shards listed in model.safetensors.index.json -> {name: StoredTensor}."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not (isinstance(weight_map, dict) and all(isinstance(shard, str) for shard in weight_map.values())):
            raise UserError(f"{index}: no 'weight_map' object from tensor names to shard files")
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard:
                raise UserError(f"{index}: shard {shard!r} is not a file name in {model_dir}")
            shard_tensors = read_header(model_dir / shard)
            for name in shard_tensors:
                if weight_map.get(name) != shard:
                    raise UserError(f"{model_dir / shard}: tensor {name} is not listed for this shard in {index.name}")
            tensors.update(shard_tensors)
        listed_but_absent = sorted(set(weight_map) - set(tensors))
        if listed_but_absent:
            raise UserError(f"{index}: tensor {listed_but_absent[0]} is listed but not in {weight_map[listed_but_absent[0]]}")
        return tensors
    if (model_dir / "model.safetensors").exists():
        return read_header(model_dir / "model.safetensors")
    raise UserError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.([0-9]+)\.(gate_proj|up_proj|down_proj)\.weight\Z")


class FusedExperts(NamedTuple):
    """A fused MoE tensor stored per expert: expert e's slice is parts[e] (StoredTensors) concatenated on axis 0."""
    parts: tuple
    shape: tuple


def canonical_names(tensors):
    """{name: StoredTensor} in one of the published layouts -> {canonical name: StoredTensor or FusedExperts}:
    `model.language_model.` -> `model.`, the vision tower dropped, and per-expert MoE tensors fused into
    experts.gate_up_proj (E, 2F, D) (gate rows first) and experts.down_proj (E, D, F)."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        if name.startswith(("model.visual.", "visual.")):
            continue
        name = "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name
        match = EXPERT_TENSOR.match(name)
        if match:
            experts.setdefault(match[1], {})[(int(match[2]), match[3])] = tensor
        else:
            out[name] = tensor
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        for e in range(count):
            for kind in ("gate_proj", "up_proj", "down_proj"):
                if (e, kind) not in parts:
                    raise UserError(f"checkpoint: tensor {prefix}.{e}.{kind}.weight is missing")
        gate, up, down = ({parts[e, kind].shape for e in range(count)}
                          for kind in ("gate_proj", "up_proj", "down_proj"))
        if len(gate | up) != 1 or len(down) != 1 or {len(s) for s in gate | down} != {2}:
            shapes = sorted({(kind, tensor.shape) for (_, kind), tensor in parts.items()})
            raise UserError(f"checkpoint: the tensors {prefix}.*.*_proj.weight differ in shape: {shapes}")
        (F, D), = gate
        out[prefix + ".gate_up_proj"] = FusedExperts(tuple((parts[e, "gate_proj"], parts[e, "up_proj"])
                                                           for e in range(count)), (count, 2 * F, D))
        out[prefix + ".down_proj"] = FusedExperts(tuple((parts[e, "down_proj"],) for e in range(count)),
                                                  (count, *next(iter(down))))
    return out


def read_source(source):  # StoredTensor or FusedExperts -> fp32 array
    if isinstance(source, StoredTensor):
        return read_tensor(source)
    fused = np.empty(source.shape, np.float32)
    for e, parts in enumerate(source.parts):
        fused[e] = np.concatenate([read_tensor(part) for part in parts])
    return fused


def check_memory(model_dir, cfg, sources):
    """Before any tensor is read: the fp32 weights and the recurrent state must fit in this machine's memory."""
    C, W, Hv, Dk, Dv = (cfg.conv_dim, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads,
                        cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    state = cfg.layer_types.count("linear_attention") * ((W - 1) * C + Hv * Dk * Dv)      # empty_state's sizes
    need = 4 * (sum(math.prod(source.shape) for source in sources.values()) + state)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # a platform without these
        return need
    if need > memory:
        raise UserError(f"{model_dir}: the weights and the recurrent state take {need / 2**30:.3g} GiB as float32, "
                        f"more than this machine's {memory / 2**30:.3g} GiB of memory")
    return need


def check_tensors(model_dir, sources, expected):  # {name: stored}, {name: shape}: the same names, the same shapes
    for name in sorted(set(expected) - set(sources)):
        raise UserError(f"{model_dir}: tensor {name} is missing")
    for name in sorted(set(sources) - set(expected)):
        raise UserError(f"{model_dir}: unexpected tensor {name}")
    for name, shape in expected.items():
        if sources[name].shape != shape:
            raise UserError(f"{model_dir}: tensor {name} has shape {sources[name].shape}, expected {shape}")


def read_weights(model_dir, cfg):
    """The text model's tensors under canonical names, fp32. Strict: a missing, unexpected or misshaped tensor is an
    error naming it, found from the headers before any tensor data is read. `mtp.*` is kept if present."""
    sources = canonical_names(read_checkpoint_headers(model_dir))
    if cfg.tie_word_embeddings:  # tied checkpoints may or may not store lm_head; the embedding is the one used
        sources.pop("lm_head.weight", None)
    expected = checkpoint_shapes(cfg, with_mtp=any(name.startswith("mtp.") for name in sources))
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
    check_tensors(model_dir, sources, expected)
    need = check_memory(model_dir, cfg, sources)
    try:
        tensors = {name: read_source(source) for name, source in sources.items()}
    except MemoryError:  # e.g. under an address-space limit
        raise UserError(f"{model_dir}: not enough memory for {need / 2**30:.3g} GiB of float32 weights") from None
    except OSError as e:  # mapping a file (a limit again, or the file changed since its header was read)
        raise UserError(f"{model_dir}: cannot map the weights ({e})") from None
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def nested_params(flat):
    """{"model.layers.0.mlp.up_proj.weight": a, ...} -> {"layers": [{"mlp": {"up_proj": a}}], ...}: the keys stay the
    checkpoint's names (without `model.` and `.weight`), so layers unpack them with ** into pure functions."""
    root = {}
    for name, array in flat.items():
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = array

    def listify(node):
        if not isinstance(node, dict):
            return node
        if node and all(key.isdigit() for key in node):
            return [listify(node[str(i)]) for i in range(len(node))]
        return {key: listify(value) for key, value in node.items()}
    return listify(root)


def load_weights(model_dir, cfg):
    """read_weights, nested as the model functions take them; params["mtp"] is None without MTP weights."""
    params = nested_params(read_weights(model_dir, cfg))
    params["mtp"] = params.get("mtp")
    return params


def load_model(model_dir):
    cfg = load_config(model_dir)
    return cfg, load_weights(model_dir, cfg)


# A DFlash drafter's checkpoint, as the public ones store it (z-lab's DFlashDraftModel): a Qwen3 config.json with
# dflash_config {target_layer_ids, mask_token_id, block_size} (each also read at the top level), and model.safetensors
# holding fc, hidden_norm, norm and layers.N.* without a `model.` prefix, and no embedding or lm_head.

DFLASH_UNSUPPORTED = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
                      "partial_rotary_factor": 1.0, "attention_bias": False}


def dflash_config_from_dict(raw, cfg):  # the drafter's config.json, the target's Config -> DFlashConfig
    if not isinstance(raw, dict):
        raise UserError(f"DFlash config: expected a JSON object, got {type(raw).__name__}")
    extra = raw.get("dflash_config", {})
    if not isinstance(extra, dict):
        raise UserError(f"DFlash config: dflash_config={extra!r} is not an object")
    rope = {**{k: raw[k] for k in ("rope_theta", "partial_rotary_factor") if k in raw},
            **(raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {})}

    def get(key, default=None, kind=int, source=None):
        source = source if source is not None else extra if key in extra else raw
        if key not in source and default is None:
            raise UserError(f"DFlash config: required field {key!r} is missing")
        value = source.get(key, default)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise UserError(f"DFlash config: {key}={value!r} has the wrong type, expected "
                            f"{getattr(kind, '__name__', 'number')}")
        return value

    if "DFlash2DraftModel" in (raw.get("architectures") or []):
        raise UserError("DFlash config: DFlash2DraftModel (dynamic convolutions, candidate selector) is not supported")
    for key, default in DFLASH_UNSUPPORTED.items():
        value = {**raw, **rope, **extra}.get(key, default)
        if value is not None and value != default:
            raise UserError(f"DFlash config: {key}={value!r} is not supported (only {default!r})")
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise UserError(f"DFlash config: RoPE scaling is not supported (only rope_type 'default')")
    if get("hidden_act", "silu", str) != "silu":
        raise UserError(f"DFlash config: hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
    layer_types = get("layer_types", [], list)
    if any(kind not in ("full_attention", "sliding_attention") for kind in layer_types):
        raise UserError(f"DFlash config: layer_types={layer_types!r:.100} must be full_attention or sliding_attention")
    window = get("sliding_window") if "sliding_attention" in layer_types else None
    if window is not None and window < 1:
        raise UserError(f"DFlash config: sliding_window={window} must be >= 1")
    is_causal = raw.get("is_causal")
    if not isinstance(is_causal, (bool, type(None))):
        raise UserError(f"DFlash config: is_causal={is_causal!r} must be true, false or null")
    for key, target_value in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size),
                              ("num_target_layers", cfg.num_hidden_layers)):
        if get(key, target_value) != target_value:
            raise UserError(f"DFlash config: {key}={get(key)} differs from the target's {target_value}")
    heads = get("num_attention_heads")
    fields = dict(num_hidden_layers=get("num_hidden_layers"), num_attention_heads=heads,
                  num_key_value_heads=get("num_key_value_heads"),
                  head_dim=get("head_dim", cfg.hidden_size // heads if heads > 0 else 1),
                  intermediate_size=get("intermediate_size"), rms_norm_eps=get("rms_norm_eps", 1e-6, (int, float)),
                  rope_theta=get("rope_theta", 10000.0, (int, float), rope))
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rms_norm_eps", "rope_theta"):
        check_limit(key, fields[key])
    if heads % fields["num_key_value_heads"]:
        raise UserError(f"DFlash config: num_attention_heads={heads} is not a multiple of num_key_value_heads="
                        f"{fields['num_key_value_heads']}")
    if fields["head_dim"] % 2:
        raise UserError(f"DFlash config: head_dim={fields['head_dim']} must be even (RoPE rotates pairs)")
    taps = get("target_layer_ids", kind=list)
    if not taps or not is_int_list(taps) or not all(0 <= i < cfg.num_hidden_layers for i in taps) or len(
            set(taps)) != len(taps):
        raise UserError(f"DFlash config: target_layer_ids={taps!r:.100} must be distinct layers of the target's "
                        f"[0, {cfg.num_hidden_layers - 1}]")
    mask, block = get("mask_token_id"), get("block_size", 16)
    if not 0 <= mask < cfg.vocab_size:
        raise UserError(f"DFlash config: mask_token_id={mask} is outside the vocabulary [0, {cfg.vocab_size})")
    if not 2 <= block <= MAX_DRAFT_LEN + 1:
        raise UserError(f"DFlash config: block_size={block} must be in [2, {MAX_DRAFT_LEN + 1}]")
    if layer_types and len(layer_types) != fields["num_hidden_layers"]:
        raise UserError(f"DFlash config: {len(layer_types)} layer_types for num_hidden_layers="
                        f"{fields['num_hidden_layers']}")
    return DFlashConfig(**fields, target_layer_ids=tuple(taps), mask_token_id=mask, block_size=block,
                        layer_types=tuple(layer_types), sliding_window=window, is_causal=is_causal)


def dflash_shapes(cfg, dcfg):  # -> {tensor name: shape} of a DFlash checkpoint for this target
    D, Hq, Hkv, Dh, F = (cfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim,
                         dcfg.intermediate_size)
    shapes = {"fc.weight": (D, len(dcfg.target_layer_ids) * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(dcfg.num_hidden_layers):
        shapes.update({f"layers.{i}.{name}.weight": shape for name, shape in {
            "input_layernorm": (D,), "post_attention_layernorm": (D,), "self_attn.q_proj": (Hq * Dh, D),
            "self_attn.k_proj": (Hkv * Dh, D), "self_attn.v_proj": (Hkv * Dh, D), "self_attn.o_proj": (D, Hq * Dh),
            "self_attn.q_norm": (Dh,), "self_attn.k_norm": (Dh,), "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D),
            "mlp.down_proj": (D, F)}.items()})
    return shapes


def load_dflash(draft_dir, cfg):  # -> DFlashConfig, nested params {"fc", "hidden_norm", "norm", "layers": [...]}
    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise UserError(f"DFlash directory {draft_dir} does not exist")
    dcfg = dflash_config_from_dict(read_json(draft_dir / "config.json"), cfg)
    sources, expected = read_checkpoint_headers(draft_dir), dflash_shapes(cfg, dcfg)
    check_tensors(draft_dir, sources, expected)
    try:
        return dcfg, nested_params({name: read_tensor(source) for name, source in sources.items()})
    except MemoryError:
        raise UserError(f"{draft_dir}: not enough memory for the drafter's float32 weights") from None
    except OSError as e:
        raise UserError(f"{draft_dir}: cannot map the weights ({e})") from None


def cast(params, dtype):
    """The weights in another float dtype: float64 separates what is float32 rounding from what is not."""
    if isinstance(params, dict):
        return {key: cast(value, dtype) for key, value in params.items()}
    if isinstance(params, list):
        return [cast(value, dtype) for value in params]
    return None if params is None else params.astype(dtype)


# ----------------------------------------------------------------------------------------------------------------
# Command line

DEFAULT_MODEL = Path(__file__).resolve().parent / "weights" / "default"


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


def missing_extra(error, extra, needed_by):
    """A ModuleNotFoundError of an optional dependency -> the UserError naming the extra that installs it
    (pyproject.toml). A module of this project that is missing is a broken install, not a choice: re-raised."""
    package = (error.name or "").split(".")[0]
    if package in ("", "reference", "conformance", "jax_impl", "qwen35"):
        raise error
    return UserError(f"{needed_by} needs {package}, which is not installed: install the kit with its `{extra}` "
                     f"extra (pip install \"KIT[{extra}]\", KIT the wheel or the repository folder it came from)")


SEED_RANGE = (0, 2**32 - 1)          # numpy's Generator takes any non-negative int; jax.random.key without x64, 32 bits
TEMPERATURE_RANGE = (1e-3, 1e3)      # besides 0 (greedy): logits / T stays finite in float32, and inf (uniform) is out
MAX_DRAFT_LEN = 32                   # jax_impl compiles a round for a fixed K (unrolling the MTP chain K times)


# A request's settings: one table, one check. Each is a flag of both command lines (--NAME, dashes for
# underscores), a keyword of jax_impl.generate and Server.submit, and a field of the JSONL and HTTP front ends
# (python -m jax_impl.jsonl, jax_impl.http_server); every one of them checks it with check_settings, so a new setting
# is a row here (and the engines' use of it).

class Setting(NamedTuple):
    name: str
    kind: type                     # int, float or str: what the flag parses and a JSON value must be
    default: object
    ok: Callable                   # value -> whether it is allowed
    rule: str                      # the message's "must be ..."
    help: str


def flag(name):  # a setting's command-line flag
    return "--" + name.replace("_", "-")


REQUEST_SETTINGS = {s.name: s for s in (
    Setting("max_new_tokens", int, 64, lambda n: n >= 0, ">= 0", "generation also stops at the context limit"),
    Setting("temperature", float, 0.0, lambda t: t == 0 or TEMPERATURE_RANGE[0] <= t <= TEMPERATURE_RANGE[1],
            f"0 (greedy) or in [{TEMPERATURE_RANGE[0]}, {TEMPERATURE_RANGE[1]}]",
            f"0 = greedy, else in [{TEMPERATURE_RANGE[0]}, {TEMPERATURE_RANGE[1]}]"),
    Setting("top_k", int, 0, lambda k: k >= 0, ">= 0", "0 = off"),
    Setting("top_p", float, 1.0, lambda p: 0 < p <= 1, "in (0, 1]", "in (0, 1]; 1 = off"),
    Setting("seed", int, 0, lambda s: SEED_RANGE[0] <= s <= SEED_RANGE[1], f"in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
            f"in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (default 0)"),
    Setting("draft", str, "none", lambda d: True, "a drafter", "the drafter"),  # forms: make_drafter (or an engine's)
    Setting("draft_len", int, 4, lambda k: 0 <= k <= MAX_DRAFT_LEN, f"in [0, {MAX_DRAFT_LEN}]",
            f"K, draft tokens per round, in [0, {MAX_DRAFT_LEN}]"),
    Setting("rollback", str, "replay", lambda r: r in ROLLBACK_STRATEGIES, f"one of {', '.join(ROLLBACK_STRATEGIES)}",
            "how a round rolls the state back to the accepted prefix"),
)}

JSON_KINDS = {int: "an integer", float: "a number", str: "a string"}


def check_settings(settings, label=str, engine_drafters=None):
    """The check of a request's settings, {name: value} (any of REQUEST_SETTINGS): a UserError "LABEL VALUE: must be
    RULE" for the first one out of range, label(name) naming it as the caller does (flag for the command lines).
    engine_drafters: (engine, the --draft names it runs) for an engine that runs fewer drafters than this file (whose
    --draft forms make_drafter checks when it builds one)."""
    for name, value in settings.items():
        setting = REQUEST_SETTINGS[name]
        if not setting.ok(value) or value != value:  # value != value catches nan
            raise UserError(f"{label(name)} {value}: must be {setting.rule}")
    if engine_drafters and settings.get("draft", "none") not in engine_drafters[1]:
        engine, names = engine_drafters
        raise UserError(f"{label('draft')} {settings['draft']}: {engine} runs {', '.join(names[:-1])} and {names[-1]} on "
                        "device (its other --draft forms run in reference.py only)")


def json_setting(name, value, label=None):
    """A setting's value from JSON (the JSONL and HTTP front ends) -> the Python value, of the setting's kind (an int is
    a number, a bool is not)."""
    kind = REQUEST_SETTINGS[name].kind
    fits = isinstance(value, str) if kind is str else (
        not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int))
    if not fits:
        raise UserError(f"{label or name}: expected {JSON_KINDS[kind]}, got {value!r:.60}")
    return kind(value)


def check_prompt_text(text, label="--prompt"):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates (JSON: as \ud800)
        raise UserError(f"{label} is not valid UTF-8 (at character {e.start})") from None


class Backend(NamedTuple):
    """What the command line runs on: this file (REFERENCE, below) or jax_impl (python -m jax_impl), with the same
    flags, outputs and errors."""
    prog: str
    description: str
    drafters: str                  # the --draft values it takes
    add_flags: Callable            # (parser) -> None: flags of its own
    context: Callable              # (args) -> a context manager the run happens in
    load: Callable                 # (args) -> cfg, params
    prompt_logits: Callable        # (params, cfg, prompt) -> logits (T, V)
    generate: Callable             # (params, cfg, prompt, args, on_tokens) -> tokens, stats
    summary: Callable              # (stats) -> the line printed on stderr
    main_process: Callable         # () -> whether this process prints and writes (multi-host runs have several)
    engine_drafters: tuple = None  # (engine, --draft names) where it runs fewer than this file (check_settings)


def parse_args(argv, backend=None):
    backend = backend or REFERENCE
    ap = OneLineParser(prog=backend.prog, description=backend.description)
    ap.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    ap.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory (default: the embedded model)")
    for s in REQUEST_SETTINGS.values():
        choices = ROLLBACK_STRATEGIES if s.name == "rollback" else None
        ap.add_argument(flag(s.name), type=s.kind, default=s.default, choices=choices,
                        help=backend.drafters if s.name == "draft" else s.help)
    ap.add_argument("--dump-logits", metavar="PATH.npy", help="write the prompt's logits, float32 (T, V), and exit")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    ap.add_argument("--ngram-table", metavar="PATH.json", help="offline n-gram table for --draft ngram")
    backend.add_flags(ap)
    args = ap.parse_args(argv)
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UserError("give exactly one of --prompt and --prompt-ids")
    check_settings({name: getattr(args, name) for name in REQUEST_SETTINGS}, flag, backend.engine_drafters)
    if args.prompt is not None:
        check_prompt_text(args.prompt)
    return args


def parse_ids(text):
    try:
        return [int(t) for t in text.split(",")] if text.strip() else []
    except ValueError:
        raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers") from None


def load_tokenizer(model_dir):
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise UserError(f"{path}: cannot read tokenizer ({e})") from None


def text_stream(tokenizer, out):
    """(on_tokens, finish) callbacks printing the text as it grows; a trailing incomplete UTF-8 character is held
    back until the next token completes it, or until finish()."""
    tokens, shown = [], 0

    def show(final):
        nonlocal shown
        text = tokenizer.decode(tokens)
        if final or not text.endswith("\ufffd"):
            out.write(text[shown:])
            shown = len(text)

    def on_tokens(new):
        tokens.extend(new)
        if tokenizer is None:
            out.write("".join(f"{t} " for t in new))
        else:
            show(final=False)
        out.flush()

    def finish():
        if tokenizer is not None:
            show(final=True)
        out.write("\n")
    return on_tokens, finish


def nbytes(tree):
    if isinstance(tree, np.ndarray):
        return tree.nbytes
    return sum(nbytes(x) for x in tree) if isinstance(tree, (list, tuple)) else 0


class SpeculationStats:
    """An observer of generate_speculative: the time of each phase, the drafts proposed and accepted by position,
    and the bytes the rollback strategy holds (the --json stats)."""

    def __init__(self, prompt_tokens, draft_len, rollback):
        self.start, self.rollback_bytes = time.perf_counter(), 0
        self.seconds = dict.fromkeys(("prefill", "draft", "verify", "rollback"), 0.0)
        self.counts = {"target_calls": 0, "proposed": 0, "accepted": 0,
                       "accepted_by_position": [0] * draft_len, "proposed_by_position": [0] * draft_len}
        self.prompt_tokens, self.draft_len, self.rollback = prompt_tokens, draft_len, rollback

    def timed(self, phase, fn):
        def run(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds[phase] += time.perf_counter() - start
        return run

    def observe(self, target):  # the target with its verify ("verify") and commit ("rollback") timed
        def verify(state, tokens):
            logits, hidden, pending = target.verify(state, tokens)
            self.rollback_bytes = max(self.rollback_bytes, nbytes(pending.kept))
            return logits, hidden, pending
        return target._replace(verify=self.timed("verify", verify), commit=self.timed("rollback", target.commit))

    def count(self, proposed, accepted):
        c = self.counts
        c["target_calls"] += 1
        c["proposed"] += proposed
        c["accepted"] += accepted
        for i in range(proposed):
            c["proposed_by_position"][i] += 1
            c["accepted_by_position"][i] += i < accepted

    def result(self, new_tokens):
        return generation_stats(self.prompt_tokens, new_tokens, self.counts["target_calls"],
                                {**self.seconds, "total": time.perf_counter() - self.start}, self.counts,
                                self.draft_len, self.rollback, rollback_bytes=self.rollback_bytes)


def summary(stats):
    s = stats["seconds"]
    line = (f"{stats['new_tokens']} tokens in {s['total']:.2f} s "
            f"({stats['new_tokens'] / s['total'] if s['total'] else 0:.1f} tok/s); target calls {stats['target_calls']}, "
            f"{stats['tokens_per_call']:.2f} tokens/call")
    if "proposed" in stats:
        line += (f"; accepted {stats['accepted']}/{stats['proposed']} drafts, by position "
                 f"{stats['accepted_by_position']}/{stats['proposed_by_position']}; draft {s['draft']:.2f} s, "
                 f"verify {s['verify']:.2f} s, rollback {s['rollback']:.3f} s ({stats['rollback']}, "
                 f"{stats['rollback_bytes'] / 2**20:.2f} MiB held)")
    return line


def build_ngram_table(sequences, n=3, length=4):
    """Offline "free drafts": for each n-gram in the target's own generations, its most frequent next phrase."""
    counts = {}
    for seq in sequences:
        for i in range(len(seq) - n):
            phrase = tuple(seq[i + n:i + n + length])
            counter = counts.setdefault(tuple(seq[i:i + n]), {})
            counter[phrase] = counter.get(phrase, 0) + 1
    return {"n": n, "table": {" ".join(map(str, key)): list(max(c, key=lambda p: (c[p], len(p), [-t for t in p])))
                              for key, c in counts.items()}}


def read_ngram_table(path, vocab_size):
    """build_ngram_table's format: {"n": n, "table": {"t1 t2 ... tn": [next tokens]}}, every id in the vocabulary."""
    table = read_json(path)
    if not (isinstance(table, dict) and is_int_list([table.get("n")]) and table["n"] >= 1 and
            isinstance(table.get("table"), dict)):
        raise UserError(f"{path}: not an n-gram table (expected {{\"n\": int >= 1, \"table\": {{...}}}})")
    for key, phrase in table["table"].items():
        ids = key.split(" ")
        if not (len(ids) == table["n"] and all(t.isascii() and t.isdigit() and str(int(t)) == t for t in ids) and
                is_int_list(phrase) and all(0 <= t < vocab_size for t in [*map(int, ids), *phrase])):
            raise UserError(f"{path}: entry {key!r:.100}: {phrase!r:.100} is not {table['n']} token ids separated by "
                            f"spaces -> a list of token ids, all in [0, {vocab_size})")
    return table


# The self-speculative drafters' --draft forms (SELF_SPECULATIVE) and their shortlist files.

def build_shortlist(sequences, size):
    """A vocabulary shortlist for mtp-shortlist: the `size` most frequent token ids in `sequences` (ties to the
    lower id), ascending. The lab takes them from the target's own continuations of training prompts."""
    counts = np.bincount(np.concatenate([np.asarray(s, np.int64) for s in sequences]))
    order = np.argsort(-counts, kind="stable")
    return sorted(int(t) for t in order[:size] if counts[t])


def read_shortlist(path, vocab_size):
    """{"ids": [distinct token ids]}, every id in the vocabulary, at least one."""
    ids = read_json(path)
    ids = ids.get("ids") if isinstance(ids, dict) else None
    if not (is_int_list(ids) and ids and len(set(ids)) == len(ids) and all(0 <= t < vocab_size for t in ids)):
        raise UserError(f"{path}: not a shortlist (expected {{\"ids\": [distinct token ids in [0, {vocab_size})]}})")
    return np.asarray(sorted(ids), np.int64)


def parse_layers(spec, text, cfg):  # "1-3,6" -> (1, 2, 3, 6)
    layers = set()
    for part in text.split(","):
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        if not match:
            raise UserError(f"--draft {spec}: layers {text!r} must be 0-based indices and ranges, e.g. 1-3,6")
        low, high = int(match[1]), int(match[2] or match[1])
        if not low <= high < cfg.num_hidden_layers:
            raise UserError(f"--draft {spec}: {part} is not a layer or a range A-B (A <= B) of the target's layers "
                            f"[0, {cfg.num_hidden_layers - 1}]")
        layers.update(range(low, high + 1))
    return tuple(sorted(layers))


def partial_mlp_setting(spec, args, cfg):  # "F[:LAYERS]" -> (F, layers)
    fraction, has_layers, layers = args.partition(":")
    try:
        fraction = float(fraction)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        raise UserError(f"--draft {spec}: F must be a fraction in (0, 1]")
    return fraction, parse_layers(spec, layers, cfg) if has_layers else tuple(range(cfg.num_hidden_layers))


def partial_mlp_drafter(spec, args, params, cfg):
    return cheapened_drafter(spec, partial_mlp_params(params, cfg, *partial_mlp_setting(spec, args, cfg)), cfg)


def residual_layer(spec, text, cfg):
    if not (text.isdigit() and 1 <= int(text) < cfg.num_hidden_layers):
        raise UserError(f"--draft {spec}: L must be a layer in [1, {cfg.num_hidden_layers - 1}]")
    return int(text)


def layers_drafter(build):  # build(spec, params, cfg, layers) -> the --draft NAME:LAYERS form's builder
    return lambda spec, args, params, cfg: build(spec, params, cfg, parse_layers(spec, args, cfg))


# --draft NAME:ARGS -> (spec, ARGS, params, cfg) -> Drafter
SELF_SPECULATIVE = {
    "partial-mlp": partial_mlp_drafter,
    "skip-blocks": layers_drafter(cheapened_drafter),
    "mixer-reuse": layers_drafter(mixer_reuse_drafter),
    "residual-reuse": lambda spec, args, params, cfg: residual_reuse_drafter(spec, params, cfg,
                                                                             residual_layer(spec, args, cfg)),
    "mtp-shortlist": lambda spec, args, params, cfg: mtp_drafter(params, cfg, read_shortlist(args, cfg.vocab_size),
                                                                 spec),
}


DRAFT_FORMS = ("none, ngram, mtp, skip:N, model:DIR, partial-mlp:F[:LAYERS], skip-blocks:LAYERS, mixer-reuse:LAYERS, "
               "residual-reuse:L, mtp-shortlist:PATH, dflash:DIR or dflash-sampled:DIR")


def make_drafter(spec, params, cfg, ngram_table=None):
    """--draft (DRAFT_FORMS) -> Drafter or None."""
    if spec == "none":
        return None
    if spec == "ngram":
        return ngram_drafter(cfg.vocab_size, ngram_table)
    if spec == "mtp":
        return mtp_drafter(params, cfg)
    if spec.startswith("skip:"):
        if not spec[5:].isdigit():
            raise UserError(f"--draft {spec}: N must be a layer count")
        if not 1 <= int(spec[5:]) <= cfg.num_hidden_layers:
            raise UserError(f"--draft {spec}: N must be in [1, {cfg.num_hidden_layers}] (the target's layer count)")
        return model_drafter(*first_layers(params, cfg, int(spec[5:])), spec)
    if spec.startswith("model:"):
        draft_cfg, draft_params = load_model(spec[6:])
        if draft_cfg.vocab_size != cfg.vocab_size:
            raise UserError(f"--draft {spec}: vocab_size {draft_cfg.vocab_size} differs from the target's {cfg.vocab_size}")
        return model_drafter(draft_params, draft_cfg, spec)
    name, _, args = spec.partition(":")
    if name in ("dflash", "dflash-sampled"):
        if not args:
            raise UserError(f"--draft {spec}: expected {name}:DIR (a DFlash drafter's checkpoint directory)")
        return dflash_drafter(spec, params, cfg, *reversed(load_dflash(args, cfg)), sampled=name == "dflash-sampled")
    if name in SELF_SPECULATIVE:
        return SELF_SPECULATIVE[name](spec, args, params, cfg)
    raise UserError(f"--draft {spec!r}: expected {DRAFT_FORMS}")


def run(args, backend):
    cfg, params = backend.load(args)
    tokenizer = load_tokenizer(args.model)
    if args.prompt is not None and tokenizer is None:
        raise UserError(f"{args.model}: no tokenizer.json, use --prompt-ids")
    prompt = parse_ids(args.prompt_ids) if args.prompt is None else tokenizer.encode(args.prompt).ids
    if args.dump_logits:
        check_prompt(cfg, prompt)
        logits = backend.prompt_logits(params, cfg, prompt)
        try:
            if backend.main_process():
                np.save(args.dump_logits, np.asarray(logits, np.float32))
        except OSError as e:
            raise UserError(f"--dump-logits {args.dump_logits}: {e}") from None
        return
    quiet = args.json or not backend.main_process()
    on_tokens, finish = ((lambda new: None), (lambda: None)) if quiet else text_stream(tokenizer, sys.stdout)
    tokens, stats = backend.generate(params, cfg, prompt, args, on_tokens)
    if not backend.main_process():
        return
    finish()
    if args.json:
        text = tokenizer.decode(tokens) if tokenizer else ""
        print(json.dumps({"prompt_ids": prompt, "tokens": tokens, "text": text, "stats": stats}))
    print(backend.summary(stats), file=sys.stderr)


def reference_generate(params, cfg, prompt, args, on_tokens):
    table = read_ngram_table(args.ngram_table, cfg.vocab_size) if args.ngram_table else None
    if args.tree:
        budget = parse_tree_budget(args.tree)
        name, _, dflash_dir = args.draft.partition(":")
        if (args.draft not in TREE_DRAFTERS and not (name == "dflash" and dflash_dir)) or table:
            raise UserError("--tree drafts with the context n-gram lookup, the MTP head's top-k or DDTree over a "
                            "DFlash block: give it with --draft ngram (no table), --draft mtp or --draft dflash:DIR")
        drafter = (dflash_tree_drafter(args.draft, params, cfg, *reversed(load_dflash(dflash_dir, cfg)))
                   if name == "dflash" else TREE_DRAFTERS[args.draft](params, cfg))
        return generate_tree_speculative(params, cfg, prompt, args.max_new_tokens,
                                         Sampling(args.temperature, args.top_k, args.top_p),
                                         np.random.default_rng(args.seed), drafter, budget, args.rollback, on_tokens)
    drafter = make_drafter(args.draft, params, cfg, table)
    sampling, rng = Sampling(args.temperature, args.top_k, args.top_p), np.random.default_rng(args.seed)
    if drafter is None:
        return generate(params, cfg, prompt, args.max_new_tokens, sampling, rng, on_tokens)
    return generate_speculative(params, cfg, prompt, args.max_new_tokens, sampling, rng, drafter, args.draft_len,
                                args.rollback, on_tokens)


def add_tree_flag(parser, drafters="ngram or mtp"):  # --tree, for this file's command line and jax_impl's
    parser.add_argument(
        "--tree", metavar="NODES[:DEPTH[:BRANCH]]",
        help=f"verify a draft tree per round instead of a chain (with --draft {drafters}): at most NODES drafted "
             "nodes, DEPTH deep, BRANCH children per node (both default to NODES, capped at 16 and 8; docs/trees.md)")


REFERENCE = Backend(
    "reference.py", "Qwen3.5 hybrid model in NumPy, with speculative decoding.",
    f"{DRAFT_FORMS} (LAYERS: 0-based layers and ranges, e.g. 1-3,6; docs/self-speculative.md)",
    add_flags=add_tree_flag,
    context=lambda args: contextlib.nullcontext(), load=lambda args: load_model(args.model),
    prompt_logits=lambda params, cfg, prompt: forward(params, cfg, prompt, empty_state(cfg))[0],
    generate=reference_generate, summary=summary, main_process=lambda: True)


def exit_code(action):
    """Runs action(); a UserError becomes one line on stderr and exit code 2, as every command line here does."""
    try:
        action()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None, backend=REFERENCE):
    def parse_and_run():
        args = parse_args(argv, backend)
        with backend.context(args):
            run(args, backend)
    return exit_code(parse_and_run)


if __name__ == "__main__":
    sys.exit(main())
