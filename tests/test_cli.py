"""The command line contract: flags, outputs, and one-line errors with exit code 2."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import reference as R
from conformance.format import TOLERANCES
from conftest import ROOT

DEFAULT = ROOT / "weights" / "default"


def cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "reference.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_prompt_streams_text_from_the_embedded_model():
    run = cli("--prompt", "Hello", "--max-new-tokens", "8")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "8 tokens" in run.stderr


def test_json_output_and_prompt_ids():
    run = cli("--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--json")
    out = json.loads(run.stdout)
    assert set(out) == {"prompt_ids", "tokens", "text", "stats"} and out["prompt_ids"] == [1, 2, 3]
    cfg, params = R.load_model(DEFAULT)
    assert out["tokens"] == R.generate(params, cfg, [1, 2, 3], 6, R.Sampling(), np.random.default_rng(0))[0]


@pytest.mark.parametrize("model, draft", [(DEFAULT, "ngram"), (DEFAULT, "mtp"), (DEFAULT, "skip:3"),
                                          (ROOT / "weights" / "tiny-mtp", f"model:{ROOT / 'weights' / 'tiny-draft'}")])
def test_draft_flags_give_the_plain_greedy_tokens_and_stats(model, draft):
    """(tiny-draft shares tiny-mtp's vocabulary, not the default model's)"""
    prompt = ("--model", str(model), "--prompt-ids", "5,6,7,5,6", "--max-new-tokens", "12", "--json")
    plain = json.loads(cli(*prompt).stdout)
    for rollback in R.ROLLBACK_STRATEGIES:
        run = cli(*prompt, "--draft", draft, "--draft-len", "3", "--rollback", rollback)
        out = json.loads(run.stdout)
        assert out["tokens"] == plain["tokens"]
        assert {"target_calls", "proposed", "accepted", "tokens_per_call", "accepted_by_position",
                "seconds"} <= set(out["stats"])
        assert {"draft", "verify", "rollback"} <= set(out["stats"]["seconds"])
        assert "accepted" in run.stderr and "tokens/call" in run.stderr


def test_the_json_stats_are_the_keys_the_readme_lists():
    """README, "The command line": the keys of each mode, exactly."""
    common = {"prompt_tokens", "new_tokens", "target_calls", "tokens_per_call", "seconds"}
    plain = json.loads(cli("--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json").stdout)["stats"]
    assert set(plain) == common and set(plain["seconds"]) == {"prefill", "decode", "total"}
    speculative = json.loads(cli("--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json", "--draft", "ngram",
                                 "--draft-len", "3").stdout)["stats"]
    assert set(speculative) == common | {"proposed", "accepted", "accepted_by_position", "proposed_by_position",
                                         "rollback", "rollback_bytes"}
    assert set(speculative["seconds"]) == {"prefill", "draft", "verify", "rollback", "total"}
    assert len(speculative["accepted_by_position"]) == len(speculative["proposed_by_position"]) == 3


def test_the_default_seed_is_0():
    sampled = ("--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--temperature", "1", "--json")
    assert json.loads(cli(*sampled).stdout)["tokens"] == json.loads(cli(*sampled, "--seed", "0").stdout)["tokens"]


def test_prompt_ids_work_without_a_tokenizer(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(DEFAULT, model)
    (model / "tokenizer.json").unlink()
    run = cli("--model", str(model), "--prompt-ids", "1,2", "--max-new-tokens", "3")
    assert run.returncode == 0 and len(run.stdout.split()) == 3


def test_dump_logits(tmp_path):
    path = tmp_path / "logits.npy"
    assert cli("--prompt-ids", "1,2,3,4", "--dump-logits", str(path)).returncode == 0
    logits = np.load(path)
    cfg, params = R.load_model(DEFAULT)
    assert logits.dtype == np.float32 and logits.shape == (4, cfg.vocab_size)
    # another process may sum in another order (BLAS threads): compare within the suite's logits bound, not bytes
    np.testing.assert_allclose(logits, R.forward(params, cfg, [1, 2, 3, 4], R.empty_state(cfg))[0], rtol=0,
                               atol=TOLERANCES["logits"]["atol"])


def test_sampling_flags_are_seeded():
    args = ("--prompt-ids", "1,2,3", "--max-new-tokens", "10", "--json", "--temperature", "1.2", "--top-k", "50",
            "--top-p", "0.9")
    first, again = cli(*args, "--seed", "3"), cli(*args, "--seed", "3")
    assert json.loads(first.stdout)["tokens"] == json.loads(again.stdout)["tokens"]


def broken_model(tmp_path, breakage):
    model = tmp_path / "model"
    shutil.copytree(DEFAULT, model)
    weights = model / "model.safetensors"
    if breakage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif breakage == "corrupt":
        weights.write_bytes(b"\xff" * 64)
    elif breakage == "config":
        (model / "config.json").write_text("{not json")
    elif breakage in ("missing", "misshaped", "unexpected"):
        from safetensors.torch import load_file, save_file        # the default model is bf16, which numpy lacks
        tensors = load_file(weights)
        name = "model.layers.2.linear_attn.A_log"
        if breakage == "missing":
            del tensors[name]
        elif breakage == "misshaped":
            tensors[name] = tensors[name][:-1]
        else:
            tensors["model.layers.2.linear_attn.extra"] = tensors[name].clone()
        save_file(tensors, weights)
    return str(model)


def ngram_table(tmp_path, table):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    return str(path)


ERRORS = [
    (lambda p: ["--model", str(p / "nowhere"), "--prompt", "x"], "nowhere does not exist"),
    (lambda p: ["--model", broken_model(p, "config"), "--prompt", "x"], "config.json: cannot read JSON"),
    (lambda p: ["--model", broken_model(p, "truncated"), "--prompt", "x"], "model.safetensors: cannot read safetensors"),
    (lambda p: ["--model", broken_model(p, "corrupt"), "--prompt", "x"], "model.safetensors: cannot read safetensors"),
    (lambda p: ["--model", broken_model(p, "missing"), "--prompt", "x"], "tensor model.layers.2.linear_attn.A_log is missing"),
    (lambda p: ["--model", broken_model(p, "misshaped"), "--prompt", "x"],
     r"tensor model.layers.2.linear_attn.A_log has shape \(3,\), expected \(4,\)"),
    (lambda p: ["--model", broken_model(p, "unexpected"), "--prompt", "x"], "unexpected tensor model.layers.2.linear_attn.extra"),
    (lambda p: ["--prompt", "x", "--temperature", "-1"],
     r"--temperature -1.0: must be 0 \(greedy\) or in \[0.001, 1000.0\]"),
    (lambda p: ["--prompt", "x", "--temperature", "1e-5"], r"--temperature 1e-05: must be 0 \(greedy\) or in"),
    (lambda p: ["--prompt", "x", "--temperature", "nan"], r"--temperature nan: must be 0 \(greedy\) or in"),
    (lambda p: ["--prompt", "x", "--seed", str(2**32)], r"--seed 4294967296: must be in \[0, 4294967295\]"),
    (lambda p: ["--prompt", "x", "--top-p", "0"], r"--top-p 0.0: must be in \(0, 1\]"),
    (lambda p: ["--prompt", "x", "--top-p", "1.5"], r"--top-p 1.5: must be in \(0, 1\]"),
    (lambda p: ["--prompt", "x", "--top-k", "-2"], "--top-k -2: must be >= 0"),
    (lambda p: ["--prompt", "x", "--max-new-tokens", "-1"], "--max-new-tokens -1: must be >= 0"),
    (lambda p: ["--prompt", "x", "--draft-len", "-1"], r"--draft-len -1: must be in \[0, 32\]"),
    (lambda p: ["--prompt", "x", "--draft-len", "33"], r"--draft-len 33: must be in \[0, 32\]"),
    (lambda p: ["--prompt", "x", "--temperature", "warm"], "argument --temperature: invalid float value: 'warm'"),
    (lambda p: ["--prompt", ""], "the prompt is empty"),
    (lambda p: ["--prompt-ids", ""], "the prompt is empty"),
    (lambda p: ["--prompt-ids", "1,x"], "--prompt-ids '1,x': expected comma-separated integers"),
    (lambda p: ["--prompt-ids", "1,4096"], r"prompt token id 4096 is outside the vocabulary \[0, 4096\)"),
    (lambda p: ["--prompt-ids", ",".join(["1"] * 4097)], "the prompt has 4097 tokens, more than max_position_embeddings=4096"),
    (lambda p: ["--prompt", "x", "--prompt-ids", "1"], "give exactly one of --prompt and --prompt-ids"),
    (lambda p: ["--prompt", "x", "--draft", "tree"], "--draft 'tree': expected none, ngram, mtp, skip:N, model:DIR, partial-mlp:F"),
    (lambda p: ["--prompt", "x", "--draft", "skip:99"], r"--draft skip:99: N must be in \[1, 8\]"),
    (lambda p: ["--prompt", "x", "--draft", "mtp", "--model", str(ROOT / "weights" / "tiny-dense")], "the MTP drafter needs mtp.\\* weights"),
    (lambda p: ["--prompt", "x", "--rollback", "undo"], "argument --rollback: invalid choice: 'undo'"),
    (lambda p: ["--prompt", "x", "--draft", f"model:{p / 'nowhere'}"], "nowhere does not exist"),
    (lambda p: ["--prompt", "x", "--draft", "ngram", "--ngram-table", ngram_table(p, {"n": 0, "table": {}})],
     "not an n-gram table"),
    (lambda p: ["--prompt", "x", "--draft", "ngram", "--ngram-table", ngram_table(p, {"n": 2, "table": {"1 2": 5}})],
     r"entry '1 2': 5 is not 2 token ids separated by spaces -> a list of token ids, all in \[0, 4096\)"),
    (lambda p: ["--prompt", "x", "--draft", "ngram", "--ngram-table", ngram_table(p, {"n": 2, "table": {"1 x": [5]}})],
     "entry '1 x'"),
    (lambda p: ["--prompt", "x", "--draft", "ngram", "--ngram-table",
                ngram_table(p, {"n": 2, "table": {"1 2": [4096]}})], "entry '1 2': \\[4096\\] is not"),
]


@pytest.mark.parametrize("make_args, message", ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_user_errors_are_one_line_and_exit_2(make_args, message, tmp_path, capsys):
    assert R.main(make_args(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert __import__("re").search(message, err), err


def test_errors_have_no_traceback():
    run = cli("--prompt-ids", "1,99999")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr


# What each way of starting leaves as the process's BLAS threads (read after NumPy has loaded): the command line
# defaults to one, an importer and an explicit setting keep theirs.
BLAS_AFTER = {
    "python reference.py": "import runpy, sys; sys.argv = ['reference.py', '--help']\n"
                           "try:\n    runpy.run_path('reference.py', run_name='__main__')\nexcept SystemExit:\n    pass",
    "qwen35-reference": "import sys; sys.argv[0] = '/venv/bin/qwen35-reference'; import reference",
    "import reference": "import reference",
    "the tests' conftest": "import sys; sys.path.insert(0, 'tests'); import conftest",
}


@pytest.mark.parametrize("start, given, expected", [
    ("python reference.py", None, "1"), ("qwen35-reference", None, "1"), ("python reference.py", "2", "2"),
    ("import reference", None, None), ("the tests' conftest", None, "1"), ("the tests' conftest", "2", "2")])
def test_blas_threads_default_to_one_on_the_command_line_and_in_the_tests(start, given, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update({"OPENBLAS_NUM_THREADS": given} if given else {})
    code = f"{BLAS_AFTER[start]}\nimport os, numpy\nprint(os.environ.get('OPENBLAS_NUM_THREADS'))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == str(expected)
