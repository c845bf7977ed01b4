"""The DFlash block drafter (reference.py, docs/dflash.md): exact through the verifier (greedy tokens of plain
decoding under both rollbacks; the target's distribution when sampling, by chi-square, and with the trained drafter
in closed form per slot and by chi-square against a wrong q), its block logits against a
from-scratch computation written out here over several rounds with partial accepts (which fails when the first slot
is a mask, the cache is not cropped, the wrong layers are tapped or the features are not normed), its checkpoint
loader and its --draft forms' one-line errors."""

import json
from functools import lru_cache
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import reference as R
from conftest import ROOT, model
from test_self_speculative import SAMPLING, SAMPLING_RUNS, output_counts, small_model_with_mtp
from test_speculative import NEW_TOKENS, PROMPT, chi_square_p_value, exact_distribution, plain_greedy
from weights.make_tiny_dflash import CONFIG, random_dflash_tensors

DIR = ROOT / "weights" / "tiny-mtp-dflash"
SPECS = ["dflash", "dflash-sampled"]


def tiny(dtype=np.float64):  # the tiny-mtp target and its committed random DFlash drafter
    cfg, params = model("tiny-mtp", dtype)
    dcfg, dparams = R.load_dflash(DIR, cfg)
    return cfg, params, dcfg, R.cast(dparams, dtype)


def drafter(spec, dtype=np.float32):
    cfg, params, dcfg, dparams = tiny(dtype)
    return R.dflash_drafter(spec, params, cfg, dparams, dcfg, sampled=spec == "dflash-sampled")


# --- Exactness ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
@pytest.mark.parametrize("spec", SPECS)
def test_greedy_speculative_equals_plain(spec, rollback):
    cfg, params = model("tiny-mtp")
    for K in (1, 4, 7):
        tokens, stats = R.generate_speculative(params, cfg, PROMPT, NEW_TOKENS, R.Sampling(), np.random.default_rng(0),
                                               drafter(spec), K, rollback)
        assert tokens == plain_greedy("tiny-mtp"), (K, stats)


def small_dflash(sampled, taps=(1, 0)):
    """A random DFlash drafter for test_self_speculative's 4-token model (2 layers): drafts get accepted and
    rejected, and its distributions are broad enough for a wrong q to show."""
    cfg, params = small_model_with_mtp()
    dcfg = R.DFlashConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          intermediate_size=16, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=taps,
                          mask_token_id=3, block_size=3)
    dparams = R.nested_params(random_dflash_tensors(cfg, dcfg, seed=5))
    return cfg, params, R.dflash_drafter("dflash", params, cfg, dparams, dcfg, sampled)


@pytest.mark.parametrize("rollback", R.ROLLBACK_STRATEGIES)
@pytest.mark.parametrize("sampled", [False, True])
def test_greedy_equals_plain_with_drafts_accepted_and_rejected(sampled, rollback):
    cfg, params, d = small_dflash(sampled)
    prompt = [1, 2, 3, 1, 2]
    plain, _ = R.generate(params, cfg, prompt, 30, R.Sampling(), np.random.default_rng(0))
    for K in (1, 2, 5):
        tokens, stats = R.generate_speculative(params, cfg, prompt, 30, R.Sampling(), np.random.default_rng(0), d, K,
                                               rollback)
        assert tokens == plain, (K, stats)
        assert 0 < stats["accepted"] < stats["proposed"], stats


def test_speculative_sampling_with_the_drafter_preserves_the_distribution():
    """The first 3 generated tokens over 2,000 seeded runs follow plain sampling's exact distribution, each slot drawn
    from the drafter's softmax (argmax proposals with a one-hot q: the trained drafter's checks below, for CI's time)."""
    cfg, params, d = small_dflash(True)
    counts = output_counts(cfg, params, d, SAMPLING, SAMPLING_RUNS)
    assert chi_square_p_value(counts, exact_distribution(cfg, params, [1, 2, 3, 1, 2], 3, SAMPLING),
                              SAMPLING_RUNS) > 1e-3


