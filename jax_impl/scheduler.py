"""Serving many requests at once: a host-side scheduler over batch.py's B device slots.

    server = jax_impl.Server(params, cfg, slots=16, context=512)
    ids = [server.submit(prompt, max_new_tokens=64, draft="ngram") for prompt in prompts]
    for event in server.run():            # tokens as they are committed, request by request
        print(event.request, event.tokens, event.done)
    tokens, stats = server.result(ids[0])

Each request has its own sampling settings, seed, drafter (none, ngram, mtp), draft length or draft tree budget
(a step with tree rows runs them beside chain rows, each row by its own rules: docs/trees.md) and stop ids, and gets the
tokens of its own single-request run (jax_impl.generate with the same arguments): batch.py computes each row as that
loop does. The rollback strategy is the server's.

The host admits waiting requests into free slots (first come, first served), then runs batch.run_steps: up to
`steps_per_sync` steps on device, fewer when a row finishes while requests wait, when a row reaches a prefix-cache
point, or when the last prompt chunk is in (so that decoding steps run narrow). It then reads the token buffers back
and reports what was committed.

Prefix cache: a request submitted with cache_prompt=True leaves a copy of its slot (target state, MTP head state and
token buffer) after all of its prompt but the last token, keyed by the prompt; a later request whose prompt starts
with a cached prompt restores that copy into its slot and prefills only the rest. Entries are kept
least-recently-used within `cache_bytes`. A restored MTP request needs an entry written by an MTP request (the head's
state is only built for those). Restoring changes where the prompt's prefill chunks end, so a restored request's
tokens equal its own run's up to rounding of the state (the same token unless two logits nearly tie).
"""

import os
import time
from collections import OrderedDict, deque
from typing import NamedTuple

import jax
import numpy as np

from . import batch, reference, spec_decode
from .batch import DECODE, DONE, LOADED_DRAFTERS, MAX_STOP_IDS, PAUSED, PREFILL, SERVED_DRAFTERS
from .sharding import fetch
from .spec_decode import DRAFTER_NAMES, check_settings, compiled, round_draft_len, round_up

MAX_DRAFT_LEN, Sampling, UserError = reference.MAX_DRAFT_LEN, reference.Sampling, reference.UserError

# Slot bookkeeping, compiled once per server shape (the steps are compiled per shape and counted: Server.step counts the steps)
new_slots = jax.jit(batch.empty_slots, static_argnums=(0, 1, 2, 3, 4))   # arrays (drafters' weights) traced
admit_slot = jax.jit(batch.admit, donate_argnums=0)
read_slot = jax.jit(batch.read_slot)
resume_slot = jax.jit(batch.resume, donate_argnums=0)
free_slot = jax.jit(batch.free, donate_argnums=0)


class Request(NamedTuple):
    prompt: tuple
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    seed: int = 0
    draft: str = "none"
    draft_len: int = 4
    stop: tuple = None            # stop ids; None: the checkpoint's EOS ids
    cache_prompt: bool = False    # leave a prefix-cache entry of this prompt
    logprobs: bool = False        # report each token's log-probability (Event.logprobs)
    tree: object = None           # a reference.TreeBudget: each round verifies a draft tree of its drafter's
                                  # (spec_decode.TREE_DRAFTERS) within it; draft_len is then unused


class Event(NamedTuple):
    request: int                  # the id submit returned
    tokens: list                  # tokens committed since the last event of this request
    done: bool
    logprobs: list = None         # the tokens' log-probabilities under the target's raw logits, where asked for


class Entry(NamedTuple):
    """A prefix-cache entry: a slot's row (batch.read_slot) whose state has consumed all of `prompt` but its last
    token."""
    prompt: tuple
    row: batch.Slots
    drafter: str                  # the drafter of the request that wrote it: the one whose state the row holds built
    nbytes: int

    def holds(self, draft):
        """Whether a request drafting with `draft` may start from it: its drafter keeps no state, or this one's."""
        return draft == self.drafter or draft not in self.row.drafts


class Running(NamedTuple):
    """A request in a slot, as the host follows it."""
    id: int
    request: Request
    limit: int
    draft_len: int                # K of its rounds
    emitted: int                  # generated tokens reported so far
    admitted: float               # time.perf_counter() at admission


