"""Serving traces: scripts in which requests in different phases share batches, each reproducing the condition of a
published engine bug, with the reference's goldens after every step (INTERPRETING.md, section 4).

A TraceBuilder writes a trace step by step. It keeps each live request's state with reference.py (in float64, as the
generator computes everything) so that it can design the next step's inputs: drafts that the target accepts exactly
`accept` of, with every decision clear of near-ties, uniforms that decide sampled acceptance with room to spare; draft
trees as make/trees.py designs them (the greedy walk ending at a chosen node, or sampled siblings with clear uniforms).
The goldens then come from reference.run_trace over the finished script, and the builder checks that the interpreter
decided what the design intended.
"""

from typing import NamedTuple

import numpy as np

from .. import reference as R
from ..format import Case, Output, trace_batches
from . import golden as G
from . import trees as T

DRAFT_LEN = G.DRAFT_LEN           # K


# The draws put a decision the builder needs within tolerance of a tie, left a wrong rule undetected, or put a stop
# token where it would end the tokens early: the scenario starts again with new draws.
Redraw = G.Redraw


class OpenRequest(NamedTuple):  # a request the trace has not finished
    state: object
    last: int              # the next token to feed: the last committed, not yet consumed


class TraceBuilder:
    def __init__(self, name, checkpoint, attempt=0):
        self.name, self.checkpoint = name, checkpoint
        self.cfg, self.params = G.model(checkpoint)
        self.target = R.reference_target(self.params, self.cfg, "replay")   # either strategy: the same goldens
        self.rng = G.rng_for(f"{name}#{attempt}" if attempt else name)
        self.batches, self.inputs, self.intended = [[]], {}, {}
        self.live, self.cache, self.slots = {}, {}, 0

    def tokens(self, n):  # a prompt of n ids, drawn below 256 (every checkpoint's vocabulary has them)
        return [int(t) for t in self.rng.integers(0, min(self.cfg.vocab_size, 256), n)]

    # ------------------------------------------------------------------------------------------------------------
    # Writing steps. Each updates the builder's view at once: steps run in order (run_trace's semantics).

    def step(self, step):
        self.batches[-1].append(step)
        return f"b{len(self.batches) - 1}.s{len(self.batches[-1]) - 1}."

    def end_batch(self):
        self.batches.append([])

    def prefill(self, request, tokens):
        tokens = [int(t) for t in tokens]
        self.step({"op": "prefill", "request": request, "tokens": tokens})
        state = self.live[request].state if request in self.live else None
        logits, state = self.target.extend(state, tokens)
        self.live[request] = OpenRequest(state, int(np.argmax(logits[-1])))
        self.slots = max(self.slots, len(self.live))

    def verify(self, request, k=DRAFT_LEN, accept=None, keep=None, sampling=None, stop_at=None, rematch=False,
               padding_accepted=False):
        """One verify row and its commit. accept=a: drafts the target accepts exactly a of (greedy, or sampled with
        `sampling`); keep=n: random drafts, n positions kept whatever the target says; k=0: a plain decoding row.
        stop_at=j: the j-th committed token is made a stop token, so the committed tokens end there. rematch: greedy
        drafts after the rejected one that match the target again. padding_accepted: the target's new token repeats
        the row's last token (what an engine padding the row by repetition would then accept)."""
        live = self.live[request]
        if keep is not None:
            drafts, rule = [int(t) for t in self.rng.integers(0, self.cfg.vocab_size, k)], {"keep": keep}
            arrays = {}
        elif sampling is None or sampling.temperature == 0:
            drafts, path = (self.rematching_drafts if rematch else self.greedy_drafts)(live, k, accept)
            rule, arrays = {"accept": "greedy", "stop": []}, {}
            if stop_at is not None:
                rule["stop"] = [path[stop_at]]
                if path[stop_at] in path[:stop_at]:
                    raise Redraw(f"{self.name}: the stop token occurs before its place")
        else:
            drafts, q, uniforms = G.sampled_drafts(self.params, self.cfg, live.state, live.last, k, accept, sampling,
                                                 self.rng)
            rule = {"accept": "sampling", **G.sampling_attrs(sampling), "stop": []}
            arrays = {"q": G.f32(q), "uniforms": G.f32(uniforms)}
        prefix = self.step({"op": "verify", "request": request, "tokens": [live.last] + drafts, "commit": rule})
        self.inputs.update({prefix + name: value for name, value in arrays.items()})
        r = R.speculative_round(self.target, live.state, [live.last] + drafts, arrays.get("q"), R.sampling_of(rule),
                                arrays.get("uniforms"), rule.get("stop", ()), keep)
        if keep is None:
            self.intended[prefix] = {"accepted": accept}
            assert r.accepted == accept, f"{self.name} {prefix}: accepted {r.accepted}, designed for {accept}"
            missed = G.undiscriminated(drafts, arrays.get("q"), r.logits, R.sampling_of(rule), arrays.get("uniforms"))
            if missed:
                raise Redraw(f"{self.name} {prefix}: {missed} would decide as the spec does")
            last = r.committed[-1]
            if padding_accepted and last != ([live.last] + drafts)[-1]:
                raise Redraw(f"{self.name} {prefix}: the new token does not repeat the row's last token")
        else:
            last = int(np.argmax(r.logits[keep - 1]))
        self.live[request] = OpenRequest(r.state, last)

    def verify_tree(self, request, parents, end=None, sampling=None, siblings="top-k", stop_at=None, path=None):
        """One tree row and its commit. Greedy: tokens the target accepts the path to node `end` of (make/trees.py's
        design); sampled (`sampling`): a toy drafter's tree, its `siblings` "top-k" (one-hot q) or "iid" (its full q),
        with uniforms for which the walk goes through a second sibling, every decision clear of its edge; path: random
        tokens, that path committed whatever the target says. stop_at=j: the j-th committed token is a stop token."""
        live = self.live[request]
        if path is not None:
            tokens = [live.last] + [int(t) for t in self.rng.integers(0, self.cfg.vocab_size, len(parents) - 1)]
            rule, arrays = {"path": path}, {}
        elif sampling is None:
            tokens = T.greedy_tokens(self.params, self.cfg, live.state, live.last, parents, end, ())
            rule, arrays = {"accept": "greedy", "stop": []}, {}
        else:
            for _ in range(TREE_DRAWS):
                tokens, q, p = T.sampled_tree(self.params, self.cfg, live.state, live.last, parents, siblings,
                                              sampling, TREE_NOISE, self.rng)
                u = T.clear_uniforms(tokens, parents, G.f32(q), p, self.rng)
                if u is not None:
                    break
            else:
                raise Redraw(f"{self.name}: no uniforms decide a {siblings} tree {parents} clearly")
            rule = {"accept": "sampling", **G.sampling_attrs(sampling), "stop": []}
            arrays = {"q": G.f32(q), "uniforms": u}
        prefix = self.step({"op": "verify_tree", "request": request, "tokens": tokens, "parents": list(parents),
                            "commit": rule})
        self.inputs.update({prefix + name: value for name, value in arrays.items()})
        def run():
            return R.tree_round(self.target, live.state, tokens, parents, arrays.get("q"), R.sampling_of(rule),
                                arrays.get("uniforms"), rule.get("stop", ()), path)
        r = run()
        if stop_at is not None:
            if r.committed[stop_at] in r.committed[:stop_at]:
                raise Redraw(f"{self.name}: the stop token occurs before its place")
            rule["stop"] = [r.committed[stop_at]]
            r = run()
        if path is None:
            self.intended[prefix] = {"path": r.path}
            assert end is None or r.path[-1] == end, f"{self.name} {prefix}: accepted {r.path}, designed to end at {end}"
            last = r.committed[-1]
        else:
            last = int(np.argmax(r.logits[path[-1]]))
        self.live[request] = OpenRequest(r.state, last)

    def snapshot(self, request, key):
        self.step({"op": "snapshot", "request": request, "key": key})
        self.cache[key] = self.live[request]

    def restore(self, request, key):
        self.step({"op": "restore", "request": request, "key": key})
        self.live[request] = self.cache[key]
        self.slots = max(self.slots, len(self.live))

    def release(self, request):
        self.step({"op": "release", "request": request})
        del self.live[request]

    # ------------------------------------------------------------------------------------------------------------
    # Designing drafts

    def greedy_path(self, live, steps):
        """The target's greedy tokens after live.last and the runner-up at each step, refusing near-ties."""
        state, token, path, runners_up = live.state, live.last, [], []
        for _ in range(steps):
            logits, state = self.target.extend(state, [token])
            token, second, tied = G.runner_up(logits[-1])
            if tied:
                raise Redraw(f"{self.name}: near-tie on the greedy path")
            path.append(token)
            runners_up.append(second)
        return path, runners_up

    def greedy_drafts(self, live, k, accept):
        """Drafts following the greedy path for `accept` tokens, then the runner-up (rejected), then noise."""
        path, runners_up = self.greedy_path(live, accept + 1)
        noise = [int(t) for t in self.rng.integers(0, self.cfg.vocab_size, max(k - accept - 1, 0))]
        return (path[:accept] + ([runners_up[accept]] + noise if accept < k else [])), path

    def rematching_drafts(self, live, k, accept):
        """Drafts following the greedy path for `accept` tokens, then the runner-up (rejected), then each the
        target's argmax given the drafts before it: they match again, which only longest-prefix acceptance ignores."""
        drafts, path = self.greedy_drafts(live, min(accept + 1, k), accept)
        while len(drafts) < k:
            logits, _ = self.target.extend(live.state, [live.last] + drafts)
            token, _, tied = G.runner_up(logits[-1])
            if tied:
                raise Redraw(f"{self.name}: near-tie after a rejected draft")
            drafts.append(token)
        return drafts, path

    # ------------------------------------------------------------------------------------------------------------
    # The case

    def case(self, description):
        batches = [batch for batch in self.batches if batch]
        features = trace_features(batches)
        spec = "reference.run_trace, reference.speculative_round" + ", reference.tree_round" * ("trace:tree" in features)
        for batch in batches:
            check_grouping(self.name, batch)
        outputs = {}
        for b, s, out in R.run_trace(self.target, trace_batches({"batches": batches}, self.inputs)):
            prefix = f"b{b}.s{s}."
            for decision, value in self.intended.get(prefix, {}).items():
                assert out[decision] == value, f"{self.name} {prefix}: interpreter disagrees on {decision}"
            for name, value in out.items():
                if name == "state":
                    outputs.update({prefix + n: o for n, o in G.state_outputs(value).items()})
                elif name == "logits":
                    outputs[prefix + name] = Output("logits", value)
                else:
                    outputs[prefix + name] = Output("decision", G.i64(np.atleast_1d(value)))
        return Case(self.name, "trace", spec, description, features + G.checkpoint_features(self.checkpoint),
                    {"slots": self.slots, "batches": batches}, self.inputs, outputs, self.checkpoint)


