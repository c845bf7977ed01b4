"""The conformance runner against the shipped engines, and against small adapters that show what it catches."""

import json
import re

import numpy as np
import pytest

import reference as R
from conformance import runner
from conformance.engines import Engine, EngineError, get_engine, register_engine
from conformance.engines.reference import Reference
from conformance.format import CASES_DIR, FEATURE_GROUPS, FEATURES, TOLERANCES, case_dirs, features_named, read_manifest
from conftest import ROOT


def run_quietly(engine, capsys, **kwargs):
    results, code = runner.run(engine, **kwargs)
    return {r.name: r for r in results}, code, capsys.readouterr().out


def test_reference_passes_its_own_goldens(capsys):
    results, code, _ = run_quietly("reference", capsys)
    assert code == 0
    assert {r.status for r in results.values()} == {"PASS"}
    assert {name.split("@")[0] for name in results} == {folder.name for folder in case_dirs()
                                                        if read_manifest(folder)["kind"] not in runner.STATISTICAL}
    assert {name.split("@")[1] for name in results if "@" in name} == set(R.ROLLBACK_STRATEGIES)


def test_transformers_has_no_unexpected_result(capsys, tmp_path):
    results, code, out = run_quietly("transformers", capsys, report=tmp_path / "report.json")
    assert code == 0, out
    assert not [r for r in results.values() if r.unexpected]
    skipped = {name for name, r in results.items() if r.status == "SKIP"}
    speculative = {name for name in results if name.startswith("spec-") or name.startswith("trace-") and "@" in name}
    mtp = {name for name in results if name.startswith("mtp-")}
    trees = {name for name in results if name.startswith("tree-")}
    dflash = {name for name in results if name.startswith("dflash-")}
    assert skipped == speculative | mtp | trees | dflash and mtp and trees and dflash
    assert all("no tree verify and commit" in results[n].note for n in trees)
    assert all("cannot roll back a Gated DeltaNet state" in results[n].note for n in speculative)
    assert all("no Qwen3.5 MTP head" in results[n].note for n in mtp)
    # the traces without drafts (prefill, plain decoding rows, prefix-cache copies, slot reuse) run and pass
    plain = {name for name in results if name.startswith("trace-plain-decoding-")}
    assert len(plain) == 4 and {results[n].status for n in plain} == {"PASS"}
    assert results["sampling-topp0.5-ties"].status == "FAIL"
    assert "spec-tiny-mtp-greedy-accept2-replay" in (tmp_path / "report.json").read_text()
    # its draws (torch.multinomial over its warped probabilities) pass the statistical pack's plain cases
    results, code, out = run_quietly("transformers", capsys, statistical=True)
    assert code == 0 and {r.status for n, r in results.items() if n.startswith("draws-sampling-")} == {"PASS"}, out


@register_engine("test_minimal")
class Minimal(Reference):
    """What a llama.cpp-style engine offers: load a checkpoint, run tokens -> logits, continue with more tokens."""
    features = frozenset({"prefill", "decode", "extend", "greedy", "moe", "untied_embeddings", "gva_ratio_3",
                          "unequal_head_dims", "conv_kernel_3", "partial_rotary_0.5", "multimodal_layout",
                          "per_expert_weights", "mtp_weights"})


def test_a_prefill_decode_only_engine_fits_and_the_rest_is_skip_with_reasons(capsys):
    reasons = {f: {"reason": f"no {f}"} for f in set(FEATURES) - Minimal.features}
    results, code, out = run_quietly("test_minimal", capsys, expectations={"unsupported": reasons})
    assert code == 0, out
    ran = {n for n, r in results.items() if r.status == "PASS"}
    assert ran == {n for n in results if n.startswith("model-")}
    assert {r.status for n, r in results.items() if n not in ran} == {"SKIP"}
    assert "outputs needing state_export not compared" in results["model-tiny-mtp-decode"].note


def test_a_skip_without_a_recorded_reason_is_unexpected(capsys):
    results, code, _ = run_quietly("test_minimal", capsys, pattern="^op-l2norm$", expectations={})
    assert code == 1
    assert results["op-l2norm"].unexpected and "no reason recorded" in results["op-l2norm"].note


@register_engine("test_no_rollback")
class NoRollback(Reference):
    """Commits without rolling back: the DeltaNet state keeps every verified position (transformers#49036 style)."""

    def commit(self, model, pending, n):
        return pending.after


