"""The kernel pack at the published geometry: the NumPy kernel engine passes in both state layouts and dtypes, every
bug of the catalogue fails naming a case, jax_impl passes, transformers' torch fallbacks pass what they implement,
and a drifted oracle fails loudly."""

import numpy as np
import pytest

from conformance import kernels as K
from conformance.__main__ import main

SMALL = r"Hv(16|48)"  # the symmetric geometry and a 3:1 one (the whole pack: `qwen35-conformance kernels`)


def failing(engine, cases=SMALL, dtype="float32"):
    return [r.case for r in K.run_pack(engine, cases, dtype, log=lambda line: None) if r.status == "FAIL"]


def test_the_numpy_engine_passes(capsys):
    assert main(["kernels", "--engine", "numpy", "--cases", "Hv16"]) == 0
    assert "8 PASS, 0 FAIL, 0 SKIP" in capsys.readouterr().out


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
}


@pytest.mark.parametrize("bug", list(K.KERNEL_BUGS))
def test_every_catalogued_bug_fails_naming_a_case(bug):
    failed = failing(K.NumpyKernels(bugs=[bug]), f"^{MUST_FAIL[bug]}$")
    assert MUST_FAIL[bug] in failed, failed


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


def test_transformers_torch_fallbacks_pass_what_they_implement():
    results = K.run_pack(K.kernel_engine("transformers"), r"Hv48-qk-l2|conv-update-Hv48", log=lambda line: None)
    assert {r.status for r in results if r.case.startswith(("gdr-chunked", "gdr-recurrent"))} == {"PASS"}
    assert {r.status for r in results if not r.case.startswith(("gdr-chunked", "gdr-recurrent"))} == {"SKIP"}


def test_bad_engine_is_one_line_exit_2(capsys):
    assert main(["kernels", "--engine", "nosuch"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
