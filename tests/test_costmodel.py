"""bench/costmodel.py: its arithmetic on configurations small enough to count by hand, checked against reference.py
(tensor shapes, the bytes rollback keeps) and brute force (MoE expert union), and the report command."""

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

import reference as R
from bench import costmodel as M
from bench import measure
from bench.__main__ import main
from conftest import ROOT

TINY = dict(model_type="qwen3_5_text", vocab_size=5, hidden_size=4, num_hidden_layers=1, intermediate_size=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=4, linear_num_key_heads=1, linear_num_value_heads=1,
            linear_key_head_dim=2, linear_value_head_dim=2, linear_conv_kernel_dim=2, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})


def tiny(kind):
    return R.config_from_dict({**TINY, "layer_types": [kind]})


def by_name(kernels):
    return {k.name: k for k in kernels}


def test_deltanet_layer_counted_by_hand():
    """D=4, Hk=Hv=1, Dk=Dv=2, W=2, fp32 (4 bytes), one token:
    C = 2*Hk*Dk + Hv*Dv = 6 conv channels, value_dim = 2.
    projections: in_proj_qkv 6x4 + in_proj_z 2x4 + in_proj_a, in_proj_b 1x4 each + out_proj 4x2 = 48 weights, 96 FLOPs;
        vectors (input norm 4, dt_bias 1, A_log 1, gated norm 2) = 8, so (48 + 8) * 4 = 224 weight bytes;
        activations read x (4) and y (2), written qkv 6, z 2, a 1, b 1, out 4: 20 * 4 = 80 bytes.
    conv: 6 channels x 2 taps: 24 FLOPs, 48 weight bytes, window (W-1)*C = 6 read and written: 48 bytes,
        6 in and 6 out: 48 activation bytes.
    recurrence: 7 Dk Dv + 5 Dk + 3 Dv = 28 + 10 + 6 = 44 FLOPs; S (1x2x2 fp32) read and written: 32 bytes;
        q, k (2 each), v, o (2 each), beta, g (1 each): 10 * 4 = 40 activation bytes."""
    k = by_name(M.deltanet_kernels(tiny("linear_attention"), 1, M.FP32, batch=1))
    assert (k["projections"].flops, k["projections"].weight_bytes, k["projections"].act_bytes) == (96, 224, 80)
    assert (k["conv"].flops, k["conv"].weight_bytes, k["conv"].state_bytes, k["conv"].act_bytes) == (24, 48, 48, 48)
    assert (k["recurrence"].flops, k["recurrence"].state_bytes, k["recurrence"].act_bytes) == (44, 32, 40)


def test_verify_reads_weights_once_and_state_once():
    """Three tokens: every FLOP and activation byte of the projections triples, the weight and state bytes do not.
    The chunked core for c = 3 tokens: 6 c Dk Dv + Dk Dv + c^2 (5 Dk + 3 Dv) = 72 + 4 + 144 = 220 FLOPs."""
    one, three = (by_name(M.deltanet_kernels(tiny("linear_attention"), T, M.FP32, 1)) for T in (1, 3))
    assert three["projections"].flops == 3 * one["projections"].flops
    assert three["projections"].act_bytes == 3 * one["projections"].act_bytes
    assert three["projections"].weight_bytes == one["projections"].weight_bytes
    assert three["recurrence"].state_bytes == one["recurrence"].state_bytes
    assert three["recurrence"].flops == 220
    assert M.gated_delta_flops(65, 128, 128) == M.gated_delta_flops(64, 128, 128) + M.gated_delta_flops(1, 128, 128)


def test_attention_layer_counted_by_hand():
    """D=4, Hq=2, Hkv=1, Dh=4, fp32, 2 new tokens after 3 cached:
    projections: q with its gate 16x4, k 4x4, v 4x4, o 4x8 = 128 weights; + input norm 4, q_norm, k_norm 4 each.
    sdpa: the queries see 4 and 5 keys = 9, each 2 heads x 4 dims x (QK^T + PV) x 2 FLOPs = 16 per key and head:
        4 * Hq * Dh * 9 = 288 FLOPs; reads (3 + 2) tokens of K and V (2 * 1 * 4 floats each) = 160 bytes and writes
        2 tokens = 64 bytes."""
    k = by_name(M.attention_kernels(tiny("full_attention"), 2, 3, M.FP32, batch=1))
    assert (k["projections"].flops, k["projections"].weight_bytes) == (2 * 2 * 128, (128 + 12) * 4)
    assert (k["sdpa"].flops, k["sdpa"].kv_bytes) == (288, 224)


