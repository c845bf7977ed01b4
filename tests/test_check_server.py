"""check-server against jax_impl's HTTP server, a real process on a free localhost port (stopped even on failure):
every scenario passes, with the scenarios' own drafters and with each drafter for every request; the server's bad
requests are 4xx with a message; a client that hangs up does not hurt the others; and injected scheduler bugs
(jax_impl/injected_bugs.py) each fail check-server naming the scenario the catalogue says catches it.

The servers pin one step program (--max-draft-len, --step-width, --all-features) and share JAX's persistent
compilation cache, so a bug server whose bug leaves the step program alone compiles nothing new. The bugs inside the
step program (each its own compilation, about a minute here), and the other host-side ones, run from
`python -m jax_impl.injected_bugs --check` (INTERPRETING.md records the run), not in CI."""

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import ROOT
from conformance import check_server as cs, reference as R, rules, server_statistics as stats
from conformance.chisquare import TEST
from jax_impl.injected_bugs import BUGS, touches_step

MODEL = ROOT / "weights" / "tiny-mtp"   # 8 DeltaNet/attention layers and an MTP head; continues prompts variously
# a prefix cache of about 7 entries (431,716 bytes each here), so that scenarios evict (prefix-cache-eviction)
PINNED = ["--slots", "16", "--max-draft-len", "8", "--step-width", "16", "--all-features", "--cache-bytes", "3000000"]
# three host-side bugs in CI (about 45 s each here: a server start and its scenario); the whole catalogue, host and
# step program: python -m jax_impl.injected_bugs --check (INTERPRETING.md section 11 records it)
HOST_BUGS = ["slot-reused-with-state", "cache-key-unchecked", "max-tokens-off-by-one", "sampled-temperature-dropped"]
assert all(not touches_step(BUGS[name]) and not BUGS[name].escapes for name in HOST_BUGS)
DRAFT_SCENARIOS = ("^(speculative-acceptance-mix|shared-prefix-cache|stop-ids|stop-in-accepted-drafts|"
                   "prompts-without-cache)$")