def test_a_missing_rollback_fails_every_partial_accept_and_shows_numbers(capsys):
    results, code, out = run_quietly("test_no_rollback", capsys, pattern="^spec-tiny-")  # not the default model's: CI time
    assert code == 1
    failed = {n for n, r in results.items() if r.status == "FAIL"}
    assert failed == {n for n in results if "accept4" not in n}
    assert "expected" in out and "actual" in out and "allowed" in out
    assert (runner.OUT_DIR / "test_no_rollback" / "spec-tiny-mtp-greedy-accept0-replay.safetensors").exists()


def test_fail_fast_stops_at_the_first_unexpected_result(capsys):
    results, code = runner.run("test_no_rollback", "^spec-tiny-", fail_fast=True)
    capsys.readouterr()
    assert code == 1 and results[-1].status == "FAIL" and results[-1].unexpected
    assert not any(r.unexpected for r in results[:-1]) and len(results) < len(runner.select_cases(CASES_DIR, "^spec-tiny-"))


@register_engine("test_flaky_top_p")
class FlakyTopP(Reference):
    """Gets one known-failing case right: an expectation that no longer holds must be reported."""


def test_an_expected_failure_that_passes_is_unexpected(capsys):
    known = {"known_failures": {"sampling-topp*": {"expected": "FAIL", "reason": "ties"}}}
    results, code, _ = run_quietly("test_flaky_top_p", capsys, pattern="^sampling-topp", expectations=known)
    assert code == 1
    assert all(r.unexpected and "update the expectations" in r.note for r in results.values())


@register_engine("test_crash")
class Crash(Engine):
    features = frozenset({"l2norm"})

    def run_op(self, kind, inputs, attrs):
        raise RuntimeError("kernel not compiled")


def test_an_adapter_crash_is_an_error_result_not_a_crashed_run(capsys):
    results, code, out = run_quietly("test_crash", capsys, pattern="^op-l2norm$")
    assert code == 1 and results["op-l2norm"].status == "ERROR"
    assert "kernel not compiled" in out


@register_engine("test_bf16")
class Bf16(Reference):
    """A bf16 engine: logits off by 0.05 (within the bf16 bound, outside float32's), every draft rejected."""
    precision = "bf16"

    def decode(self, model, state, tokens):
        logits, state = super().decode(model, state, tokens)
        return logits + 0.05, state

    def accept(self, draft, q, logits, sampling, uniforms):
        return 0, 0


def test_a_bf16_engine_is_compared_with_the_bf16_profile(capsys):
    pattern = "^(model-(default|tiny-mtp)-(decode|greedy)|spec-default-greedy-accept2-replay)$"
    results, code, out = run_quietly("test_bf16", capsys, pattern=pattern)
    assert code == 0, out
    assert results["model-default-decode"].status == "PASS" and results["model-default-decode"].max_abs >= 0.05
    # decisions are not compared in bf16: greedy is SKIP (by the profile, not unexpected); a speculative case commits
    # the golden's decision, so its state and next logits are compared although the engine rejected every draft
    for greedy in (results["model-default-greedy"], results["model-tiny-mtp-greedy"]):
        assert greedy.status == "SKIP" and not greedy.unexpected and "not compared at bf16" in greedy.note
    spec = results["spec-default-greedy-accept2-replay"]
    assert spec.status == "PASS" and "accepted, committed: not compared at bf16" in spec.note
    assert {"verify_logits", "next_logits", "state.layers.0.S"} <= set(spec.outputs)
    # a random checkpoint's whole-model outputs are not compared in bf16
    random = results["model-tiny-mtp-decode"]
    assert random.status == "SKIP" and "logits" in random.note and "not compared at bf16" in random.note


def test_an_unknown_precision_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(Bf16, "precision", "fp8")
    with pytest.raises(EngineError, match="precision 'fp8'"):
        runner.run("test_bf16", pattern="^op-l2norm$")


@pytest.mark.parametrize("folder", case_dirs(), ids=lambda p: p.name)
def test_every_case_names_known_features_and_tolerances(folder):
    meta = read_manifest(folder)
    assert set(meta["features"]) <= set(FEATURES)
    assert all(spec["tolerance"] in TOLERANCES for spec in meta["outputs"].values())


