"""jax_impl's batched serving engine (jax_impl.scheduler over jax_impl.batch) against single-request runs: property-based
over random schedules (slot counts, arrivals, drafters, sampling settings, prompts that make the drafts accepted in
part or whole, slot reuse), every request's tokens and acceptance counts equal its own jax_impl.generate run, and
the state each slot ends with equals a one-pass prefill of its request's committed tokens within float32 rounding;
the prefix cache; stop ids; the compilation count; the command line. The serving traces run through the batched
path in test_conformance_jax.py; 4 devices in test_jax_sharding.py.

Every server here pins its shapes (max_draft_len, features, step_width), so that each slot count and rollback
strategy compiles one step program, shared by all examples."""

import functools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import jax_impl
import reference
from jax_impl import batch, jsonl
from jax_impl.scheduler import Server
from conftest import ROOT

CHECKPOINT = "tiny-odd"   # 4 layers (DeltaNet, 3 value heads per key head, and attention), an MTP head; repeats itself
# Prompts that invite copying, so that n-gram drafts are accepted (in part, or whole once the model repeats itself)
PROMPTS = [[5, 17, 42, 99, 3, 17, 42, 7, 8, 9, 100, 200, 17, 42, 7], [1, 2, 3, 1, 2, 3, 1, 2], [9, 9, 9, 9, 9],
           [200, 31, 7, 200, 31], [64], [12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15, 12, 13]]
# (sampling, drafter, draft length) of a request: every drafter, greedy and sampled, three round widths
SETTINGS = [(reference.Sampling(), "none", 0), (reference.Sampling(), "ngram", 4),
            (reference.Sampling(0.9, 40, 0.95), "mtp", 2), (reference.Sampling(0.7), "none", 0)]
LIMITS = (5, 9, 17)                  # new tokens: each > every draft length, so a request's K is its draft length
PINNED = dict(context=48, max_draft_len=4, features=batch.Features(True, True, True, True), step_width=8)


@functools.cache
def model():
    return jax_impl.load(ROOT / "weights" / CHECKPOINT)


@functools.cache
def alone(prompt, setting, limit, seed):
    """The request's own run: jax_impl.generate -> (tokens, stats). With replay rollback whatever the server's
    strategy: both give the same tokens (test_jax_generate), and this keeps the compilations down."""
    cfg, params = model()
    sampling, draft, draft_len = SETTINGS[setting]
    return jax_impl.generate(params, cfg, PROMPTS[prompt], limit, sampling, seed, draft, draft_len)


def request(prompt, setting, limit, seed):
    sampling, draft, draft_len = SETTINGS[setting]
    return dict(prompt=PROMPTS[prompt], max_new_tokens=limit, sampling=sampling, seed=seed, draft=draft,
                draft_len=draft_len)


SPEC_KEYS = ("target_calls", "proposed", "accepted", "proposed_by_position", "accepted_by_position")


def prefilled(tokens):
    """The state after consuming `tokens` in one pass (the adapter's prefill), for comparison with a slot's."""
    cfg, params = model()
    engine = jax_impl_engine()
    return engine.prefill((cfg, params), np.asarray(tokens))[1]


@functools.cache
def jax_impl_engine():
    from conformance.engines import get_engine
    return get_engine("jax")


def state_error(slot_state, tokens):
    """Largest |slot - one-pass prefill| of the state after `tokens`, relative to the largest magnitude of each
    tensor (DeltaNet S and conv window, the live KV): what the slot's rollbacks and chunking changed."""
    engine = jax_impl_engine()
    ours = engine.export_state(model(), slot_state)
    want = engine.export_state(model(), prefilled(tokens))
    assert ours.keys() == want.keys()
    return max(float(np.abs(ours[n] - want[n]).max(initial=0)) / max(float(np.abs(want[n]).max(initial=0)), 1.0)
               for n in ours)


