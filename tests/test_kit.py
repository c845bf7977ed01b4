"""The kit as a stranger gets it: the wheel built from this tree, installed into a fresh virtual environment, run
from another directory (the reference's command line, the suite, an engine in the stranger's own package with its
own expectations file); and one clear line, exit 2, where an optional dependency is missing."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile

import pytest

from conformance.engines import EXTRAS, SHIPPED
from conformance.format import case_dirs
from conftest import ROOT

WHEEL_LIMIT = 40 * 2**20
NOT_PACKAGED = shutil.ignore_patterns(".git", "_out", "__pycache__", "build", "dist", "*.egg-info", ".hypothesis",
                                      ".pytest_cache", "venv", ".venv", "tests", "bench", "docs")
PLUGIN_ENGINE = '''
"""A stranger's engine: rms_norm and l2norm in NumPy; its rms_norm scales by w where the spec has (1 + w)."""
from pathlib import Path

import numpy as np
from qwen35.conformance.engines import Engine


class MyEngine(Engine):
    features = frozenset({"rms_norm", "l2norm"})
    expectations = Path(__file__).with_name("expectations.json")

    def run_op(self, kind, inputs, attrs):
        x = inputs["x"].astype(np.float64)
        if kind == "l2norm":
            return {"y": x / np.sqrt((x * x).sum(-1, keepdims=True) + attrs["eps"])}
        return {"y": x / np.sqrt((x * x).mean(-1, keepdims=True) + attrs["eps"]) * inputs["weight"]}
'''
PLUGIN_EXPECTATIONS = {
    "unsupported": {"ops": {"reason": "two primitives only", "evidence": "myengine/engine.py"}},
    "known_failures": {"op-rms_norm": {"expected": "FAIL", "reason": "scales by w, not 1 + w", "evidence": "-"}}}
PLUGIN_PROJECT = '''
[build-system]
requires = ["setuptools>=70.1"]
build-backend = "setuptools.build_meta"

[project]
name = "myengine"
version = "0.1"

[project.entry-points."qwen35.conformance.engines"]
myengine = "myengine.engine:MyEngine"