ROWS = ("prefill", "verify", "verify_tree")
BEFORE_ROWS, AFTER_ROWS = ("snapshot", "restore", "release"), ("snapshot", "release")


def check_grouping(name, batch):
    """A batch is snapshot/restore/release steps, then rows (at most one per request), then snapshot/release steps
    (INTERPRETING.md section 4): so an engine can run the rows together."""
    ops = [step["op"] for step in batch]
    first_row = next((i for i, op in enumerate(ops) if op in ROWS), len(ops))
    last_row = max((i for i, op in enumerate(ops) if op in ROWS), default=-1)
    rows = [step["request"] for step in batch if step["op"] in ROWS]
    ok = (all(op in BEFORE_ROWS for op in ops[:first_row]) and all(op in ROWS for op in ops[first_row:last_row + 1])
          and all(op in AFTER_ROWS for op in ops[last_row + 1:]) and len(rows) == len(set(rows)))
    assert ok, f"{name}: batch {ops} on {[step['request'] for step in batch]} is not grouped as a batch must be"


def trace_features(batches):
    """What an engine needs to run these steps (format.FEATURES). A row without drafts is plain decoding: its
    decision is the argmax, or a draw with the supplied uniform ("sampling")."""
    steps = [step for batch in batches for step in batch]
    rows = [step for step in steps if step["op"] == "verify"]
    speculative = [step for step in rows if len(step["tokens"]) > 1]
    started, continued = set(), False
    for step in steps:
        continued |= step["op"] == "prefill" and step["request"] in started
        started |= {step["request"]} if step["op"] in ("prefill", "restore") else set()
    features = ["trace", "prefill"] + ["extend"] * continued + ["decode"] * bool(rows)
    features += ["sampling"] * any(s["commit"].get("accept") == "sampling" for s in rows if len(s["tokens"]) == 1)
    features += ["speculative"] * bool(speculative)
    features += sorted({f"accept:{s['commit']['accept']}" for s in speculative if "accept" in s["commit"]})
    features += ["snapshot"] * any(step["op"] in ("snapshot", "restore") for step in steps)
    trees = [step for step in steps if step["op"] == "verify_tree"]
    features += ["tree", "trace:tree"] * bool(trees)
    features += ["accept:tree-sampling"] * any(s["commit"].get("accept") == "sampling" for s in trees)
    return tuple(features)