class Served:
    """python -m jax_impl.http_server as a process; .url once its ready line came."""

    def __init__(self, cache_dir, bug=None, model=MODEL, flags=PINNED):
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONPATH=str(ROOT))
        argv = [sys.executable, "-m", "jax_impl.http_server", "--model", str(model), "--port", "0", *flags]
        self.process = subprocess.Popen(argv + (["--inject-bug", bug] if bug else []), cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = []
        reader = threading.Thread(target=lambda: ready.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(300)
        if not ready or "serving" not in ready[0]:
            self.stop()
            raise AssertionError(f"the server did not start: {ready} {self.process.stdout.read()[-2000:]}")
        self.url = ready[0].split()[-1]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="module")
def server(cache_dir):
    served = Served(cache_dir)
    try:
        yield served
    finally:
        served.stop()


def check(url, tmp_path, model=MODEL, **kwargs):
    summary, code = cs.check_server(url, model, report=tmp_path / "report.json", log=lambda line: None, timeout=300,
                                    **kwargs)
    assert json.loads((tmp_path / "report.json").read_text()) == summary
    return summary, code


def failing(summary):
    return {r["scenario"]: r["failures"] for r in summary["scenarios"] if r["status"] == "FAIL"}


def test_every_scenario_passes_with_its_own_drafters(server, tmp_path):
    summary, code = check(server.url, tmp_path)
    assert (code, failing(summary)) == (0, {})
    assert len(summary["scenarios"]) == len(cs.load_scenarios())
    assert all(r["tokens"] > 0 for r in summary["scenarios"])


@pytest.mark.parametrize("draft", ["none", "ngram", "mtp"])
def test_drafting_scenarios_pass_with_each_drafter(server, tmp_path, draft):
    summary, code = check(server.url, tmp_path, draft=draft, scenarios_regex=DRAFT_SCENARIOS)
    assert (code, failing(summary)) == (0, {})


@pytest.fixture(scope="module")
def unpinned_server(cache_dir):
    """A server that compiles its steps per shape: the one kind that verifies draft trees."""
    served = Served(cache_dir, flags=["--slots", "16", "--cache-bytes", "3000000"])
    try:
        yield served
    finally:
        served.stop()


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
def test_drafting_scenarios_pass_with_draft_trees(unpinned_server, tmp_path, draft):
    """check-server --tree: every drafting request carries a tree budget, and the server's tree rows (beside its
    chain, plain and prefilling rows) give the spec's tokens under concurrent load."""
    summary, code = check(unpinned_server.url, tmp_path, draft=draft, tree="4:2:2", scenarios_regex=DRAFT_SCENARIOS)
    assert (code, failing(summary)) == (0, {}) and summary["tree"] == "4:2:2"


def test_tree_budgets_reach_the_server(server, tmp_path):
    """The pinned server refuses tree requests: so check-server --tree sends the budget (a dialect that dropped it
    would pass here)."""
    summary, code = check(server.url, tmp_path, draft="ngram", tree="4", scenarios_regex="^stop-ids$")
    assert code == 1 and "steps are pinned" in json.dumps(failing(summary))


def test_generations_run_to_1000_tokens(cache_dir, tmp_path):
    """long-generations at its full 1,000 tokens, which tiny-mtp's context (512) cuts to 496: on tiny-dense (context
    2,048, no MTP head), its MTP request drafted with n-gram instead (so: one plain request, two n-gram ones, the
    periodic prompt's accepting most drafts), and with ignore_eos, since this random checkpoint's greedy runs reach
    EOS after 39-682 tokens. A state drifting or a position off late shows here."""
    model = ROOT / "weights" / "tiny-dense"
    data = json.loads(cs.SCENARIOS.read_text())
    long = next(s for s in data["scenarios"] if s["name"] == "long-generations")
    assert all(r["max_tokens"] == 1000 for r in long["requests"])
    assert [r["draft"] for r in long["requests"]] == ["none", "ngram", "mtp"]
    long["requests"] = [dict(r, draft=draft, ignore_eos=True) for r, draft in zip(long["requests"],
                                                                                  ("none", "ngram", "ngram"))]
    scenarios = tmp_path / "long.json"
    scenarios.write_text(json.dumps(dict(data, scenarios=[long])))
    served = Served(cache_dir, model=model, flags=["--slots", "8", "--max-draft-len", "4", "--all-features"])
    try:
        summary, code = check(served.url, tmp_path, model=model, scenarios_path=scenarios)
    finally:
        served.stop()
    assert (code, failing(summary)) == (0, {})
    assert summary["scenarios"][0]["tokens"] == 3 * 1000


def post(url, body):
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode() if isinstance(body, dict)
                                     else body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body, message", [
    (b"not json", "not JSON"), ({"max_tokens": 3}, "prompt: required"),
    ({"prompt": [1, 999]}, "outside the vocabulary"), ({"prompt": [1], "draft": "eagle"}, "draft eagle"),
    ({"prompt": [1], "max_tokens": -1}, "max_tokens"), ({"prompt": [1], "n": 2}, "n: not supported"),
    ({"prompt": [1], "temperature": "hot"}, "temperature"), ({"prompt": [1], "max_tokens": 10**6}, "context"),
    ({"prompt": [1], "draft_len": 9, "draft": "ngram"}, "draft_len 9"), ({"prompt": [1], "bogus": 1}, "bogus"),
    ({"prompt": [1], "logprobs": 2}, "logprobs: not supported"),
    ({"prompt": [1], "draft": "mtp", "tree": "4:x"}, "tree '4:x': expected NODES[:DEPTH[:BRANCH]]"),
    ({"prompt": [1], "draft": "mtp", "tree": "4:2:2"}, "steps are pinned")])   # trees need an unpinned server
