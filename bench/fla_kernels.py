"""flash-linear-attention's Triton kernels as a kernel-pack engine (GPU only; bench/gpu_kernels.sh runs it).

    python -m conformance kernels --engine bench.fla_kernels:FlaKernels [--dtype bfloat16]

chunk_gated_delta_rule and fused_recurrent_gated_delta_rule are called once on the whole varlen batch (cu_seqlens,
batch 1), q/k expanded to the value heads first (repeat_interleave, value head j reads key head j // (Hv / Hk)),
raw q/k normalised by the kernel (use_qk_l2norm_in_kernel). fla's states are [N, H, K, V]: layout HKV. The conv
and per-position-state ops are not adapted (SKIP). Untested here: no device was lent when it was written."""

import numpy as np

from conformance import kernels as K


class FlaKernels(K.KernelEngine):
    name = "fla"
    state_layout = "HKV"

    def __init__(self):
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        self.torch = torch
        self.ops = {"chunked": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}

    def gated_delta_rule(self, form, q, k, v, g, beta, initial_states, cu_seqlens, qk_normalized, dtype):
        torch = self.torch
        ddt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        r = v.shape[1] // q.shape[1]
        t = lambda x, d=ddt: torch.from_numpy(np.ascontiguousarray(x)).to("cuda", d)[None]
        o, S = self.ops[form](t(np.repeat(q, r, axis=1)), t(np.repeat(k, r, axis=1)), t(v), t(g, torch.float32),
                              t(beta), scale=q.shape[-1] ** -0.5,
                              initial_state=t(initial_states, torch.float32)[0], output_final_state=True,
                              cu_seqlens=torch.from_numpy(cu_seqlens).to("cuda"),
                              use_qk_l2norm_in_kernel=not qk_normalized)
        return o[0].float().cpu().numpy(), S.float().cpu().numpy()
