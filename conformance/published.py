"""The published Qwen3.5 configurations' layer geometry, and random checkpoints of that geometry at reduced depth.

    qwen35-conformance checkpoint --like Qwen3.5-9B --layers 4 [--vocab N] --out DIR

writes a random checkpoint in the Hugging Face layout with the named model's exact per-layer shapes (head counts,
head dims, conv width, FFN or MoE widths), its layer pattern and config fields, and its MTP head, but only the first
N decoder layers, so an engine loads it with the kernels it runs the real model with. Where each number was
confirmed: docs/published-configs.md (and `Published.confirmed` below).

The tensors are drawn block by block from one seeded stream and written to the .safetensors file as they are drawn,
so memory stays at one block whatever the checkpoint's size; the disk space it needs is checked before writing.
"""

import json
import shutil
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from . import reference as R

EOS = "<|endoftext|>"  # id 256 of the byte-level tokenizer
EOS_ID = 256


class Published(NamedTuple):
    fields: dict          # the config.json fields that differ between the models
    confirmed: str        # where those numbers were confirmed (docs/published-configs.md has the details)


# Shared by every Qwen3.5 text model (each of them in every source of docs/published-configs.md).
COMMON = dict(
    vocab_size=248320, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=262144, attention_bias=False, mtp_num_hidden_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    # read by no transformers class, but present in the published configs (vLLM reads mamba_ssm_dtype)
    attn_output_gate=True, mamba_ssm_dtype="float32")


def dense(layers, hidden, ffn, heads, kv_heads, value_heads, tie, confirmed):
    return Published(dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=layers,
                          hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, linear_num_value_heads=value_heads,
                          tie_word_embeddings=tie), confirmed)


def moe(layers, hidden, experts, top_k, expert_ffn, shared_ffn, heads, kv_heads, value_heads, confirmed):
    return Published(dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                          num_hidden_layers=layers, hidden_size=hidden, num_experts=experts,
                          num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
                          shared_expert_intermediate_size=shared_ffn, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, linear_num_value_heads=value_heads,
                          tie_word_embeddings=False), confirmed)


PUBLISHED = {
    "Qwen3.5-0.8B": dense(24, 1024, 3584, 8, 2, 16, True, "all fields: a preset copied from the model's config.json "
                          "and Megatron training arguments mirroring it"),
    "Qwen3.5-2B": dense(24, 2048, 6144, 8, 2, 16, True, "depth, width and attention heads from a model page and a "
                        "runtime's size table; FFN width 6144, 16 value heads and tied embeddings NOT confirmed"),
    "Qwen3.5-4B": dense(32, 2560, 9216, 16, 4, 32, True, "from configs of derived Qwen3_5ForCausalLM checkpoints; "
                        "tied embeddings NOT confirmed"),
    "Qwen3.5-9B": dense(32, 4096, 12288, 16, 4, 32, False, "the model card (32 value heads, 16 query/key heads, "
                        "rotary dim 64) and a quantised copy's config; untied embeddings NOT confirmed"),
    "Qwen3.5-27B": dense(64, 5120, 17408, 24, 4, 48, False, "all fields: the config and tensor list of Qwen3.6-27B "
                         "(same architecture), Megatron training arguments, the model card"),
    "Qwen3.5-35B-A3B": moe(40, 2048, 256, 8, 512, 512, 16, 2, 32, "all fields: Megatron training arguments, a preset "
                           "from the config, a tensor manifest (in_proj_qkv [8192, 2048], gate_up_proj "
                           "[256, 1024, 2048])"),
    "Qwen3.5-122B-A10B": moe(48, 3072, 256, 8, 1024, 1024, 32, 2, 64, "depth, width, experts, heads from model pages; "
                             "64 value heads and the shared-expert width 1024 NOT confirmed"),
    "Qwen3.5-397B-A17B": moe(60, 4096, 512, 10, 1024, 1024, 32, 2, 64, "depth, width, experts, heads from Megatron "
                             "training arguments; 64 value heads NOT confirmed"),
}


def published_config(name, layers, vocab=None):
    """config.json (a flat text config) of `name` cut to its first `layers` decoder layers."""
    if name not in PUBLISHED:
        raise R.UserError(f"--like {name!r}: not a published configuration ({', '.join(PUBLISHED)})")
    fields = {**COMMON, **PUBLISHED[name].fields}
    depth = fields["num_hidden_layers"]
    if not 4 <= layers <= depth:
        raise R.UserError(f"--layers {layers}: must be in [4, {depth}] for {name} (4 holds both layer types)")
    vocab = fields["vocab_size"] if vocab is None else vocab
    if not EOS_ID < vocab <= R.CONFIG_LIMITS["vocab_size"][1]:
        raise R.UserError(f"--vocab {vocab}: must be in [{EOS_ID + 1}, {R.CONFIG_LIMITS['vocab_size'][1]}] "
                          f"(the byte-level tokenizer uses ids 0..{EOS_ID})")
    fields.update(num_hidden_layers=layers, vocab_size=vocab, eos_token_id=EOS_ID, bos_token_id=EOS_ID,
                  layer_types=list(R.layer_types_from_interval(layers, fields["full_attention_interval"])))
    return fields


