"""The gated delta rule in JAX: one step, the per-token scan and the chunked (WY / UT) form (rollback.py rebuilds
states from a verify pass's tape). Same argument names, axis letters and einsum strings as reference.py; everything
here is fp32 whatever the model dtype (the DeltaNet state is always fp32).

Per value head h, with S of shape (Dk, Dv):
    S_t = alpha_t S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - (alpha_t S_{t-1})^T k_t),   o_t = S_t^T q_t
"""

import jax.numpy as jnp
from jax import lax

f32 = jnp.float32


def gva_heads(x, num_value_heads):  # (T, Hk, Dk) -> (T, Hv, Dk): consecutive value heads share a key head
    return jnp.repeat(x, num_value_heads // x.shape[1], axis=1)


def value_head_queries_keys(q, k, num_value_heads):  # (T, Hk, Dk) x2 -> (T, Hv, Dk) x2, q scaled by Dk^-1/2
    return gva_heads(q, num_value_heads) * f32(q.shape[-1] ** -0.5), gva_heads(k, num_value_heads)


def gated_delta_step(S, q, k, v, g, beta):  # (Hv, Dk, Dv), (Hv, Dk), (Hv, Dk), (Hv, Dv), (Hv,), (Hv,)
    """One token (q and k already per value head): decay, write the correction of what S predicts for k, read."""
    S = jnp.exp(g)[:, None, None] * S                                   # (Hv, Dk, Dv)  alpha_t S_{t-1}
    delta = beta[:, None] * (v - jnp.einsum("hkv,hk->hv", S, k))        # (Hv, Dv)
    S = S + jnp.einsum("hk,hv->hkv", k, delta)                          # (Hv, Dk, Dv)
    o = jnp.einsum("hkv,hk->hv", S, q)                                  # (Hv, Dv)  read after the update
    return o, S, delta


def gated_delta_recurrent(q, k, v, g, beta, initial_state):
    """The per-token loop as a scan. (T, Hk, Dk) x2, (T, Hv, Dv), (T, Hv) x2, (Hv, Dk, Dv) -> (T, Hv, Dv), S, delta."""
    q, k = value_head_queries_keys(q, k, v.shape[1])

    def step(S, x):
        o, S, delta = gated_delta_step(S, *x)
        return S, (o, delta)
    S, (o, delta) = lax.scan(step, initial_state, (q, k, v, g, beta))
    return o, S, delta


def solve_unit_lower(A, B):  # (Hv, C, C) strictly lower, (Hv, C, N) -> X (Hv, C, N) with (I + A) X = B
    """Forward substitution, row by row. Not a LAPACK triangular solve: on XLA:CPU (jax 0.10.2) its custom call
    intermittently deadlocks the runtime (seen in training steps and in the gradient through this scan).
    A verify pass's few rows are unrolled: there a loop iteration costs more than a row (on a GPU, a round trip
    to the host); a prefill chunk's 64 rows stay a loop."""
    def row(X, i):
        return X.at[:, i].set(B[:, i] - jnp.einsum("hj,hjn->hn", A[:, i], X)), None
    C = B.shape[1]
    return lax.scan(row, jnp.zeros_like(B), jnp.arange(C), unroll=C <= 16)[0]


def gated_delta_chunked(q, k, v, g, beta, initial_state, chunk_size=64):
    """The chunked form (see reference.gated_delta_chunked for the matrices), a scan over chunks of C tokens.
    Chunks are min(chunk_size, T) long, so a verify pass of K+1 tokens is one chunk without padding."""
    T, Hv = v.shape[:2]
    q, k = value_head_queries_keys(q, k, Hv)
    C = min(chunk_size, T)
    pad = (-T) % C
    chunks = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta)]
    chunks = [x.reshape((-1, C) + x.shape[1:]).swapaxes(1, 2) for x in chunks]               # (N, Hv, C, ...)
    lower = jnp.tril(jnp.ones((C, C), bool))                                                 # (C, C) i >= j
    strictly_lower = jnp.tril(lower, -1)

    def chunk(S, x):
        Q, Kc, Vc, G, B = x
        gamma = jnp.cumsum(G, axis=-1)                                                       # (Hv, C)
        Gamma = jnp.exp(jnp.where(lower, gamma[:, :, None] - gamma[:, None, :], -jnp.inf))   # (Hv, C, C)
        A = jnp.where(strictly_lower, jnp.einsum("hik,hjk->hij", B[..., None] * Kc, Kc) * Gamma, 0)
        U = solve_unit_lower(A, B[..., None] * Vc)                                           # (Hv, C, Dv)
        Wk = solve_unit_lower(A, (B * jnp.exp(gamma))[..., None] * Kc)                       # (Hv, C, Dk)
        Delta = U - jnp.einsum("hik,hkv->hiv", Wk, S)                                        # (Hv, C, Dv)
        O = (jnp.exp(gamma)[..., None] * jnp.einsum("hik,hkv->hiv", Q, S)
             + jnp.einsum("hij,hjv->hiv", jnp.einsum("hik,hjk->hij", Q, Kc) * Gamma, Delta))  # (Hv, C, Dv)
        decay_to_end = jnp.exp(gamma[:, -1:] - gamma)[..., None]                             # (Hv, C, 1)
        S = jnp.exp(gamma[:, -1])[:, None, None] * S + jnp.einsum("hik,hiv->hkv", decay_to_end * Kc, Delta)
        return S, (O.swapaxes(0, 1), Delta.swapaxes(0, 1))
    S, (O, Delta) = lax.scan(chunk, initial_state, chunks)
    return O.reshape((-1,) + O.shape[2:])[:T], S, Delta.reshape((-1,) + Delta.shape[2:])[:T]