# float32 rounding of chunked and one-pass forwards, rolled back or not: measured up to 2e-6 here; a wrong state
# (a rollback or slot mix-up) is off by O(1)
STATE_BOUND = 1e-4


schedules = st.fixed_dictionaries({
    # (slots, rollback): few slots (many reused) and the most the issue asks for, each strategy once (a compilation
    # each; a row's rollback does not depend on the others)
    "server": st.sampled_from([(4, "per-position"), (16, "replay")]),
    "steps_per_sync": st.sampled_from((1, 3)),
    "requests": st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, len(SETTINGS) - 1),
                                   st.sampled_from(LIMITS), st.integers(0, 3), st.integers(0, 6)),
                         min_size=1, max_size=20),
})


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])   # 8 before: CI time
@given(schedules)
# a request admitted into a released slot that finishes within the step that admitted it
@example({"server": (4, "per-position"), "steps_per_sync": 3,
          "requests": [(0, 0, 5, 0, 0), (0, 0, 5, 0, 0), (2, 1, 5, 0, 2)]})
def test_random_schedules_give_each_request_its_own_run(schedule):
    """Requests (prompt, settings, limit, seed, arrival round) arrive at their round, in slots taken and released as
    they come and go; each gets the tokens and acceptance counts of its own run, and each slot ends with the state
    of its last request's committed tokens."""
    cfg, params = model()
    slots, rollback = schedule["server"]
    server = Server(params, cfg, slots, rollback=rollback, steps_per_sync=schedule["steps_per_sync"], **PINNED)
    pending = sorted(schedule["requests"], key=lambda r: r[4])
    ids, occupants, rounds = {}, {}, 0
    while pending or server.waiting or any(server.live):
        while pending and pending[0][4] <= rounds:
            prompt, setting, limit, seed, _ = pending.pop(0)
            ids[server.submit(**request(prompt, setting, limit, seed))] = (prompt, setting, limit, seed)
        server.admit_waiting()   # what step() does first; seen here, a request finishing within the step counts too
        occupants.update({live.id: index for index, live in enumerate(server.live) if live})
        server.step()
        rounds += 1
    assert server.compilations <= 1   # one step program per server shape, shared across examples
    last = {}
    for request_id, (prompt, setting, limit, seed) in ids.items():
        tokens, stats = server.result(request_id)
        want, want_stats = alone(prompt, setting, limit, seed)
        assert tokens == want, (request_id, SETTINGS[setting])
        assert {k: stats[k] for k in SPEC_KEYS if k in want_stats} == {k: want_stats[k] for k in SPEC_KEYS
                                                                        if k in want_stats}
        if request_id in occupants:
            last[occupants[request_id]] = PROMPTS[prompt] + tokens[:-1]
    for index, tokens in last.items():   # each slot's last request (ids ascend with admission)
        assert state_error(batch.read_slot(server.slots.state, index), tokens) < STATE_BOUND


def test_one_slot_gives_each_request_its_own_run():
    """A one-slot server, whose loop carries the row without the slot axis (batch.run_steps): requests one after
    another through the slot (plain and n-gram, per-position rollback, a host sync every 3 steps, so the row goes in
    and out of the slot axis many times) get their own runs' tokens and counts. Greedy only: one small compilation."""
    cfg, params = model()
    server = Server(params, cfg, 1, rollback="per-position", steps_per_sync=3,
                    **dict(PINNED, features=batch.Features()))
    runs = [(0, 0, 5, 0), (2, 1, 5, 0), (0, 1, 9, 0)]
    results = server.generate([request(*r) for r in runs])
    assert server.compilations <= 1
    for (tokens, stats), run in zip(results, runs):
        want, want_stats = alone(*run)
        assert tokens == want and {k: stats[k] for k in SPEC_KEYS if k in want_stats} == {
            k: want_stats[k] for k in SPEC_KEYS if k in want_stats}, run