@pytest.mark.parametrize("name", ["default", "tiny-moe", "tiny-odd"])
def test_one_token_reads_every_weight_but_the_embedding_table(name):
    """Decode at batch 1 reads each checkpoint tensor once (lm_head even when tied), the embedding only one row,
    and of a MoE layer's experts only the k routed."""
    cfg = R.load_config(ROOT / "weights" / name)
    shapes = R.checkpoint_shapes(cfg, with_mtp=False)
    expected = sum(math.prod(s) for n, s in shapes.items() if n != "model.embed_tokens.weight")
    if cfg.is_moe:
        idle = cfg.num_experts - cfg.num_experts_per_tok
        expected -= cfg.num_hidden_layers * idle * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    kernels = M.forward_kernels(cfg, 1, 10, M.BF16)
    assert sum(k.weight_bytes for k in kernels) == pytest.approx(2 * expected, rel=1e-12)


@pytest.mark.parametrize("E,k", [(4, 1), (5, 2), (6, 3)])
def test_expert_union_is_the_brute_force_mean(E, k):
    """Every way T tokens can each pick k of E experts, equally likely: the mean number of distinct experts."""
    choices = list(itertools.combinations(range(E), k))
    for T in (1, 2, 3):
        distinct = [len(set().union(*picks)) for picks in itertools.product(choices, repeat=T)]
        assert M.expert_union(E, k, T) == pytest.approx(np.mean(distinct), rel=1e-12)


def test_moe_verify_loads_the_union_and_rows_per_expert():
    cfg = M.published_config("35B-A3B")
    experts = [k for k in M.ffn_kernels(cfg, 17, M.BF16, 1) if k.name == "experts"][0]
    one_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    assert experts.weight_bytes == pytest.approx(M.expert_union(256, 8, 17) * one_expert)
    assert experts.rows * M.expert_union(256, 8, 17) == pytest.approx(17 * 8)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("K", [0, 1, 4, 16])
def test_expected_tokens_is_the_mean_of_the_kept_distribution(a, K):
    dist = M.kept_distribution(a, K)
    assert sum(p for _, p in dist) == pytest.approx(1)
    assert M.expected_tokens(a, K) == pytest.approx(sum(n * p for n, p in dist))
    assert M.expected_tokens(1.0, K) == K + 1 and M.expected_tokens(0.0, K) == 1


def test_the_claim_is_the_model_with_sequential_deltanet_layers():
    """N / (0.75 N + 0.25) -> 4/3; and the claim's premise inside the model: T one-token passes per DeltaNet layer."""
    assert M.claim_speedup(4) == pytest.approx(4 / 3.25) and M.claim_speedup(1e9) == pytest.approx(4 / 3)
    cfg = R.load_config(ROOT / "weights" / "default")
    one = M.totals(M.forward_kernels(cfg, 1, 8, M.BF16, sequential_deltanet=True))
    five = M.totals(M.forward_kernels(cfg, 5, 8, M.BF16, sequential_deltanet=True))
    for field in ("flops", "weight_bytes", "state_bytes"):
        assert five["deltanet"][field] == pytest.approx(5 * one["deltanet"][field])
    assert five["attention"]["weight_bytes"] == one["attention"]["weight_bytes"]


def test_rollback_memory_is_what_reference_keeps():
    """reference.py's per-position states and replay tapes for K drafts: exactly the model's bytes (fp32)."""
    cfg, params = R.load_model(ROOT / "weights" / "default")
    _, _, state, _ = R.forward(params, cfg, [1, 2, 3, 4, 5], R.empty_state(cfg))
    for K in (0, 3, 7):
        _, _, _, tapes = R.forward(params, cfg, list(range(K + 1)), state)
        kept = R.keep_per_position(state, tapes)
        assert R.nbytes(kept) == M.rollback_memory(cfg, K, "per-position", M.FP32)["states"]
        assert R.nbytes(tapes) == M.rollback_memory(cfg, K, "replay", M.FP32)["tape"]


