"""The kernel pack at the published geometry: the NumPy kernel engine passes in both state layouts and dtypes, every
bug of the catalogue fails naming a case, jax_impl passes, the PyTorch peers (transformers' fallbacks, fla's naive
functions) give the results recorded in conformance/expectations/kernels.json, and a drifted oracle fails loudly."""

import numpy as np
import pytest

from conformance import kernels as K
from conformance.__main__ import main

SMALL = r"Hv(16|48)"  # the symmetric geometry and a 3:1 one (the whole pack: `qwen35-conformance kernels`)


def failing(engine, cases=SMALL, dtype="float32"):
    return [r.case for r in K.run_pack(engine, cases, dtype, log=lambda line: None) if r.status == "FAIL"]


def test_the_numpy_engine_passes(capsys):
    assert main(["kernels", "--engine", "numpy", "--cases", "Hv16"]) == 0
    assert "9 PASS, 0 FAIL, 0 SKIP" in capsys.readouterr().out  # 8 delta-rule and conv cases, the gated RMSNorm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_other_state_layout_is_converted(dtype):
    assert failing(K.NumpyKernels(state_layout="HVK"), r"Hv48-qk-l2|conv-update-Hv48", dtype) == []


# Which cases each bug must fail (at least); all other bugs fail somewhere in SMALL too.
MUST_FAIL = {
    "modulo-heads": "gdr-chunked-Hv48-qk-raw",        # invisible where Hv = Hk (Hv16)
    "tail-decay": "gdr-chunked-Hv16-qk-raw",
    "carry-state": "gdr-recurrent-Hv16-qk-raw",
    "initial-ignored": "gdr-verify-states-Hv16-qk-l2",
    "bf16-state": "gdr-chunked-Hv48-qk-l2",
    "states-shifted": "gdr-verify-states-Hv48-qk-raw",
    "conv-wrong-window": "conv-varlen-Hv16",
    "accepted-off-by-one": "conv-update-Hv48",
    "no-qk-norm": "gdr-recurrent-Hv16-qk-raw",
    "gate-before-norm": "rmsnorm-gated-Hv16",
    "norm-one-plus-weight": "rmsnorm-gated-Hv48",
    "rope-interleaved": "rope-H8",
    "rope-full-dim": "rope-H24",
    "rope-bf16-angles": "rope-H16",
    "kv-heads-modulo": "attention-Hq8-Hkv2",
    "causal-top-left": "attention-Hq24-Hkv4",
    "attention-gate-ignored": "attention-Hq16-Hkv2",
    "router-ties-higher-id": "router-E256-k8",
    "router-not-renormalised": "router-E512-k10",
}
OTHER_OPS = [bug for bug, case in MUST_FAIL.items() if not case.startswith(("gdr", "conv"))]


@pytest.mark.parametrize("bug", list(K.KERNEL_BUGS))
def test_every_catalogued_bug_fails_naming_a_case(bug):
    failed = failing(K.NumpyKernels(bugs=[bug]), f"^{MUST_FAIL[bug]}$")
    assert MUST_FAIL[bug] in failed, failed


@pytest.mark.parametrize("bug", OTHER_OPS)
def test_the_other_ops_bugs_fail_in_bfloat16_too(bug):
    assert failing(K.NumpyKernels(bugs=[bug]), f"^{MUST_FAIL[bug]}$", "bfloat16") == [MUST_FAIL[bug]]


def test_router_cases_have_ties_at_the_top_k_boundary():
    for case in (c for c in K.pack_cases() if c.kind == "router"):
        for dtype in ("float32", "bfloat16"):
            ranked = -np.sort(-K.case_inputs(case, dtype)["logits"], axis=-1)
            k = case.dims[1]
            assert (ranked[:, k - 1] == ranked[:, k]).sum() >= K.ROUTER_TOKENS // 4, (case.name, dtype)


def test_rope_without_the_angle_allowance_fails_a_correct_float32_peer():
    """The allowance is needed: jax_impl's RoPE (XLA's correctly rounded float32 pow) differs from the reference's
    (numpy's) in the last bit of some inv_freq, 0.01 at position 262143."""
    case = next(c for c in K.pack_cases() if c.name == "rope-H8")
    inputs, want = K.prepared(case, "float32")
    got = K.kernel_engine("jax").rope(**inputs, theta=K.ROPE_THETA, rotary_dim=K.ROTARY_DIM, dtype="float32")
    tol = K.tolerance_of(K.load_pack(), case, "y", "float32")
    assert not K.within(got, want["y"], tol)[0]
    assert K.within(got, want["y"], tol, K.rope_bound(inputs))[0]
    late = K.ROPE_POSITIONS >= 65533
    assert K.within(got[~late], want["y"][~late], tol, K.rope_bound(inputs)[~late])[0]


def test_modulo_heads_is_invisible_on_the_symmetric_geometry():
    assert failing(K.NumpyKernels(bugs=["modulo-heads"]), r"Hv16") == []


def test_a_drifted_oracle_fails_loudly(monkeypatch):
    real = K.expected
    monkeypatch.setattr(K, "expected", lambda case, inputs: {n: a * (1 + 1e-7) for n, a in real(case, inputs).items()})
    K._PREPARED.clear()
    with pytest.raises(K.R.UserError, match="drifted from the pinned fingerprint"):
        K.run_pack(K.NumpyKernels(), "conv-update-Hv16", log=lambda line: None)
    K._PREPARED.clear()


def test_jax_impl_passes():
    assert failing(K.kernel_engine("jax"), r"gdr-.*-Hv48-qk-raw|conv-.*Hv16") == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_impl_passes_the_other_ops(dtype):
    assert failing(K.kernel_engine("jax"), r"rmsnorm-gated-Hv48|rope-H24|attention-Hq8-Hkv2|router", dtype) == []


def recorded(engine, cases, dtype="float32"):
    """The engine's results on `cases`, weighed against conformance/expectations/kernels.json: -> the surprises."""
    results = K.run_pack(K.kernel_engine(engine), cases, dtype, log=lambda line: None)
    return [f"{r.case}: {r.status}, recorded {want}" for r, want in K.weigh(engine, results, dtype)
            if want != r.status]


def test_transformers_torch_fallbacks_give_the_recorded_results():
    assert recorded("transformers", r"Hv48-qk-l2|conv-.*Hv48|rmsnorm-gated-Hv48|rope-H24|attention-Hq8|router") == []


def test_transformers_router_breaks_ties_otherwise():
    results = {r.case: r for r in K.run_pack(K.kernel_engine("transformers"), "router-E256", log=lambda line: None)}
    assert results["router-E256-k8"].status == "FAIL" and "ids:" in results["router-E256-k8"].detail


def test_transformers_refuses_packed_sequences():
    assert recorded("transformers-varlen", r"gdr-chunked-Hv16-qk-raw|gdr-recurrent-Hv16-qk-l2") == []


def test_fla_naive_reference_functions_give_the_recorded_results():
    assert recorded("fla", r"gdr-chunked-Hv48-qk-raw|gdr-verify-states-Hv48-qk-l2|conv-update-Hv16|rope-H8") == []


def test_bad_engine_is_one_line_exit_2(capsys):
    assert main(["kernels", "--engine", "nosuch"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
