"""Kernel-pack peers: jax_impl's ops; the pure-PyTorch fallbacks transformers ships for this model (the chunked and
recurrent gated delta rule, the causal conv1d and its update, the gated RMSNorm, the text rotary embedding, eager
GQA attention, the MoE top-k router); flash-linear-attention's PyTorch reference functions (fla's naive chunked and
recurrent gated delta rule). The gated-delta peers reuse the NumPy engine's varlen loop (one sequence at a time), so
only the per-sequence kernel is the peer's; transformers-varlen instead hands transformers the whole packed batch with
cu_seqlens, as Qwen3_5GatedDeltaNet.forward does (conformance/expectations/kernels-transformers.json: what happens)."""

import importlib.util

import numpy as np

from .. import kernels as K, reference as R


class JaxKernels(K.NumpyKernels):
    name = "jax"

    def __init__(self):
        super().__init__()
        import jax
        jax.config.update("jax_enable_x64", False)
        from .. import sibling
        self.gd, self.M, self.jax = sibling("jax_impl.gated_delta"), sibling("jax_impl.model"), jax

    def _sequence(self, form, q, k, v, g, beta, S):
        fn = self.gd.gated_delta_recurrent if form == "recurrent" else self.gd.gated_delta_chunked
        o, S, _ = fn(q, k, v, g, beta, S)
        return np.asarray(o), np.asarray(S)

    def rms_norm_gated(self, x, z, weight, eps, dtype):
        return K.output_in(np.asarray(self.M.rms_norm_gated(x, z, weight, eps)), dtype)

    def rope(self, x, positions, theta, rotary_dim, dtype):
        return K.output_in(np.asarray(self.M.rope(x, positions, theta, rotary_dim)), dtype)

    def gated_attention(self, q, k, v, gate, cu_seqlens_q, cu_seqlens_k, dtype):
        outs = []
        for sq, sk in zip(K.sequences(cu_seqlens_q), K.sequences(cu_seqlens_k)):
            keys, values = k[sk].swapaxes(0, 1), v[sk].transpose(1, 2, 0)        # jax_impl's KV layout
            visible = K.causal_visible(sq.stop - sq.start, sk.stop - sk.start)
            o = self.M.gqa_attention(self.jax.numpy.asarray(q[sq]), keys, values, visible)
            outs.append(np.asarray(o * self.jax.nn.sigmoid(gate[sq])))
        return K.output_in(np.concatenate(outs), dtype)

    def moe_route(self, logits, top_k, dtype):
        ids, weights = self.M.route(self.jax.numpy.asarray(logits), top_k)
        return np.asarray(ids), np.asarray(weights)