def test_greedy_near_ties_list_both_tokens():
    tied = [read_manifest(f) for f in case_dirs() if read_manifest(f)["kind"] == "greedy"
            and "ties" in read_manifest(f)["outputs"]["tokens"]]
    assert tied, "the tiny checkpoints have near-tie greedy steps; the generator should list them"
    for meta in tied:
        for step, tokens in meta["outputs"]["tokens"]["ties"].items():
            assert len(set(tokens)) == 2 and int(step) < meta["attrs"]["n"]


def test_compare_reports_the_first_mismatches_side_by_side():
    spec = {"tolerance": "logits", "atol": 0.02, "rtol": 0}
    expected = np.zeros((2, 3), np.float32)
    actual = expected.copy()
    actual[1, 2] = 0.5
    result = runner.compare(spec, actual, expected)
    assert not result.ok and result.max_abs == 0.5
    assert "[1, 2]" in result.lines[1] and "actual  0.5" in result.lines[1]
    assert not runner.compare(spec, np.full((2, 3), np.nan, np.float32), expected).ok


# --- The MTP head ------------------------------------------------------------------------------------------------

def pre_norm_hidden(params, cfg, tokens, state):
    """reference.forward without its final norm: the residual stream that ik_llama.cpp#1815 and LightLLM#1402 fed the
    MTP head."""
    x, positions, layers = params["embed_tokens"][np.asarray(tokens)], state.length + np.arange(len(tokens)), []
    for kind, layer, layer_state in zip(cfg.layer_types, params["layers"], state.layers):
        x, layer_state, _ = R.decoder_layer(x, kind, layer, layer_state, positions, cfg)
        layers.append(layer_state)
    return x, R.State(tuple(layers), state.length + len(tokens))


@register_engine("test_mtp_pre_norm")
class MtpPreNorm(Reference):
    def mtp_hidden(self, model, state, tokens):
        cfg, params = model
        return pre_norm_hidden(params, cfg, tokens, R.empty_state(cfg) if state is None else state)


@register_engine("test_mtp_last_pair_only")
class MtpLastPairOnly(Reference):
    """The prompt's pairs never reach the head's cache, only each round's last one (ik_llama.cpp#1987)."""

    def mtp_draft(self, model, mtp_state, tokens, hidden, chain):
        return super().mtp_draft(model, mtp_state, tokens[-1:], hidden[-1:], chain)


@register_engine("test_mtp_chain_kept")
class MtpChainKept(Reference):
    """The chain's cache entries stay in the head's cache after the round."""

    def mtp_draft(self, model, mtp_state, tokens, hidden, chain):
        cfg, params = model
        logits, depth_hidden, state = super().mtp_draft(model, mtp_state, tokens, hidden, chain)
        for token, h in zip(chain, depth_hidden):
            state = R.mtp_forward(params, cfg, [token], h[None], state)[2]
        return logits, depth_hidden, state


@register_engine("test_mtp_fed_target_hidden")
class MtpFedTargetHidden(Reference):
    """The chain fed the target's last hidden state at every depth instead of the head's own output."""

    def mtp_draft(self, model, mtp_state, tokens, hidden, chain):
        cfg, params = model
        logits, depth_hidden, committed = super().mtp_draft(model, mtp_state, tokens, hidden, [])
        state, rows, outs = committed, [logits[0]], [depth_hidden[0]]
        for token in chain:
            row, h, state = R.mtp_forward(params, cfg, [token], hidden[-1:], state)
            rows.append(row[0])
            outs.append(h[0])
        return np.stack(rows), np.stack(outs), committed


@pytest.mark.parametrize("engine, failing", [
    ("test_mtp_pre_norm", "target_hidden"), ("test_mtp_last_pair_only", "r0.draft_logits"),
    ("test_mtp_chain_kept", "r0.mtp_state.layers.0.k"), ("test_mtp_fed_target_hidden", "r0.draft_hidden")])
def test_mtp_cases_catch_the_heads_usual_mistakes(engine, failing, capsys):
    """Each mistake costs acceptance without a wrong token; the mtp cases fail it, on every checkpoint with a head."""
    results, code, out = run_quietly(engine, capsys, pattern="^mtp-", expectations={})
    assert code == 1 and len(results) == 3 and {r.status for r in results.values()} == {"FAIL"}, out
    assert all(any(failing in line for line in r.details) for r in results.values()), out


def test_feature_groups_expand_and_a_feature_named_itself_wins():
    named = features_named(["ops", "rope", "serving"])
    assert set(named) == {*FEATURE_GROUPS["ops"], "trace", "snapshot"}
    assert named["rope"] == "rope" and named["l2norm"] == "ops" and named["trace"] == "serving"
    with pytest.raises(ValueError, match=r"unknown features \['opps'\]"):
        features_named(["opps"])


