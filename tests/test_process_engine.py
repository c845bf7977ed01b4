"""Engines in other processes and languages, through the engine protocol (INTERPRETING.md section 8): the reference
served through it passes the whole suite, the C++ example passes the primitive and delta-rule cases (and a build
with a published bug fails them), and an engine that crashes, hangs, writes junk or answers nonsense fails the case
it was running, with one line saying why, while the run goes on."""

import gc
import os
import shlex
import subprocess
import sys

import pytest

from conformance import runner
from conformance.engines import EngineError
from conformance.engines.process import ProcessEngine
from conformance.format import case_dirs, read_manifest
from conformance.protocol import ProtocolError
from conftest import ROOT
from test_conformance import run_quietly

SERVE = f"exec:{shlex.quote(sys.executable)} -m conformance serve --engine reference"
EXAMPLE = ROOT / "conformance" / "examples"


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)         # `python -m conformance` in the engine process finds the clone's package


def test_the_reference_served_through_the_protocol_passes_the_whole_suite(capsys):
    results, code, out = run_quietly(SERVE, capsys)
    assert code == 0, out
    assert {r.status for r in results.values()} == {"PASS"}
    assert {name.split("@")[0] for name in results} == {folder.name for folder in case_dirs()
                                                       if read_manifest(folder)["kind"] not in runner.STATISTICAL}
    assert any(name.startswith("mtp-") for name in results)


def test_the_statistical_pack_through_the_protocol(capsys):
    """draw and accept_draws as requests: the served reference's own random numbers pass the pack."""
    results, code, out = run_quietly(SERVE, capsys, statistical=True)
    assert code == 0, out
    assert {r.status for r in results.values()} == {"PASS"}
    assert {name for name in results} == {folder.name for folder in case_dirs()
                                          if read_manifest(folder)["kind"] in runner.STATISTICAL}


def test_tensors_in_files_and_whole_traces_in_one_request(capsys):
    pattern = "^(trace-(mixed-accepts|snapshot-after-partial-accept)-tiny-draft-sampling|model-tiny-odd-extend|" \
              "sampling-topk10-ties|op-rope-Dh20-partial0.5|spec-tiny-dense-sampling-candidates-accept2-replay|mtp-tiny-mtp)$"
    results, code, out = run_quietly(f"{SERVE} --tensors files --batched-traces", capsys, pattern=pattern)
    assert code == 0, out
    assert len(results) == 9 and {r.status for r in results.values()} == {"PASS"}


def build(tmp_path, *flags):
    binary = tmp_path / ("ops_engine" + "".join(flags).replace("-D", "_"))
    compiler = os.environ.get("CXX", "c++")
    subprocess.run([compiler, "-O2", "-std=c++17", *flags, "-o", str(binary), str(EXAMPLE / "ops_engine.cc")],
                   check=True, timeout=300)
    return f"exec:{binary}"


def test_the_cpp_example_passes_the_primitive_and_delta_rule_cases(tmp_path, capsys):
    results, code, out = run_quietly(build(tmp_path), capsys, expectations=EXAMPLE / "ops_engine.json")
    assert code == 0, out
    passed = {name for name, r in results.items() if r.status == "PASS"}
    assert passed == {name for name in results if name.startswith(("op-", "gdr-"))} and len(passed) == 18
    assert {r.status for name, r in results.items() if name not in passed} == {"SKIP"}


def test_the_cpp_example_with_the_decay_after_the_write_fails_every_delta_rule_case(tmp_path, capsys):
    results, code, out = run_quietly(build(tmp_path, "-DDECAY_AFTER_WRITE"), capsys, pattern="^(op|gdr)-",
                                     expectations=EXAMPLE / "ops_engine.json")
    assert code == 1
    assert {name for name, r in results.items() if r.status == "FAIL"} == {n for n in results if n.startswith("gdr-")}
    assert "final_state" in out


