"""Kernel-pack peers: jax_impl's gated-delta forms and conv, and the pure-PyTorch gated delta rule transformers ships
for this model (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule). Both reuse the NumPy engine's
varlen loop (one sequence at a time), so only the per-sequence kernel is the peer's."""

import numpy as np

from .. import kernels as K, reference as R


class JaxKernels(K.NumpyKernels):
    name = "jax"

    def __init__(self):
        super().__init__()
        import jax
        jax.config.update("jax_enable_x64", False)
        from .. import sibling
        self.gd = sibling("jax_impl.gated_delta")

    def _sequence(self, form, q, k, v, g, beta, S):
        fn = self.gd.gated_delta_recurrent if form == "recurrent" else self.gd.gated_delta_chunked
        o, S, _ = fn(q, k, v, g, beta, S)
        return np.asarray(o), np.asarray(S)


class TransformersKernels(K.NumpyKernels):
    """transformers' torch fallbacks take q/k at the value heads ([1, T, Hv, Dk]); we expand them as the model does
    (repeat_interleave) and pass raw q/k with use_qk_l2norm_in_kernel where the case gives them raw."""
    name = "transformers"

    def __init__(self):
        super().__init__()
        import torch
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        self.torch, self.m = torch, m

    def _prepare(self, q, k, v, initial_states, qk_normalized):
        self._raw = not qk_normalized
        return (*self._heads(q, k, v.shape[1]), initial_states)

    def _sequence(self, form, q, k, v, g, beta, S):
        t = lambda x: self.torch.from_numpy(np.ascontiguousarray(x, np.float32))[None]
        fn = self.m.torch_recurrent_gated_delta_rule if form == "recurrent" else self.m.torch_chunk_gated_delta_rule
        o, S = fn(t(q), t(k), t(v), t(g), t(beta), initial_state=t(S), output_final_state=True,
                  use_qk_l2norm_in_kernel=self._raw)
        return o[0].numpy(), S[0].numpy()

    def gated_delta_states(self, *args, **kwargs):
        raise NotImplementedError  # the fallbacks return the final state only

    def conv_varlen(self, *args, **kwargs):
        raise NotImplementedError  # not adapted yet

    def conv_update(self, *args, **kwargs):
        raise NotImplementedError  # transformers' update has no accepted count


def make(spec):
    try:
        return {"jax": JaxKernels, "transformers": TransformersKernels}[spec]()
    except ModuleNotFoundError as e:
        raise R.missing_extra(e, spec, f"--engine {spec}") from None