def byte_level_tokenizer():
    """256 byte tokens (ids in sorted order of GPT-2's byte-to-unicode alphabet) and <|endoftext|> = 256."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return tokenizer


def random_tensor(name, shape, rng, dtype=np.float64):
    """Weights spread around their init: N(0, 1/fan_in) matrices, norm offsets near 0, A and dt_bias spread wide.
    (float32 draws halve the time and memory of big checkpoints; the committed tiny ones use float64 draws.)"""
    def normal(mean, std):
        return mean + std * rng.standard_normal(shape, dtype=dtype)
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.5, 8.0, shape))
    if name.endswith("dt_bias"):
        return normal(0.0, 1.0)
    if name.endswith("linear_attn.norm.weight"):
        return normal(1.0, 0.2)
    if len(shape) == 1:  # zero-centred RMSNorm offsets
        return normal(0.0, 0.2)
    if name.endswith("embed_tokens.weight"):
        return normal(0.0, 1.0)
    return normal(0.0, shape[-1] ** -0.5)


def to_bf16_bits(x):  # float32 -> bfloat16 bits, rounded to nearest even (no nan or inf here)
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype("<u2")


BLOCK = 1 << 22  # elements drawn at a time


def drawn_blocks(name, shape, rng, dtype):
    """The tensor's bytes, drawn along its first axis a block at a time (the std depends on the last axis only)."""
    rows = max(1, BLOCK // max(1, int(np.prod(shape[1:], dtype=np.int64)))) if len(shape) > 1 else shape[0]
    for start in range(0, shape[0], rows):
        block = random_tensor(name, (min(rows, shape[0] - start),) + tuple(shape[1:]), rng, np.float32)
        yield (to_bf16_bits(block) if dtype == "bfloat16" else block.astype("<f4")).tobytes()


def checkpoint_names(cfg, multimodal):
    """Tensor name -> shape, in the Hugging Face layout (the multimodal one nests the trunk in model.language_model)."""
    shapes = R.checkpoint_shapes(cfg, with_mtp=True)
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    if multimodal:
        shapes = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): s
                  for n, s in shapes.items()}
    return shapes


def write_checkpoint(out_dir, raw, seed=0, dtype="bfloat16", multimodal=False):
    """A random checkpoint of config `raw`: config.json, generation_config.json, model.safetensors, tokenizer.json."""
    cfg = R.config_from_dict(raw)
    shapes = checkpoint_names(cfg, multimodal)
    width = 2 if dtype == "bfloat16" else 4
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * width
        header[name] = {"dtype": "BF16" if dtype == "bfloat16" else "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise R.UserError(f"--out {out_dir}: exists and is not an empty folder")
    probe = next(p for p in [out_dir, *out_dir.parents] if p.exists())
    free = shutil.disk_usage(probe).free
    if offset + (1 << 20) > free:
        raise R.UserError(f"--out {out_dir}: the checkpoint needs {offset / 2**30:.2f} GiB, {free / 2**30:.2f} GiB "
                          f"free (reduce --layers or --vocab)")
    if multimodal:
        text = {k: v for k, v in raw.items() if k not in ("architectures", "tie_word_embeddings")}
        text["model_type"] = text["model_type"][:-len("_text")]
        config = {"model_type": text["model_type"], "text_config": text, "tie_word_embeddings": cfg.tie_word_embeddings,
                  "architectures": ["Qwen3_5MoeForConditionalGeneration" if cfg.is_moe else
                                    "Qwen3_5ForConditionalGeneration"]}
    else:
        config = raw
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}, indent=2) + "\n")
    byte_level_tokenizer().save(str(out_dir / "tokenizer.json"))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    rng = np.random.default_rng(seed)
    with open(out_dir / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in shapes.items():
            for chunk in drawn_blocks(name, shape, rng, dtype):
                f.write(chunk)
    return offset


def add_arguments(parser):
    parser.add_argument("--like", required=True, choices=list(PUBLISHED), help="the published configuration")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep (>= 4: both layer types)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the published 248320)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="stored dtype (default bfloat16, as published)")
    parser.add_argument("--seed", type=int, default=0, help=f"in [{R.SEED_RANGE[0]}, {R.SEED_RANGE[1]}] (default 0)")
    parser.add_argument("--multimodal", action="store_true", help="the published repositories' layout: the text "
                        "config nested in text_config, the trunk under model.language_model. (no vision tower)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (must not exist or be empty)")


def checkpoint_command(args):
    low, high = R.SEED_RANGE
    if not low <= args.seed <= high:
        raise R.UserError(f"--seed {args.seed}: must be in [{low}, {high}]")
    raw = published_config(args.like, args.layers, args.vocab)
    size = write_checkpoint(args.out, raw, args.seed, args.dtype, args.multimodal)
    print(f"wrote {args.out}: {args.like} geometry, {args.layers} layers ({', '.join(raw['layer_types'])}) + MTP "
          f"head, vocabulary {raw['vocab_size']}, {args.dtype}, {size / 2**20:.1f} MiB")
    return 0
