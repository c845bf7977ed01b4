"""jax_impl's on-device generation against reference.py: greedy tokens (plain and speculative, every drafter and
rollback strategy) and the reference's acceptance bookkeeping exactly; EOS and length limits; the offline n-gram
table; acceptance rules; sampling distributions (chi-square over many keys, vmapped); the command line."""

import dataclasses
import functools
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import jax_impl
import reference
from jax_impl.spec_decode import buffer_sizes, generate_device

ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = ROOT / "weights"
PROMPT = [5, 17, 42, 99, 3, 17, 42, 7, 8, 9, 100, 200, 17, 42, 7]
GREEDY = reference.Sampling()


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            cfg, params = reference.load_model(WEIGHTS / name)
            cache[name] = cfg, params, jax_impl.to_jax(params)
        return cache[name]
    return get


def reference_run(cfg, params, draft="none", K=4, rollback="replay", max_new=24, table=None):
    rng = np.random.default_rng(0)
    if draft == "none":
        return reference.generate(params, cfg, PROMPT, max_new, GREEDY, rng)
    drafter = reference.make_drafter(draft, params, cfg, table)
    return reference.generate_speculative(params, cfg, PROMPT, max_new, GREEDY, rng, drafter, K, rollback)


SPEC_KEYS = ("target_calls", "proposed", "accepted", "accepted_by_position", "proposed_by_position")


# every checkpoint once, plain or drafting (each case is a compilation: about 10-20 s in CI, whose time is near its
# limit); every drafter on two checkpoints, both rollback strategies
@pytest.mark.parametrize("name, draft, K, rollback", [
    ("tiny-dense", "none", 0, "replay"),
    ("tiny-moe", "none", 0, "replay"), ("tiny-moe", "ngram", 4, "replay"),
    ("tiny-odd", "none", 0, "replay"), ("tiny-odd", "ngram", 3, "per-position"),
    ("tiny-multimodal", "mtp", 2, "per-position"),
    ("tiny-mtp", "none", 0, "replay"), ("tiny-mtp", "ngram", 4, "per-position"), ("tiny-mtp", "mtp", 3, "replay"),
    ("tiny-moe-per-expert-mtp", "mtp", 4, "replay"),
])
def test_greedy_matches_reference(models, name, draft, K, rollback):
    """Greedy tokens equal the reference's, plain or speculative; a speculative run also drafts, accepts and
    verifies exactly as the reference does (same target calls, same acceptance by position)."""
    cfg, params, jparams = models(name)
    tokens, stats = jax_impl.generate(jparams, cfg, PROMPT, 24, draft=draft, draft_len=K, rollback=rollback)
    want_tokens, want = reference_run(cfg, params, draft, K, rollback)
    assert tokens == want_tokens
    assert {k: stats[k] for k in SPEC_KEYS if k in want} == {k: want[k] for k in SPEC_KEYS if k in want}


def test_offline_ngram_table_eos_and_length_limit(models):
    """With no match in the context, drafts come from the offline table (built here from the model's own greedy
    output, so they are accepted), as in the reference. An EOS among accepted drafts ends the output right after it;
    a token limit cuts the last round's drafts."""
    cfg, params, jparams = models("tiny-dense")
    plain, _ = reference_run(cfg, params, max_new=24)
    table = reference.build_ngram_table([PROMPT + plain])
    cfg_eos = dataclasses.replace(cfg, eos_token_id=(plain[10],))
    for run_cfg, max_new, expected in ((cfg, 24, plain), (cfg_eos, 24, plain[:plain.index(plain[10]) + 1]),
                                       (cfg, 13, plain[:13])):
        want, want_stats = reference_run(run_cfg, params, "ngram", 4, max_new=max_new, table=table)
        tokens, stats = jax_impl.generate(jparams, run_cfg, PROMPT, max_new, draft="ngram", draft_len=4,
                                          ngram_table=table)
        assert tokens == want == expected
        assert {k: stats[k] for k in SPEC_KEYS} == {k: want_stats[k] for k in SPEC_KEYS}
        assert stats["accepted"] > 0


def test_prompt_lookup_matches_reference():
    lookup = jax.jit(jax_impl.prompt_lookup, static_argnums=2)
    rng = np.random.default_rng(0)
    for _ in range(40):
        context = rng.integers(0, 4, rng.integers(1, 24)).tolist()
        drafts, count = lookup(jnp.array(context + [9] * (32 - len(context))), len(context), 4)
        assert drafts[:int(count)].tolist() == reference.prompt_lookup(context, 4)


def test_acceptance_rules():
    """Disjoint supports reject the first draft and resample from p; drafts past m never count; greedy takes the
    longest prefix equal to the argmax."""
    V, K = 8, 3
    p = jax.nn.softmax(jax.random.normal(jax.random.key(0), (K + 1, V)))
    q = jax.nn.one_hot(jnp.argmax(p[:K], -1), V)                   # each draft on the target's favourite token
    p = p.at[0].set(jnp.where(q[0] > 0, 0.0, p[0]) / (1 - p[0].max()))
    u = jax.random.uniform(jax.random.key(1), (200, K + 1))
    draft = jnp.argmax(q, -1)
    accepted, token = jax.vmap(jax_impl.accept_speculative, (None, None, None, None, 0))(draft, K, q, p, u)
    assert (accepted == 0).all() and (p[0][token] > 0).all()
    q = p[:K]
    accepted, _ = jax.vmap(jax_impl.accept_speculative, (None, None, None, None, 0))(draft, 1, q, p, u)
    assert (accepted <= 1).all()
    logits = jnp.log(p)
    n, token = jax_impl.accept_greedy(jnp.argmax(logits[:K], -1), 2, logits)
    assert int(n) == 2 and int(token) == int(jnp.argmax(logits[2]))