# ----------------------------------------------------------------------------------------------------------------
# Scenarios. Each writes one trace into a builder; `sampling` (None: greedy) decides every accepting row.
# K = DRAFT_LEN drafts per verify row unless said otherwise; k=0 is a plain decoding row.

def mixed_accepts(t, sampling=None):
    """Rows accepting 0, 1 and all K drafts side by side, then other mixes (vllm#52942, RFC #48202)."""
    for r in "abc":
        t.prefill(r, t.tokens(12 + 4 * "abc".index(r)))
    for counts in ((0, 1, DRAFT_LEN), (DRAFT_LEN, 0, 2), (None, 3, 1)):
        t.end_batch()
        for r, a in zip("abc", counts):
            t.verify(r, k=0, accept=0, sampling=sampling) if a is None else t.verify(r, accept=a, sampling=sampling)


def zero_draft_after_accept(t, sampling=None):
    """A row that drafts nothing right after a step in which it accepted drafts (vllm#52942, #39273)."""
    t.prefill("a", t.tokens(14))
    t.prefill("b", t.tokens(9))
    for a, b in ((3, 1), (None, 2), (None, None), (2, DRAFT_LEN)):
        t.end_batch()
        for r, n in (("a", a), ("b", b)):
            t.verify(r, k=0, accept=0, sampling=sampling) if n is None else t.verify(r, accept=n, sampling=sampling)


