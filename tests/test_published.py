"""`checkpoint --like`: random checkpoints with a published model's exact layer geometry at reduced depth, loaded by
reference.py and by transformers (logits within the kit's fp32 logits bound), and their command line's errors."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import reference as R
from conformance import published
from conformance.__main__ import main
from conformance.format import TOLERANCES

VOCAB = 300
PROMPT = np.random.default_rng(3).integers(0, VOCAB, 10).tolist()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Qwen3.5-0.8B's geometry, 4 layers, vocabulary 300, bf16 (about 200 MB): (folder, cfg, params)."""
    out = tmp_path_factory.mktemp("ckpt") / "qwen35-0.8b-4"
    assert main(["checkpoint", "--like", "Qwen3.5-0.8B", "--layers", "4", "--vocab", str(VOCAB), "--out",
                 str(out)]) == 0
    return out, *R.load_model(out)


def test_the_checkpoint_has_the_published_geometry(small):
    out, cfg, params = small
    raw = json.loads((out / "config.json").read_text())
    assert (raw["linear_num_key_heads"], raw["linear_num_value_heads"], raw["linear_key_head_dim"],
            raw["linear_value_head_dim"], raw["linear_conv_kernel_dim"]) == (16, 16, 128, 128, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim) == (8, 2, 256, 64)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.hidden_size == 1024 and cfg.intermediate_size == 3584 and cfg.tie_word_embeddings
    assert "mtp" in params and raw["torch_dtype"] == "bfloat16"


def test_transformers_loads_it_and_agrees_with_the_reference(small):
    out, cfg, params = small
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].numpy()
    logits, _, state, _ = R.forward(params, cfg, PROMPT[:7], R.empty_state(cfg))
    steps = [logits]
    for t in PROMPT[7:]:  # the reference's decode path against transformers' one-pass prefill
        logits, _, state, _ = R.forward(params, cfg, [t], state)
        steps.append(logits)
    assert np.abs(np.concatenate(steps) - expected).max() <= TOLERANCES["logits"]["atol"]


def test_the_multimodal_layout_holds_the_same_model(small, tmp_path):
    _, cfg, params = small
    out = tmp_path / "mm"
    assert main(["checkpoint", "--like", "Qwen3.5-0.8B", "--layers", "4", "--vocab", str(VOCAB), "--multimodal",
                 "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5"
    mm_cfg, mm_params = R.load_model(out)
    assert mm_cfg == cfg
    np.testing.assert_array_equal(R.forward(mm_params, mm_cfg, PROMPT, R.empty_state(cfg))[0],
                                  R.forward(params, cfg, PROMPT, R.empty_state(cfg))[0])


# Tensor shapes the published checkpoints are documented to have (docs/published-configs.md), against the names
# and shapes the command would write, without writing them.
DOCUMENTED = {
    "Qwen3.5-27B": {"model.layers.0.linear_attn.in_proj_qkv.weight": (10240, 5120),
                    "model.layers.0.linear_attn.in_proj_z.weight": (6144, 5120),
                    "model.layers.0.linear_attn.A_log": (48,),
                    "model.layers.3.self_attn.q_proj.weight": (12288, 5120),
                    "model.layers.3.self_attn.k_proj.weight": (1024, 5120),
                    "model.layers.3.self_attn.o_proj.weight": (5120, 6144),
                    "lm_head.weight": (248320, 5120)},
    "Qwen3.5-35B-A3B": {"model.layers.0.linear_attn.in_proj_qkv.weight": (8192, 2048),
                        "model.layers.0.mlp.experts.gate_up_proj": (256, 1024, 2048),
                        "mtp.layers.0.mlp.experts.gate_up_proj": (256, 1024, 2048)},
}


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_documented_tensor_shapes(name):
    shapes = published.checkpoint_names(R.config_from_dict(published.published_config(name, 4)), multimodal=False)
    for tensor, shape in DOCUMENTED[name].items():
        assert shapes[tensor] == shape, tensor


@pytest.mark.parametrize("name", list(published.PUBLISHED))
def test_every_published_geometry_is_a_valid_config(name):
    cfg = R.config_from_dict(published.published_config(name, 8))
    assert (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.head_dim, cfg.rotary_dim) == (16, 128, 256, 64)
    assert cfg.layer_types[3] == cfg.layer_types[7] == "full_attention"


@pytest.mark.parametrize("argv, message", [
    (["--like", "Qwen3.5-9X", "--layers", "4"], "invalid choice"),
    (["--like", "Qwen3.5-9B", "--layers", "3"], "--layers 3: must be in [4, 32]"),
    (["--like", "Qwen3.5-9B", "--layers", "33"], "--layers 33"),
    (["--like", "Qwen3.5-9B", "--layers", "4", "--vocab", "100"], "--vocab 100"),
    (["--like", "Qwen3.5-9B", "--layers", "4", "--seed", "-1"], "--seed -1"),
])
def test_bad_flags_are_one_line_exit_2(argv, message, tmp_path, capsys):
    assert main(["checkpoint", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_refuses_a_folder_in_use_and_more_than_the_disk_holds(tmp_path, capsys, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("")
    assert main(["checkpoint", "--like", "Qwen3.5-0.8B", "--layers", "4", "--out", str(tmp_path / "full")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    monkeypatch.setattr(published.shutil, "disk_usage", lambda path: type("U", (), {"free": 10**9})())
    assert main(["checkpoint", "--like", "Qwen3.5-397B-A17B", "--layers", "4", "--out", str(tmp_path / "big")]) == 2
    assert "GiB free" in capsys.readouterr().err and not (tmp_path / "big").exists()