@functools.lru_cache
def second_token_law(name, sampling, prompt):
    """P(2nd generated token), exactly, by enumerating the first with the reference model: (V,)."""
    cfg, params = reference.load_model(WEIGHTS / name)
    prompt = list(prompt)
    first = reference.probabilities(reference.forward(params, cfg, prompt, reference.empty_state(cfg))[0][-1], sampling)
    law = np.zeros(cfg.vocab_size)
    for token in np.nonzero(first > 1e-7)[0]:
        logits = reference.forward(params, cfg, prompt + [int(token)], reference.empty_state(cfg))[0][-1]
        law += first[token] * reference.probabilities(logits, sampling)
    return law / law.sum()


def chi_square_pvalue(samples, law, runs):
    """Goodness of fit of integer samples to a law over their values, categories under 5 expected pooled."""
    counts = np.bincount(np.asarray(samples), minlength=len(law))
    common = law * runs >= 5
    observed, expected = counts[common], law[common] * runs
    if not common.all():
        observed, expected = np.append(observed, counts[~common].sum()), np.append(expected, law[~common].sum() * runs)
    return scipy_stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def test_speculative_sampling_law():
    """Leviathan's guarantee on overlapping full-support p and q: the first emitted token (an accepted draft or a
    residual draw) follows p_0; with q = p all K drafts are accepted and the bonus token follows p_K."""
    V, K, runs = 6, 3, 20000
    p = np.asarray(jax.nn.softmax(2 * jax.random.normal(jax.random.key(0), (K + 1, V))), np.float64)
    q = np.asarray(jax.nn.softmax(2 * jax.random.normal(jax.random.key(1), (K, V))), np.float64)

    def run(key, q):
        k_draft, k_u = jax.random.split(key)
        draft = jax.random.categorical(k_draft, jnp.log(q), axis=-1)
        n, token = jax_impl.accept_speculative(draft, K, q, jnp.asarray(p, jnp.float32), jax.random.uniform(k_u, (K + 1,)))
        return n, jnp.where(n > 0, draft[0], token), token
    keys = jax.random.split(jax.random.key(2), runs)
    n, first, _ = jax.jit(jax.vmap(run, (0, None)))(keys, jnp.asarray(q, jnp.float32))
    assert 0.1 * runs < int((n == 0).sum()) < 0.9 * runs  # both paths taken
    assert chi_square_pvalue(first, p[0], runs) > 1e-3
    n, _, bonus = jax.jit(jax.vmap(run, (0, None)))(keys, jnp.asarray(p[:K], jnp.float32))
    assert (n == K).all() and chi_square_pvalue(bonus, p[K], runs) > 1e-3


@pytest.mark.parametrize("draft, K", [("none", 0), ("mtp", 2), ("ngram", 2)])
def test_sampling_distribution(models, draft, K):
    """End to end, vmapped over 3000 keys: the law of the 2nd generated token (temperature 2, whole vocabulary)
    matches the target's exact law (chi-square). With a drafter it comes from the first speculative round.
    EOS is switched off, so that every run has a 2nd token."""
    cfg, params, jparams = models("tiny-multimodal")
    cfg = dataclasses.replace(cfg, eos_token_id=())
    sampling, runs = reference.Sampling(temperature=2.0), 3000
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    law = second_token_law("tiny-multimodal", sampling, tuple(prompt))
    P, capacity = buffer_sizes(len(prompt), 3, K)
    run = partial(generate_device, jparams, cfg, jnp.array(prompt + [0] * (P - len(prompt))), len(prompt), 3,
                  sampling=sampling, draft=draft, K=K, rollback="replay", capacity=capacity)
    buf, ntok, stats = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(7), runs))
    assert (ntok == len(prompt) + 3).all()
    if draft != "none":
        assert int(stats.proposed_by_position[:, 0].sum()) > 0
    assert chi_square_pvalue(buf[:, len(prompt) + 1], law, runs) > 1e-3


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jax_impl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_cli_json_matches_reference_cli():
    args = ["--model", str(WEIGHTS / "tiny-odd"), "--prompt", "abcabcab", "--max-new-tokens", "12", "--json",
            "--draft", "ngram", "--draft-len", "3", "--rollback", "per-position"]
    ours = run_cli(*args)
    assert ours.returncode == 0, ours.stderr
    ref = subprocess.run([sys.executable, "reference.py", *args], cwd=ROOT, capture_output=True, text=True)
    ours_json, ref_json = json.loads(ours.stdout), json.loads(ref.stdout)
    assert ours_json["tokens"] == ref_json["tokens"] and ours_json["text"] == ref_json["text"]
    assert ours_json["stats"]["accepted"] == ref_json["stats"]["accepted"]
    assert "compile" in ours.stderr and ours_json["stats"]["seconds"]["compile"] > 0


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,2", "--draft", "skip:2"],
     "jax_impl runs none, ngram, mtp, mtp-shortlist, partial-mlp, dflash and dflash-sampled on device (its other "
     "--draft forms run in reference.py only)"),
    (["--prompt-ids", "1,2", "--dtype", "float16"], "--dtype"),
    (["--prompt-ids", "1,2", "--devices", "64"], "--devices 64"),
    (["--prompt-ids", "1,2", "--temperature", "-1"], "--temperature"),
    (["--prompt-ids", "1,2", "--model", "/nonexistent"], "does not exist"),
])
def test_cli_user_errors(args, message):
    result = run_cli(*args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
