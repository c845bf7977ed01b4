"""Many requests at once on the device: B request slots and one jit-compiled step in which each slot's row does its
own thing (a prefill chunk, a verify of its own number of drafts, or nothing), accepts its own count with its own key
and rolls back its own state. A step is spec_decode.request_step, the single-request loop's step, vmapped over the
slots, so each request gets the tokens of its own single-request run; scheduler.py drives it from the host, and the
conformance adapter drives its pieces (target_pass, decide, commit_kept) through the serving traces (explicit_step).

Slots hold the target State with a leading slot axis (DeltaState conv (B, W-1, C), S (B, Hv, Dk, Dv); AttnState
keys (B, Hkv, S, Dh), values (B, Hkv, Dh, S); length (B,)), each slot's drafter states, token buffer, phase, key,
settings and counts. Fixed shapes: every step runs all B rows over T tokens; a row with fewer is padded and masked by
model.py's `valid` (padding leaves the DeltaNet state and conv window alone and writes KV only past the row's length,
where the causal mask hides it), and a row with nothing to do has valid = 0. T is K+1 in a decoding step, K the
widest draft among the rows (bucketed: DRAFT_BUCKETS), and a prefill width (PREFILL_WIDTHS) in a step where some row
prefills, so a run compiles one step per (T, K, sampling features, drafters) it meets, not one per batch. A step
compiles in the drafters of its Features (compiled_drafters) and each row takes its own (Settings.drafter).

Per row, as the single-request loop: spec_decode's section "A request's step" says what a step does, in which key
order. The accept uniforms are drawn for the widest K and a row reads its own K+1 of them: jax.random is
prefix-stable in the shape (threefry partitionable), so a row sees the uniforms of its own run.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import reference
from .model import empty_state
from .sharding import replicated, state_shardings
from .spec_decode import (DECODE, DONE, DRAFTER_NAMES, FREE, PAUSED, PREFILL, Features, Row, Settings, Stats,
                          commit_kept, decide, empty_drafts, request_step, target_pass)
from .trees import chain_parents, commit_tree, per_row

# the spec's
MAX_DRAFT_LEN, Sampling, State, Tape = reference.MAX_DRAFT_LEN, reference.Sampling, reference.State, reference.Tape

f32, i32 = jnp.float32, jnp.int32

DRAFT_BUCKETS = (0, 1, 2, 4, 8, 16, 32)              # a decoding step's K: the smallest bucket >= every row's K
PREFILL_WIDTHS = (16, 64)                            # a prefilling step's T: the smallest >= every row's chunk
MAX_STOP_IDS = 8                                     # stop ids per request (the checkpoint's EOS ids by default)


def draft_bucket(k):
    return next(b for b in DRAFT_BUCKETS if b >= k)


def prefill_width(tokens):
    """T of a step that prefills `tokens` (the longest chunk among its rows), chunks being at most the widest."""
    return next((w for w in PREFILL_WIDTHS if w >= tokens), PREFILL_WIDTHS[-1])


def compiled_drafters(features):
    """The drafters a step with these Features computes for its rows: prompt lookup always, the MTP head and the
    server's DFlash drafter if asked."""
    return ("ngram",) + (("mtp",) if features.mtp else ()) + (("dflash",) if features.dflash else ())


# a request's drafter in a server, named without arguments ("dflash": the DFlash drafter the server loaded, if any)
SERVED_DRAFTERS = ("none", *compiled_drafters(Features(mtp=True)))
LOADED_DRAFTERS = ("dflash",)


class Slots(NamedTuple):
    """B requests' spec_decode.Rows stacked, slot axis first, and their Settings (of (B,) arrays; Settings.drafter
    an index into DRAFTER_NAMES)."""
    state: State              # the target's, slot axis first
    drafts: dict              # {drafter name: its state}: the MTP head's (State, last output hidden (B, D)), the
                              # DFlash drafter's context cache (reference.DFlashState), if compiled in
    buf: jax.Array            # (B, L) i32: prompt, then generated tokens
    ntok: jax.Array           # (B,) tokens in buf; the state has consumed all but the last once decoding
    prefill_to: jax.Array     # (B,) a prefilling row consumes its prompt up to here (then PAUSED if short of it)
    phase: jax.Array          # (B,) i32
    key: jax.Array            # (B,) jax.random keys
    settings: Settings
    stats: Stats              # spec_decode.Stats, one row per slot, by-position counts (B, MAX_DRAFT_LEN)
    logprob: jax.Array        # (B, L) f32: each generated token's log-probability under the target's raw logits


# ----------------------------------------------------------------------------------------------------------------
# One slot's part of a serving step: spec_decode.request_step on its row