def gated_delta_tree(q, k, v, g, beta, initial_state, mask):
    """A draft tree's nodes in one chunk (reference.gated_delta_tree_chunked): each node's recurrence from its
    parent's state. mask (N, N) bool is the inclusive ancestor mask (model.Tree); nodes are topologically ordered, so
    the proper-ancestor part of A is strictly lower and solve_unit_lower applies. With prefix_i the sum of g over
    i's path and Gamma_ij = exp(prefix_i - prefix_j) on the mask:
        A     = diag(beta) K K^T * Gamma on proper ancestors
        Delta = (I + A)^-1 diag(beta) (V - diag(e^prefix) K S)
        O     = diag(e^prefix) Q S + (Q K^T * Gamma) Delta
    (N, Hk, Dk) x2, (N, Hv, Dv), (N, Hv) x2, (Hv, Dk, Dv) -> o (N, Hv, Dv), delta (N, Hv, Dv)."""
    q, k = value_head_queries_keys(q, k, v.shape[1])
    Q, Kn, Vn, G, B = [x.swapaxes(0, 1) for x in (q, k, v, g, beta)]                       # (Hv, N, ...)
    N = mask.shape[0]
    prefix = jnp.einsum("hj,ij->hi", G, mask.astype(f32))                                   # (Hv, N)
    Gamma = jnp.exp(jnp.where(mask, prefix[:, :, None] - prefix[:, None, :], -jnp.inf))     # (Hv, N, N)
    proper = mask & ~jnp.eye(N, dtype=bool)
    A = jnp.where(proper, jnp.einsum("hik,hjk->hij", B[..., None] * Kn, Kn) * Gamma, 0)
    S = initial_state
    Delta = solve_unit_lower(A, B[..., None] * (Vn - jnp.exp(prefix)[..., None] * jnp.einsum("hik,hkv->hiv", Kn, S)))
    O = (jnp.exp(prefix)[..., None] * jnp.einsum("hik,hkv->hiv", Q, S)
         + jnp.einsum("hij,hjv->hiv", jnp.einsum("hik,hjk->hij", Q, Kn) * Gamma, Delta))   # (Hv, N, Dv)
    return O.swapaxes(0, 1), Delta.swapaxes(0, 1)


__all__ = ["gva_heads", "value_head_queries_keys", "gated_delta_step", "gated_delta_recurrent", "gated_delta_chunked",
           "gated_delta_tree"]