def test_schedules_see_every_accept_count():
    """The prompts and drafters above accept none, some and all of a round's drafts (what the property test's
    examples rely on to exercise partial rollbacks)."""
    by_position = [alone(prompt, 1, 17, 0)[1]["accepted_by_position"] for prompt in range(len(PROMPTS))]
    proposed = [alone(prompt, 1, 17, 0)[1]["proposed_by_position"] for prompt in range(len(PROMPTS))]
    assert any(a[0] < p[0] for a, p in zip(by_position, proposed))            # rejected first drafts
    assert any(0 < a[-1] for a in by_position)                                 # whole rounds accepted
    assert any(a[-1] < a[0] for a in by_position)                              # partial rounds


def test_prefix_cache_and_stop_ids():
    """A request with cache_prompt leaves its prompt's state; later prompts that begin with it restore it (counted)
    and still get their own runs' tokens. A stop id ends a request at its first occurrence."""
    cfg, params = model()
    server = Server(params, cfg, 4, **PINNED)
    base, longer = PROMPTS[1], PROMPTS[1] + [3, 4]
    first = server.submit(base, 9, draft="ngram", cache_prompt=True)
    list(server.run())
    assert server.cache_hits == 0 and list(server.cache) == [tuple(base)]
    sampled = dict(sampling=SETTINGS[2][0], draft="mtp", draft_len=2)
    later = [server.submit(base, 9, draft="ngram"), server.submit(longer, 9, **sampled), server.submit(longer, 9)]
    list(server.run())
    assert server.cache_hits == 2     # the MTP request needs an entry written by an MTP request
    for request_id, (prompt, options) in zip([first, *later], [(base, dict(draft="ngram")), (base, dict(draft="ngram")),
                                                               (longer, sampled), (longer, {})]):
        assert server.result(request_id)[0] == jax_impl.generate(params, cfg, prompt, 9, **options)[0]
    free = server.result(later[1])[0]     # sampled: varied tokens
    stop = free[4]
    stopped = server.generate([dict(prompt=longer, max_new_tokens=9, stop=[stop], **sampled)])[0][0]
    assert stopped == free[:free.index(stop) + 1]


def test_dflash_requests_get_their_own_runs():
    """A server with a DFlash drafter (Server(dflash=DIR), --dflash; the default model's trained one, so that drafts
    are accepted): greedy and sampled "dflash" requests beside a plain one, prompts prefilled in chunks of the step
    width (the drafter's context grows by each chunk's tapped features), get their own jax_impl.generate runs' tokens
    and acceptance counts with --draft dflash:DIR. A later dflash request restores the prefix-cache entry a dflash
    request left (its drafter's context included), and not one a plain request left (no DFlash context in it).
    Prompts of 17-32 tokens: one padded length, so that the single runs compile once per setting."""
    cfg, params = jax_impl.load(ROOT / "weights" / "default")
    drafter = ROOT / "weights" / "default-dflash"
    encode = reference.load_tokenizer(ROOT / "weights" / "default").encode
    server = Server(params, cfg, 3, context=64, max_draft_len=4, features=batch.Features(sample=True, dflash=True),
                    step_width=8, dflash=str(drafter))
    fib, loop, stack = (encode(text).ids for text in ("def fibonacci(n):\n    if n < 2:\n        return n\n",
                                                      "for i in range(10):\n    print(i, i * i)\n    total += i\n",
                                                      "class Stack:\n    def __init__(self):\n        self.items = [] #"))
    greedy, sampled = reference.Sampling(), reference.Sampling(0.8)
    runs = [[(fib, greedy, "dflash", True), (loop, sampled, "dflash", False), (stack, greedy, "none", True),
             (fib + fib[:2], greedy, "dflash", False)],      # 3 slots: it starts once the first has finished
            [(stack + stack[:2], greedy, "dflash", False)]]  # the cached stack prompt was a plain request's
    accepted = 0
    for wave, hits in zip(runs, (1, 1)):
        ids = [server.submit(prompt, 12, sampling=sampling, seed=3, draft=draft, cache_prompt=cache)
               for prompt, sampling, draft, cache in wave]
        list(server.run())
        assert server.cache_hits == hits
        for request_id, (prompt, sampling, draft, _) in zip(ids, wave):
            tokens, stats = server.result(request_id)
            want, want_stats = jax_impl.generate(params, cfg, prompt, 12, sampling, 3,
                                                 f"dflash:{drafter}" if draft == "dflash" else draft, 4)
            assert tokens == want and {k: stats[k] for k in SPEC_KEYS if k in want_stats} == {
                k: want_stats[k] for k in SPEC_KEYS if k in want_stats}, (prompt, draft)
            accepted += stats.get("accepted", 0)
    assert accepted > 0                                              # drafts were verified and some kept
    with pytest.raises(reference.UserError, match="needs dflash"):   # a server pinned without it
        Server(params, cfg, 1, context=64, max_draft_len=4, features=batch.Features(), step_width=8,
               dflash=str(drafter)).submit(fib, 4, draft="dflash")