def test_bad_requests_are_4xx_with_a_message(server, body, message):
    status, answer = post(server.url, body)
    assert status == 400 and message in answer["error"]["message"]
    assert post(server.url, {"prompt": [1, 2], "max_tokens": 2, "temperature": 0})[0] == 200  # still serving


def test_check_server_fails_a_server_that_is_not_there(tmp_path):
    with pytest.raises(cs.ServerError, match="Connection refused"):
        check("http://127.0.0.1:9", tmp_path, scenarios_regex="single")


@pytest.mark.parametrize("bug", HOST_BUGS)
def test_a_host_side_bug_fails_its_scenario(cache_dir, tmp_path, bug):
    served = Served(cache_dir, bug)
    try:
        summary, code = check(served.url, tmp_path, scenarios_regex=f"^{BUGS[bug].caught_by}$")
    finally:
        served.stop()
    assert code == 1 and BUGS[bug].caught_by in failing(summary)
    first = failing(summary)[BUGS[bug].caught_by][0]
    assert first["rule"] in ("greedy", "logprob", "stop", "max_tokens", "distribution") and {
        "request", "position", "prefix_tail", "spec_top", "server_token"} <= set(first)


def test_the_http_server_imports_no_module_a_bug_mutates():
    """--inject-bug replaces a module (injected_bugs.install) only if nothing imported it first: importing the HTTP
    server must leave every catalogued bug's module unimported (one top-level import of spec_decode there once made
    every step-program bug fail to install, outside CI)."""
    mutated = sorted({f"jax_impl.{bug.module}" for bug in BUGS.values()})
    probe = f"import sys, jax_impl.http_server; print([m for m in {mutated} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("argv, message", [
    (["--dialect", "nope"], "--dialect nope: expected one of"), (["--scenarios", "("], "not a regular expression"),
    (["--scenarios", "^nothing$"], "no scenario matches"), (["--concurrency", "0"], "--concurrency 0"),
    (["--precision", "fp8"], "--precision fp8"), (["--tree", "4:0"], "--tree '4:0': depth must be in"),
    (["--tree", "4", "--dialect", "vllm"], "--tree: the vllm dialect takes no draft tree")])
