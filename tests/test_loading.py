"""Config parsing and strict weight loading: every layout the published checkpoints use, and clear errors."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch

import reference as R
from conftest import ROOT
from hf_models import build, text_config
from weights import make_tiny

DENSE = json.loads((ROOT / "weights" / "tiny-dense" / "config.json").read_text())


def test_all_four_model_types_and_both_nestings():
    flat = R.config_from_dict(DENSE)
    nested = R.config_from_dict({"model_type": "qwen3_5", "text_config": {**DENSE, "model_type": "qwen3_5_text"},
                                 "tie_word_embeddings": False})
    assert flat == nested
    moe = json.loads((ROOT / "weights" / "tiny-moe" / "config.json").read_text())
    moe_nested = R.config_from_dict({"model_type": "qwen3_5_moe", "text_config": moe, "tie_word_embeddings": False})
    assert R.config_from_dict(moe) == moe_nested and moe_nested.is_moe and moe_nested.num_experts == 4


def test_config_written_by_transformers_round_trips(tmp_path):
    for kind in ("dense", "moe", "odd"):
        hf = text_config(kind)
        hf.save_pretrained(tmp_path / kind)
        cfg = R.load_config(tmp_path / kind)
        assert cfg.layer_types == tuple(hf.layer_types) and cfg.rotary_dim == int(hf.head_dim * (0.5 if kind == "odd" else 0.25))


def test_layer_types_from_interval_and_legacy_rope_fields():
    legacy = {k: v for k, v in DENSE.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1e6, partial_rotary_factor=0.5, full_attention_interval=2)
    cfg = R.config_from_dict(legacy)
    assert cfg.rope_theta == 1e6 and cfg.rotary_dim == 8
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    explicit = R.config_from_dict({**DENSE, "layer_types": ["full_attention"] * 4})
    assert explicit.layer_types == ("full_attention",) * 4


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    shutil.copytree(ROOT / "weights" / "tiny-dense", tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 7]}))
    assert R.load_config(tmp_path / "m").eos_token_id == (7, 256)


BAD_CONFIGS = [
    ({"model_type": "llama"}, "model_type='llama' is not one of"),
    ({"num_hidden_layers": "4"}, "num_hidden_layers=.4. has the wrong type, expected int"),
    ({"linear_num_key_heads": 3}, "linear_num_key_heads=3 does not divide linear_num_value_heads=4"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types=3 entries, expected num_hidden_layers=4"),
    ({"layer_types": ["mamba"] * 4}, "layer_types='mamba' is not a known layer type"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rms_norm_eps": -1}, "rms_norm_eps=-1 must be in [1e-12, 1.0]"),
    ({"rope_parameters": {"rope_theta": "big"}}, "rope_theta=.big. has the wrong type"),
    ({"intermediate_size": 0}, "intermediate_size=0 must be in [1, 262144]"),
    ({"linear_num_key_heads": 0}, "linear_num_key_heads=0 must be in [1, 1024]"),
    # sizes are bounded before anything is built from them (a 10**9-entry layer list took 43 s and 6.8 GB)
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 must be in [1, 1024]"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings=1000000000000 must be in [1, 16777216]"),
    ({"vocab_size": 2**40}, "vocab_size=1099511627776 must be in [1, 1048576]"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf must be in"),
    ({"rope_parameters": {"rope_theta": 10**400}}, "rope_theta=1000.* must be in [1.0, 1000000000000.0]"),
    ({"rope_parameters": {"partial_rotary_factor": float("nan")}}, "partial_rotary_factor=nan must be in [0.0, 1.0]"),
    # wrong types that used to escape as TypeError / AttributeError
    ({"model_type": ["qwen3_5_text"]}, "model_type=['qwen3_5_text'] is not one of"),
    ({"model_type": "qwen3_5"}, "text_config=None is not an object"),
    ({"rope_scaling": [1, 2]}, "rope_scaling=[1, 2] has the wrong type, expected dict"),
    ({"layer_types": "full_attention"}, "layer_types='full_attention' has the wrong type, expected list"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' has the wrong type, expected bool"),
    ({"eos_token_id": [[1]]}, "eos_token_id=[[1]] must be an integer or a list of integers"),
    ({"eos_token_id": 272}, r"eos_token_id=272 is outside the vocabulary [0, 272)"),
]


@pytest.mark.parametrize("change, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_config_errors_name_the_field_and_value(change, message):
    raw = {**DENSE, **change}
    for bracket in "()[]":
        message = message.replace(bracket, "\\" + bracket)
    with pytest.raises(R.UserError, match=message):
        R.config_from_dict({k: v for k, v in raw.items() if v is not None})


def test_generation_config_must_be_an_object():
    with pytest.raises(R.UserError, match="generation config: expected a JSON object, got list"):
        R.config_from_dict(DENSE, [256])


def test_missing_config_field():
    with pytest.raises(R.UserError, match="required field 'head_dim' is missing"):
        R.config_from_dict({k: v for k, v in DENSE.items() if k != "head_dim"})


def test_bf16_upcast_is_exact(tmp_path):
    """bf16 -> fp32 without torch must give torch's values bit for bit."""
    x = torch.randn(64, 3).bfloat16()
    save_torch({"x": x, "h": x.half()}, tmp_path / "t.safetensors")
    loaded = {name: R.read_tensor(tensor) for name, tensor in R.read_header(tmp_path / "t.safetensors").items()}
    np.testing.assert_array_equal(loaded["x"], x.float().numpy())
    np.testing.assert_array_equal(loaded["h"], x.half().float().numpy())