def test_tree_requests_beside_chains_get_their_own_runs():
    """Requests with draft trees of different budgets (Server.submit(tree=...), the HTTP and JSONL "tree") in the
    same steps as chain, plain and prefilling rows (a 29-token prompt prefilled in chunks while the others decode),
    greedy and sampled, per-position rollback: each gets the tokens and acceptance counts of its own
    jax_impl.generate run (whose tree rounds test_jax_trees holds to the reference), and each slot ends with the
    state of its request's committed tokens (tiny-odd mostly repeats its last token whatever its state: the tokens
    alone would not show a wrong state). The n-gram trees (spec_decode.TREE_DRAFTERS, each within its own budget
    inside the step's) are accepted in part."""
    cfg, params = model()
    greedy, sampled = reference.Sampling(), reference.Sampling(0.9, 40, 0.95)
    requests = [dict(prompt=PROMPTS[0], max_new_tokens=17, draft="ngram", tree=reference.TreeBudget(6, 3, 2)),
                dict(prompt=PROMPTS[3], max_new_tokens=12, draft="ngram", tree="4:2:2", sampling=sampled, seed=3),
                dict(prompt=PROMPTS[1], max_new_tokens=9, draft="ngram", draft_len=4),
                dict(prompt=PROMPTS[5] + PROMPTS[0], max_new_tokens=9),     # 29 tokens: prefilled beside trees
                dict(prompt=PROMPTS[2], max_new_tokens=12, draft="mtp", tree=reference.TreeBudget(3, 3, 1))]
    server = Server(params, cfg, len(requests), context=48, rollback="per-position", steps_per_sync=3)
    results = server.generate(requests)      # a slot each: every request's last state stays in its slot
    accepted = {}
    for index, (r, (tokens, stats)) in enumerate(zip(requests, results)):
        tree = reference.parse_tree_budget(r["tree"]) if isinstance(r.get("tree"), str) else r.get("tree")
        want, want_stats = jax_impl.generate(params, cfg, r["prompt"], r["max_new_tokens"], r.get("sampling", greedy),
                                             r.get("seed", 0), r.get("draft", "none"), r.get("draft_len", 4),
                                             tree=tree)
        assert tokens == want and {k: stats[k] for k in SPEC_KEYS if k in want_stats} == {
            k: want_stats[k] for k in SPEC_KEYS if k in want_stats}, r
        accepted[index] = (stats.get("accepted"), stats.get("proposed"))
        assert state_error(batch.read_slot(server.slots.state, index), r["prompt"] + tokens[:-1]) < STATE_BOUND, r
    assert 0 < accepted[0][0] < accepted[0][1] and 0 < accepted[1][0] < accepted[1][1]   # trees accepted in part
    with pytest.raises(reference.UserError, match="pinned"):
        Server(params, cfg, 4, **PINNED).submit(PROMPTS[0], 4, draft="ngram", tree="4")
    with pytest.raises(reference.UserError, match="a draft tree needs draft"):
        server.submit(PROMPTS[0], 4, tree="4")
    with pytest.raises(reference.UserError, match="nodes 33"):
        server.submit(PROMPTS[0], 4, draft="ngram", tree=reference.TreeBudget(33, 2, 2))