[tool.setuptools.package-data]
myengine = ["*.json"]
'''


def check(args, cwd, env, code=0):
    run = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == code, f"{args}: exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """(the venv's bin folder, a folder outside the repository, the environment, the wheel). The venv sees the test
    environment's packages (numpy, safetensors, tokenizers, pip, setuptools) through a .pth file, so nothing is
    downloaded, and not this repository: the kit comes from the wheel alone."""
    tmp = tmp_path_factory.mktemp("kit")
    shutil.copytree(ROOT, tmp / "source", ignore=NOT_PACKAGED)       # setuptools builds in the source tree
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w",
           tmp / "dist", tmp / "source"], tmp, env)
    wheel, = (tmp / "dist").glob("qwen35_reference-*.whl")
    check([sys.executable, "-m", "venv", "--without-pip", tmp / "venv"], tmp, env)
    bin_dir = tmp / "venv" / ("Scripts" if os.name == "nt" else "bin")
    purelib = check([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp,
                    env).stdout.strip()
    (tmp / purelib / "test-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    check([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], tmp, env)
    (tmp / "elsewhere").mkdir()
    return bin_dir, tmp / "elsewhere", env, wheel


def test_the_wheel_holds_the_kit_within_its_size_limit(kit):
    bin_dir, elsewhere, env, wheel = kit
    assert wheel.stat().st_size < WHEEL_LIMIT, f"{wheel.stat().st_size / 2**20:.1f} MiB"
    where = check([bin_dir / "python", "-c", "import qwen35.conformance, qwen35.reference as R; "
                   "print(qwen35.conformance.__file__); print(R.DEFAULT_MODEL)"], elsewhere, env).stdout.split()
    assert all(path.startswith(str(bin_dir.parent)) for path in where), where
    no_generic_names = "import importlib.util as u; print([n for n in ('reference', 'conformance', 'bench', " \
                       "'weights', 'jax_impl') if u.find_spec(n)])"
    assert check([bin_dir / "python", "-c", no_generic_names], elsewhere, env).stdout.strip() == "[]"


IMPORT_ALL = """
import importlib, pkgutil, sys
import qwen35.conformance, qwen35.jax_impl
skip = set(sys.argv[1:])
for package in (qwen35.conformance, qwen35.jax_impl):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if module.name not in skip and not module.name.endswith("__main__"):
            importlib.import_module(module.name)
"""


def test_every_installed_module_imports(kit):
    """Adapters included: the venv sees the test environment's torch, jax, mlx and llama_cpp."""
    bin_dir, elsewhere, env, _ = kit
    check([bin_dir / "python", "-c", IMPORT_ALL], elsewhere, env)


def test_the_kit_ships_the_checker_without_the_golden_generator(kit):
    """conformance/make/ (the generator and the suite's proofs of power) is a tool of a clone; nothing the kit ships
    imports it (test_every_installed_module_imports would fail), and `generate` says where it runs."""
    bin_dir, elsewhere, env, wheel = kit
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if n.startswith("qwen35/conformance/make/")]
    run = subprocess.run([bin_dir / "qwen35-conformance", "generate", "--check"], cwd=elsewhere, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 2 and "in a clone" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_where_names_the_installed_kits_files(kit):
    bin_dir, elsewhere, env, wheel = kit
    rows = dict(line.split(":", 1) for line in check([bin_dir / "qwen35-conformance", "where"], elsewhere,
                                                     env).stdout.splitlines())
    rows = {name: value.strip() for name, value in rows.items()}
    assert rows["version"].startswith(wheel.name.split("-")[1] + ", suite version ")
    assert rows["layout"] == "installed kit (qwen35.conformance)"
    for name in ("package", "cases", "expectations", "examples", "interpreting", "checkpoints"):
        assert rows[name].startswith(str(bin_dir.parent)) and os.path.exists(rows[name]), (name, rows[name])
    assert rows["failing outputs"].startswith(str(elsewhere / "qwen35-conformance-out"))


def test_the_reference_command_line_runs_the_embedded_model(kit):
    bin_dir, elsewhere, env, _ = kit
    run = check([bin_dir / "qwen35-reference", "--prompt", "def fibonacci(n):", "--max-new-tokens", "8", "--json"],
                elsewhere, env)
    out = json.loads(run.stdout)
    assert len(out["tokens"]) == 8 and out["text"]


def test_the_suite_runs_from_another_directory(kit):
    bin_dir, elsewhere, env, _ = kit
    listed = check([bin_dir / "qwen35-conformance", "list"], elsewhere, env).stdout.splitlines()
    assert len(listed) == len(case_dirs()) + 1 and listed[-1].endswith("in the statistical pack for `sample`")
    check([bin_dir / "qwen35-conformance", "run", "--engine", "reference", "--report", "reference.json"], elsewhere, env)
    report = json.loads((elsewhere / "reference.json").read_text())
    assert report["summary"]["PASS"] == len(report["cases"]) >= len(case_dirs())
    run = check([bin_dir / "qwen35-conformance", "generate"], elsewhere, env, code=2)
    assert run.stderr.count("\n") == 1 and "clone of the repository" in run.stderr


def test_an_engine_in_its_own_package_with_its_own_expectations(kit, tmp_path):
    bin_dir, elsewhere, env, _ = kit
    (tmp_path / "myengine").mkdir()
    (tmp_path / "myengine" / "__init__.py").write_text("")
    (tmp_path / "myengine" / "engine.py").write_text(textwrap.dedent(PLUGIN_ENGINE))
    (tmp_path / "myengine" / "expectations.json").write_text(json.dumps(PLUGIN_EXPECTATIONS))
    (tmp_path / "pyproject.toml").write_text(PLUGIN_PROJECT)
    check([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
           tmp_path], elsewhere, env)
    for engine, extra in (("myengine", []),                  # by its entry point, with the expectations it ships
                          ("myengine.engine:MyEngine", ["--expectations", tmp_path / "myengine" / "expectations.json"])):
        check([bin_dir / "qwen35-conformance", "run", "--engine", engine, *extra, "--cases", "^op-", "--report",
               "mine.json"], elsewhere, env)
        cases = {c["name"]: c for c in json.loads((elsewhere / "mine.json").read_text())["cases"]}
        assert cases["op-l2norm"]["status"] == "PASS"
        assert cases["op-rms_norm"]["status"] == "FAIL" and not cases["op-rms_norm"]["unexpected"]
        assert cases["op-rope-Dh16-partial0.25"]["note"] == "lacks rope: two primitives only"
    assert len(list((elsewhere / "qwen35-conformance-out").glob("*/op-rms_norm.safetensors"))) == 2
    assert not list((bin_dir.parent / "lib").rglob("op-rms_norm.safetensors"))     # nothing in site-packages
    run = check([bin_dir / "qwen35-conformance", "run", "--engine", "myengine", "--expectations", "missing.json"],
                elsewhere, env, code=2)
    assert run.stderr.strip() == "error: missing.json: cannot read it (No such file or directory)"


def test_the_pytest_plugin_runs_the_suite_as_an_engines_own_tests(kit, tmp_path):
    """The kit's pytest11 entry point: a shipped engine passes, the stranger's engine xfails its known failure and
    skips what it lacks, and without its expectations fails with the runner's report."""
    bin_dir, _, env, _ = kit
    (tmp_path / "myengine").mkdir()
    (tmp_path / "myengine" / "__init__.py").write_text("")
    (tmp_path / "myengine" / "engine.py").write_text(textwrap.dedent(PLUGIN_ENGINE))
    (tmp_path / "mine.json").write_text(json.dumps(PLUGIN_EXPECTATIONS))
    (tmp_path / "none.json").write_text("{}")
    (tmp_path / "tests").mkdir()
    env = {**env, "PYTHONPATH": str(tmp_path)}
    pytest_ = [bin_dir / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--qwen35-cases", "^op-"]
    ops = sum(folder.name.startswith("op-") for folder in case_dirs())
    run = check([*pytest_, "--qwen35-engine", "reference"], tmp_path / "tests", env)
    assert f"{ops} passed" in run.stdout.splitlines()[-1], run.stdout
    run = check([*pytest_[:-1], "^draws-spec-one-hot", "--qwen35-engine", "reference", "--qwen35-sample",
                 "--qwen35-seed", "7"], tmp_path / "tests", env)
    assert "1 passed" in run.stdout.splitlines()[-1], run.stdout            # the statistical pack's case
    run = check([*pytest_, "--qwen35-engine", "myengine.engine:MyEngine", "--qwen35-expectations=../mine.json"],
                tmp_path / "tests", env)
    assert f"1 passed, {ops - 2} skipped, 1 xfailed" in run.stdout.splitlines()[-1], run.stdout
    run = check([*pytest_, "--qwen35-engine", "myengine.engine:MyEngine", "--qwen35-expectations=../none.json",
                 "-k", "l2norm or rms_norm and not gated"], tmp_path / "tests", env, code=1)
    assert f"1 failed, 1 passed, {ops - 2} deselected" in run.stdout.splitlines()[-1], run.stdout
    report = run.stdout[run.stdout.index("qwen35-conformance::op-rms_norm"):]
    assert "op-rms_norm  FAIL!" in report and "elements outside atol=" in report and "Traceback" not in report
    assert "FAILED qwen35-conformance::op-rms_norm" in run.stdout
    assert (tmp_path / "tests" / "qwen35-conformance-out" / "myengine.engine_MyEngine" / "op-rms_norm.safetensors"
            ).is_file()
    run = check([*pytest_, "--qwen35-engine", "nosuch"], tmp_path / "tests", env, code=4)
    assert "--qwen35-engine: no engine 'nosuch'; known: " in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("engine, blocked", [("transformers", "torch"), ("llama_cpp", "llama_cpp"), ("mlx", "mlx"),
                                             ("jax", "jax"), ("jax_bf16", "jax")])
def test_an_engine_without_its_dependency_names_the_extra(engine, blocked):
    code = (f"import sys; sys.modules[{blocked!r}] = None; from conformance.__main__ import main; "
            f"sys.exit(main(['run', '--engine', {engine!r}]))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(f"error: engine {engine} needs {blocked}, which is not installed")
    assert f"`{EXTRAS[engine]}` extra (pip install \"KIT[{EXTRAS[engine]}]\", KIT the wheel or the repository" in run.stderr


@pytest.mark.parametrize("module, args", [("jax_impl", ["--prompt-ids", "1,2"]), ("weights.evaluate", ["weights/default"])])
def test_the_jax_command_lines_without_jax_name_the_extra(module, args):
    code = (f"import runpy, sys; sys.modules['jax'] = None; sys.argv[1:] = {args!r}; "
            f"runpy.run_module({module!r}, run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "needs jax, which is not installed" in run.stderr and "`jax` extra" in run.stderr


def test_every_extra_named_exists():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS.values()) | {"jax"} <= set(extras)
    assert set(EXTRAS) == set(SHIPPED) - {"reference", "slots", "kernel_peers"}     # the adapters that need more than NumPy
