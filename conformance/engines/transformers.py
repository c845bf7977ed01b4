"""Hugging Face transformers (torch, CPU, float32, eager attention) as a peer engine. (The benchmarks run the same
adapter in their dtype, on a GPU when there is one.)

Whole-model cases go through AutoModelForCausalLM and its DynamicCache; primitive and layer cases call the
transformers functions and modules themselves (torch_chunk_gated_delta_rule, Qwen3_5GatedDeltaNet, ...) with the
case's weights, so they check transformers' code rather than a re-implementation. Speculative cases are
unsupported: transformers cannot roll back a Gated DeltaNet state (expectations/transformers.json has the evidence).
"""

import copy

import numpy as np
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.utils import logging

from . import Engine, register_engine
from ..format import FEATURE_GROUPS, FEATURES


def tensor(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def array(t):
    return t.detach().to(torch.float32).cpu().numpy().copy()    # a copy: the cache's tensors change in place later


def warped(logits, sampling):
    """The probabilities generate() draws from: transformers' warpers in its order, then a softmax (N, V)."""
    scores = tensor(logits)
    if sampling["temperature"] == 0:
        return F.one_hot(scores.argmax(-1), scores.shape[-1]).to(torch.float32)
    scores = TemperatureLogitsWarper(sampling["temperature"])(None, scores)
    if sampling["top_k"]:
        scores = TopKLogitsWarper(sampling["top_k"])(None, scores)
    if sampling["top_p"] < 1:
        scores = TopPLogitsWarper(sampling["top_p"])(None, scores)
    return scores.softmax(-1)


def text_config(attrs, hidden_size, layer_type, moe=False):
    """A one-layer text config carrying the case's attrs (they are named as config.json keys)."""
    rope = {"rope_type": "default", "rope_theta": attrs.get("rope_theta", 1e4),
            "partial_rotary_factor": attrs.get("partial_rotary_factor", 1.0)}
    fields = {k: v for k, v in attrs.items() if k not in ("rope_theta", "partial_rotary_factor", "prefix", "layer",
                                                           "checkpoint")}
    config = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(
        hidden_size=hidden_size, num_hidden_layers=1, layer_types=[layer_type], rope_parameters=rope, **fields)
    config._attn_implementation = "eager"
    return config


def module_with(module, inputs, prefix):
    """Load the case's weights (checkpoint names under `prefix`) strictly: a name mismatch is an error."""
    module.load_state_dict({n[len(prefix):]: tensor(a) for n, a in inputs.items() if n.startswith(prefix)}, strict=True)
    return module.eval()


@torch.no_grad()
def deltanet_layer(inputs, attrs):
    x = tensor(inputs["x"])[None]
    config = text_config(attrs, x.shape[-1], "linear_attention")
    layer = module_with(qwen.Qwen3_5GatedDeltaNet(config, layer_idx=0), inputs, attrs["prefix"] + "linear_attn.")
    cache = DynamicCache(config=config)
    # transformers keeps W conv columns (the oldest is never read) where the suite keeps W-1: pad one zero column
    conv = F.pad(tensor(inputs["state.conv"]).T[None], (1, 0))
    cache.update_conv_state(conv, 0)
    cache.update_recurrent_state(tensor(inputs["state.S"])[None], 0)
    y = layer(x, cache_params=cache)
    W = attrs["linear_conv_kernel_dim"]
    return {"y": array(y[0]), "state.conv": array(cache.layers[0].conv_states[0][0, :, -(W - 1):].T),
            "state.S": array(cache.layers[0].recurrent_states[0][0])}


@torch.no_grad()
def attention_layer(inputs, attrs):
    x, positions = tensor(inputs["x"])[None], tensor(inputs["positions"])[None]
    config = text_config(attrs, x.shape[-1], "full_attention")
    layer = module_with(qwen.Qwen3_5Attention(config, layer_idx=0), inputs, attrs["prefix"] + "self_attn.")
    cache = DynamicCache(config=config)
    cache.update(tensor(inputs["state.k"]).transpose(0, 1)[None], tensor(inputs["state.v"]).transpose(0, 1)[None], 0)
    keys = torch.arange(len(inputs["state.k"]) + x.shape[1])
    mask = torch.where(keys[None, :] <= positions[0, :, None], 0.0, float("-inf"))[None, None]   # (1, 1, T, S)
    cos_sin = qwen.Qwen3_5TextRotaryEmbedding(config)(x, positions)
    y, _ = layer(x, position_embeddings=cos_sin, attention_mask=mask, past_key_values=cache)
    return {"y": array(y[0]), "state.k": array(cache.layers[0].keys[0].transpose(0, 1)),
            "state.v": array(cache.layers[0].values[0].transpose(0, 1))}


@torch.no_grad()
def mlp_layer(inputs, attrs):
    x = tensor(inputs["x"])
    prefix = attrs["prefix"] + "mlp."
    width = inputs[prefix + "up_proj.weight"].shape[0]
    layer = module_with(qwen.Qwen3_5MLP(text_config(attrs, x.shape[-1], "linear_attention"), width), inputs, prefix)
    return {"y": array(layer(x))}


@torch.no_grad()
def moe_layer(inputs, attrs):
    x = tensor(inputs["x"])[None]
    config = text_config(attrs, x.shape[-1], "linear_attention", moe=True)
    return {"y": array(module_with(Qwen3_5MoeSparseMoeBlock(config), inputs, attrs["prefix"] + "mlp.")(x)[0])}


@torch.no_grad()
def gated_delta_rule(inputs, attrs):
    q, k, v, g, beta = (tensor(inputs[n])[None] for n in ("q", "k", "v", "g", "beta"))
    rule = qwen.torch_chunk_gated_delta_rule if attrs["form"] == "chunked" else qwen.torch_recurrent_gated_delta_rule
    o, S = rule(q, k, v, g=g, beta=beta, initial_state=tensor(inputs["initial_state"])[None], output_final_state=True,
                use_qk_l2norm_in_kernel=False)
    return {"o": array(o[0]), "final_state": array(S[0])}


@torch.no_grad()
def rms_norm(inputs, attrs):
    norm = qwen.Qwen3_5RMSNorm(inputs["weight"].shape[0], eps=attrs["eps"])
    norm.weight.copy_(tensor(inputs["weight"]))
    return {"y": array(norm(tensor(inputs["x"])))}


@torch.no_grad()
def rms_norm_gated(inputs, attrs):
    norm = qwen.Qwen3_5RMSNormGated(inputs["weight"].shape[0], eps=attrs["eps"])
    norm.weight.copy_(tensor(inputs["weight"]))
    return {"y": array(norm(tensor(inputs["x"]), tensor(inputs["z"])))}


@torch.no_grad()
def rope(inputs, attrs):
    x = tensor(inputs["x"]).transpose(0, 1)[None]                                     # (1, H, T, Dh)
    config = Qwen3_5TextConfig(head_dim=x.shape[-1], rope_parameters={
        "rope_type": "default", "rope_theta": attrs["rope_theta"], "partial_rotary_factor": attrs["partial_rotary_factor"]})
    cos, sin = qwen.Qwen3_5TextRotaryEmbedding(config)(x, tensor(inputs["positions"])[None])
    y, _ = qwen.apply_rotary_pos_emb(x, x, cos, sin)
    return {"y": array(y[0].transpose(0, 1))}


@torch.no_grad()
def causal_conv1d(inputs, attrs):
    window = tensor(inputs["window"]).T[None].clone()                                   # (1, C, W-1), updated in place
    y = qwen.causal_conv1d_update(tensor(inputs["x"]).T[None], window, tensor(inputs["weight"]))
    return {"y": array(y[0].T), "window": array(window[0].T)}


OPS = {"rms_norm": rms_norm, "rms_norm_gated": rms_norm_gated,
       "l2norm": lambda i, a: {"y": array(qwen.l2norm(tensor(i["x"]), eps=a["eps"]))},
       "rope": rope, "causal_conv1d": causal_conv1d, "gated_delta_rule": gated_delta_rule,
       "deltanet_layer": deltanet_layer, "attention_layer": attention_layer, "mlp_layer": mlp_layer,
       "moe_layer": moe_layer}


@register_engine("transformers")
class Transformers(Engine):
    features = frozenset(FEATURES) - {"speculative", "rollback:per-position", "rollback:replay", "accept:greedy",
                                      "accept:sampling", "accept:draws", "mtp", "dflash", *FEATURE_GROUPS["trees"]}

    def __init__(self, dtype="float32", device="cpu", attention="eager"):
        """The suite runs the defaults: float32 on the CPU, eager attention. The benchmarks (bench/timing.py) time
        transformers as it is usually run: in their --dtype, on a GPU when there is one, attention=None (its default
        implementation)."""
        self.dtype, self.device, self.attention = dtype, device, attention
        self.precision = "bf16" if dtype == "bfloat16" else "fp32"

    def load(self, checkpoint_dir):
        logging.disable_progress_bar()     # one "Loading weights" bar per checkpoint drowns the runner's progress
        return AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=getattr(torch, self.dtype),
                                                    attn_implementation=self.attention).to(self.device).eval()

    @torch.no_grad()
    def prefill(self, model, tokens):
        return self.decode(model, None, tokens)

    @torch.no_grad()
    def decode(self, model, state, tokens):
        out = model(input_ids=tensor(tokens)[None].to(model.device), past_key_values=state, use_cache=True)
        return array(out.logits[0]), out.past_key_values

    def copy_state(self, model, cache):
        return copy.deepcopy(cache)              # decode updates a DynamicCache in place

    def export_state(self, model, cache):
        """DynamicCache -> suite names: conv window = the last W-1 of the W cached columns, K/V as (S, Hkv, Dh)."""
        tensors = {"state.length": np.array([cache.get_seq_length()], dtype=np.int64)}
        W = model.config.linear_conv_kernel_dim
        for i, layer in enumerate(cache.layers):
            if model.config.layer_types[i] == "linear_attention":
                tensors[f"state.layers.{i}.conv"] = array(layer.conv_states[0][0, :, -(W - 1):].T)
                tensors[f"state.layers.{i}.S"] = array(layer.recurrent_states[0][0])
            else:
                tensors[f"state.layers.{i}.k"] = array(layer.keys[0].transpose(0, 1))
                tensors[f"state.layers.{i}.v"] = array(layer.values[0].transpose(0, 1))
        return tensors

    @torch.no_grad()
    def greedy(self, model, prompt, n):
        """transformers' own generation loop (greedy search with its cache), EOS ignored."""
        ids = tensor(prompt)[None].to(model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].cpu().numpy().astype(np.int64)

    def run_op(self, kind, inputs, attrs):
        return OPS[kind](inputs, attrs)

    @torch.no_grad()
    def sample(self, logits, sampling, uniforms):
        """transformers' warpers in the order generate() applies them, then an inverse-CDF draw per row."""
        p = warped(logits, sampling)
        cdf = p.cumsum(-1)
        tokens = torch.searchsorted(cdf, (tensor(uniforms) * cdf[:, -1])[:, None], right=True)[:, 0]
        return array(p), tokens.clamp(max=p.shape[-1] - 1).numpy().astype(np.int64)

    def draw(self, logits, sampling, n, seed):
        """generate()'s draw: torch.multinomial over the warped probabilities, from a seeded torch.Generator."""
        return torch.multinomial(warped(logits, sampling), n, replacement=True,
                                 generator=torch.Generator().manual_seed(seed)).numpy().astype(np.int64)
