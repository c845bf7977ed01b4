"""Write weights/tiny-mtp-dflash: a random-weight DFlash block drafter for the tiny-mtp target, in the public
drafters' layout (z-lab's DFlashDraftModel: a Qwen3 config.json with dflash_config, and model.safetensors with fc,
hidden_norm, norm and layers.N.*; no embedding or lm_head), byte for byte reproducibly.

    python -m weights.make_tiny_dflash            # rewrite it
    python -m weights.make_tiny_dflash --check    # verify the committed files are what this script writes
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

import reference

HERE = Path(__file__).resolve().parent
NAME, TARGET = "tiny-mtp-dflash", "tiny-mtp"

# Three taps of the 8-layer target, not in a symmetric pattern, so a wrong layer or a wrong order shows; the mask
# id is a row of the embedding no byte or EOS uses; block_size 5: the default --draft-len 4.
CONFIG = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 272, "num_target_layers": 8,
    "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False, "torch_dtype": "float32", "block_size": 5,
    "dflash_config": {"target_layer_ids": [1, 6, 3], "mask_token_id": 271, "block_size": 5},
}


def random_dflash_tensors(cfg, dcfg, seed, dtype=np.float64):
    """N(0, 1/fan_in) matrices; Qwen3 RMSNorm scales (w, not 1 + w) spread around 1."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in reference.dflash_shapes(cfg, dcfg).items():
        draw = rng.standard_normal(shape, dtype=dtype)
        tensors[name] = (1.0 + 0.2 * draw if len(shape) == 1 else draw * shape[-1] ** -0.5).astype(np.float32)
    return tensors


def write(out_dir, raw=CONFIG, seed=None):
    cfg = reference.load_config(HERE / TARGET)
    dcfg = reference.dflash_config_from_dict(raw, cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file(random_dflash_tensors(cfg, dcfg, zlib.crc32(NAME.encode()) if seed is None else seed),
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    if ap.parse_args().check:
        with tempfile.TemporaryDirectory() as tmp:
            write(tmp)
            if digest(Path(tmp)) != digest(HERE / NAME):
                sys.exit(f"stale: weights/{NAME} (run python -m weights.make_tiny_dflash)")
    else:
        write(HERE / NAME)
        print(f"wrote weights/{NAME}")


if __name__ == "__main__":
    main()
