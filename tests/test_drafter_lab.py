"""bench.drafter_lab's functions on a tiny checkpoint: the metrics, the teacher-forced and free-running drivers, the
cost estimate, the break-even acceptance, the speculative runs, and the whole lab end to end (no timing asserted)."""

import json
import math
from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest

import reference as R
from bench import drafter_lab as L
from conftest import model
from test_speculative import PROMPT, plain_greedy


@lru_cache(maxsize=None)
def run():
    cfg, params = model("tiny-mtp")
    return L.target_run(params, cfg, PROMPT, 10)


def test_distribution_metrics_at_the_extremes():
    p = R.softmax(np.random.default_rng(0).standard_normal(50))
    same = L.distribution_metrics(p, p)
    assert same["js"] == pytest.approx(0, abs=1e-12)
    assert same["top1"] == 1 and same["overlap"] == 20 and same["retained"] == pytest.approx(1) == same["accept"]
    a, b = np.zeros(50), np.zeros(50)
    a[:25], b[25:] = 1 / 25, 1 / 25
    apart = L.distribution_metrics(a, b)
    assert apart["js"] == pytest.approx(math.log(2)) and apart["accept"] == 0 and apart["overlap"] == 0
    assert apart["retained"] == 0 and apart["top1"] == 0


def test_target_run_is_plain_greedy_decoding_with_its_states():
    cfg, params = model("tiny-mtp")
    r = run()
    assert r.tokens == plain_greedy("tiny-mtp")[:10]
    assert [s.length for s in r.states] == [len(PROMPT) + j for j in range(10)]
    assert r.hidden.shape == (len(PROMPT) + 9, cfg.hidden_size) and r.logits.shape == (10, cfg.vocab_size)
    assert [int(np.argmax(x)) for x in r.logits] == r.tokens


@pytest.mark.parametrize("spec", ["partial-mlp:1", "mtp", "skip:8", "mixer-reuse:2"])
def test_teacher_forced_calls_are_what_generate_speculative_would_make(spec):
    """The full-width partial MLP and all 8 layers as a drafter are the target: teacher forced they agree with it
    everywhere. (The MTP head and mixer reuse do not: they only have to run.)"""
    cfg, params = model("tiny-mtp")
    d = R.make_drafter(spec, params, cfg)
    calls = L.teacher_forced_calls(d, run(), 8)
    assert [len(c.context) for c in calls] == [len(PROMPT) + j for j in range(1, 9)]
    assert [len(c.new_hidden) for c in calls] == [len(PROMPT)] + [1] * 7
    q = L.quality(d, [run()], 8)
    gap = L.free_running_gap(d, [run()])
    if spec in ("partial-mlp:1", "skip:8"):
        assert q["js"] < 1e-6 and q["top1"] == 1 and q["accept"] > 0.999
        assert gap == {"teacher_forced": 1.0, "free_running": 1.0, "all_right": 1.0, "exact_prefix": 8.0}
    else:
        assert 0 <= q["accept"] <= 1 and 0 <= gap["free_running"] <= 1


def test_the_mac_share_counts_what_each_drafter_runs(tmp_path):
    cfg, _ = model("tiny-mtp")
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"ids": list(range(68))}))
    share = {spec: L.mac_share(spec, cfg, 64) for spec in
             ["partial-mlp:1", "partial-mlp:0.5", "partial-mlp:0.5:1-2", "skip-blocks:0-7", "skip-blocks:3",
              "mixer-reuse:1-6", "residual-reuse:4", "skip:4", "mtp", f"mtp-shortlist:{path}", "ngram"]}
    assert share["partial-mlp:1"] == pytest.approx(1) and share["ngram"] == 0
    assert share["partial-mlp:0.5"] < share["partial-mlp:0.5:1-2"] < 1
    assert share["skip-blocks:0-7"] < share["residual-reuse:4"] < share["skip-blocks:3"] < 1
    assert share["residual-reuse:4"] == pytest.approx(share["skip:4"], rel=0.2)   # 4 of 8 layers either way
    assert share["mixer-reuse:1-6"] < 1 and share[f"mtp-shortlist:{path}"] < share["mtp"]