def prefill_only_batch(t, sampling=None):
    """A prefill-only batch while speculation is on (vllm#55357), then a prefill row inside a verify batch."""
    for r in "abc":
        t.prefill(r, t.tokens(10 + 3 * "abc".index(r)))
    t.end_batch()
    t.verify("a", accept=2)
    t.verify("b", accept=0)
    t.verify("c", k=0, accept=0)
    t.end_batch()
    t.prefill("d", t.tokens(11))
    t.verify("a", accept=1)
    t.verify("b", accept=3)
    t.end_batch()
    t.verify("d", accept=2)
    t.verify("c", accept=1)


def accept_edges(t, sampling=None):
    """n = 1 and n = K+1 kept positions, forced and decided, side by side (vllm#50021, #40756: accepted - 1 = -1)."""
    for r in "abc":
        t.prefill(r, t.tokens(13))
    t.end_batch()
    t.verify("a", keep=1)
    t.verify("b", keep=DRAFT_LEN + 1)
    t.verify("c", accept=0)
    t.end_batch()
    t.verify("a", accept=DRAFT_LEN)
    t.verify("b", keep=1)
    t.verify("c", keep=DRAFT_LEN + 1)
    t.end_batch()
    t.verify("a", accept=0)
    t.verify("b", accept=DRAFT_LEN)
    t.verify("c", accept=1)


def stop_inside_accepted(t, sampling=None):
    """A stop (EOS) token inside an accepted block ends the committed tokens there, and the state keeps only their
    positions; the finished request is released and a new one takes its slot."""
    t.prefill("a", t.tokens(15))
    t.prefill("b", t.tokens(12))
    t.end_batch()
    t.verify("a", accept=DRAFT_LEN, stop_at=1)
    t.verify("b", accept=2)
    t.snapshot("a", "finished")           # a multi-turn follow-up would restore this
    t.release("a")
    t.end_batch()
    t.prefill("c", t.tokens(10))
    t.verify("b", accept=1)
    t.end_batch()
    t.restore("d", "finished")
    t.verify("c", accept=2)
    t.verify("d", accept=1)
    t.verify("b", k=0, accept=0)


def snapshot_after_partial_accept(t, sampling=None):
    """A prefix-cache entry written after a partial accept, restored by a new request that goes on with its own
    drafts while the first one continues (vllm#43559, #53912)."""
    t.prefill("a", t.tokens(18))
    t.end_batch()
    t.verify("a", accept=2, sampling=sampling)
    t.end_batch()
    t.snapshot("a", "prefix")
    t.restore("b", "prefix")
    t.verify("a", accept=3, sampling=sampling)
    t.verify("b", accept=1, sampling=sampling)
    t.end_batch()
    t.verify("b", accept=2, sampling=sampling)
    t.verify("a", accept=0, sampling=sampling)


