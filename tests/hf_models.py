"""Tiny Qwen3.5 checkpoints written by Hugging Face transformers itself, in every layout published checkpoints use.

Every parameter is moved away from its init (norm offsets, A_log, dt_bias included), so a wrong convention (a
missing +1 on a norm, a wrong head grouping, a swapped gate) changes the logits and cannot hide.
"""

import torch
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig)
from safetensors.torch import load_file, save_file

VOCAB = 131

COMMON = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              tie_word_embeddings=False, pad_token_id=0)

# Shapes that implementations get wrong: value/key head ratio 3, head dims that are not powers of two, conv kernel 3,
# half the head rotated, tied embeddings, a layer pattern given by interval 2.
ODD = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=20,
           head_dim=20, num_attention_heads=6, num_key_value_heads=2, linear_conv_kernel_dim=3,
           rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
           tie_word_embeddings=True, layer_types=None, full_attention_interval=2)

MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28)

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


def perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim == 1 else 0.05))
    return model.float().eval()


def text_config(kind, **changes):
    fields = {**COMMON, **(ODD if kind == "odd" else {}), **changes}
    if kind == "moe":
        return Qwen3_5MoeTextConfig(**fields, **MOE)
    return Qwen3_5TextConfig(**fields, intermediate_size=40)


def build(kind, seed=0, **changes):
    """kind: dense | moe | odd | multimodal -> a perturbed fp32 transformers model in eval mode."""
    torch.manual_seed(seed)
    if kind == "multimodal":
        cfg = Qwen3_5Config(text_config=text_config("dense", **changes).to_dict(), vision_config=VISION,
                            tie_word_embeddings=False)
        return perturb(Qwen3_5ForConditionalGeneration(cfg), seed)
    cfg = text_config(kind, **changes)
    return perturb((Qwen3_5MoeForCausalLM if kind == "moe" else Qwen3_5ForCausalLM)(cfg), seed)


def split_experts(path):
    """Rewrite a saved MoE checkpoint with per-expert tensors (experts.{e}.{gate,up,down}_proj.weight), the layout
    transformers' qwen2_moe converter also reads."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        prefix = name[:-len("gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(prefix + "down_proj")
        F = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :F].contiguous()
            tensors[f"{prefix}{e}.up_proj.weight"] = gate_up[e, F:].contiguous()
            tensors[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def add_tensors(path, extra):
    """Append tensors (e.g. mtp.* or visual.*) to a saved single-file checkpoint."""
    tensors = load_file(path / "model.safetensors")
    tensors.update(extra)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