def test_breakeven_acceptance():
    """K = 1 with a verify that costs one decode step: a drafter costing c breaks even at a = c; a verify costing
    two steps needs a = 1 + c, more than any drafter has."""
    assert L.breakeven_acceptance(0.3, lambda K, a: 1.0, ks=(1,)) == pytest.approx(0.3, abs=1e-9)
    assert L.breakeven_acceptance(0.0, lambda K, a: 1.0, ks=(1,)) == 0
    assert L.breakeven_acceptance(0.1, lambda K, a: 2.0, ks=(1,)) is None
    free = L.breakeven_acceptance(0.3, L.datasheet_cycle_share(L.M.H200))
    assert 0 < free < L.breakeven_acceptance(0.6, L.datasheet_cycle_share(L.M.H200)) < 1


def test_predicted_speedup_takes_the_best_k():
    figures = {1: {"tokens_per_call": 1.8, "acceptance": 0.8}, 2: {"tokens_per_call": 2.0, "acceptance": 0.5}}
    assert L.predicted_speedup(figures, 0.3, lambda K, a: 1.0) == (1, pytest.approx(1.8 / 1.3))
    assert L.predicted_speedup(figures, 0.0, lambda K, a: 1.0) == (2, pytest.approx(2.0))


def test_speculation_counts_acceptance_and_tokens_per_call():
    cfg, params = model("tiny-mtp")
    drafters = [R.make_drafter(s, params, cfg) for s in ("partial-mlp:1", "skip-blocks:3")]
    figures = L.speculation(params, cfg, drafters, [PROMPT], 10, [0.0], ks=(1, 3))
    for d in drafters:
        for K, f in figures[d.name].items():
            assert 0 <= f["acceptance"] <= 1 and 1 <= f["tokens_per_call"] <= K + 1 and f["speedup"] > 0
            assert len(f["by_position"]) == K
    assert figures["partial-mlp:1"][3]["acceptance"] > 0.9     # q is the target's p up to rounding


def test_the_lab_end_to_end_on_a_tiny_checkpoint(tmp_path):
    cfg, params = model("tiny-mtp")
    cfg = R.replace(cfg, eos_token_id=())
    shortlist = tmp_path / "shortlist-64.json"
    shortlist.write_text(json.dumps({"ids": R.build_shortlist([plain_greedy("tiny-mtp"), PROMPT], 64)}))
    prompts = [PROMPT, [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    results = L.lab(params, cfg, prompts, prompts[:1], [shortlist], new_tokens=6, positions=8, repeats=1, jax=False)
    assert set(results["block_scan"]) == set(range(8)) and set(results["verify_ratios"]) == set(L.KS)
    rows = results["rows"]
    assert {r["label"] for r in rows.values()} >= {"ngram", "mtp", "mtp-shortlist:64", "partial-mlp:0.25", "skip:4"}
    assert rows["ngram"]["quality"] is None and rows["mtp"]["quality"]["top1"] >= 0
    assert all(set(r["speculation"]) == set(L.KS) and r["jax_impl_speedup"] is None for r in rows.values())
    assert all(r["predicted_h200"][0] in L.KS and r["predicted_h200"][1] > 0 for r in rows.values())
    text = L.report(results, "python -m bench.drafter_lab")
    assert text.count("not ported") == len(rows) and "teacher forced top-1" in text
    json.dumps(results)                                             # the --json output
    if L.pyplot() is not None:
        assert L.plot(results, tmp_path / "lab.png").stat().st_size > 0


def test_the_jax_column_measures_the_drafters_jax_impl_runs():
    """jax_impl's speedup for each drafter it runs on device, at the row's best K; none for the others."""
    cfg, params = model("tiny-mtp")
    cfg = replace(cfg, eos_token_id=())                 # every run its 6 tokens
    best_at_2 = {"speculation": {K: {"speedup": float(K == 2)} for K in L.KS}}
    rows = {spec: dict(best_at_2) for spec in ("ngram", "partial-mlp:0.5", "skip-blocks:2")}
    speedups = L.jax_speedups(params, cfg, rows, [PROMPT], 6, repeats=1)
    assert set(speedups) == {"ngram", "partial-mlp:0.5"} and all(s > 0 for s in speedups.values())


def test_bad_flags_are_one_line_and_exit_2(capsys):
    assert L.main(["--prompts", "0"]) == 2
    assert L.main(["--positions", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --prompts 0: must be >= 1", "error: --positions 4: must be >= 8 (the seed's gap drafts 8)"]