def test_the_sampling_check_catches_a_wrong_q():
    """The check above has power at its run count: slots drawn from the drafter's softmax but reported with a
    uniform q fail it."""
    cfg, params, d = small_dflash(True)

    def uniform_q(*args):
        tokens, q, state = d.propose(*args)
        return tokens, np.full_like(q, 1 / cfg.vocab_size), state
    counts = output_counts(cfg, params, d._replace(propose=uniform_q), SAMPLING, SAMPLING_RUNS)
    assert chi_square_p_value(counts, exact_distribution(cfg, params, [1, 2, 3, 1, 2], 3, SAMPLING),
                              SAMPLING_RUNS) < 1e-6


def test_sampled_slots_follow_the_q_reported():
    """Each slot is drawn independently from its q: over 2,000 draws the first two slots' frequencies fit q[0], q[1]."""
    cfg, params, d = small_dflash(True)
    prompt = [1, 2, 3, 1, 2, 0]
    _, tapped, _, _ = R.forward(params, cfg, prompt[:-1], R.empty_state(cfg), d.taps)
    counts = [{}, {}]
    for seed in range(2_000):
        tokens, q, _ = d.propose(d.initial_state, prompt, tapped, 2, R.Sampling(1.0), np.random.default_rng(seed))
        for i in range(2):
            counts[i][(tokens[i],)] = counts[i].get((tokens[i],), 0) + 1
    for i in range(2):
        assert chi_square_p_value(counts[i], {(t,): p for t, p in enumerate(q[i])}, 2_000) > 1e-3


# --- The block logits, written out ---------------------------------------------------------------------------------

