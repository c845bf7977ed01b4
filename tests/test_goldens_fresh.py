"""The committed goldens are what `python -m conformance generate` writes now, up to float32 rounding, on any CPU, BLAS
and thread count: a stale golden fails here (INTERPRETING.md, "Regenerating")."""

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import reference as R
from conformance.make import build as G
from conformance.format import CASES_DIR, EXPECTED, MANIFEST, REGENERATE, TOLERANCES, read_tensors
from conftest import ROOT

SIZE_LIMIT = 20 * 2**20          # the serving traces hold a state after every commit: the 4-layer checkpoints keep them small


def test_regenerating_changes_nothing_but_float32_rounding(tmp_path):
    G.build_cases(tmp_path, progress=io.StringIO())
    stale = G.differences(tmp_path, CASES_DIR)
    assert not stale, f"{len(stale)} differences, e.g. {stale[:5]}; run `{REGENERATE}` and commit cases/"


def test_regenerating_with_one_blas_thread_changes_nothing_either():
    """The check the command line offers, in a process whose BLAS runs on one thread. Where this process's BLAS runs on
    one thread already (the suite's default, tests/conftest.py), the test above did this very regeneration: .ci/run
    runs this one in its second pass, with a BLAS thread per core, so CI regenerates twice, not three times."""
    if all(os.environ.get(v) == "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        pytest.skip("this process's BLAS runs on one thread: the in-process regeneration above was this check")
    run = subprocess.run([sys.executable, "-m", "conformance", "generate", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "fresh" in run.stdout


def primitives_into(folder):
    G.build_cases(folder, progress=io.StringIO(), cases=G.primitive_cases())


@pytest.fixture
def fresh_primitives(tmp_path):
    folder = tmp_path / "fresh"
    primitives_into(folder)
    assert G.differences(folder, CASES_DIR, subset=True) == []
    return folder


def test_a_changed_reference_function_makes_its_golden_stale(tmp_path, monkeypatch):
    """A one-line change to the spec (eps outside the square root) shows up as a stale golden, named."""
    monkeypatch.setattr(R, "rms_norm", lambda x, w, eps: x / (np.sqrt(np.mean(x * x, -1, keepdims=True)) + eps) * (1 + w))
    primitives_into(tmp_path)
    stale = G.differences(tmp_path, CASES_DIR, subset=True)
    assert stale and all(line.startswith("op-rms_norm/expected.safetensors: y differs") for line in stale), stale


def test_a_change_far_below_the_conformance_tolerances_is_still_stale(tmp_path, monkeypatch):
    """l2norm's eps 1e-6 -> 1.0005e-6 moves y by up to about 7e-6, under a tenth of the activations tolerance that
    engines are held to (1e-4), and is still a stale golden."""
    l2norm = R.l2norm
    monkeypatch.setattr(R, "l2norm", lambda x, eps=1e-6: l2norm(x, eps * 1.0005))
    primitives_into(tmp_path)
    stale = G.differences(tmp_path, CASES_DIR, subset=True)
    assert [line.split(" differs")[0] for line in stale] == ["op-l2norm/expected.safetensors: y"], stale
    change = np.abs(read_tensors(tmp_path / "op-l2norm", EXPECTED)["y"] - read_tensors(CASES_DIR / "op-l2norm", EXPECTED)["y"])
    assert change.max() < TOLERANCES["activations"]["atol"] / 10


def test_a_changed_attribute_or_token_is_stale(fresh_primitives):
    meta = json.loads((fresh_primitives / "op-rms_norm" / MANIFEST).read_text())
    meta["attrs"]["eps"] = 1e-5
    (fresh_primitives / "op-rms_norm" / MANIFEST).write_text(json.dumps(meta))
    assert G.differences(fresh_primitives, CASES_DIR, subset=True) == [
        "op-rms_norm/case.json: attrs differs: {'eps': 1e-05} now, {'eps': 1e-06} committed"]
    fresh, committed = {"tokens": np.array([3, 4])}, {"tokens": np.array([3, 5])}
    assert G.tensor_differences("x", fresh, committed) == ["x: tokens[1] is 4 now, 5 committed"]


def test_float32_rounding_is_not_stale_and_a_missing_case_is():
    b = np.array([1.0, -0.5, 3e-9], np.float32)
    one_ulp = np.nextafter(b, np.float32(np.inf))
    assert G.tensor_differences("x", {"y": one_ulp}, {"y": b}) == []
    assert G.tensor_differences("x", {"y": b * (1 + 1e-5)}, {"y": b})
    assert G.tensor_differences("x", {"y": b[:2]}, {"y": b}) == ["x: y is float32[2] now, float32[3] committed"]


def test_a_case_no_longer_generated_is_stale(tmp_path):
    shutil.copytree(CASES_DIR / "op-l2norm", tmp_path / "op-l2norm")
    assert G.differences(tmp_path, CASES_DIR)[0].endswith("is committed but no longer generated")
    assert G.differences(tmp_path, CASES_DIR, subset=True) == []


def test_goldens_fit_the_size_budget():
    size = sum(p.stat().st_size for p in CASES_DIR.rglob("*") if p.is_file())
    assert size <= SIZE_LIMIT, f"conformance/cases is {size / 2**20:.1f} MiB, the budget is {SIZE_LIMIT / 2**20:.0f} MiB"
