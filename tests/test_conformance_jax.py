"""jax_impl against the goldens: every case passes in float32 (engine jax), and in bf16 (engine jax_bf16) within the
bf16 profile of tolerances.json. That profile compares no decisions (greedy cases SKIP) and no whole-model outputs of
the random checkpoints (their model and speculative cases SKIP); the trained default model's are compared."""

from conformance import runner
from conformance.format import TRAINED_CHECKPOINTS, case_dirs, read_manifest
from test_conformance import run_quietly


def test_jax_passes_every_case_but_the_traces(capsys):
    """(the serving traces, through jax_impl's batched step, are tests/test_conformance_jax_traces.py's). The draft
    trees pass, under both rollback strategies, and the DFlash drafter's case (jax_impl.dflash)."""
    results, code, out = run_quietly("jax", capsys, pattern="^(?!trace-)")
    assert code == 0, out
    trees = {name for name in results if name.startswith("tree-")}
    dflash = {name for name in results if name.startswith("dflash-")}
    assert trees and dflash and {r.status for r in results.values()} == {"PASS"}
    assert {name.split("@")[1] for name in trees} == {"per-position", "replay"}
    assert {name.split("@")[0] for name in results} == {folder.name for folder in case_dirs() if not folder.name.startswith(
        "trace-") and read_manifest(folder)["kind"] not in runner.STATISTICAL}
    # and the statistical pack (its trees' too), drawing with jax.random as its generate loop does
    results, code, out = run_quietly("jax", capsys, statistical=True)
    assert code == 0 and {r.status for r in results.values()} == {"PASS"}, out
    assert any(name.startswith("draws-tree-") for name in results)


def uncompared_in_bf16(meta):
    """greedy cases; whole-model and speculative cases on random checkpoints (sampling cases need no checkpoint)"""
    random = meta["checkpoint"] is not None and meta["checkpoint"]["name"] not in TRAINED_CHECKPOINTS
    return meta["kind"] == "greedy" or random


def test_jax_bf16_passes_within_the_bf16_profile(capsys):
    results, code, out = run_quietly("jax_bf16", capsys)
    assert code == 0, out
    skipped = {name for name, r in results.items() if r.status == "SKIP"}
    # a trace with drafts runs once per rollback strategy, as <case>@<strategy>
    assert {name.split("@")[0] for name in skipped} == {folder.name for folder in case_dirs()
                                                        if uncompared_in_bf16(read_manifest(folder))}
    assert {r.status for name, r in results.items() if name not in skipped} == {"PASS"}
    assert {"model-default-prefill-T70", "spec-default-greedy-accept2-replay",
            "trace-prefix-cache-on-trained-model-default-greedy@replay"} <= set(results) - skipped
    assert results["model-default-prefill-T70"].max_abs > 0.02     # outside the float32 bound: bf16 is compared