# A fake engine in Python, misbehaving on purpose: it computes l2norm, and on rms_norm does what argv[1] says.
FAKE = r'''
import base64, json, os, sys, time
import numpy as np

def tensor(a):
    a = np.ascontiguousarray(a, "<f4")
    return {"dtype": "F32", "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}

mode = sys.argv[1]
if len(sys.argv) > 2:            # where to write its process id
    open(sys.argv[2], "w").write(str(os.getpid()))
if mode == "feature-stubborn":   # an unknown feature, and deaf to the end of its input
    print(json.dumps({"id": json.loads(sys.stdin.readline())["id"], "ok": True, "protocol": 1,
                      "features": ["no_such_feature"]}), flush=True)
    time.sleep(600)
for line in sys.stdin:
    r = json.loads(line)
    answer = {"id": r["id"], "ok": True}
    if r["op"] == "hello":
        answer.update(protocol=1, features=["l2norm", "rms_norm"] + (["no_such_feature"] if mode == "feature" else []))
    elif r["op"] == "run_op" and r["kind"] == "l2norm":
        spec = r["inputs"]["x"]
        x = np.frombuffer(base64.b64decode(spec["data"]), "<f4").reshape(spec["shape"])
        answer["outputs"] = {"y": tensor(x / np.sqrt((x * x).sum(-1, keepdims=True) + r["attrs"]["eps"]))}
    elif mode == "crash":
        os._exit(3)
    elif mode == "hang":
        time.sleep(600)
    elif mode == "junk":
        print("loading kernels...")
    elif mode == "fail":
        answer = {"id": r["id"], "ok": False, "error": "kernel rms_norm not compiled"}
    elif mode == "short":
        answer["outputs"] = {"y": {"dtype": "F32", "shape": [5, 64], "data": base64.b64encode(b"0000").decode()}}
    print(json.dumps(answer), flush=True)
'''


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE)
    return lambda mode: f"exec:{shlex.quote(sys.executable)} {script} {mode}"


@pytest.mark.parametrize("mode, message", [
    ("crash", "the engine process exited (status 3) during run_op"),
    ("hang", "no answer to run_op within 2 s: stopped the engine process"),
    ("junk", "not a JSON line (stdout is for protocol lines only): b'loading kernels...\\n'"),
    ("fail", "run_op: kernel rms_norm not compiled"),
    ("short", "tensor of shape [5, 64] F32 needs 1280 bytes, its data has 4"),
])
def test_a_misbehaving_engine_fails_that_case_and_the_run_goes_on(fake, mode, message, capsys):
    """op-rms_norm runs between two l2norm runs: the second l2norm run passes, in a fresh process where needed."""
    engine = runner.get_engine(fake(mode), timeout=2)
    try:
        results = [runner.run_engine(engine, mode, pattern, report=None, cases_dir=runner.CASES_DIR, expectations={},
                                     out=None, progress=None, out_dir=runner.OUT_DIR)[0][0]
                   for pattern in ("^op-l2norm$", "^op-rms_norm$", "^op-l2norm$")]
    finally:
        engine.close()
    assert [r.status for r in results] == ["PASS", "ERROR", "PASS"]
    assert message in results[1].details[0]


def test_engines_that_cannot_start_are_one_line_errors(fake, tmp_path):
    with pytest.raises(EngineError, match=r"exec:.*cannot start '/no/such/engine': No such file or directory"):
        runner.get_engine("exec:/no/such/engine --threads 1")
    with pytest.raises(EngineError, match=r"unknown features \['no_such_feature'\]"):
        runner.get_engine(fake("feature"))
    with pytest.raises(EngineError, match="needs a command"):
        runner.get_engine("exec:  ")
    run = subprocess.run([sys.executable, "-m", "conformance", "run", "--engine", "exec:/no/such/engine"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("error: exec:")


@pytest.mark.parametrize("mode", ["feature", "feature-stubborn"])
def test_an_engine_refused_at_its_handshake_is_stopped(fake, mode, tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(EngineError, match=r"unknown features \['no_such_feature'\]"):
        runner.get_engine(f"{fake(mode)} {pid_file}")
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):      # killed and reaped: no such process any more
        os.kill(pid, 0)


def test_states_the_runner_drops_are_freed_in_the_engine():
    engine = ProcessEngine(f"{shlex.quote(sys.executable)} -m conformance serve --engine reference")
    try:
        model = engine.load(ROOT / "weights" / "tiny-dense")
        _, state = engine.prefill(model, [1, 2, 3])
        logits, kept = engine.decode(model, state, [4])
        key = state.key
        del state
        gc.collect()
        assert engine.dropped == [key]
        copy = engine.copy_state(model, kept)           # the next request tells the engine first
        assert engine.dropped == [] and copy.key != kept.key
        assert engine.decode(model, copy, [5])[0].shape == logits.shape
    finally:
        engine.close()


def test_after_a_crash_a_fresh_process_loads_the_model_again_and_old_states_are_refused():
    engine = ProcessEngine(f"{shlex.quote(sys.executable)} -m conformance serve --engine reference")
    try:
        model = engine.load(ROOT / "weights" / "tiny-dense")
        first, state = engine.prefill(model, [1, 2, 3])
        engine.process.kill()                               # the engine dies between two cases
        with pytest.raises(ProtocolError, match=r"exited \(status -9\) during decode"):
            engine.decode(model, state, [4])
        again, _ = engine.prefill(model, [1, 2, 3])          # a new process, the checkpoint loaded again
        assert (again == first).all()
        with pytest.raises(ProtocolError, match="belongs to an engine process that has exited"):
            engine.decode(model, state, [4])
    finally:
        engine.close()