def slot_step(params, cfg, s, arrays, *, T, K, rollback, features, prefills, tree=None):
    """One slot's part of a step (vmapped over the slots by `step`): s is one row of Slots; arrays: {drafter name:
    its constant arrays} (the DFlash drafter's weights), shared by the slots."""
    drafters = compiled_drafters(features)
    row = Row(s.state, {name: s.drafts[name] for name in drafters if name in s.drafts}, s.buf, s.ntok, s.prefill_to,
              s.phase, s.key, s.stats, s.logprob)
    row = request_step(params, cfg, row, s.settings, arrays, T=T, K=K, rollback=rollback, features=features,
                       drafters=drafters, prefills=prefills, tree=tree)
    return s._replace(**row._replace(drafts={**s.drafts, **row.drafts})._asdict())


# ----------------------------------------------------------------------------------------------------------------
# Steps and the on-device loop over them

def step(params, cfg, slots, arrays=None, *, T, K, rollback, features, prefills=True, mesh=None, tree=None):
    """Every slot's row one step on: vmapped slot_step (the weights are read once for all rows' tokens). prefills:
    whether a row may prefill (a step without compiles no prefill). tree: the step's reference.TreeBudget (K = its
    nodes) when some row's request verifies draft trees (Settings.tree), each within its own."""
    row = partial(slot_step, params, cfg, arrays=arrays, T=T, K=K, rollback=rollback, features=features,
                  prefills=prefills, tree=tree)
    slots = jax.vmap(row)(slots)
    return slots if mesh is None else lax.with_sharding_constraint(slots, slot_shardings(mesh, slots))


def slot_shardings(mesh, slots):
    """The slots' layout on a mesh: the target state split as sharding.state_shardings (after the slot axis), the
    rest replicated. Steps keep it, so that a compiled step always gets the layout it was compiled for."""
    rest = jax.tree.map(lambda _: replicated(mesh), slots._replace(state=None))
    return rest._replace(state=state_shardings(mesh, slots.state, batched=True))


def run_steps(params, cfg, slots, max_steps, stop_when_done, arrays=None, *, T, K, rollback, features, prefill,
              prefills=True, mesh=None, tree=None):
    """Steps on device until max_steps, until no row has work, until a row pauses or (stop_when_done) finishes, or,
    in a prefill-width loop (prefill), until no row prefills -> (slots, steps run). prefills: whether a row may
    prefill in these steps (no row can start to: admission is the host's)."""
    def working(slots):
        return ((slots.phase == PREFILL) | (slots.phase == DECODE)).any() & (
            (slots.phase == PREFILL).any() if prefill else True)

    def cond(carry):
        i, slots, event = carry
        return (i < max_steps) & ~event & working(slots)

    # One slot (and no mesh): the loop carries its row without the slot axis, as the single-request loop does.
    # Carried with the axis, XLA wrote each KV cache twice a step into copies of it (one for the attention dot's
    # squeezed operand, one for the carry): 4 whole-cache copies a step, none in the loop's (docs/measured.md).
    one = mesh is None and slots.phase.shape[0] == 1

    def body(carry):
        i, slots, _ = carry
        if one:
            new = slot_step(params, cfg, slots, arrays, T=T, K=K, rollback=rollback, features=features,
                            prefills=prefills, tree=tree)
        else:
            new = step(params, cfg, slots, arrays, T=T, K=K, rollback=rollback, features=features, prefills=prefills,
                       mesh=mesh, tree=tree)
        done_now = (new.phase == DONE) & (slots.phase != DONE)
        return i + 1, new, (new.phase == PAUSED).any() | (stop_when_done & done_now.any())
    carried = jax.tree.map(lambda x: x[0], slots) if one else slots
    steps, carried, _ = lax.while_loop(cond, body, (jnp.int32(0), carried, jnp.bool_(False)))
    return (jax.tree.map(lambda x: x[None], carried) if one else carried), steps


# ----------------------------------------------------------------------------------------------------------------
# Slots: allocation, one slot in and out

def empty_slots(cfg, slots, capacity, dtype=f32, mtp=False, arrays=None):
    """B empty slots whose KV buffers and token buffers hold `capacity` positions (FREE, zero state); the MTP head's
    state if `mtp`, the DFlash drafter's if arrays (its constant arrays by name) has one."""
    def one(_):
        state = empty_state(cfg, capacity, dtype)
        features = Features(mtp=mtp, dflash="dflash" in (arrays or {}))
        drafts = empty_drafts(None, cfg, compiled_drafters(features), capacity, dtype, arrays)
        zero = jnp.int32(0)
        settings = Settings(f32(0), zero, f32(1), zero, zero, zero, zero, jnp.full(MAX_STOP_IDS, -1, i32),
                            reference.TreeBudget(zero, zero, zero))
        stats = Stats(zero, zero, zero, jnp.zeros(MAX_DRAFT_LEN, i32), jnp.zeros(MAX_DRAFT_LEN, i32))
        return Slots(state, drafts, jnp.zeros(capacity, i32), zero, zero, jnp.int32(FREE), jax.random.key(0),
                     settings, stats, jnp.zeros(capacity, f32))
    return jax.vmap(one)(jnp.arange(slots))