def request_settings(r):
    """A Request's settings (its fields named in reference.REQUEST_SETTINGS, and its sampling's) as
    reference.check_settings takes them."""
    return {**{name: getattr(r, name) for name in reference.REQUEST_SETTINGS if name in Request._fields},
            **r.sampling._asdict()}


def check_request(cfg, params, r, label=str, loaded=()):
    """The settings (spec_decode.check_settings: the command lines' check), the stop ids, the prompt -> its token
    limit. label(name): how the caller names a setting (the HTTP front end's max_tokens); loaded: the drafters the
    server loaded at its start (batch.LOADED_DRAFTERS: its DFlash drafter's "dflash")."""
    name = r.draft.partition(":")[0]
    if name in LOADED_DRAFTERS and (r.draft != name or name not in loaded):
        raise UserError(f"{label('draft')} {r.draft}: a server drafts with the DFlash drafter it was started with "
                        f"(--dflash DIR), named {name}" + ("" if name in loaded else "; this one has none"))
    check_settings(params, cfg, request_settings(r), label, ("jax_impl", SERVED_DRAFTERS + tuple(loaded)), loaded)
    stop = cfg.eos_token_id if r.stop is None else r.stop
    if len(stop) > MAX_STOP_IDS or not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in stop):
        raise UserError(f"{label('stop')} {list(stop)!r:.100}: at most {MAX_STOP_IDS} token ids in "
                        f"[0, {cfg.vocab_size})")
    if r.tree is not None:
        check_tree_budget(r, label)
    return reference.token_limit(cfg, list(r.prompt), r.max_new_tokens)


def check_tree_budget(r, label=str):
    """A request's draft tree budget: a drafter that drafts trees, each bound in reference.TREE_LIMITS, and at most
    MAX_DRAFT_LEN nodes (a server's widest round)."""
    if r.draft not in spec_decode.TREE_DRAFTERS:
        raise UserError(f"{label('tree')}: a draft tree needs {label('draft')} "
                        f"{' or '.join(spec_decode.TREE_DRAFTERS)}, not {r.draft}")
    limits = {**reference.TREE_LIMITS, "nodes": min(reference.TREE_LIMITS["nodes"], MAX_DRAFT_LEN)}
    for field, value in r.tree._asdict().items():
        if not (isinstance(value, int) and 1 <= value <= limits[field]):
            raise UserError(f"{label('tree')} {field} {value!r}: must be an integer in [1, {limits[field]}]")


def tree_budget(tree):
    """A request's tree setting: a reference.TreeBudget, "NODES[:DEPTH[:BRANCH]]" (--tree's form) or None."""
    return reference.parse_tree_budget(tree) if isinstance(tree, str) else tree


def round_width(r, limit):
    """K of a request's rounds: its tree's nodes, or its drafts (round_draft_len)."""
    return r.tree.nodes if r.tree is not None else round_draft_len(r.draft, r.draft_len, limit)