def restore_at_chunk_boundary(t, sampling=None):
    """Prefix-cache entries at a length that is a multiple of the 64-token chunk and at one that is not
    (sglang#33515), restored and continued with a prefill and with drafts."""
    t.prefill("a", t.tokens(64))
    t.snapshot("a", "at64")
    t.end_batch()
    t.prefill("a", t.tokens(7))
    t.snapshot("a", "at71")
    t.end_batch()
    t.restore("b", "at64")
    t.restore("c", "at71")
    t.prefill("b", t.tokens(10))
    t.verify("c", accept=2)
    t.verify("a", accept=1)
    t.end_batch()
    t.verify("b", accept=3)
    t.verify("c", accept=0)


def chunked_prefill_across_chunk(t, sampling=None):
    """A chunked prefill crossing the 64-token chunk boundary while other rows verify (sglang#39342)."""
    t.prefill("b", t.tokens(16))
    t.prefill("c", t.tokens(12))
    for chunk, (b, c) in ((40, (2, 1)), (40, (0, 3)), (8, (None, 2))):
        t.end_batch()
        t.prefill("a", t.tokens(chunk))
        t.verify("b", k=0, accept=0) if b is None else t.verify("b", accept=b)
        t.verify("c", accept=c)
    t.end_batch()
    t.verify("a", accept=2)
    t.verify("b", accept=1)


def release_and_reuse(t, sampling=None):
    """Two slots, four requests: a released slot is taken by the next request, which must not see the old state,
    also when the old request left per-position states behind (lvyufeng/PocketLLM#162)."""
    t.prefill("a", t.tokens(12))
    t.prefill("b", t.tokens(16))
    t.end_batch()
    t.verify("a", accept=2)
    t.verify("b", accept=DRAFT_LEN)
    t.release("a")
    t.end_batch()
    t.prefill("c", t.tokens(9))
    t.verify("b", accept=1)
    t.end_batch()
    t.verify("c", accept=1)
    t.verify("b", accept=0)
    t.release("b")
    t.end_batch()
    t.prefill("d", t.tokens(14))
    t.verify("c", k=0, accept=0)
    t.end_batch()
    t.verify("d", accept=3)
    t.verify("c", accept=2)


def same_prompt_diverge(t, sampling=None):
    """Two requests with the same prompt in one batch, then different drafts and accepts, and a restored copy of one
    going its own way: nothing may alias."""
    prompt = t.tokens(17)
    t.prefill("a", prompt)
    t.prefill("b", prompt)
    t.end_batch()
    t.verify("a", accept=3, sampling=sampling)
    t.verify("b", accept=0, sampling=sampling)
    t.end_batch()
    t.verify("a", accept=0, sampling=sampling)
    t.verify("b", accept=DRAFT_LEN, sampling=sampling)
    t.snapshot("a", "a-now")
    t.end_batch()
    t.restore("e", "a-now")
    t.verify("a", accept=2, sampling=sampling)
    t.verify("e", accept=1, sampling=sampling)


def verify_width_prompt_chunks(t, sampling=None):
    """Prompt chunks of exactly K+1 tokens (a new request's, then a continuing one's) and a one-token prompt beside
    verify rows: shaped like verify rows, they are prefills (vllm#49918, #53051)."""
    t.prefill("a", t.tokens(12))
    t.prefill("b", t.tokens(DRAFT_LEN + 1))
    t.end_batch()
    t.verify("a", accept=2)
    t.prefill("b", t.tokens(DRAFT_LEN + 1))
    t.prefill("c", t.tokens(1))
    t.end_batch()
    t.verify("a", accept=1)
    t.verify("b", accept=2)
    t.verify("c", accept=1)


def long_context(t, sampling=None):
    """Attention over more than 1,000 tokens: a 1,100-token prompt in four chunks beside a short request, then
    verify rows."""
    t.prefill("b", t.tokens(10))
    for _ in range(4):
        t.prefill("a", t.tokens(275))
        t.end_batch()
    t.verify("a", accept=2)
    t.verify("b", accept=1)
    t.end_batch()
    t.verify("a", accept=DRAFT_LEN)


