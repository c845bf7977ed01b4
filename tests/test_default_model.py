"""The embedded default model (weights/default, trained by weights/train.py): it loads in every engine with matching
logits, its greedy text agrees across engines (the conformance case model-default-greedy pins it), and its MTP head
drafts far better than chance."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jax_impl
import reference as R
from conftest import ROOT, model

DEFAULT = ROOT / "weights" / "default"
PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def prompt():
    return R.load_tokenizer(DEFAULT).encode(PROMPT).ids


def test_it_is_the_trained_qwen35_architecture_with_mtp():
    cfg, params = model("default")
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + \
        ("full_attention",)
    assert params["mtp"] is not None and cfg.mtp_num_hidden_layers == 1
    assert R.load_tokenizer(DEFAULT).decode(R.load_tokenizer(DEFAULT).encode(PROMPT).ids) == PROMPT


def test_reference_jax_and_transformers_agree(prompt):
    cfg, params = model("default")
    logits = R.forward(params, cfg, prompt, R.empty_state(cfg))[0]
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].numpy()
    jcfg, jparams = jax_impl.load(DEFAULT)
    state = jax_impl.empty_state(jcfg, len(prompt))
    jax_logits = np.asarray(jax_impl.prefill(jparams, jcfg, np.asarray(prompt), state)[0])
    scale = np.abs(expected).max()
    assert np.abs(logits - expected).max() <= 1e-4 * scale
    assert np.abs(jax_logits - expected).max() <= 1e-4 * scale


def test_greedy_text_is_the_same_in_reference_and_transformers(prompt):
    cfg, params = model("default")
    tokens, _ = R.generate(params, cfg, prompt, 24, R.Sampling(), np.random.default_rng(0))
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False)[0, len(prompt):]
    assert tokens == expected.tolist()


def test_mtp_drafts_far_better_than_chance(prompt):
    """Chance acceptance of a draft is 1/V = 0.02%; the trained MTP head must reach the model card's target, half of
    its first-position drafts accepted (on held-out text it gets 82%)."""
    cfg, params = model("default")
    cfg = R.replace(cfg, eos_token_id=())
    tokens, stats = R.generate_speculative(params, cfg, prompt, 48, R.Sampling(), np.random.default_rng(0),
                                           R.make_drafter("mtp", params, cfg), 1)
    assert stats["accepted"] / stats["proposed"] >= 0.5
    assert tokens == R.generate(params, cfg, prompt, 48, R.Sampling(), np.random.default_rng(0))[0]