class Server:
    """B request slots on the device (batch.Slots) and the host's queue. `context`: the most tokens (prompt and
    generated) a request may hold; the slots' KV and token buffers are allocated for it at the start.

    What a step compiles for is by default what its rows need: K the widest draft among them (bucketed), the sampling
    features and drafters they use, T = K+1 for decoding and a prefill width (batch.PREFILL_WIDTHS) while a row
    prefills. max_draft_len (every step's K), features (a batch.Features every step compiles in) and step_width
    (every step's T, prompts prefilled in chunks of it; needs max_draft_len) pin them instead: one compilation per
    server shape, each step as wide as the widest request could need; a request outside them is refused at submit.
    dflash: a DFlash drafter's checkpoint directory (reference.load_dflash), drafting for requests with draft
    "dflash" (argmax drafts, a one-hot q, as --draft dflash:DIR)."""

    def __init__(self, params, cfg, slots=16, context=None, rollback="replay", steps_per_sync=16,
                 cache_bytes=2**30, mesh=None, max_draft_len=None, features=None, step_width=None, dflash=None):
        reference.check_settings({"rollback": rollback})
        context = min(cfg.max_position_embeddings, 4096) if context is None else context
        if not 1 <= context <= cfg.max_position_embeddings:
            raise UserError(f"context {context}: must be in [1, {cfg.max_position_embeddings}] (the checkpoint's "
                            "max_position_embeddings)")
        if not 1 <= slots <= 4096:
            raise UserError(f"slots {slots}: must be in [1, 4096]")
        if max_draft_len is not None and not 0 <= max_draft_len <= MAX_DRAFT_LEN:
            raise UserError(f"max_draft_len {max_draft_len}: must be in [0, {MAX_DRAFT_LEN}]")
        if step_width is not None and (max_draft_len is None or not
                                       batch.draft_bucket(max_draft_len) < step_width <= 4096):
            raise UserError(f"step_width {step_width}: needs max_draft_len, and must be in "
                            f"[{batch.draft_bucket(max_draft_len or 0) + 1}, 4096]")
        self.params, self.cfg, self.rollback, self.mesh = params, cfg, rollback, mesh
        self.max_draft_len, self.features, self.step_width = max_draft_len, features, step_width
        self.context, self.steps_per_sync, self.cache_bytes = context, steps_per_sync, cache_bytes
        # room past the longest request for a step's padded writes: batch.py never lets a write clamp
        self.capacity = round_up(context + max(batch.PREFILL_WIDTHS[-1], MAX_DRAFT_LEN + 1, step_width or 0) + 1, 64)
        self.has_mtp = params.get("mtp") is not None
        # the drafters' constant arrays by name: the DFlash drafter's weights (DeviceDrafter.prepare's)
        self.arrays = {} if dflash is None else {"dflash": spec_decode.DFLASH.prepare(params, cfg, f"dflash:{dflash}",
                                                                                      None, None)}
        check_memory(cfg, params, slots, self.capacity)
        self.slots = new_slots(cfg, slots, self.capacity, params["embed_tokens"].dtype, self.has_mtp, self.arrays)
        if mesh is not None:  # on the weights' devices, laid out as the steps keep them
            self.slots = jax.device_put(self.slots, batch.slot_shardings(mesh, self.slots))
        self.waiting, self.live = deque(), [None] * slots
        self.results, self.cache, self.next_id = {}, OrderedDict(), 0
        self.finished = []         # Events of requests done without a step (no tokens to generate)
        # step programs compiled, steps run, host syncs, requests started from a prefix-cache entry
        self.compilations, self.steps, self.syncs, self.cache_hits = 0, 0, 0, 0

    # ------------------------------------------------------------------------------------------------------------
    # The API

    def submit(self, prompt, max_new_tokens=64, sampling=Sampling(), seed=0, draft="none", draft_len=4, stop=None,
               cache_prompt=False, logprobs=False, tree=None):
        """Queue a request -> its id. Checked here: a bad request raises reference.UserError and is not queued.
        tree: a draft tree budget (a reference.TreeBudget or "NODES[:DEPTH[:BRANCH]]"), draft one of
        spec_decode.TREE_DRAFTERS."""
        r = Request(tuple(int(t) for t in prompt), max_new_tokens, sampling, seed, draft, draft_len,
                    None if stop is None else tuple(stop), cache_prompt, logprobs, tree_budget(tree))
        limit = check_request(self.cfg, self.params, r, loaded=tuple(self.arrays))
        if len(r.prompt) + limit > self.context:
            raise UserError(f"the prompt ({len(r.prompt)} tokens) and {limit} new tokens exceed the server's context "
                            f"of {self.context} tokens")
        self.check_pinned(r, limit)
        request_id, self.next_id = self.next_id, self.next_id + 1
        if limit == 0:
            self.results[request_id] = ([], stats_of(r, [], None, 0.0, self.rollback))
            self.finished.append(Event(request_id, [], True))
        else:
            self.waiting.append((request_id, r, limit))
        return request_id

    def check_pinned(self, r, limit):
        pinned = self.max_draft_len is not None or self.features is not None
        if r.tree is not None and pinned:  # its steps are compiled once, for chains
            raise UserError("a draft tree: this server's steps are pinned (max_draft_len, features, step_width), and "
                            "they verify chains only")
        K = round_width(r, limit)
        if self.max_draft_len is not None and K > self.max_draft_len:
            raise UserError(f"draft_len {r.draft_len}: the server compiles rounds of at most {self.max_draft_len}")
        if self.features is not None:
            needs = features_of([r])
            missing = [name for name, on in needs._asdict().items() if on and not getattr(self.features, name)]
            if missing:
                raise UserError(f"the request needs {', '.join(missing)}, which the server's steps are not compiled "
                                "for")

    def run(self):
        """Run until every submitted request is done, yielding Events as tokens are committed."""
        while self.waiting or any(self.live) or self.finished:
            yield from self.step()

    def step(self):
        """Admit what fits, run one batch of device steps, report -> list of Events."""
        self.admit_waiting()
        phase, length = (fetch(x) for x in (self.slots.phase, self.slots.state.length))
        working = [i for i, live in enumerate(self.live) if live and phase[i] in (PREFILL, DECODE)]
        if not working:
            return self.collect()
        K = batch.draft_bucket(max(self.live[i].draft_len for i in working) if self.max_draft_len is None
                               else self.max_draft_len)
        tree = step_tree(K, [self.live[i].request.tree for i in working])
        prefill_to = fetch(self.slots.prefill_to)
        prefilling = [i for i in working if phase[i] == PREFILL]
        chunk = max((int(prefill_to[i]) - int(length[i]) for i in prefilling), default=0)
        T = self.step_width or (batch.prefill_width(max(chunk, K + 1)) if prefilling else K + 1)
        features = self.features or features_of([self.live[i].request for i in working])
        statics = dict(T=T, K=K, rollback=self.rollback, features=features,
                       prefill=bool(prefilling) and not self.step_width,
                       prefills=bool(prefilling) or self.step_width is not None, mesh=self.mesh, tree=tree)
        if self.mesh is not None:  # slot bookkeeping (admit, resume) may have moved some leaves: back in place
            self.slots = jax.device_put(self.slots, batch.slot_shardings(self.mesh, self.slots))
        run_steps, fresh = compiled(batch.run_steps, (1,), self.cfg, statics, self.params, self.slots,
                                    np.int32(self.steps_per_sync), np.bool_(bool(self.waiting)), self.arrays)
        self.compilations += fresh
        self.slots, steps = run_steps(self.params, self.slots, np.int32(self.steps_per_sync),
                                      np.bool_(bool(self.waiting)), self.arrays)
        self.steps += int(fetch(steps))
        self.syncs += 1
        return self.collect()

    def cancel(self, request_id):
        """Drop a waiting or running request: its slot is freed at once (no more tokens, no result, no prefix-cache
        entry). -> whether it was still there (a finished or unknown request is left alone)."""
        for item in self.waiting:
            if item[0] == request_id:
                self.waiting.remove(item)
                return True
        for index, live in enumerate(self.live):
            if live is not None and live.id == request_id:
                self.slots = free_slot(self.slots, np.int32(index))
                self.live[index] = None
                return True
        return False

    def result(self, request_id):
        """(tokens, stats) of a finished request: stats as jax_impl.generate's (without its timings)."""
        return self.results[request_id]

    def generate(self, requests):
        """Submit Request-like dicts (submit's arguments), run them all -> [(tokens, stats)] in their order."""
        ids = [self.submit(**r) for r in requests]
        for _ in self.run():
            pass
        return [self.result(i) for i in ids]

    # ------------------------------------------------------------------------------------------------------------
    # Host bookkeeping

    def admit_waiting(self):
        while self.waiting and None in self.live:
            index = self.live.index(None)
            request_id, r, limit = self.waiting.popleft()
            entry = self.lookup(r)
            stop = self.cfg.eos_token_id if r.stop is None else r.stop
            K = round_width(r, limit)
            settings = batch.Settings(
                np.float32(r.sampling.temperature), np.int32(min(r.sampling.top_k, self.cfg.vocab_size)),
                np.float32(r.sampling.top_p),
                np.int32(DRAFTER_NAMES.index(r.draft)), np.int32(K), np.int32(limit), np.int32(len(r.prompt)),
                np.array(list(stop) + [-1] * (MAX_STOP_IDS - len(stop)), np.int32),
                reference.TreeBudget(*(np.int32(v) for v in (r.tree or (0, 0, 0)))))
            prompt = np.zeros(self.capacity, np.int32)
            prompt[:len(r.prompt)] = r.prompt
            cache_point = len(r.prompt) - 1 if r.cache_prompt and len(r.prompt) > 1 else len(r.prompt)
            self.slots = admit_slot(self.slots, np.int32(index), prompt, settings, np.uint32(r.seed),
                                    np.int32(cache_point), None if entry is None else entry.row)
            self.live[index] = Running(request_id, r, limit, K, 0, time.perf_counter())

    def lookup(self, r):
        """The longest cached prompt that begins r.prompt (and, for a request whose drafter keeps a state, the MTP
        head's or the DFlash drafter's, one written by a request of that drafter: only its own requests build it)."""
        best = None
        for key, entry in self.cache.items():
            if (len(key) <= len(r.prompt) and r.prompt[:len(key)] == key and entry.holds(r.draft)
                    and (best is None or len(key) > len(best.prompt))):
                best = entry
        if best is not None:
            self.cache.move_to_end(best.prompt)
            self.cache_hits += 1
        return best

    def collect(self):
        """Read the slots back: report new tokens, finish DONE requests, snapshot PAUSED ones -> [Event]."""
        phase, ntok, buf = (fetch(x) for x in (self.slots.phase, self.slots.ntok, self.slots.buf))
        logprob = fetch(self.slots.logprob) if any(live and live.request.logprobs for live in self.live) else None
        events, self.finished = self.finished, []
        for index, live in enumerate(self.live):
            if live is None:
                continue
            P = len(live.request.prompt)
            generated = max(int(ntok[index]) - P, 0) if phase[index] in (DECODE, DONE) else 0
            new = buf[index, P + live.emitted:P + generated].tolist()
            done = phase[index] == DONE
            if new or done:
                events.append(Event(live.id, new, bool(done)))
                if live.request.logprobs:
                    events[-1] = events[-1]._replace(logprobs=logprob[index, P + live.emitted:P + generated].tolist())
                self.live[index] = live = live._replace(emitted=generated)
            if done:
                tokens = buf[index, P:P + generated].tolist()
                stats = fetch_row(self.slots.stats, index)
                self.results[live.id] = (tokens, stats_of(live.request, tokens, stats,
                                                         time.perf_counter() - live.admitted, self.rollback))
                self.live[index] = None
            elif phase[index] == PAUSED:
                self.snapshot(index, live.request)
        return events

    def snapshot(self, index, r):
        """Store slot `index` (its state after all of r.prompt but the last token) in the prefix cache, then let it
        prefill on."""
        row = read_slot(self.slots, np.int32(index))
        nbytes = sum(x.nbytes for x in jax.tree.leaves(row))
        self.cache.pop(r.prompt, None)
        self.cache[r.prompt] = Entry(r.prompt, row, r.draft, nbytes)
        while sum(e.nbytes for e in self.cache.values()) > self.cache_bytes:
            self.cache.popitem(last=False)
        self.slots = resume_slot(self.slots, np.int32(index), np.int32(len(r.prompt)))