def test_check_server_bad_flags_are_one_line_and_exit_2(capsys, argv, message):
    from conformance.__main__ import main
    assert main(["check-server", "--url", "http://127.0.0.1:9", "--model", str(MODEL), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_scenario_prompts_follow_the_documented_rule():
    # the LCG of INTERPRETING.md section 11, stepped by hand for seed 0: x1 = 1442695040888963407
    assert cs.lcg_tokens(0, 1, 2**31, set()) == [1442695040888963407 >> 33]
    assert cs.lcg_tokens(0, 1, 7, {(1442695040888963407 >> 33) % 7}) == [((1442695040888963407 >> 33) + 1) % 7]
    assert cs.build_prompt([{"seed": 3, "length": 7, "period": 3}], 272, set())[3:6] == cs.lcg_tokens(3, 3, 272, set())


# The statistical check on its own: answers drawn here, with numpy, from the spec's distribution (a correct sampler)
# and from the usual wrong ones (rules.py), held to the distribution scenarios as check-server holds a server's.

def drawn_answers(scenario, spec, draw_probabilities, seed=0):
    """The scenario's requests answered by a sampler that draws each token from draw_probabilities(logits,
    sampling) given its own preceding tokens (the plain loop: what an exact speculative server's tokens follow)."""
    rng, requests, answers = np.random.default_rng(seed), cs.expand(scenario, spec, 512, None), []
    for _, r in requests:
        answer, sampling = cs.Answer(), stats.sampling_of(r)
        logits, _, state, _ = R.forward(spec.params, spec.cfg, list(r.prompt), R.empty_state(spec.cfg))
        while len(answer.ids) < r.max_tokens:
            if answer.ids:
                logits, _, state, _ = R.forward(spec.params, spec.cfg, answer.ids[-1:], state)
            answer.ids.append(R.sample(draw_probabilities(logits[-1].astype(np.float64), sampling), rng.random()))
        answers.append(answer)
    return requests, answers


@pytest.fixture(scope="module")
def spec():
    return cs.Spec(MODEL)


@pytest.mark.parametrize("scenario_name, rule", [("sampled-first-token", None), ("sampled-first-token",
                         "temperature-ignored"), ("sampled-first-token", "temperature-last"),
                         ("sampled-speculative", None), ("sampled-speculative", "temperature-ignored")])
def test_the_distribution_tests_pass_the_spec_and_fail_a_wrong_rule(spec, scenario_name, rule):
    scenario = next(s for s in cs.load_scenarios() if s["name"] == scenario_name)
    scenario = dict(scenario, requests=scenario["requests"][:1])    # one prompt's requests: every test, in seconds
    draw = R.probabilities if rule is None else rules.RULES[rule].parts.probabilities
    requests, answers = drawn_answers(scenario, spec, draw)
    records, failures = stats.check(spec, scenario, requests, answers, cs.RULES["greedy_margin"]["float32"])
    assert {r["test"] for r in records} == ({"first-token"} if scenario_name == "sampled-first-token" else
                                            {"first-token", "second-token", "later-tokens"})
    if rule is None:
        assert failures == [] and all(r["passed"] for r in records)
    else:
        assert failures and failures[0]["rule"] == "distribution" and failures[0]["scenario"] == scenario_name


def test_the_first_token_counts_have_the_statistical_packs_power(spec):
    # python -m conformance.make.server_statistics sized them: power against every wrong rule that changes a draw
    from conformance.make.server_statistics import groups_of, sizing
    scenario = next(s for s in cs.load_scenarios() if s["name"] == "sampled-first-token")
    groups = groups_of(scenario, spec)
    (count,) = {n for n, _ in groups.values()}
    df, critical, power = sizing(scenario["name"], groups, count)
    assert set(power) == {"temperature-ignored", "temperature-last"}
    assert min(power.values()) >= TEST["power"] and df > 0


def test_the_transform_is_uniform_under_the_spec():
    p = np.array([0.5, 0.0, 0.2, 0.3])      # in order of decreasing p: token 0 [0, .5), 3 [.5, .8), 2 [.8, 1)
    assert [stats.transform(p, t, 0.5) for t in (0, 3, 2)] == pytest.approx([0.25, 0.65, 0.9])
    rng = np.random.default_rng(1)
    u = [stats.transform(p, R.sample(p, rng.random()), rng.random()) for _ in range(20000)]
    assert np.histogram(u, bins=10, range=(0, 1))[0] == pytest.approx([2000] * 10, rel=0.1)


def test_the_logprob_rule_holds_returned_logprobs_to_the_spec(spec):
    scenario = next(s for s in cs.load_scenarios() if s["name"] == "single-greedy")
    (_, r), = cs.expand(scenario, spec, 512, None)
    answer = cs.Answer()
    answer.ids, answer.finish = spec.greedy_tokens(r.prompt, range(r.max_tokens)), "length"
    z = spec.logits(list(r.prompt) + answer.ids)[len(r.prompt) - 1:]
    answer.logprobs = [float(cs.log_softmax(z[j])[t]) for j, t in enumerate(answer.ids)]
    dialect, margin = cs.DIALECTS["jax_impl"], cs.RULES["greedy_margin"]["float32"]
    atol = cs.RULES["logprob_atol"]["float32"]
    assert cs.check_answer(spec, scenario, 0, r, answer, dialect, margin, atol) is None
    answer.logprobs[5] -= 2 * atol
    failed = cs.check_answer(spec, scenario, 0, r, answer, dialect, margin, atol)
    assert (failed["rule"], failed["position"]) == ("logprob", 5)
