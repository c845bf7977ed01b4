"""The DFlash block drafter on device: reference.py's section "DFlash block drafter" in JAX (docs/dflash.md).

The drafter's weights travel as a Weights pytree whose leaves are the arrays (jax_impl's layout: 2-D matrices
(in, out)) and whose static part is the reference.DFlashConfig and whether it samples, so that a compiled round is
specialised to the drafter's shapes and layer kinds. Its state is a reference.DFlashState of preallocated KV buffers
in jax_impl's layout (keys (Hkv, S, Dh), values (Hkv, Dh, S)) and the context length: the context features' keys
and values (k_norm and RoPE applied) at positions [0, length). A round appends the kept positions' features (update),
and the block [last committed token, MASK x K] attends to the live context and to itself (block_logits); the
block's own keys are never written (the reference's crop). spec_decode.py's DFLASH drafters run these in its round.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import reference
from .matvec import matmul
from .model import gqa_attention, kv_from_reference, lm_head, mlp, rope
from .weights import to_jax

f32 = jnp.float32


@jax.tree_util.register_pytree_node_class
class Weights:
    """A DFlash drafter: its nested weights (leaves), config and proposal mode (static)."""

    def __init__(self, params, dcfg, sampled=False):
        self.params, self.dcfg, self.sampled = params, dcfg, sampled

    def tree_flatten(self):
        return (self.params,), (self.dcfg, self.sampled)

    @classmethod
    def tree_unflatten(cls, static, leaves):
        return cls(leaves[0], *static)


def load(params, cfg, spec):
    """dflash:DIR or dflash-sampled:DIR -> Weights in the target's dtype (reference.load_dflash's checks)."""
    name, _, directory = spec.partition(":")
    if not directory:
        raise reference.UserError(f"--draft {spec}: expected {name}:DIR (a DFlash drafter's checkpoint directory)")
    dcfg, dparams = reference.load_dflash(directory, cfg)
    return Weights(to_jax(dparams, jnp.dtype(params["embed_tokens"].dtype).name), dcfg, name == "dflash-sampled")


def plain_rms_norm(x, weight, eps):  # (..., N) -> (..., N): Qwen3's RMSNorm, scale w (not 1 + w), fp32 statistics
    x32 = x.astype(f32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * weight.astype(f32)).astype(x.dtype)


def empty(dcfg, capacity, dtype):  # -> DFlashState with `capacity` context positions, none live
    Hkv, Dh = dcfg.num_key_value_heads, dcfg.head_dim
    layer = reference.AttnState(jnp.zeros((Hkv, capacity, Dh), dtype), jnp.zeros((Hkv, Dh, capacity), dtype))
    return reference.DFlashState((layer,) * dcfg.num_hidden_layers, jnp.int32(0))


def keys_values(x, positions, dcfg, k_proj, v_proj, k_norm):  # (T, D) -> AttnState (Hkv, T, Dh), (Hkv, Dh, T)
    T, Hkv, Dh = x.shape[0], dcfg.num_key_value_heads, dcfg.head_dim
    k = plain_rms_norm(matmul(x, k_proj).reshape(T, Hkv, Dh), k_norm, dcfg.rms_norm_eps)
    return kv_from_reference(reference.AttnState(rope(k, positions, dcfg.rope_theta, Dh),
                                                 matmul(x, v_proj).reshape(T, Hkv, Dh)))


def extend(w, draft_state, tapped, n):  # DFlashState, (T, len(taps) D) target layer outputs, n <= T -> DFlashState
    """Append the features of the first n of T positions (reference.dflash_extend): all T are written at the
    context's end, n become live (the rest is overwritten later, as attention buffers are)."""
    dp, dcfg = w.params, w.dcfg
    features = plain_rms_norm(matmul(tapped.astype(dp["fc"].dtype), dp["fc"]), dp["hidden_norm"], dcfg.rms_norm_eps)
    positions = draft_state.length + jnp.arange(features.shape[0], dtype=jnp.int32)
    layers = []
    for layer, cache in zip(dp["layers"], draft_state.layers):
        a = layer["self_attn"]
        new = keys_values(features, positions, dcfg, a["k_proj"], a["v_proj"], a["k_norm"])
        layers.append(reference.AttnState(
            lax.dynamic_update_slice_in_dim(cache.k, new.k.astype(cache.k.dtype), draft_state.length, 1),
            lax.dynamic_update_slice_in_dim(cache.v, new.v.astype(cache.v.dtype), draft_state.length, 2)))
    return reference.DFlashState(tuple(layers), draft_state.length + n)


def visible(dcfg, i, queries, keys):  # layer i, positions (B,), (S,) -> (B, S): reference.dflash_visible
    sliding = i < len(dcfg.layer_types) and dcfg.layer_types[i] == "sliding_attention"
    causal = sliding if dcfg.is_causal is None else dcfg.is_causal
    query, key = queries[:, None], keys[None, :]
    seen = jnp.ones((len(queries), len(keys)), bool)
    if causal:
        seen &= key <= query
    if sliding:
        seen &= (query - key < dcfg.sliding_window) & (causal | (key - query < dcfg.sliding_window))
    return seen


def block_logits(params, w, draft_state, block):  # (B,) tokens -> logits (B - 1, V) fp32 (reference.dflash_block)
    """One drafter pass over the block at positions [length, length + B): queries from the block, keys and values
    from the live context and the block; the block's keys are not kept."""
    dp, dcfg = w.params, w.dcfg
    B, Hq, Dh, eps = block.shape[0], dcfg.num_attention_heads, dcfg.head_dim, dcfg.rms_norm_eps
    positions = draft_state.length + jnp.arange(B, dtype=jnp.int32)
    x = params["embed_tokens"][block]                                                    # (B, D)
    for i, (layer, cache) in enumerate(zip(dp["layers"], draft_state.layers)):
        a, h = layer["self_attn"], plain_rms_norm(x, layer["input_layernorm"], eps)
        q = rope(plain_rms_norm(matmul(h, a["q_proj"]).reshape(B, Hq, Dh), a["q_norm"], eps), positions,
                 dcfg.rope_theta, Dh)
        own = keys_values(h, positions, dcfg, a["k_proj"], a["v_proj"], a["k_norm"])
        S = cache.k.shape[1]
        key_positions = jnp.concatenate([jnp.arange(S, dtype=jnp.int32), positions])
        live = jnp.concatenate([jnp.arange(S) < draft_state.length, jnp.ones(B, bool)])
        seen = visible(dcfg, i, positions, key_positions) & live[None, :]
        out = gqa_attention(q, jnp.concatenate([cache.k, own.k.astype(cache.k.dtype)], axis=1),
                            jnp.concatenate([cache.v, own.v.astype(cache.v.dtype)], axis=2), seen)
        x = x + matmul(out.reshape(B, Hq * Dh), a["o_proj"])
        x = x + mlp(plain_rms_norm(x, layer["post_attention_layernorm"], eps), **layer["mlp"])
    return lm_head(params, plain_rms_norm(x[1:], dp["norm"], eps))


def round_logits(params, w, draft_state, tapped, n, last_token, k):
    """reference.dflash_round: append n positions' features, then the block [last_token, MASK x k] -> (logits (k, V),
    the state covering the context only)."""
    draft_state = extend(w, draft_state, tapped, n)
    block = jnp.concatenate([jnp.reshape(last_token, (1,)).astype(jnp.int32),
                             jnp.full(k, w.dcfg.mask_token_id, jnp.int32)])
    return block_logits(params, w, draft_state, block), draft_state