def test_roofline_takes_the_slower_of_compute_and_memory():
    hw = M.Hardware("toy", flops=100, bandwidth=10, source="", matmul_rates=((1, 100), (4, 25)))
    assert M.kernel_seconds(M.Kernel("x", "memory-bound", flops=50, act_bytes=20), hw) == 2
    assert M.kernel_seconds(M.Kernel("x", "compute-bound", flops=1000, state_bytes=10), hw) == 10
    assert [hw.weight_bandwidth(r) for r in (0.5, 1, 2, 4, 8)] == pytest.approx([100, 100, 50, 25, 25])
    assert M.Hardware("peak", 1, 7, "").weight_bandwidth(16) == 7


def test_published_configs_land_on_their_names():
    sizes = {"0.8B": (0.7, 0.9), "2B": (1.7, 2.1), "4B": (3.8, 4.5), "9B": (8.5, 9.5), "27B": (25, 28),
             "35B-A3B": (33, 37), "397B-A17B": (380, 410)}
    for name, (low, high) in sizes.items():
        assert low < M.parameters(M.published_config(name)) / 1e9 < high, name
    assert 3 < M.parameters(M.published_config("35B-A3B"), active=True) / 1e9 < 4
    assert 16 < M.parameters(M.published_config("397B-A17B"), active=True) / 1e9 < 18


def test_design_order_and_the_reforward_two_pass_rule():
    """Replay never loses to re-forward; re-forward with a cheap verify costs about two passes a rejected round."""
    cfg, s = M.published_config("9B"), M.Setting(M.H200)
    for a in (0.3, 0.6, 0.9):
        for K in (1, 4, 16):
            assert M.speedup(cfg, K, a, "replay", s) >= M.speedup(cfg, K, a, "re-forward", s)
    reject_all = M.cycle_seconds(cfg, 4, 0.0, "re-forward", s) / M.decode_seconds(cfg, s)
    assert 1.9 < reject_all < 2.2


def test_measure_predict_adds_up_rounds():
    """The CPU check's prediction: decode and verify as timed calls; the speedup from the loop's costs: plain decode
    steps over the verify passes and replays of the rounds the run logged, a fixed cost per round, and the
    drafter's seconds."""
    cfg = R.load_config(ROOT / "weights" / "default")
    hw = M.Hardware("cpu", 1e11, 1e10, "")
    rounds = [(4, 5), (4, 2), (0, 1)]
    measured = {"spec": {"rounds": rounds, "new_tokens": 8, "draft_s": 1e-3}}
    calls, loop = M.Overhead(forward=((1, 3e-4),)), M.Overhead(forward=((1, 1e-4),))
    got = measure.predict(cfg, hw, calls, replace(loop, round=2e-3), measured)
    s, in_loop = (M.Setting(hw, M.FP32, measure.PROMPT_LEN, overhead=o) for o in (calls, loop))
    spent = sum(M.verify_seconds(cfg, j, "replay", in_loop) + M.commit_seconds(cfg, j, n, "replay", in_loop)
                for j, n in rounds)
    assert got["spec"] == pytest.approx(7 * M.decode_seconds(cfg, in_loop) / (spent + 3 * 2e-3 + 1e-3))
    assert got["decode"] == pytest.approx(M.decode_seconds(cfg, s))
    assert got["verify"][1] == pytest.approx(M.verify_seconds(cfg, 1, "replay", s) / M.decode_seconds(cfg, s))


def test_report_writes_markdown_and_plots(tmp_path, capsys):
    main(["report", "--out", str(tmp_path)])
    text = (tmp_path / "report.md").read_text()
    assert "N / (0.75·N + 0.25)" in text and "| 9B | replay |" in text
    for plot in ("speedup_vs_acceptance.png", "verify_cost_vs_K.png", "memory_vs_K.png"):
        assert (tmp_path / plot).stat().st_size > 10_000
    main(["predict", "35B-A3B", "--hardware", "M4-Max"])
    assert "replay" in capsys.readouterr().out


