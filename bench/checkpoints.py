"""Random benchmark checkpoints, written on demand (never committed) into a cache folder; and random weights of the
published shapes made on the device (random_model), where a checkpoint would take long to write and read.

Shapes: `0.8b` is Qwen3.5-0.8B (docs/architecture.md, "Published configurations"; fp32 about 3.2 GB), `30m` is
a ~30M-parameter model (hidden 512, 8 layers, vocab 8192), `30m-draft` a small drafter with the same vocabulary.
"""

import os
import sys
from pathlib import Path

import numpy as np

import reference as R
from weights.make_tiny import BASE, write_random_checkpoint

CACHE = Path(os.environ.get("QWEN35_BENCH_CACHE", "/tmp/qwen35-bench"))

SHAPES = {
    "0.8b": dict(vocab_size=248320, hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                 max_position_embeddings=262144, tie_word_embeddings=True, mtp_num_hidden_layers=1,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
    "30m": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096,
                tie_word_embeddings=True, mtp_num_hidden_layers=1),
    "30m-draft": dict(vocab_size=8192, hidden_size=128, num_hidden_layers=2, full_attention_interval=2,
                      intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
                      linear_value_head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True),
}


def checkpoint(name):
    """Path of the random checkpoint `name`, written (with MTP weights, seed 0) if not cached yet."""
    path = CACHE / name
    if not (path / "model.safetensors").exists():
        print(f"writing random checkpoint {name} into the bench cache ...", file=sys.stderr, flush=True)
        write_random_checkpoint(path, SHAPES[name], seed=0, options={"mtp": "mtp_num_hidden_layers" in SHAPES[name]},
                                dtype=np.float32)
    return path


def model_dir(name):
    """The benchmarks' checkpoint `name`: "default" is the embedded default model, the rest are random (SHAPES)."""
    return R.DEFAULT_MODEL if name == "default" else checkpoint(name)


def random_model(name, dtype):
    """(Config, jax_impl weights) of shape `name`, a published configuration (bench/costmodel.py PUBLISHED: "0.8B",
    "9B", ...) or one of SHAPES, its weights random and made on the device: for timing only."""
    from bench.costmodel import PUBLISHED, published_config
    from jax_impl.weights import random_params
    cfg = published_config(name) if name in PUBLISHED else R.config_from_dict({**BASE, **SHAPES[name]})
    return cfg, random_params(cfg, dtype)


def label(name):
    """Where checkpoint `name` comes from, for a log: without this machine's paths."""
    return "weights/default" if name == "default" else f"random, {name} in the bench cache"


def copy_prompt(length, vocab, seed=0):
    """A prompt that invites copying: one random 16-token phrase, repeated to `length` tokens."""
    return [int(t) for t in np.resize(np.random.default_rng(seed).integers(0, vocab, 16), length)]