def prefix_cache_on_trained_model(t, sampling=None):
    """A prefix-cache entry after a partial accept on the trained default model, restored by a second request."""
    t.prefill("a", t.tokens(20))
    t.end_batch()
    t.verify("a", accept=2)
    t.snapshot("a", "prefix")
    t.end_batch()
    t.restore("b", "prefix")
    t.verify("b", accept=1)


def plain_decoding(t, sampling=None):
    """No drafts at all: a prefill-only batch, plain decoding rows beside a new prompt, release and reuse, and a
    prefix-cache entry restored (what an engine without speculative decoding serves)."""
    for r in "abc":
        t.prefill(r, t.tokens(8 + 5 * "abc".index(r)))
    for _ in range(2):
        t.end_batch()
        for r in "abc":
            t.verify(r, k=0, accept=0, sampling=sampling)
    t.release("b")
    t.snapshot("c", "c-now")
    t.end_batch()
    t.restore("e", "c-now")
    t.prefill("d", t.tokens(11))
    t.verify("a", k=0, accept=0, sampling=sampling)
    t.verify("c", k=0, accept=0, sampling=sampling)
    t.end_batch()
    for r in "acde":
        t.verify(r, k=0, accept=0, sampling=sampling)


def soak(t, sampling=None):
    """Up to four requests arriving and leaving over six steps, each row with its own accept count (0..K) or none."""
    order = iter("abcdefgh")
    for _ in range(3):
        t.prefill(next(order), t.tokens(int(t.rng.integers(6, 20))))
    for _ in range(6):
        t.end_batch()
        live = sorted(t.live)
        if len(live) > 2 and t.rng.random() < 0.3:
            t.release(live[int(t.rng.integers(len(live)))])
        if len(t.live) < 4 and t.rng.random() < 0.5:
            t.prefill(next(order), t.tokens(int(t.rng.integers(6, 20))))
        for r in sorted(t.live):
            if r in {s["request"] for s in t.batches[-1]}:
                continue
            a = int(t.rng.integers(-1, DRAFT_LEN + 1))
            try:
                t.verify(r, k=0, accept=0, sampling=sampling) if a < 0 else t.verify(r, accept=a, sampling=sampling)
            except Redraw:                    # a near-tie here: this row keeps a forced number of positions
                t.verify(r, keep=int(t.rng.integers(1, DRAFT_LEN + 2)))


def ragged_drafts(t, sampling=None):
    """Rows verifying 1, 2, 3 and K drafts and rows without drafts side by side, accepting all or some of theirs;
    requests a, b and c, on a repeated-token prompt, accept everything and then get their last token again, so an
    engine that pads a short row to K by repeating its last token and lets acceptance run into the padding keeps more
    tokens than the row verified."""
    for r in "abcde":
        t.prefill(r, t.tokens(1) * 12 if r in "abc" else t.tokens(10 + 2 * "abcde".index(r)))
    for rows in (((0, 0), (1, 1), (2, 2), (3, 1), (DRAFT_LEN, DRAFT_LEN)),
                 ((3, 3), (0, 0), (DRAFT_LEN, 2), (2, 0), (1, 1)),
                 ((1, 0), (2, 2), (0, 0), (DRAFT_LEN, 3), (3, 3))):
        t.end_batch()
        for r, (k, a) in zip("abcde", rows):
            t.verify(r, k=k, accept=a, sampling=sampling,
                     padding_accepted=sampling is None and r in "abc" and a == k)


def greedy_rematch(t, sampling=None):
    """Greedy rows whose drafts after the first rejected one match the target's argmax again: longest-prefix
    acceptance and counting the matches decide them differently."""
    for r in "abc":
        t.prefill(r, t.tokens(11 + 3 * "abc".index(r)))
    for accepts in ((0, 1, 2), (2, 0, DRAFT_LEN - 2), (1, DRAFT_LEN - 2, 0)):
        t.end_batch()
        for r, a in zip("abc", accepts):
            t.verify(r, accept=a, rematch=True)


STAR, BINARY, DEEP_NARROW = [-1, 0, 0, 0, 0], T.BINARY, T.DEEP_NARROW
TOP_K_TREE, IID_TREE = T.SAMPLED_TREES[0][1], T.SAMPLED_TREES[1][1]     # shapes whose walk can pass a second sibling
TREE_NOISE = 2.0    # the toy tree drafter's logits: the target's plus this much Gaussian noise (tiny-draft's are sharp)
TREE_DRAWS = 20     # sampled trees drawn for one row before the scenario starts again: about one in three has uniforms
                    # that walk through a second sibling with every decision clear