def test_micro_twin_overheads_per_call_per_loop_step_and_per_round():
    """Calls cost 3e-4 s a decode, steps inside the generation loop 1e-4 s (7 steps in 7e-4 s): the 2e-4 s of
    dispatch come off every pass and commit in the loop. Its speculative run took 1e-4 s more than its two verify
    passes (3e-4 s each in the loop; one full accept, one replay costing nothing once dispatch is off): 5e-5 s a
    round."""
    micro = {"decode": 3e-4, "verify": {1: 4e-4, 4: 5e-4}, "verify_extra": {"per-position": 1e-5},
             "commit": {"replay": {1: 2e-5}},
             "spec": {"plain_s": 7e-4, "spec_s": 7e-4, "new_tokens": 8, "rounds": [[4, 5], [4, 2]], "draft_s": 0.0}}
    calls, loop = measure.overheads(micro, R.load_config(ROOT / "weights" / "default"))
    assert calls.forward == ((1, 3e-4), (2, 4e-4), (5, 5e-4)) and calls.round == 0
    assert [T for T, _ in loop.forward] == [1, 2, 5]
    assert [s for _, s in loop.forward] == pytest.approx([1e-4, 2e-4, 3e-4])
    assert loop.commit == (("replay", 1, 0.0),) and loop.verify == (("per-position", 1e-5),)
    assert loop.round == pytest.approx(5e-5)


def test_serving_by_batch():
    """compute_bound_batch is the smallest batch whose weight matmuls spend more time on FLOPs than on bytes (brute
    force on a machine of 1 FLOP/s and 1.5 bytes/s, where one token a sequence needs several; and on the H200 at the ridge the datasheet gives: 989e12 / 4.8e12
    FLOP/byte, 2 FLOPs per bf16 weight of 2 bytes, so about 206 rows: T = 1 at ~206 sequences, T = 5 at ~206 / 5).
    Plain tokens/s grows with the batch; speculation's gain over plain shrinks once its verify is compute-bound;
    acceptance_of inverts expected_tokens."""
    unit = M.Setting(M.Hardware("unit", 1.0, 1.5, "by hand"), M.FP32, context=8)
    cfg = tiny("linear_attention")
    for T in (1, 3):
        brute = next(B for B in range(1, 4096) if M.matmul_times(cfg, T, replace(unit, batch=B))[0]
                     >= M.matmul_times(cfg, T, replace(unit, batch=B))[1])
        assert M.compute_bound_batch(cfg, T, unit) == brute
        assert brute > 1 or T > 1    # a bisection to do
    h200, cfg9 = M.Setting(M.H200, M.BF16, 1024), M.published_config("9B")
    ridge = M.H200.flops / M.H200.bandwidth
    assert 0.9 * ridge < M.compute_bound_batch(cfg9, 1, h200) < 1.2 * ridge
    assert 0.9 * ridge / 5 < M.compute_bound_batch(cfg9, 5, h200) < 1.2 * ridge / 5
    batches = (1, 16, 256)
    plain = [M.serving_tokens_per_second(cfg9, replace(h200, batch=B)) for B in batches]
    gain = [M.serving_tokens_per_second(cfg9, replace(h200, batch=B), 4, 0.7) / p for B, p in zip(batches, plain)]
    assert plain[0] < plain[1] < plain[2] and gain[0] > 2 > 1.1 > gain[2]
    for a in (0.0, 0.3, 0.9):
        assert M.acceptance_of(M.expected_tokens(a, 4), 4) == pytest.approx(a, abs=1e-9)


def test_a_chain_is_the_tree_of_one_child_per_node_and_a_shallow_tree_drafts_less():
    cfg = M.published_config("9B")
    for drafter in ("free", "mtp"):
        s = M.Setting(M.H200, drafter=drafter)
        for K in (1, 4, 8):       # everything accepted: the chain's expected tokens, no commit in either
            assert M.tree_speedup(cfg, K, K, K + 1, "replay", s) == pytest.approx(M.speedup(cfg, K, 1.0, "replay", s))
    mtp, free = M.Setting(M.H200, drafter="mtp"), M.Setting(M.H200)
    assert M.tree_cycle_seconds(cfg, 8, 3, 2.5, "replay", mtp) < M.tree_cycle_seconds(cfg, 8, 8, 2.5, "replay", mtp)
    assert M.tree_cycle_seconds(cfg, 8, 3, 2.5, "replay", free) == M.tree_cycle_seconds(cfg, 8, 8, 2.5, "replay", free)