class TransformersKernels(K.NumpyKernels):
    """transformers' torch fallbacks, float32 on the CPU. The delta rule gets q/k at the key heads (it expands them
    to the value heads itself, repeat_interleave) and raw q/k with use_qk_l2norm_in_kernel where the case gives them
    raw; one call per sequence (the fallbacks take no cu_seqlens: see transformers-varlen)."""
    name = "transformers"

    def __init__(self):
        super().__init__()
        import torch
        from transformers.models.qwen3_5 import configuration_qwen3_5 as c, modeling_qwen3_5 as m
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe
        self.torch, self.m, self.c, self.moe = torch, m, c, moe

    def t(self, x):
        return self.torch.from_numpy(np.ascontiguousarray(x))

    def _prepare(self, q, k, v, initial_states, qk_normalized):
        self._raw = not qk_normalized
        return q, k, initial_states

    def _sequence(self, form, q, k, v, g, beta, S):
        fn = self.m.torch_recurrent_gated_delta_rule if form == "recurrent" else self.m.torch_chunk_gated_delta_rule
        o, S = fn(*(self.t(x)[None] for x in (q, k, v, g, beta)), initial_state=self.t(S)[None],
                  output_final_state=True, use_qk_l2norm_in_kernel=self._raw)
        return o[0].numpy(), S[0].numpy()

    def gated_delta_states(self, *args, **kwargs):
        raise NotImplementedError  # the fallbacks return the final state only

    def conv_varlen(self, x, weight, windows, cu_seqlens, dtype):
        """causal_conv1d_fn pads with zeros: the model prepends the cached window (update_conv_state) and drops
        the outputs at the window's positions, as here; the window left is the last W-1 inputs."""
        W1 = weight.shape[1] - 1
        ys, outs = [], []
        for i, s in enumerate(K.sequences(cu_seqlens)):
            padded = np.concatenate([windows[i], x[s]])                             # (W-1+T, C)
            y = self.m.causal_conv1d_fn(self.t(padded.T)[None], self.t(weight), None, activation=None)
            ys.append(y[0].numpy().T[W1:])
            outs.append(padded[len(padded) - W1:])
        return K.output_in(np.concatenate(ys), dtype), np.stack(outs)

    def conv_update(self, x, weight, windows, accepted, dtype):
        """causal_conv1d_update on the whole verify block (its outputs); it has no accepted count, so the window
        to keep comes from a second update on the first accepted[i] inputs (0: no call), its in-place state."""
        ys, outs = [], []
        for xi, window, n in zip(x, windows, accepted):
            state = self.t(window.T.copy())[None]                                   # (1, C, W-1)
            ys.append(self.m.causal_conv1d_update(self.t(xi.T.copy())[None], state, self.t(weight))[0].numpy().T)
            kept = self.t(window.T.copy())[None]
            if n:
                self.m.causal_conv1d_update(self.t(xi[:n].T.copy())[None], kept, self.t(weight))
            outs.append(kept[0].numpy().T)
        return K.output_in(np.stack(ys), dtype), np.stack(outs)

    def rms_norm_gated(self, x, z, weight, eps, dtype):
        norm = self.m.Qwen3_5RMSNormGated(x.shape[-1], eps=eps)
        with self.torch.no_grad():
            norm.weight.copy_(self.t(weight))
            y = norm(self.t(x).reshape(-1, x.shape[-1]), self.t(z).reshape(-1, x.shape[-1]))
        return K.output_in(y.numpy().reshape(x.shape), dtype)

    def rope(self, x, positions, theta, rotary_dim, dtype):
        """Qwen3_5TextRotaryEmbedding (mRoPE, text positions on all three sections) and apply_rotary_pos_emb."""
        Dh = x.shape[-1]
        cfg = self.c.Qwen3_5TextConfig(head_dim=Dh, rope_parameters={
            "rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary_dim / Dh,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True})
        xt = self.t(x).transpose(0, 1)[None]                                        # (1, H, T, Dh)
        cos, sin = self.m.Qwen3_5TextRotaryEmbedding(cfg)(xt, self.t(positions)[None])
        y, _ = self.m.apply_rotary_pos_emb(xt, xt, cos, sin)
        return K.output_in(y[0].transpose(0, 1).numpy(), dtype)

    def gated_attention(self, q, k, v, gate, cu_seqlens_q, cu_seqlens_k, dtype):
        """eager_attention_forward (repeat_kv, additive mask built here: causal after the cached keys)."""
        torch = self.torch
        Hq, Hkv, Dh = q.shape[1], k.shape[1], q.shape[2]
        module = type("Attention", (), {"num_key_value_groups": Hq // Hkv, "training": False})()
        outs = []
        for sq, sk in zip(K.sequences(cu_seqlens_q), K.sequences(cu_seqlens_k)):
            visible = K.causal_visible(sq.stop - sq.start, sk.stop - sk.start)
            mask = torch.where(self.t(visible), 0.0, torch.finfo(torch.float32).min)[None, None]
            o, _ = self.m.eager_attention_forward(module, *(self.t(a).transpose(0, 1)[None] for a in
                                                            (q[sq], k[sk], v[sk])), mask, scaling=Dh ** -0.5)
            outs.append(o[0].numpy() * R.sigmoid(gate[sq]))
        return K.output_in(np.concatenate(outs), dtype)

    def moe_route(self, logits, top_k, dtype):
        """Qwen3_5MoeTopKRouter with an identity router weight, so its logits are the case's."""
        E = logits.shape[1]
        cfg = type("Config", (), {"num_experts_per_tok": top_k, "num_experts": E, "hidden_size": E})()
        router = self.moe.Qwen3_5MoeTopKRouter(cfg)
        with self.torch.no_grad():
            router.weight.copy_(self.torch.eye(E))
            _, weights, ids = router(self.t(logits))
        return ids.numpy(), weights.numpy()


class TransformersVarlenKernels(TransformersKernels):
    """The whole packed batch in one call of each delta-rule fallback, with cu_seqlens, batch 1, one initial state
    per sequence: the call Qwen3_5GatedDeltaNet.forward makes for packed sequences (cu_seq_lens_q)."""
    name = "transformers-varlen"

    def gated_delta_rule(self, form, q, k, v, g, beta, initial_states, cu_seqlens, qk_normalized, dtype):
        fn = self.m.torch_recurrent_gated_delta_rule if form == "recurrent" else self.m.torch_chunk_gated_delta_rule
        o, S = fn(*(self.t(x)[None] for x in (q, k, v, g, beta)), initial_state=self.t(initial_states),
                  output_final_state=True, use_qk_l2norm_in_kernel=not qk_normalized,
                  cu_seqlens=self.t(cu_seqlens))
        return K.output_in(o[0].numpy(), dtype), S.numpy()


def fla_naive():
    """fla/ops/gated_delta_rule/naive.py, loaded by its path: `import fla.ops` imports Triton, which a CPU-only
    machine lacks (ModuleNotFoundError: No module named 'triton', from fla/ops/abc/chunk.py)."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        raise ModuleNotFoundError("No module named 'fla'", name="fla")
    path = f"{spec.submodule_search_locations[0]}/ops/gated_delta_rule/naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


class FlaNaiveKernels(K.NumpyKernels):
    """flash-linear-attention's naive_chunk_gated_delta_rule and naive_recurrent_gated_delta_rule, one call per
    sequence (they take no cu_seqlens), q/k at the value heads (they take one head count) and l2-normalised here
    where the case gives them raw (they have no use_qk_l2norm_in_kernel); the per-position states: the recurrent
    one a token per call."""
    name = "fla"

    def __init__(self):
        super().__init__()
        import torch
        self.torch, self.naive = torch, fla_naive()

    def _sequence(self, form, q, k, v, g, beta, S):
        t = lambda x: self.torch.from_numpy(np.ascontiguousarray(x, np.float32))[None]
        if form == "recurrent":
            o, S = self.naive.naive_recurrent_gated_delta_rule(t(q), t(k), t(v), t(beta), t(g), initial_state=t(S),
                                                               output_final_state=True)
        else:
            o, S = self.naive.naive_chunk_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), initial_state=t(S),
                                                           output_final_state=True)
        return o[0].numpy(), S[0].numpy()

    def gated_delta_states(self, q, k, v, g, beta, initial_states, cu_seqlens, qk_normalized, dtype):
        q, k, S0 = self._prepare(q, k, v, initial_states, qk_normalized)
        outs, states = [], []
        for i, s in enumerate(K.sequences(cu_seqlens)):
            S = S0[i]
            for t in range(s.start, s.stop):
                o, S = self._sequence("recurrent", q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], S)
                outs.append(o[0])
                states.append(S)
        return K.output_in(np.stack(outs), dtype), self._out(np.stack(states))

    def conv_varlen(self, *args, **kwargs):
        raise NotImplementedError  # fla's naive functions are the delta rule's only

    conv_update = rms_norm_gated = rope = gated_attention = moe_route = conv_varlen


PEERS = {"jax": JaxKernels, "transformers": TransformersKernels, "transformers-varlen": TransformersVarlenKernels,
         "fla": FlaNaiveKernels}


def make(spec):
    try:
        return PEERS[spec]()
    except ModuleNotFoundError as e:
        raise R.missing_extra(e, "transformers" if spec.startswith("transformers") else spec,
                              f"--engine {spec}") from None