UNTRUNCATED = R.Sampling(4.0, 0, 1.0)   # the iid rows': drafts drawn from the whole vocabulary mostly miss a top-k/top-p cut


def tree_rows(t, sampling=None):
    """Tree rows of three shapes (a star, a binary tree, a deep narrow one) in batches beside chain verify rows, plain
    rows and prefill rows, accepting the root only, an inner node, a deepest leaf and a short branch's leaf, a stop
    token inside an accepted path and a forced path; a prefix-cache entry written after a tree commit, restored and
    continued; request a alternates tree and chain rounds."""
    for r in "abc":
        t.prefill(r, t.tokens(10 + 3 * "abc".index(r)))
    t.end_batch()
    t.verify_tree("a", STAR, end=0)
    t.verify_tree("b", BINARY, end=6)
    t.verify("c", accept=2)
    t.prefill("d", t.tokens(9))
    t.end_batch()
    t.verify("a", accept=DRAFT_LEN)
    t.verify_tree("b", DEEP_NARROW, end=2)
    t.verify("c", k=0, accept=0)
    t.verify_tree("d", BINARY, end=1)
    t.snapshot("b", "after-tree")
    t.release("c")
    t.end_batch()
    t.restore("e", "after-tree")
    t.verify_tree("a", DEEP_NARROW, end=6)
    t.verify_tree("b", BINARY, path=[0, 2, 5])
    t.verify_tree("e", BINARY, end=4, stop_at=0)
    t.verify("d", accept=1)
    t.release("e")                        # finished: its first committed token is a stop token
    t.end_batch()
    t.verify("a", accept=1)
    t.verify_tree("d", STAR, end=3)
    t.verify("b", k=0, accept=0)
    t.end_batch()
    t.verify_tree("a", BINARY, end=5)


def tree_rows_sampled(t, sampling):
    """Sampled tree rows with supplied uniforms, siblings the drafter's top-k (one-hot q) or drawn from it (its full
    q, untruncated settings), each walk through a second sibling, beside sampled chain rows, plain rows and a prefill
    row; a prefix-cache
    entry written after a tree commit, restored and continued with a tree; request a alternates tree and chain
    rounds."""
    for r in "abc":
        t.prefill(r, t.tokens(10 + 3 * "abc".index(r)))
    t.end_batch()
    t.verify_tree("a", TOP_K_TREE, sampling=sampling)
    t.verify("b", accept=2, sampling=sampling)
    t.verify("c", k=0, accept=0, sampling=sampling)
    t.end_batch()
    t.verify("a", accept=1, sampling=sampling)
    t.verify_tree("b", IID_TREE, sampling=UNTRUNCATED, siblings="iid")
    t.prefill("d", t.tokens(8))
    t.snapshot("b", "after-tree")
    t.release("c")
    t.end_batch()
    t.restore("e", "after-tree")
    t.verify_tree("a", IID_TREE, sampling=UNTRUNCATED, siblings="iid")
    t.verify_tree("e", TOP_K_TREE, sampling=sampling)
    t.verify("d", accept=3, sampling=sampling)


PER_ROW_SETTINGS = (None, R.Sampling(4.0, 40, 0.9), R.Sampling(3.0, 0, 0.8), R.Sampling(6.0, 20, 1.0))


def per_row_settings(t, sampling=None):
    """Every row with its own settings, greedy and sampled rows (with and without drafts) mixed in every batch: an
    engine must not apply one row's temperature, top-k or top-p to another, nor one rule to the whole batch."""
    for r in "abcd":
        t.prefill(r, t.tokens(9 + 3 * "abcd".index(r)))
    for b, accepts in enumerate(((2, 0, DRAFT_LEN, 1), (None, 3, 1, 0), (1, 2, None, DRAFT_LEN))):
        t.end_batch()
        for j, (r, a) in enumerate(zip("abcd", accepts)):
            settings = PER_ROW_SETTINGS[(b + j) % len(PER_ROW_SETTINGS)]
            t.verify(r, k=0, accept=0, sampling=settings) if a is None else t.verify(r, accept=a, sampling=settings)