def norm(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def target_layer_outputs(params, cfg, tokens):  # -> [(T, D) after each target layer]
    x, positions, outputs = params["embed_tokens"][tokens], np.arange(len(tokens)), []
    for kind, layer, state in zip(cfg.layer_types, params["layers"], R.empty_state(cfg).layers):
        x, _, _ = R.decoder_layer(x, kind, layer, state, positions, cfg)
        outputs.append(x)
    return outputs


def written_out_logits(committed, k, taps=None, dcfg=None):
    """From scratch, no cache: the target's outputs after layers target_layer_ids at every committed position but
    the last, concatenated, fc, hidden_norm; the block [last committed, MASK x k] at positions P..P+k (P = the last
    committed token's position); each drafter layer: queries from the normed block, keys and values from [features;
    normed block], k_norm and RoPE on every key, full attention; the logits of the k mask slots."""
    cfg, params, tiny_dcfg, dp = tiny()
    dcfg = dcfg or tiny_dcfg
    P, eps = len(committed) - 1, dcfg.rms_norm_eps
    outputs = target_layer_outputs(params, cfg, committed[:-1])
    features = norm(np.concatenate([outputs[i] for i in taps or dcfg.target_layer_ids], -1) @ dp["fc"].T,
                    dp["hidden_norm"], eps)
    x = params["embed_tokens"][[committed[-1]] + [dcfg.mask_token_id] * k]
    H, G, Dh = dcfg.num_key_value_heads, dcfg.num_attention_heads // dcfg.num_key_value_heads, dcfg.head_dim
    block_positions, all_positions = P + np.arange(k + 1), np.arange(P + k + 1)
    for i, layer in enumerate(dp["layers"]):
        a, h = layer["self_attn"], norm(x, layer["input_layernorm"], eps)
        hidden_from = np.zeros((k + 1, P + k + 1), bool)     # a sliding layer: causal, and the window
        if dcfg.layer_types and dcfg.layer_types[i] == "sliding_attention":
            for slot, position in enumerate(block_positions):
                hidden_from[slot] = (all_positions > position) | (position - all_positions >= dcfg.sliding_window)
        q = R.rope(norm((h @ a["q_proj"].T).reshape(k + 1, H * G, Dh), a["q_norm"], eps), block_positions,
                   dcfg.rope_theta, Dh)
        kv_in = np.concatenate([features, h])
        keys = R.rope(norm((kv_in @ a["k_proj"].T).reshape(-1, H, Dh), a["k_norm"], eps), all_positions,
                      dcfg.rope_theta, Dh)
        values = (kv_in @ a["v_proj"].T).reshape(-1, H, Dh)
        out = np.zeros((k + 1, H * G, Dh))
        for head in range(H * G):
            scores = keys[:, head // G] @ q[:, head].T / np.sqrt(Dh)              # (S, B)
            out[:, head] = R.softmax(np.where(hidden_from, -np.inf, scores.T)) @ values[:, head // G]
        x = x + out.reshape(k + 1, -1) @ a["o_proj"].T
        m = layer["mlp"]
        g = norm(x, layer["post_attention_layernorm"], eps)
        x = x + (R.silu(g @ m["gate_proj"].T) * (g @ m["up_proj"].T)) @ m["down_proj"].T
    return norm(x[1:], dp["norm"], eps) @ params["lm_head"].T


ROUNDS = [(4, 2), (3, 0), (4, 4), (2, 1), (5, 3)]   # (k, accepted drafts): partial, none, all, ...


def block_distributions_over_rounds(d):
    """Runs d (dflash-sampled, temperature 1) over ROUNDS from PROMPT + [7]: each round keeps `accepted` drafts and
    a token of its own, and feeds the kept positions' tapped outputs at the next propose. -> [(committed, k, q)]."""
    cfg, params = model("tiny-mtp", np.float64)
    committed, state, seen = PROMPT + [7], d.initial_state, []
    new_hidden = R.forward(params, cfg, PROMPT, R.empty_state(cfg), d.taps)[1]
    for r, (k, accepted) in enumerate(ROUNDS):
        tokens, q, state = d.propose(state, committed, new_hidden, k, R.Sampling(1.0), np.random.default_rng(r))
        seen.append((list(committed), k, q))
        kept = [committed[-1]] + tokens[:accepted]
        committed = committed + tokens[:accepted] + [(11 * r + 3) % cfg.vocab_size]
        new_hidden = R.forward(params, cfg, committed[:-1], R.empty_state(cfg), d.taps)[1][-len(kept):]
    return seen


def test_block_logits_over_rounds_with_partial_accepts_are_the_written_out_ones():
    for committed, k, q in block_distributions_over_rounds(drafter("dflash-sampled", np.float64)):
        np.testing.assert_allclose(q, R.softmax(written_out_logits(committed, k)), atol=1e-9)


def test_a_sliding_layer_is_causal_within_its_window():
    """The published Qwen3.5 drafters' first layers: sliding_attention with no is_causal, which z-lab's
    dflash/model.py runs causally and within sliding_window; a window of 6 cuts into the context here."""
    cfg, params, dcfg, dparams = tiny()
    sliding = R.DFlashConfig(**{**dcfg.__dict__, "layer_types": ("sliding_attention", "full_attention"),
                                "sliding_window": 6})
    d = R.dflash_drafter("dflash-sampled", params, cfg, dparams, sliding, sampled=True)
    for committed, k, q in block_distributions_over_rounds(d):
        np.testing.assert_allclose(q, R.softmax(written_out_logits(committed, k, dcfg=sliding)), atol=1e-9)
    worst = max(np.abs(q - R.softmax(written_out_logits(committed, k))).max()
                for committed, k, q in block_distributions_over_rounds(d))
    assert worst > 1e-3   # the window and the causal mask matter here


def mutants(monkeypatch, name):
    """The port mistakes that lose acceptance without a wrong token, applied to the reference drafter."""
    if name == "mask in the first slot":
        monkeypatch.setattr(R, "dflash_block_tokens", lambda context, k, mask: [mask] * (k + 1))
    elif name == "no crop":     # the block's keys and values stay in the cache; positions go on as if cropped
        monkeypatch.setattr(R, "dflash_crop", lambda state, length: R.DFlashState(state.layers, length))
    elif name == "features not normed":
        monkeypatch.setattr(R, "dflash_features", lambda dparams, dcfg, tapped: tapped @ dparams["fc"].T)
    d = drafter("dflash-sampled", np.float64)
    return d._replace(taps=d.taps[::-1]) if name == "taps in the wrong order" else d


@pytest.mark.parametrize("name", ["mask in the first slot", "no crop", "features not normed",
                                  "taps in the wrong order"])
def test_each_port_mistake_changes_the_block_logits(monkeypatch, name):
    """The written-out check above has power against each mistake: some round's distributions differ (no crop
    shows only after the first round, as a cache does)."""
    rounds = block_distributions_over_rounds(mutants(monkeypatch, name))
    monkeypatch.undo()
    worst = max(np.abs(q - R.softmax(written_out_logits(committed, k))).max() for committed, k, q in rounds)
    assert worst > 1e-3, name


def test_the_first_round_does_not_see_a_missing_crop(monkeypatch):
    """So the check needs several rounds: a cache never cropped matches until a block has been run."""
    (committed, k, q), *_ = block_distributions_over_rounds(mutants(monkeypatch, "no crop"))
    monkeypatch.undo()
    np.testing.assert_allclose(q, R.softmax(written_out_logits(committed, k)), atol=1e-9)


def test_the_tapped_features_are_the_target_layers_outputs():
    cfg, params = model("tiny-mtp", np.float64)
    outputs = target_layer_outputs(params, cfg, PROMPT)
    _, tapped, _, _ = R.forward(params, cfg, PROMPT, R.empty_state(cfg), (1, 6, 3))
    np.testing.assert_allclose(tapped, np.concatenate([outputs[1], outputs[6], outputs[3]], -1), atol=1e-12)


def test_argmax_proposals_are_the_written_out_argmax_with_a_one_hot_q():
    d = drafter("dflash", np.float64)
    cfg, params = model("tiny-mtp", np.float64)
    committed = PROMPT + [7]
    tapped = R.forward(params, cfg, PROMPT, R.empty_state(cfg), d.taps)[1]
    tokens, q, _ = d.propose(d.initial_state, committed, tapped, 4, R.Sampling(1.0), np.random.default_rng(0))
    assert tokens == list(written_out_logits(committed, 4).argmax(-1))
    np.testing.assert_array_equal(q, R.one_hot(tokens, cfg.vocab_size))


# --- Loader and command line ---------------------------------------------------------------------------------------

def edited(tmp_path, **changes):  # a copy of the tiny drafter with config fields changed (None: removed)
    out = tmp_path / "drafter"
    shutil.copytree(DIR, out)
    raw = json.loads(json.dumps(CONFIG))
    for key, value in changes.items():
        section = raw["dflash_config"] if key in raw["dflash_config"] else raw
        if value is None:
            section.pop(key)
        else:
            section[key] = value
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 32}, r"hidden_size=32 differs from the target's 64"),
    ({"num_target_layers": 4}, r"num_target_layers=4 differs from the target's 8"),
    ({"target_layer_ids": [1, 8]}, r"target_layer_ids=\[1, 8\] must be distinct layers of the target's \[0, 7\]"),
    ({"target_layer_ids": [1, 1]}, r"must be distinct layers"),
    ({"target_layer_ids": [1, 3]}, r"tensor fc.weight has shape \(64, 192\), expected \(64, 128\)"),
    ({"mask_token_id": 272}, r"mask_token_id=272 is outside the vocabulary \[0, 272\)"),
    ({"mask_token_id": None}, r"required field 'mask_token_id' is missing"),
    ({"block_size": 1}, r"block_size=1 must be in \[2, 33\]"),
    ({"num_hidden_layers": 3}, r"tensor layers.2.input_layernorm.weight is missing"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"architectures": ["DFlash2DraftModel"]}, r"DFlash2DraftModel .* is not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"required field 'sliding_window' is missing"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, r"must be full_attention or sliding_attention"),
    ({"layer_types": ["full_attention"]}, r"1 layer_types for num_hidden_layers=2"),
    ({"output_multiplier": 0.5}, r"output_multiplier=0.5 is not supported"),
    ({"is_causal": "yes"}, r"is_causal='yes' must be true, false or null"),
])
def test_bad_drafter_checkpoints_are_one_line_and_exit_2(changes, message, tmp_path, capsys):
    path = edited(tmp_path, **changes)
    code = R.main(["--model", str(ROOT / "weights" / "tiny-mtp"), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                   "--draft", f"dflash:{path}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


@pytest.mark.parametrize("args, message", [
    (["--draft", "dflash:"], r"--draft dflash:: expected dflash:DIR"),
    (["--draft", "dflash"], r"--draft dflash: expected dflash:DIR"),
    (["--draft", "dflash:/nowhere"], r"DFlash directory /nowhere does not exist"),
    (["--draft", f"dflash-sampled:{DIR}"], r"DFlash config: hidden_size=64 differs from the target's"),  # default model
])
def test_bad_dflash_forms_are_one_line_and_exit_2(args, message, capsys):
    assert R.main(["--prompt-ids", "1,2", "--max-new-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_the_command_lines_run_or_refuse_the_drafter():
    base = [sys.executable, "reference.py", "--model", "weights/tiny-mtp", "--prompt-ids", "5,17,200,33",
            "--max-new-tokens", "12", "--json"]
    plain = json.loads(subprocess.run(base, cwd=ROOT, capture_output=True, text=True, check=True).stdout)["tokens"]
    for spec in SPECS:
        run = subprocess.run(base + ["--draft", f"{spec}:weights/tiny-mtp-dflash"], cwd=ROOT, capture_output=True,
                             text=True)
        assert run.returncode == 0 and json.loads(run.stdout)["tokens"] == plain, run.stderr
    run = subprocess.run([sys.executable, "-m", "jax_impl", "--model", "weights/tiny-mtp", "--prompt-ids", "1,2",
                          "--draft", "dflash"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr   # (jax_impl runs dflash:DIR:
    assert "dflash: expected dflash:DIR" in run.stderr                                    # test_jax_runs_the_trained...)


def test_jax_runs_the_trained_drafter_on_device_with_the_references_drafts():
    """jax_impl's on-device loop with weights/default-dflash (jax_impl.dflash in spec_decode's round): greedy gives
    plain decoding's tokens, and the same drafts accepted at each position as reference.py's drafter (a block of 8;
    the drafts differ only if the drafter does: a mask in the first slot, a missing crop, the wrong taps)."""
    import jax_impl                     # jax is a test dependency: missing, this fails rather than skips
    cfg, params = R.load_model(ROOT / "weights" / "default")
    prompt = R.load_tokenizer(ROOT / "weights" / "default").encode("def read_lines(path):\n").ids
    spec = f"dflash:{ROOT / 'weights' / 'default-dflash'}"
    plain, _ = R.generate(params, cfg, prompt, 24, R.Sampling(), np.random.default_rng(0))
    _, expected = R.generate_speculative(params, cfg, prompt, 24, R.Sampling(), np.random.default_rng(0),
                                         R.make_drafter(spec, params, cfg), 7, "replay")
    jax_cfg, jax_params = jax_impl.load(ROOT / "weights" / "default")
    tokens, stats = jax_impl.generate(jax_params, jax_cfg, prompt, 24, draft=spec, draft_len=7)
    assert tokens == plain, stats
    assert stats["accepted"] >= 2 and stats["accepted_by_position"] == expected["accepted_by_position"], (stats,
                                                                                                          expected)


def test_the_tiny_drafter_is_what_its_script_writes(tmp_path):
    from weights.make_tiny_dflash import digest, write
    write(tmp_path)
    assert digest(tmp_path) == digest(DIR)


def test_a_published_qwen35_drafters_config_loads_with_its_tensor_count_and_size():
    """The config of z-lab's Qwen3.5-4B drafter as ports quote it, against the Qwen3.5-4B target: six Qwen3 layers
    (five sliding), eight taps, block 16; the ports' manifest gives 69 tensors and 634,425,856 parameters."""
    from conformance.published import published_config
    cfg = R.config_from_dict(published_config("Qwen3.5-4B", 32, vocab=248320))
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2560,
           "intermediate_size": 9216,
           "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "vocab_size": 248320, "num_target_layers": 32, "rms_norm_eps": 1e-6, "attention_bias": False,
           "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 4096,
           "use_sliding_window": True, "tie_word_embeddings": True, "pad_token_id": None,
           "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
           "dflash_config": {"block_size": 16, "mask_token_id": 248077,
                             "target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29]}}
    dcfg = R.dflash_config_from_dict(raw, cfg)
    assert (dcfg.block_size, dcfg.mask_token_id, dcfg.sliding_window, dcfg.rope_theta) == (16, 248077, 4096, 1e7)
    assert dcfg.target_layer_ids == (1, 5, 9, 13, 17, 21, 25, 29) and dcfg.is_causal is None
    shapes = R.dflash_shapes(cfg, dcfg)
    assert shapes["fc.weight"] == (2560, 8 * 2560)
    assert len(shapes) == 69 and sum(int(np.prod(s)) for s in shapes.values()) == 634_425_856


def test_the_trained_drafter_is_exact_and_drafts_the_default_models_own_continuations():
    """weights/default-dflash (weights/train_dflash.py) on its target: speculative greedy decoding gives plain
    decoding's tokens at a block of 8, and its drafts are accepted above chance (1/4096 a draft: 0.03 of these 120
    expected; it accepts 4): the committed checkpoint is the trained one, read as the public drafters' layout."""
    cfg, params = R.load_model(ROOT / "weights" / "default")
    prompt = R.load_tokenizer(ROOT / "weights" / "default").encode("def read_lines(path):\n").ids
    d = R.make_drafter(f"dflash:{ROOT / 'weights' / 'default-dflash'}", params, cfg)
    plain, _ = R.generate(params, cfg, prompt, 24, R.Sampling(), np.random.default_rng(0))
    tokens, stats = R.generate_speculative(params, cfg, prompt, 24, R.Sampling(), np.random.default_rng(0), d, 7,
                                           "replay")
    assert tokens == plain, stats
    assert stats["accepted"] >= 2, stats


def test_the_training_forward_is_the_spec():
    """weights/train_dflash.py's batched blocks (many anchors at once, SpecForge's mask: context before the anchor,
    the own block only) give reference.dflash_block's logits, with a sliding first layer cutting into the context."""
    import jax.numpy as jnp             # jax is a test dependency: missing, this fails rather than skips
    from weights import train_dflash as T
    cfg, params = model("tiny-mtp", np.float32)
    raw = {**CONFIG, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}
    dcfg = R.dflash_config_from_dict(raw, cfg)
    flat = random_dflash_tensors(cfg, dcfg, seed=3)
    dparams = R.nested_params(flat)
    tokens = np.array(PROMPT * 4, np.int64)[:24]
    _, tapped, _, _ = R.forward(params, cfg, tokens, R.empty_state(cfg), R.dflash_taps(dcfg))
    anchors, block = np.array([3, 9, 17]), 5
    logits = T.drafter_logits({n: jnp.asarray(a) for n, a in flat.items()}, jnp.asarray(params["embed_tokens"]), dcfg,
                              jnp.asarray(tapped), jnp.asarray(tokens), jnp.asarray(anchors), block)
    for row, a in zip(np.asarray(logits), anchors):
        state = R.dflash_extend(dparams, dcfg, R.dflash_empty_state(dcfg), tapped[:a])
        expected, _ = R.dflash_block(params, dparams, dcfg, state,
                                     R.dflash_block_tokens([tokens[a]], block - 1, dcfg.mask_token_id))
        np.testing.assert_allclose(row[1:], expected, atol=1e-3)


# --- Sampling exactness with the trained drafter ------------------------------------------------------------------
# weights/default-dflash on weights/default, after a context in its corpus's style where its drafts are often
# accepted (a repetitive argument list: at temperature 0.8 its argmax drafts have target probabilities 0.74, 0.54,
# 0.76; its softmax shares 0.55-0.65 of the target's mass at each slot). The round's rule is the
# spec's (reference.acceptance, reference.residual, reference.round_outcomes); the target's distributions come from
# a plain forward over the context and the drafts, not from the verify pass.

TRAINED_CONTEXT = '''def _splitext(p, sep, altsep, extsep):
    """Split the extension from a pathname."""
    sepIndex = p.rfind(sep)
    if altsep:
        return None
    return _is_other(a, _, _, _, _, _, _, _, _,'''
TRAINED_SAMPLING, TRAINED_K = R.Sampling(0.8), 3


@lru_cache(maxsize=None)
def trained_prefill():  # -> target params, cfg, the drafter's (params, cfg), the context, its tapped features, state
    cfg, params = model("default", np.float64)
    dcfg, dparams = R.load_dflash(ROOT / "weights" / "default-dflash", cfg)
    context = R.load_tokenizer(ROOT / "weights" / "default").encode(TRAINED_CONTEXT).ids
    _, tapped, state, _ = R.forward(params, cfg, context[:-1], R.empty_state(cfg), R.dflash_taps(dcfg))
    return params, cfg, R.cast(dparams, np.float64), dcfg, context, tapped, state


@lru_cache(maxsize=None)
def trained_round(sampled):
    """The trained drafter's proposal for one round after TRAINED_CONTEXT (seed 0): drafts (K,), q (K, V), and the
    target's distributions p (K+1, V) along them (a plain forward, not the verify pass), all in float64."""
    params, cfg, dparams, dcfg, context, tapped, state = trained_prefill()
    d = R.dflash_drafter("dflash", params, cfg, dparams, dcfg, sampled)
    draft, q, _ = d.propose(d.initial_state, context, tapped, TRAINED_K, TRAINED_SAMPLING, np.random.default_rng(0))
    logits = R.forward(params, cfg, context[-1:] + draft, state)[0]
    return draft, np.asarray(q, np.float64), R.probabilities(logits, TRAINED_SAMPLING)


def unit(x, V):  # a one-hot row
    return (np.arange(V) == x).astype(np.float64)


def committed_law(drawn, q, p):  # (V,) the draft's law, (V,) the q reported, (V,) the target's -> (V,)
    """The law of the token a round commits at a slot it reaches, under the spec's rule: draft x (drawn from
    `drawn`; DFlash's slots are drawn independently of each other) kept with chance acceptance(p(x), q(x)), else a
    token drawn from residual(p, q): round_outcomes of that one slot, its two outcomes summed."""
    kept = np.array([drawn[x] * R.acceptance(p[x], q[x]) if drawn[x] else 0.0 for x in range(len(p))])
    return R.round_outcomes([kept.sum()], [R.residual(p, q)], kept).sum(axis=0)


def test_trained_argmax_rounds_commit_the_targets_distribution():
    """Argmax drafts with a one-hot q: the round's outcome (reference.speculative_outcomes) is, in closed form, what
    the target's distributions give a chain that stops at the first token differing from the draft: accept j drafts
    and then t with probability p_0(x_0) ... p_{j-1}(x_{j-1}) p_j(t), t != x_j below the last slot."""
    draft, q, p = trained_round(False)
    assert np.array_equal(q, np.stack([unit(x, p.shape[1]) for x in draft]))
    expected = np.stack([np.prod([p[i, x] for i, x in enumerate(draft[:j])]) * p[j] for j in range(TRAINED_K + 1)])
    for j, x in enumerate(draft):
        expected[j, x] = 0
    np.testing.assert_allclose(R.speculative_outcomes(draft, q, p), expected, rtol=1e-9, atol=1e-15)
    assert 0.2 < expected[1:].sum() < 1      # the first draft is often accepted, and not always: the check has teeth


def test_trained_sampled_rounds_commit_the_targets_distribution_at_every_slot():
    """Each slot drawn from the drafter's softmax and reported as q: at every slot the round reaches, the token
    committed there follows the target's p_j (DFlash's slots are drawn independently of the earlier drafts, so each
    slot's law is that of a one-draft round). The drafter's softmax at the wrong temperature as q is not exact."""
    draft, q, p = trained_round(True)
    for j in range(TRAINED_K):
        np.testing.assert_allclose(committed_law(q[j], q[j], p[j]), p[j], rtol=1e-9, atol=1e-15)
        assert np.minimum(q[j], p[j]).sum() > 0.4                               # often kept: the check has teeth
    at_one = R.probabilities(np.log(q[0]) * TRAINED_SAMPLING.temperature, R.Sampling(1.0))   # the slot at T = 1
    assert 0.5 * np.abs(committed_law(q[0], at_one, p[0]) - p[0]).sum() > 0.05


DRAWS = 2_000


def first_committed_counts(draft_of, q_of, runs=DRAWS):
    """`runs` draws of slot 0 of the sampled round through reference.accept_speculative: draft x = draft_of(u) for a
    uniform u, reported with q_of(x), verified against the target's p_0 -> the first committed tokens' counts {(t,):
    n} (the bonus row, p_0 again, never decides the first token)."""
    _, _, p = trained_round(True)
    rng, counts, bonus = np.random.default_rng(1), {}, np.stack([p[0], p[0]])
    for _ in range(runs):
        x = draft_of(rng.random())
        accepted, token = R.accept_speculative([x], q_of(x)[None], bonus, rng.random(2))
        counts[(x if accepted else token,)] = counts.get((x if accepted else token,), 0) + 1
    return counts


@pytest.mark.parametrize("proposal", ["argmax, one-hot q", "sampled, q its softmax", "sampled, one-hot q",
                                      "argmax, softmax q (wrong)"])
def test_trained_first_committed_token_follows_the_target_by_chi_square(proposal):
    """2,000 rounds drawn with their own uniforms: the first committed token fits the target's p_0 (chi-square,
    p > 1e-3, seeded), for argmax and for sampled drafts. Sampled drafts reported with a one-hot q at the drawn
    token are exact too (kept with chance p(x), else drawn from p without x, whatever drew x): they only accept
    less, so they are no negative control. The control, deterministic argmax drafts reported with the drafter's
    softmax as q (as if sampled), commits the argmax far too often and must fail (p < 1e-6; p = 1e-136 here)."""
    _, q, p = trained_round(True)
    V = p.shape[1]
    argmax = lambda u: int(q[0].argmax())                                # noqa: E731
    sampled = lambda u: R.sample(q[0], u)                                # noqa: E731  (the drafter's rule: R.draw)
    draft_of, q_of = {"argmax, one-hot q": (argmax, lambda x: unit(x, V)),
                      "sampled, q its softmax": (sampled, lambda x: q[0]),
                      "sampled, one-hot q": (sampled, lambda x: unit(x, V)),
                      "argmax, softmax q (wrong)": (argmax, lambda x: q[0])}[proposal]
    p_value = chi_square_p_value(first_committed_counts(draft_of, q_of), {(t,): p[0, t] for t in range(V)}, DRAWS)
    assert p_value < 1e-6 if "wrong" in proposal else p_value > 1e-3, p_value
