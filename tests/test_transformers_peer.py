"""reference.py against Hugging Face transformers on checkpoints transformers itself writes, in every layout and dtype
the published Qwen3.5 checkpoints use. fp32 logits must agree within 1e-4, greedy continuations exactly."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

import reference as R
from hf_models import VOCAB, add_tensors, build, split_experts

TOL = 1e-4  # fp32; the observed differences are ~2e-6
PROMPT = np.random.default_rng(7).integers(0, VOCAB, 40).tolist()

# (name, model kind, how it is saved)
VARIANTS = [
    ("dense", "dense", {}),
    ("moe", "moe", {}),
    ("odd-shapes-tied", "odd", {}),
    ("multimodal-layout", "multimodal", {}),
    ("bf16", "dense", {"dtype": torch.bfloat16}),
    ("fp16", "dense", {"dtype": torch.float16}),
    ("sharded", "dense", {"max_shard_size": "30KB"}),
    ("moe-bf16-sharded", "moe", {"dtype": torch.bfloat16, "max_shard_size": "40KB"}),
    ("moe-per-expert", "moe", {"per_expert": True}),
]


@pytest.fixture(scope="module", params=VARIANTS, ids=[v[0] for v in VARIANTS])
def peer(request, tmp_path_factory):
    """(transformers model reloaded in fp32 from the checkpoint, reference cfg, reference params)."""
    name, kind, save = request.param
    path = tmp_path_factory.mktemp(name)
    model = build(kind)
    if "dtype" in save:
        model = model.to(save["dtype"])
    model.save_pretrained(path, max_shard_size=save.get("max_shard_size", "50GB"))
    if save.get("per_expert"):
        split_experts(path)
    loader = Qwen3_5ForConditionalGeneration if kind == "multimodal" else AutoModelForCausalLM
    hf = loader.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return hf, *R.load_model(path)


def test_checkpoint_layout_is_the_published_one(peer, tmp_path):
    hf, cfg, params = peer
    assert len(params["layers"]) == cfg.num_hidden_layers
    assert cfg.layer_types == tuple(hf.config.get_text_config().layer_types)


def test_prefill_logits(peer):
    hf, cfg, params = peer
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].numpy()
    logits = R.forward(params, cfg, PROMPT, R.empty_state(cfg))[0]
    assert np.abs(logits - expected).max() <= TOL


def test_decode_logits(peer):
    """Prefill 8 tokens, then 32 single-token steps through each implementation's own cache."""
    hf, cfg, params = peer
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = hf(ids[:, :8], use_cache=True)
        expected = [out.logits[0]]
        for t in range(8, 40):
            out = hf(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            expected.append(out.logits[0])
    expected = torch.cat(expected).numpy()
    logits, _, state, _ = R.forward(params, cfg, PROMPT[:8], R.empty_state(cfg))
    steps = [logits]
    for t in PROMPT[8:]:
        logits, _, state, _ = R.forward(params, cfg, [t], state)
        steps.append(logits)
    assert np.abs(np.concatenate(steps) - expected).max() <= TOL


def test_greedy_continuation(peer):
    hf, cfg, params = peer
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT[:12]]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    tokens, _ = R.generate(params, cfg, PROMPT[:12], 16, R.Sampling(), np.random.default_rng(0))
    assert tokens == expected[0, 12:].tolist()


def test_mtp_and_vision_tensors(tmp_path):
    """Published checkpoints carry mtp.* (kept: the MTP drafter needs it; transformers ignores it) and, in the
    multimodal layout, model.visual.* (ignored by both)."""
    model = build("dense")
    model.save_pretrained(tmp_path)
    D, F, Hq, Hkv, Dh = 48, 40, 4, 2, 24
    mtp = {"mtp.fc.weight": torch.randn(D, 2 * D), "mtp.norm.weight": torch.randn(D),
           "mtp.pre_fc_norm_embedding.weight": torch.randn(D), "mtp.pre_fc_norm_hidden.weight": torch.randn(D)}
    layer = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
             "self_attn.q_proj.weight": (2 * Hq * Dh, D), "self_attn.k_proj.weight": (Hkv * Dh, D),
             "self_attn.v_proj.weight": (Hkv * Dh, D), "self_attn.o_proj.weight": (D, Hq * Dh),
             "self_attn.q_norm.weight": (Dh,), "self_attn.k_norm.weight": (Dh,), "mlp.gate_proj.weight": (F, D),
             "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
    mtp.update({f"mtp.layers.0.{n}": torch.randn(s) for n, s in layer.items()})
    add_tensors(tmp_path, {**mtp, "model.visual.patch_embed.proj.weight": torch.randn(4, 3)})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    cfg, params = R.load_model(tmp_path)
    assert params["mtp"]["layers"][0]["self_attn"]["q_proj"].shape == (2 * Hq * Dh, D)
    np.testing.assert_array_equal(params["mtp"]["fc"], mtp["mtp.fc.weight"].numpy())
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(R.forward(params, cfg, PROMPT, R.empty_state(cfg))[0] - expected).max() <= TOL
