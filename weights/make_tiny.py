"""Write the tiny random Qwen3.5 checkpoints in weights/, in the Hugging Face layout, byte for byte reproducibly
(the embedded default model is trained instead: weights/train.py).

    python -m weights.make_tiny            # rewrite all of them
    python -m weights.make_tiny --check    # verify the committed files are what this script writes

Each checkpoint covers a layout or shape that real checkpoints have and implementations get wrong (see README.md).
Every tensor is drawn away from its usual init (norm offsets, A_log, dt_bias too) so a wrong convention cannot hide.
"""

import argparse
import hashlib
import json
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import reference  # (the one table of tensor names and shapes)
from conformance.published import EOS, byte_level_tokenizer, random_tensor  # noqa: F401 (shared with the kit)

HERE = Path(__file__).resolve().parent

BASE = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=272, hidden_size=64,
    num_hidden_layers=4, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, full_attention_interval=4, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False, eos_token_id=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    torch_dtype="float32")

MOE = dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], intermediate_size=None,
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

# name -> (config changes, options). Options: mtp (write mtp.* tensors), multimodal (the Qwen3_5ForConditionalGeneration
# layout: nested text_config, `model.language_model.` prefix), per_expert (unfused MoE experts, as some MTP layers are).
CHECKPOINTS = {
    "tiny-mtp": (dict(num_hidden_layers=8, mtp_num_hidden_layers=1), {"mtp": True}),
    "tiny-dense": (dict(tie_word_embeddings=False, max_position_embeddings=2048), {}),  # room for a >1000-token trace
    "tiny-moe": (dict(MOE, tie_word_embeddings=False), {}),
    "tiny-moe-per-expert-mtp": (dict(MOE, mtp_num_hidden_layers=1), {"mtp": True, "per_expert": True}),
    "tiny-odd": (dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=20,
                      head_dim=20, linear_conv_kernel_dim=3, intermediate_size=72,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
                      mtp_num_hidden_layers=1), {"mtp": True}),
    "tiny-multimodal": (dict(tie_word_embeddings=False, mtp_num_hidden_layers=1), {"mtp": True, "multimodal": True}),
    "tiny-draft": (dict(num_hidden_layers=2, full_attention_interval=2, hidden_size=32, intermediate_size=48), {}),
}


def checkpoint_tensors(cfg, seed, options, dtype=np.float64):
    rng = np.random.default_rng(seed)
    shapes = reference.checkpoint_shapes(cfg, with_mtp=options.get("mtp", False))
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    tensors = {n: random_tensor(n, shape, rng, dtype).astype(np.float32) for n, shape in shapes.items()}
    if options.get("per_expert"):
        for fused in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
            prefix, F = fused[:-len("gate_up_proj")], cfg.moe_intermediate_size
            gate_up, down = tensors.pop(fused), tensors.pop(prefix + "down_proj")
            for e in range(cfg.num_experts):
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :F]
                tensors[f"{prefix}{e}.up_proj.weight"] = gate_up[e, F:]
                tensors[f"{prefix}{e}.down_proj.weight"] = down[e]
    if options.get("multimodal"):
        tensors = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
                   for n, t in tensors.items()}
    return {n: np.ascontiguousarray(t) for n, t in tensors.items()}


def write_random_checkpoint(out_dir, changes, seed, options=None, dtype=np.float64):
    """A random checkpoint of BASE updated with `changes`, in the Hugging Face layout, with the byte tokenizer."""
    options = options or {}
    raw = {k: v for k, v in {**BASE, **changes}.items() if v is not None}
    cfg = reference.config_from_dict(raw)
    if options.get("multimodal"):
        text = {k: v for k, v in raw.items() if k not in ("architectures", "tie_word_embeddings", "torch_dtype")}
        raw = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": text, "tie_word_embeddings": raw["tie_word_embeddings"], "torch_dtype": "float32"}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}, indent=2) + "\n")
    save_file(checkpoint_tensors(cfg, seed, options, dtype), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    byte_level_tokenizer().save(str(out_dir / "tokenizer.json"))


def write_checkpoint(name, out_dir):
    changes, options = CHECKPOINTS[name]
    write_random_checkpoint(out_dir, changes, zlib.crc32(name.encode()), options)


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    ap.add_argument("names", nargs="*", default=list(CHECKPOINTS))
    args = ap.parse_args()
    stale = []
    for name in args.names:
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                write_checkpoint(name, Path(tmp))
                if digest(Path(tmp)) != digest(HERE / name):
                    stale.append(name)
        else:
            write_checkpoint(name, HERE / name)
            print(f"wrote weights/{name}")
    if stale:
        sys.exit(f"stale checkpoints (run python -m weights.make_tiny): {', '.join(stale)}")


if __name__ == "__main__":
    main()