SCENARIOS = {f.__name__.replace("_", "-"): f for f in (
    mixed_accepts, zero_draft_after_accept, prefill_only_batch, accept_edges, stop_inside_accepted,
    snapshot_after_partial_accept, prefix_cache_on_trained_model, restore_at_chunk_boundary,
    chunked_prefill_across_chunk, release_and_reuse, same_prompt_diverge, verify_width_prompt_chunks, long_context,
    plain_decoding, soak, ragged_drafts, greedy_rematch, per_row_settings, tree_rows, tree_rows_sampled)}


# Sampled traces draw at a temperature far enough from 1 that drawing at temperature 1 (a usual mistake) changes
# decisions. tiny-draft's logits are sharp (a std of about 6): at temperature 1 nearly all the mass is on one token,
# where any uniform, right or wrong, draws the same; its sampled traces run hotter. tiny-dense's and tiny-moe's have a
# std of about 1.
GREEDY, SAMPLING, SAMPLING_SHARP = None, R.Sampling(0.6, 40, 0.9), R.Sampling(4.0, 40, 0.9)
SMALL, DENSE, MOE = "tiny-draft", "tiny-dense", "tiny-moe"
# (scenario, checkpoint, sampling). A state after every commit makes the goldens grow with the state's size, so every
# scenario runs on the smallest hybrid (tiny-draft: one DeltaNet and one attention layer, a 10 KB state), the ones
# where layers or experts could be mixed up also on the 4-layer dense and MoE checkpoints, and one short trace on the
# trained default model (its state is 0.5 MB). The long trace needs tiny-dense's 2048 positions.
MATRIX = [(scenario, SMALL, GREEDY) for scenario in (
    "mixed-accepts", "zero-draft-after-accept", "prefill-only-batch", "accept-edges", "stop-inside-accepted",
    "snapshot-after-partial-accept", "restore-at-chunk-boundary", "chunked-prefill-across-chunk", "release-and-reuse",
    "same-prompt-diverge", "verify-width-prompt-chunks", "plain-decoding", "soak")]
MATRIX += [(scenario, SMALL, SAMPLING_SHARP) for scenario in (
    "mixed-accepts", "snapshot-after-partial-accept", "same-prompt-diverge", "plain-decoding", "soak")]
MATRIX += [(scenario, DENSE, GREEDY) for scenario in (
    "mixed-accepts", "zero-draft-after-accept", "accept-edges", "snapshot-after-partial-accept", "release-and-reuse",
    "plain-decoding", "long-context")]
MATRIX += [("zero-draft-after-accept", DENSE, SAMPLING)]
MATRIX += [(scenario, MOE, GREEDY) for scenario in (
    "mixed-accepts", "zero-draft-after-accept", "chunked-prefill-across-chunk", "plain-decoding")]
MATRIX += [("zero-draft-after-accept", MOE, SAMPLING), ("prefix-cache-on-trained-model", "default", GREEDY)]
# The decisions the traces above never force: ragged draft counts, matches after a mismatch, per-row settings.
MIXED = "mixed"     # the scenario gives each row its own settings
MATRIX += [("ragged-drafts", SMALL, GREEDY), ("ragged-drafts", SMALL, SAMPLING_SHARP), ("greedy-rematch", SMALL, GREEDY),
           ("greedy-rematch", DENSE, GREEDY), ("per-row-settings", SMALL, MIXED)]
# Tree rows in the batches (suite 6), on the smallest hybrid.
MATRIX += [("tree-rows", SMALL, GREEDY), ("tree-rows-sampled", SMALL, SAMPLING_SHARP)]
ATTEMPTS = 200      # scenarios are redrawn (new prompts) until no decision sits near a tie


def trace_case(scenario, checkpoint, sampling):
    label = sampling if isinstance(sampling, str) else 'greedy' if sampling is None else 'sampling'
    name = f"trace-{scenario}-{checkpoint}-{label}"
    for attempt in range(ATTEMPTS):
        t = TraceBuilder(name, checkpoint, attempt)
        try:
            SCENARIOS[scenario](t, sampling)
        except Redraw:
            continue
        return t.case(" ".join(SCENARIOS[scenario].__doc__.split()))
    raise AssertionError(f"{name}: every one of {ATTEMPTS} draws met a near-tie")


def trace_cases():
    for scenario, checkpoint, sampling in MATRIX:
        yield trace_case(scenario, checkpoint, sampling)