def test_one_reason_for_a_group_covers_its_features(capsys):
    expectations = {"unsupported": {"ops": {"reason": "no primitives"}, "rope": {"reason": "no rotary"}}}
    results, code, _ = run_quietly("test_minimal", capsys, pattern="^op-", expectations=expectations)
    assert code == 0
    assert results["op-l2norm"].note == "lacks l2norm: no primitives"
    assert results["op-rope-Dh20-partial0.5"].note == "lacks rope: no rotary"


class OutOfTree(Reference):
    """An engine that no one registered, named by module and class; features given as groups."""
    features = frozenset({"ops", "gated_delta_rule"})


def test_an_engine_named_by_module_and_class_with_its_own_expectations_file(capsys, tmp_path):
    path = tmp_path / "mine.json"
    path.write_text('{"unsupported": {"layers": {"reason": "no layers"}, "checkpoint_layouts": {"reason": "no layers"}}}')
    results, code, out = run_quietly("test_conformance:OutOfTree", capsys, pattern="^(op|gdr|layer)-",
                                     expectations=path, report=tmp_path / "report.json")
    assert code == 0, out
    assert {n for n, r in results.items() if r.status == "PASS"} == {n for n in results if not n.startswith("layer-")}
    layers = [r for n, r in results.items() if n.startswith("layer-")]
    assert len(layers) == 7 and all(r.status == "SKIP" and r.note.endswith(": no layers") for r in layers)
    assert json.loads((tmp_path / "report.json").read_text())["expectations"] == str(path)


@pytest.mark.parametrize("spec, message", [
    ("no_such_module:Engine", "no module 'no_such_module' (install its package, or put its folder on PYTHONPATH)"),
    ("test_conformance:Nope", "module test_conformance has no 'Nope'"),
    ("test_conformance:Crash", None),
    ("json:JSONDecoder", "`features` must be a set of feature names, not None"),
    ("json:loads", "creating <function loads"),
])
def test_engines_named_wrongly_are_one_line_errors(spec, message):
    if message is None:         # a class that is fine: no error
        assert get_engine(spec).features == {"l2norm"}
        return
    with pytest.raises(EngineError, match=re.escape(message)):
        get_engine(spec)


@pytest.mark.parametrize("expectations, message", [
    ({"unsupported": {"rmsnorm": {"reason": "-"}}}, "`unsupported` names unknown features ['rmsnorm']"),
    ({"unsupported": {"rms_norm": "no"}}, "`unsupported` must map features to"),
    ({"known_failures": {"op-*": {"expected": "PASS", "reason": "-"}}}, "`known_failures` must map"),
    ([], "expected a JSON object"),
])
def test_unusable_expectations_are_refused(expectations, message):
    with pytest.raises(runner.ExpectationsError, match=re.escape(message)):
        runner.run("reference", pattern="^op-l2norm$", expectations=expectations)


def test_the_shipped_expectations_files_are_usable():
    for path in sorted((ROOT / "conformance" / "expectations").glob("*.json")) + [
            ROOT / "conformance" / "examples" / "ops_engine.json"]:
        runner.checked_expectations(runner.read_expectations(path), path)


def trace_engine_reporting(name, finished):
    """The reference adapter whose run_trace reports `finished(golden's value)` instead (None: leaves it out)."""
    @register_engine(name)
    class Reporting(Reference):
        def run_trace(self, model, batches, rollback, slots):
            for b, s, out in super().run_trace(model, batches, rollback, slots):
                value = finished(out.pop("finished")) if "finished" in out else None
                yield b, s, out if value is None else {**out, "finished": value}
    return name


@pytest.mark.parametrize("finished, says", [(lambda value: None, "the engine did not return this output"),
                                            (lambda value: 0, "expected 1, actual 0")])
def test_a_trace_engine_must_say_when_a_request_has_finished(finished, says, capsys):
    engine = trace_engine_reporting(f"test_finished_{says.split()[0]}", finished)
    results, code, _ = run_quietly(engine, capsys, pattern="^trace-stop-inside-accepted-tiny-draft-greedy$",
                                   expectations={}, diagnose=False)
    assert code == 1 and {r.status for r in results.values()} == {"FAIL"}
    assert all(any(".finished: " in line and says in line for line in r.details) for r in results.values())