def step_tree(K, trees):
    """The reference.TreeBudget a step of width K compiles for its rows' trees (None among them: chains): their
    widest depth and branch, K nodes; None when no row verifies trees."""
    trees = [t for t in trees if t is not None]
    if not trees:
        return None
    return reference.TreeBudget(K, max(t.depth for t in trees), max(t.branch for t in trees))


def features_of(requests):
    """The batch.Features that rows running `requests` need."""
    sampled = [r.sampling for r in requests if r.sampling.temperature > 0]
    return batch.Features(sample=bool(sampled), top_k=any(s.top_k > 0 for s in sampled),
                          top_p=any(s.top_p < 1 for s in sampled), mtp=any(r.draft == "mtp" for r in requests),
                          logprobs=any(r.logprobs for r in requests),
                          dflash=any(r.draft == "dflash" for r in requests))


def fetch_row(stats, index):
    return {name: fetch(value)[index].tolist() for name, value in stats._asdict().items()}


def stats_of(r, tokens, counts, seconds, rollback="replay"):
    """A request's stats as jax_impl.generate gives them (seconds: the total since admission)."""
    counts = counts or {"target_calls": 0, "proposed": 0, "accepted": 0, "proposed_by_position": [],
                        "accepted_by_position": []}
    return reference.generation_stats(len(r.prompt), len(tokens), counts["target_calls"], {"total": seconds},
                                      None if r.draft == "none" else counts,
                                      r.draft_len if r.tree is None else r.tree.nodes, rollback)


def check_memory(cfg, params, slots, capacity):
    """The slots' state must fit in memory with the weights: refuse before allocating."""
    itemsize = params["embed_tokens"].dtype.itemsize
    per_position = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize * (
        sum(kind == "full_attention" for kind in cfg.layer_types) + 1)
    delta = 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim + (
        cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * itemsize
    need = slots * (capacity * (per_position + 4) + delta * cfg.layer_types.count("linear_attention"))
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > available:
        raise UserError(f"{slots} slots of {capacity} positions need {need / 2**30:.1f} GiB of state, more than the "
                        f"{available / 2**30:.1f} GiB of memory available")