def test_tied_checkpoint_with_or_without_lm_head(tmp_path):
    model = build("odd")
    assert model.config.tie_word_embeddings
    model.save_pretrained(tmp_path / "m")
    cfg, params = R.load_model(tmp_path / "m")
    assert params["lm_head"] is params["embed_tokens"]
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    assert R.load_model(tmp_path / "m")[1]["lm_head"] is not None


@pytest.fixture
def sharded(tmp_path):
    build("dense").save_pretrained(tmp_path, max_shard_size="30KB")
    return tmp_path


def test_shard_index_mismatches_are_errors(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    name, shard = next(iter(sorted(index["weight_map"].items())))
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != shard)
    index["weight_map"][name] = other
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(R.UserError, match=f"tensor {name} is (not listed for this shard|listed but not in)"):
        R.load_model(sharded)


@pytest.mark.parametrize("change, message", [
    (lambda index: [index], "no 'weight_map' object from tensor names to shard files"),
    (lambda index: {**index, "weight_map": {**index["weight_map"], "lm_head.weight": 5}}, "no 'weight_map' object"),
    (lambda index: {**index, "weight_map": {**index["weight_map"], "lm_head.weight": "../model.safetensors"}},
     r"shard '../model.safetensors' is not a file name in"),
    (lambda index: {**index, "weight_map": {**index["weight_map"], "lm_head.weight": "a\x00b"}},
     "cannot read safetensors .embedded null byte"),
])
def test_bad_shard_index_is_an_error(sharded, change, message):
    path = sharded / "model.safetensors.index.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    with pytest.raises(R.UserError, match=message):
        R.load_model(sharded)


def test_weights_that_do_not_fit_in_memory_are_refused_before_reading(monkeypatch):
    """The check compares the fp32 size with the machine's memory, here made 256 KiB; no tensor is read."""
    monkeypatch.setattr(R.os, "sysconf", {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 64}.get)
    monkeypatch.setattr(R, "read_tensor", None)
    with pytest.raises(R.UserError, match=r"tiny-dense: the weights and the recurrent state take 0.00\d+ GiB as "
                                          r"float32, more than this machine's 0.000244 GiB of memory"):
        R.load_model(ROOT / "weights" / "tiny-dense")


def test_corrupt_headers_are_errors(tmp_path):
    """Each is one line naming the file; the header must tile the data exactly, as the format requires."""
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    cases = [({"b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 12, "tensor b starts at data byte 4"),
             ({"b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}, 16, "tensor b starts at data byte 12"),
             ({"b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 12]}}, 12, "do not hold a F32 tensor of shape"),
             ({"b": {"dtype": "F32", "shape": [-1], "data_offsets": [8, 4]}}, 12, "expected a dtype, a shape"),
             ({"b": {"dtype": ["F32"], "shape": [1], "data_offsets": [8, 12]}}, 12, "expected a dtype, a shape"),
             ({}, 16, "the tensors cover 12 data bytes, the file holds 16"),
             ({}, 8, "the tensors cover 12 data bytes, the file holds 8")]
    for change, data_size, message in cases:
        text = json.dumps({**header, **change}).encode()
        path = tmp_path / "t.safetensors"
        path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(data_size))
        with pytest.raises(R.UserError, match=f"t.safetensors: cannot read safetensors .*({message})"):
            R.read_header(path)


def test_missing_shard_is_an_error(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    with pytest.raises(R.UserError, match=f"{shard}: cannot read safetensors"):
        R.load_model(sharded)


def test_unsupported_dtype_is_an_error(tmp_path):
    save_file({"x": np.zeros(3, np.int8)}, tmp_path / "t.safetensors")
    with pytest.raises(R.UserError, match="tensor x has dtype I8"):
        R.read_header(tmp_path / "t.safetensors")


def test_incomplete_per_expert_tensors_are_an_error(tmp_path):
    shutil.copytree(ROOT / "weights" / "tiny-moe-per-expert-mtp", tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["mtp.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(R.UserError, match="tensor mtp.layers.0.mlp.experts.2.up_proj.weight is missing"):
        R.load_model(tmp_path / "m")


def test_no_weights_file(tmp_path):
    shutil.copy(ROOT / "weights" / "tiny-dense" / "config.json", tmp_path)
    with pytest.raises(R.UserError, match="no model.safetensors or model.safetensors.index.json"):
        R.load_model(tmp_path)


def test_misshaped_per_expert_tensor_is_an_error(tmp_path):
    shutil.copytree(ROOT / "weights" / "tiny-moe-per-expert-mtp", tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    tensors = load_file(weights)
    tensors["mtp.layers.0.mlp.experts.1.up_proj.weight"] = tensors["mtp.layers.0.mlp.experts.1.up_proj.weight"][:-1]
    save_file(tensors, weights)
    with pytest.raises(R.UserError, match=r"mtp.layers.0.mlp.experts.\*.\*_proj.weight differ in shape"):
        R.load_model(tmp_path / "m")


@pytest.mark.parametrize("name", list(make_tiny.CHECKPOINTS))
def test_tiny_checkpoints_are_what_make_tiny_writes(name, tmp_path):
    make_tiny.write_checkpoint(name, tmp_path)
    assert make_tiny.digest(tmp_path) == make_tiny.digest(ROOT / "weights" / name)