def test_unpinned_server_compiles_per_bucket():
    """Without pinned shapes a greedy n-gram run compiles two step programs: a prefill width and the decoding
    width K+1 (more only for other draft-length buckets, sampling features or drafters)."""
    cfg, params = model()
    server = Server(params, cfg, 4, context=48)
    server.generate([dict(prompt=p, max_new_tokens=9, draft="ngram") for p in PROMPTS])
    assert server.compilations <= 2 and server.syncs >= 2


def test_compiled_programs_are_bounded(monkeypatch):
    """spec_decode.compiled keeps at most MAX_COMPILED programs, dropping the least recently used (an unpinned server
    meets a program per step shape; unbounded, their mapped code exhausted the process's memory maps), and compiles
    a dropped one again when it comes back."""
    from jax_impl import spec_decode
    monkeypatch.setattr(spec_decode, "_compiled", spec_decode.OrderedDict())
    monkeypatch.setattr(spec_decode, "MAX_COMPILED", 2)

    def scaled(params, cfg, x, *, scale):
        return x * scale * params
    fresh = []
    for scale in (1, 2, 1, 3, 2, 1):
        run, new = spec_decode.compiled(scaled, (), None, dict(scale=scale), np.float32(2), np.ones(3, np.float32))
        assert np.asarray(run(np.float32(2), np.ones(3, np.float32))).tolist() == [2.0 * scale] * 3
        fresh.append(new)
        assert len(spec_decode._compiled) <= 2
    assert fresh == [True, True, False, True, True, True]   # 1 was used after 2, so 3 dropped 2; then 2 dropped 1
    # past its share of the kernel's memory-map limit the cache keeps only the newest program (Linux's /proc counts)
    monkeypatch.setattr(spec_decode, "MAX_COMPILED", 8)
    monkeypatch.setattr(spec_decode, "memory_maps", lambda: (1000 * len(spec_decode._compiled), 2000))
    for scale in (4, 5, 6):
        spec_decode.compiled(scaled, (), None, dict(scale=scale), np.float32(2), np.ones(3, np.float32))
        assert list(dict(key[3])["scale"] for key in spec_decode._compiled) == [scale]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[], max_new_tokens=4), "the prompt is empty"),
    (dict(prompt=[1, 99999], max_new_tokens=4), "outside the vocabulary"),
    (dict(prompt=[1], max_new_tokens=4, draft="skip:2"), "draft skip:2"),
    (dict(prompt=[1], max_new_tokens=4, draft_len=33), "draft_len 33"),
    (dict(prompt=[1], max_new_tokens=20, draft_len=8, draft="ngram"), "at most 4"),
    (dict(prompt=[1], max_new_tokens=4, sampling=reference.Sampling(-1.0)), "temperature"),
    (dict(prompt=[1] * 40, max_new_tokens=20), "exceed the server's context of 48"),
    (dict(prompt=[1], max_new_tokens=4, stop=list(range(9))), "at most 8 token ids"),
    (dict(prompt=[1], max_new_tokens=4, logprobs=True), "needs logprobs"),   # PINNED compiles no log-softmax
    (dict(prompt=[1], max_new_tokens=4, draft="dflash"), "draft dflash: a server drafts with the DFlash drafter it "
                                                         "was started with .* this one has none"),
    (dict(prompt=[1], max_new_tokens=4, draft="dflash:weights/tiny-mtp-dflash"), "named dflash; this one has none"),
])
def test_bad_requests_are_refused_at_submit(kwargs, message):
    cfg, params = model()
    server = Server(params, cfg, 4, **PINNED)
    with pytest.raises(reference.UserError, match=message):
        server.submit(**kwargs)
    assert not server.waiting