def read_slot(slots, index):
    """One slot's row (copies that later steps cannot change): a prefix-cache entry, or a state to export."""
    return jax.tree.map(lambda x: x[index], slots)


def write_slot(slots, index, row):
    return jax.tree.map(lambda x, r: x.at[index].set(r), slots, row)


def admit(slots, index, prompt, settings, seed, prefill_to, restored=None):
    """A request takes slot `index`: its prompt (L,) in the token buffer, its settings (a Settings of scalars), key
    jax.random.key(seed) and zero counts; its state zero, or `restored` (a read_slot row: a prefix-cache entry whose
    state has consumed prompt[:restored.state.length]), from where its prefill continues up to prefill_to."""
    row = read_slot(slots, index)
    zero = partial(jax.tree.map, jnp.zeros_like)
    source = row._replace(state=zero(row.state), drafts=zero(row.drafts)) if restored is None else restored
    row = row._replace(state=source.state, drafts=source.drafts, buf=prompt, ntok=settings.prompt_len,
                       prefill_to=prefill_to, phase=jnp.int32(PREFILL), key=jax.random.key(seed), settings=settings,
                       stats=zero(row.stats))
    return write_slot(slots, index, row)


def resume(slots, index, prefill_to):
    """A PAUSED slot prefills on, up to prefill_to."""
    return slots._replace(prefill_to=slots.prefill_to.at[index].set(prefill_to),
                          phase=slots.phase.at[index].set(PREFILL))


def free(slots, index):
    """Slot `index` takes no more steps (a cancelled request); admit overwrites it."""
    return slots._replace(phase=slots.phase.at[index].set(FREE))


# ----------------------------------------------------------------------------------------------------------------
# A step whose rows come from the caller (the conformance adapter's serving traces): tokens, drafts, q, uniforms and
# commit rules given, nothing drafted or drawn here.

class Rows(NamedTuple):
    tokens: jax.Array         # (B, T) i32: a prefill chunk, or [last committed token, drafts] (padded)
    valid: jax.Array          # (B,) i32 tokens that count; 0: the row does nothing
    prefill: jax.Array        # (B,) bool: every valid token is kept, logits of the last come back
    keep: jax.Array           # (B,) i32 positions kept whatever the target says ({"keep": n}); -1: decide
    q: jax.Array              # (B, K, V) f32 the drafts' distributions (sampling rows)
    u: jax.Array              # (B, K+1) f32 uniforms: u[i] decides draft i, u[K] draws the target's token
    sampling: Sampling        # of (B,) arrays
    stop: jax.Array           # (B, MAX_STOP_IDS) i32, -1 padded
    tree: jax.Array = None    # (B,) bool: the row's tokens are a draft tree's nodes (verify_tree), the root first
    parents: jax.Array = None  # (B, K+1) i32: a tree row's parents, its padding nodes children of the root
    path: jax.Array = None    # (B, K+1) i32: a tree row's forced path, its first `keep` entries committed
    # (tree, parents, path None: no row is a tree's, and the step compiles no tree pass)


def explicit_step(params, cfg, state, rows, *, T, K, rollback):
    """Every row's pass, decision and commit -> (logits (B, K+1, V): a prefill row's last at [0], a tree row's in
    node order, accepted (B,), committed tokens (B, K+1), kept positions n (B,), the new state, and with tree rows
    the accepted paths (B, K+1): a tree row's first accepted + 1 entries, its commit the first n)."""
    trees_on = rows.tree is not None

    def row(state, r):
        pick = jnp.where(r.prefill, jnp.maximum(r.valid - 1, 0), jnp.arange(K + 1))
        pass_parents = jnp.where(r.tree, jnp.pad(r.parents, (0, T - K - 1)), chain_parents(T)) if trees_on else None
        as_tree = r.tree if trees_on else True
        logits, _, after, kept, _ = target_pass(params, cfg, state, r.tokens, r.valid, pick, K, rollback, pass_parents,
                                                (), as_tree)
        accepted, _, new, n_decided, _, path = decide(r.tokens[1:K + 1], jnp.maximum(r.valid - 1, 0), r.q, logits,
                                                      r.sampling, r.u, r.stop, Features(True, True, True), r.parents,
                                                      as_tree)
        n = jnp.where(r.prefill | (r.valid == 0), r.valid, jnp.where(r.keep >= 0, r.keep, n_decided))
        if not trees_on:
            return logits, accepted, new, n, commit_kept(rollback, state, after, kept, n, K)
        committed_path = jnp.where(r.keep >= 0, r.path, path)
        state = per_row(r.tree, lambda: commit_tree(rollback, state, after, kept.tree, committed_path, jnp.maximum(n, 1)),
                        lambda: commit_kept(rollback, state, after, kept.chain, n, K))
        return logits, accepted, new, n, state, path
    return jax.vmap(row)(state, rows)
