"""mlx-lm (the mlx CPU backend on Linux, float32) as a peer engine.

Whole-model cases load a float32 copy of the checkpoint directory with mlx_lm.utils.load_model and run through the
model's cache (a KVCache per attention layer, an ArraysCache of conv window and recurrent state per Gated DeltaNet
layer), which is also what export_state reads. Flat text configs (model_type qwen3_5_text / qwen3_5_moe_text) name
no mlx-lm module, so their model_type is overridden with the module that handles them. expectations/mlx.json says
what is unsupported and what mlx-lm gets wrong.
"""

import copy
import json
import tempfile
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
from mlx_lm import sample_utils
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.models.gated_delta import gated_delta_ops
from mlx_lm.utils import load_model

from . import Engine, inverse_cdf_draw, register_engine

MLX_MODULE = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}   # HF model_type -> mlx_lm.models.<module>


def float32_copy(checkpoint_dir, folder):
    """The checkpoint with float32 weights. mlx-lm computes in the stored dtype, and its Model.sanitize adds 1 to the
    (1 + w) norm weights at load, in that dtype: on a bf16 checkpoint (weights/default) that alone rounds every norm
    to bf16 (states 3e-3 off, found by this suite). The llama_cpp adapter likewise converts to a float32 GGUF."""
    for file in checkpoint_dir.iterdir():
        if file.suffix == ".safetensors":
            weights, metadata = mx.load(str(file), return_metadata=True)
            mx.save_safetensors(str(folder / file.name), {n: w.astype(mx.float32) for n, w in weights.items()},
                                metadata)
        else:
            (folder / file.name).symlink_to(file.resolve())


def array(x):
    return np.array(x.astype(mx.float32))


def sampler_logits(sampling, logprobs):
    """The logits mlx-lm's sampler for these settings draws from: make_sampler's filters (top-p, then top-k, on the
    log-probabilities), then categorical_sampling's division by the temperature. Its draw uses mlx's own generator,
    so it is intercepted here to read what it would sample from."""
    seen = []

    def categorical_sampling(logits, temp):
        seen.append(logits * (1 / temp))
        return mx.argmax(logits, axis=-1)

    with mock.patch.object(sample_utils, "categorical_sampling", categorical_sampling):
        sample_utils.make_sampler(temp=sampling["temperature"], top_p=sampling["top_p"], top_k=sampling["top_k"])(
            logprobs)
    return seen[0]


@register_engine("mlx")
class Mlx(Engine):
    features = frozenset({"gated_delta_rule", "prefill", "decode", "extend", "greedy", "state_export", "sampling",
                          "draws", "trace", "snapshot", "moe", "untied_embeddings", "gva_ratio_3", "unequal_head_dims",
                          "conv_kernel_3", "partial_rotary_0.5", "multimodal_layout", "per_expert_weights",
                          "mtp_weights"})

    def load(self, checkpoint_dir):
        model_type = json.loads((Path(checkpoint_dir) / "config.json").read_text())["model_type"]
        override = {"model_type": MLX_MODULE[model_type]} if model_type in MLX_MODULE else None
        with tempfile.TemporaryDirectory() as copy:
            float32_copy(Path(checkpoint_dir), Path(copy))
            model, _ = load_model(Path(copy), model_config=override)
        return model

    def prefill(self, model, tokens):
        return self.decode(model, model.make_cache(), tokens)

    def decode(self, model, cache, tokens):
        logits = model(mx.array(tokens.astype(np.int32))[None], cache=cache)
        return array(logits[0]), cache

    def copy_state(self, model, cache):
        return copy.deepcopy(cache)              # a decode writes into the caches in place

    def export_state(self, model, cache):
        """mlx caches -> suite names: the conv window is already (W-1, C); S is stored (Hv, Dv, Dk) and K/V as
        (Hkv, S, Dh), both transposed here."""
        tensors = {}
        for i, layer in enumerate(cache):
            if isinstance(layer, KVCache):
                keys, values = layer.keys_and_values()
                tensors[f"state.layers.{i}.k"] = array(keys[0].transpose(1, 0, 2))
                tensors[f"state.layers.{i}.v"] = array(values[0].transpose(1, 0, 2))
                tensors["state.length"] = np.array([layer.offset], dtype=np.int64)
            else:
                tensors[f"state.layers.{i}.conv"] = array(layer[0][0])
                tensors[f"state.layers.{i}.S"] = array(layer[1][0].transpose(0, 2, 1))
        return tensors

    def greedy(self, model, prompt, n):
        """mlx-lm's own generation loop (generate_step, whose default sampler is argmax); it has no EOS stop."""
        steps = generate_step(mx.array(prompt.astype(np.int32)), model, max_tokens=n)
        return np.array([int(token) for token, _ in steps], dtype=np.int64)

    def run_op(self, kind, inputs, attrs):
        """gated_delta_rule through gated_delta_ops, the recurrence mlx-lm's GatedDeltaNet runs on CPU. Its
        conventions: the decay factor exp(g) rather than g, q already scaled by Dk^-1/2 (normalize_qk folds it in),
        states stored (Hv, Dv, Dk)."""
        q, k, v, g, beta = (mx.array(inputs[n])[None] for n in ("q", "k", "v", "g", "beta"))
        state = mx.array(inputs["initial_state"]).transpose(0, 2, 1)[None]
        o, state = gated_delta_ops(q * q.shape[-1] ** -0.5, k, v, mx.exp(g), beta, state)
        return {"o": array(o[0]), "final_state": array(state[0].transpose(0, 2, 1))}

    def sample(self, logits, sampling, uniforms):
        """Probabilities of mlx-lm's sampler; the draw is the suite's inverse CDF with the case's uniforms."""
        rows = mx.array(logits)
        if sampling["temperature"] == 0:
            p = array(mx.eye(logits.shape[-1])[sample_utils.make_sampler(temp=0)(rows)])
        else:
            p = array(mx.softmax(sampler_logits(sampling, rows - mx.logsumexp(rows, axis=-1, keepdims=True)),
                                 axis=-1))
        return p, inverse_cdf_draw(p, uniforms)

    def draw(self, logits, sampling, n, seed):
        """mlx-lm's sampler (make_sampler) over n copies of each row, drawing with mlx's own generator, seeded."""
        mx.random.seed(seed)
        sampler = sample_utils.make_sampler(temp=sampling["temperature"], top_p=sampling["top_p"],
                                            top_k=sampling["top_k"])
        rows = mx.array(logits)
        logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        return np.stack([np.array(sampler(mx.broadcast_to(row, (n, len(row))))) for row in logprobs]).astype(np.int64)