# ----------------------------------------------------------------------------------------------------------------
# The command line

def test_cli_results_equal_single_runs(tmp_path, capsys):
    """python -m jax_impl.jsonl: each result line equals python -m jax_impl --json's output for that request alone
    (tokens, text, acceptance), results written as they finish. (The shapes of test_unpinned_server...: shared
    compiled programs.)"""
    requests = [{"prompt_ids": PROMPTS[0], "max_new_tokens": 9, "draft": "ngram", "id": "a"},
                {"prompt_ids": PROMPTS[5], "max_new_tokens": 9, "draft": "ngram"},
                {"prompt_ids": PROMPTS[3], "max_new_tokens": 0},
                {"prompt_ids": PROMPTS[1], "max_new_tokens": 9, "draft": "mtp", "tree": "4:2:2"}]
    path, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    model_dir = str(ROOT / "weights" / CHECKPOINT)
    code = jsonl.main(["--requests", str(path), "--out", str(out), "--model", model_dir, "--slots", "4",
                       "--context", "48"])
    assert code == 0, capsys.readouterr().err
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(results) == {"a", 2, 3, 4}
    for request_id, fields in zip(["a", 2, 3, 4], requests):
        argv = ["--model", model_dir, "--json", "--prompt-ids", ",".join(map(str, fields["prompt_ids"]))]
        for name, value in fields.items():
            if name not in ("prompt_ids", "id"):
                argv += [f"--{name.replace('_', '-')}", str(value)]
        assert {"id": request_id, **jax_impl_json(argv, capsys)} == without_seconds(results[request_id])


def without_seconds(result):
    return {**result, "stats": {k: v for k, v in result["stats"].items() if k != "seconds"}}


def jax_impl_json(argv, capsys):
    """python -m jax_impl --json's object (in this process: the compiled programs are shared)."""
    from jax_impl.__main__ import main
    capsys.readouterr()
    assert main(argv) == 0
    return without_seconds(json.loads(capsys.readouterr().out))


@pytest.mark.parametrize("lines, flags, message", [
    (["{not json"], [], "line 1: not JSON"),
    ([{"prompt_ids": [1]}, {"prompt_ids": [1], "temprature": 1}], [], "line 2: unknown field 'temprature'"),
    ([{"prompt_ids": [1], "temperature": 1e9}], [], "line 1: temperature 1000000000.0: must be"),
    ([{"prompt_ids": [1, 5000]}], [], "line 1: prompt token id 5000 is outside the vocabulary"),
    ([{"prompt_ids": [1], "draft": "model:x"}], [], "line 1: draft model:x: jax_impl runs none, ngram and mtp"),
    ([{"prompt_ids": [1], "stop": 256}], [], "line 1: stop: expected a list of token ids"),
    ([{"prompt_ids": "1,2"}], [], "line 1: prompt_ids: expected a list of token ids"),
    ([[1, 2]], [], "line 1: expected a JSON object"),
    ([], [], "no requests"),
    ([{"prompt_ids": [1]}], ["--slots", "0"], "--slots 0: must be in"),
    ([{"prompt_ids": [1], "max_new_tokens": 30}], ["--context", "8"], "--context 8: must be in [31, 512]"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, lines, flags, message):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    code = jsonl.main(["--requests", str(path), "--out", str(tmp_path / "out.jsonl"), "--model",
                       str(ROOT / "weights" / CHECKPOINT), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_missing_requests_file(tmp_path, capsys):
    assert jsonl.main(["--requests", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "none.jsonl" in err and len(err.strip().splitlines()) == 1
