"""The conformance command line as a newcomer meets it: one count of the cases in `list` and `run` (a trace with
drafts runs once per rollback strategy, said so), the outputs of failing cases under the current directory, `where`,
and `run --help` naming every shipped engine. The installed kit's side of these is in test_kit.py."""

import os
import re
import subprocess
import sys

import numpy as np

from conformance import runner
from conformance.engines import SHIPPED, register_engine
from conformance.engines.reference import Reference
from conformance.format import case_dirs, read_manifest
from conftest import ROOT

ONE_TRACE_TWICE = "^trace-(accept-edges|plain-decoding)-tiny-draft-greedy$"   # drafts / plain decoding


def conformance(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}    # the clone's package from any directory
    run = subprocess.run([sys.executable, "-m", "conformance", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_list_counts_the_cases_as_run_does(capsys):
    listed = conformance("list").splitlines()
    folders = case_dirs()
    assert len(listed) == len(folders) + 1
    statistical = sum(read_manifest(f)["kind"] in runner.STATISTICAL for f in folders)
    with_drafts = sum(read_manifest(f)["kind"] == "trace" and "speculative" in read_manifest(f)["features"]
                      for f in folders)
    trees = sum(read_manifest(f)["kind"] == "tree" for f in folders)
    cases = len(folders) - statistical
    assert listed[-1] == (f"{cases} cases ({cases + with_drafts + trees} runs: {with_drafts} traces and {trees} tree "
                          "cases run once per rollback strategy, per-position and replay) for `run`, and "
                          f"{statistical} cases in the statistical pack for `sample`")
    assert conformance("list", "--cases", ONE_TRACE_TWICE).splitlines()[-1].startswith(
        "2 cases (3 runs: 1 trace run once per rollback strategy, per-position and replay) for `run`")
    results, code = runner.run("reference", ONE_TRACE_TWICE)
    out = capsys.readouterr().out
    assert code == 0 and len(results) == 3
    assert out.splitlines()[-1] == ("reference: 2 cases (3 runs: 1 trace run once per rollback strategy, per-position "
                                    "and replay): 3 pass, 0 fail, 0 error, 0 skip; all as expected")
    runner.run("reference", "^op-l2norm$")
    assert capsys.readouterr().out.splitlines()[-1] == ("reference: 1 case: 1 pass, 0 fail, 0 error, 0 skip; all as "
                                                        "expected")


@register_engine("test_wrong_l2norm")
class WrongL2Norm(Reference):
    """l2norm without its epsilon."""

    def run_op(self, kind, inputs, attrs):
        x = inputs["x"].astype(np.float64)
        return {"y": x / np.sqrt((x * x).sum(-1, keepdims=True))} if kind == "l2norm" else super().run_op(kind, inputs,
                                                                                                            attrs)


def test_outputs_of_failing_cases_go_under_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = sorted(p for p in (ROOT / "conformance").rglob("*") if "__pycache__" not in p.parts)
    results, code = runner.run("test_wrong_l2norm", "^op-l2norm$")
    out = capsys.readouterr().out
    assert code == 1 and results[0].status == "FAIL"
    saved = tmp_path / "qwen35-conformance-out" / "test_wrong_l2norm" / "op-l2norm.safetensors"
    assert saved.is_file() and f"outputs of the failing cases: {saved.parent}" in out
    assert sorted(p for p in (ROOT / "conformance").rglob("*") if "__pycache__" not in p.parts) == before
    runner.run("test_wrong_l2norm", "^op-l2norm$", out_dir=tmp_path / "mine")
    capsys.readouterr()
    assert (tmp_path / "mine" / "test_wrong_l2norm" / "op-l2norm.safetensors").is_file()


def test_where_prints_the_kits_paths_and_version(tmp_path):
    rows = dict(line.split(":", 1) for line in conformance("where", cwd=tmp_path).splitlines())
    rows = {name: value.strip() for name, value in rows.items()}
    assert rows["package"] == str(ROOT / "conformance") and rows["cases"] == str(ROOT / "conformance" / "cases")
    assert rows["expectations"] == str(ROOT / "conformance" / "expectations")
    assert rows["examples"] == str(ROOT / "conformance" / "examples")
    assert re.search(r"suite version \d+$", rows["version"])
    assert rows["failing outputs"].startswith(str(tmp_path / "qwen35-conformance-out"))


def test_run_help_names_every_shipped_engine():
    shipped = {p.stem for p in (ROOT / "conformance" / "engines").glob("*.py")} - {"__init__", "process"}
    assert shipped == set(SHIPPED) and "slots" in shipped
    for mode in ("run", "sample"):
        text = " ".join(conformance(mode, "--help").split())
        assert all(re.search(rf"[(, ]{name}[,)]", text) for name in shipped), text
