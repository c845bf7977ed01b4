"""Many requests at once on the device: B request slots and one jit-compiled step in which each slot's row does its
own thing (a prefill chunk, a verify of its own number of drafts, or nothing), accepts its own count with its own key
and rolls back its own state. A step is spec_decode.py's round (and prefill) written for one row and vmapped over the
slots, so each request gets the tokens of its own single-request run; serving.py drives it from the host, and the
conformance adapter drives its pieces (forward_row, decide_row, commit_row) through the serving traces.

Slots hold the target State with a leading slot axis (DeltaState conv (B, W-1, C), S (B, Hv, Dk, Dv); AttnState
keys (B, Hkv, S, Dh), values (B, Hkv, Dh, S); length (B,)), each slot's token buffer, phase, key, settings and
counts. Fixed shapes: every step runs all B rows over T tokens; a row with fewer is padded and masked by model.py's
`valid` (padding leaves the DeltaNet state and conv window alone and writes KV only past the row's length, where the
causal mask hides it), and a row with nothing to do has valid = 0. T is K+1 in a decoding step, K the widest draft
among the rows (bucketed: DRAFT_BUCKETS), and a prefill width (PREFILL_WIDTHS) in a step where some row prefills, so
a run compiles one step per (T, K, sampling features, drafters) it meets, not one per batch.

Per row, as the single-request loop (spec_decode.decode_device, prefill_device):
  * keys: a plain row splits its key in two, a speculative round in three (key, draft key, accept key); the prompt's
    last chunk draws the first token with a two-way split. The accept uniforms are drawn for the widest K and the
    row reads its own K+1 of them: jax.random is prefix-stable in the shape (threefry partitionable), so a row sees
    the uniforms of its own run.
  * drafts: prompt lookup or the MTP head, at most the row's own K (spec_decode.round_draft_len) and the tokens left.
  * acceptance: greedy or speculative sampling per row (its own temperature, top-k, top-p).
  * commit: the committed tokens end at the row's first stop id (an EOS inside an accepted block); the state keeps
    one verified position per committed token (reference.run_trace's rule), rebuilt by the engine's rollback strategy
    from what the verify pass kept for its first K+1 positions; a row whose every consumed position is kept (a
    prefill chunk, a full accept) takes the verify pass's state.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import reference, rollback
from .model import empty_kv, empty_state, forward_hidden, lm_head
from .sharding import replicated, state_shardings
from .spec_decode import (Stats, accept_greedy, accept_speculative, draw, mtp_hidden, mtp_propose, probabilities,
                          prompt_lookup)

# the spec's
MAX_DRAFT_LEN, Sampling, State, Tape = reference.MAX_DRAFT_LEN, reference.Sampling, reference.State, reference.Tape

f32, i32 = jnp.float32, jnp.int32

FREE, PREFILL, DECODE, DONE, PAUSED = range(5)       # a slot's phase (PAUSED: at the position the host asked for)
DRAFTERS = ("none", "ngram", "mtp")                  # a slot's drafter, by its index here
NONE, NGRAM, MTP = range(3)
DRAFT_BUCKETS = (0, 1, 2, 4, 8, 16, 32)              # a decoding step's K: the smallest bucket >= every row's K
PREFILL_WIDTHS = (16, 64)                            # a prefilling step's T: the smallest >= every row's chunk
MAX_STOP_IDS = 8                                     # stop ids per request (the checkpoint's EOS ids by default)


def draft_bucket(k):
    return next(b for b in DRAFT_BUCKETS if b >= k)


def prefill_width(tokens):
    """T of a step that prefills `tokens` (the longest chunk among its rows), chunks being at most the widest."""
    return next((w for w in PREFILL_WIDTHS if w >= tokens), PREFILL_WIDTHS[-1])


class Settings(NamedTuple):
    """A request's settings, one row per slot, written when it takes the slot."""
    temperature: jax.Array    # (B,) f32; 0 = greedy
    top_k: jax.Array          # (B,) i32; 0 = off
    top_p: jax.Array          # (B,) f32; 1 = off
    drafter: jax.Array        # (B,) i32, an index into DRAFTERS
    draft_len: jax.Array      # (B,) i32: K of its rounds, spec_decode.round_draft_len
    limit: jax.Array          # (B,) i32: tokens to generate at most (reference.token_limit)
    prompt_len: jax.Array     # (B,) i32
    stop: jax.Array           # (B, MAX_STOP_IDS) i32, -1 padded


class Slots(NamedTuple):
    state: State              # the target's, slot axis first
    mtp: object               # (the MTP head's State, its last output hidden (B, D)), or None without MTP weights
    buf: jax.Array            # (B, L) i32: prompt, then generated tokens
    ntok: jax.Array           # (B,) tokens in buf; the state has consumed all but the last once decoding
    prefill_to: jax.Array     # (B,) a prefilling row consumes its prompt up to here (then PAUSED if short of it)
    phase: jax.Array          # (B,) i32
    key: jax.Array            # (B,) jax.random keys
    settings: Settings
    stats: Stats              # spec_decode.Stats, one row per slot, by-position counts (B, MAX_DRAFT_LEN)
    logprob: jax.Array        # (B, L) f32: each generated token's log-probability under the target's raw logits


class Features(NamedTuple):
    """What a step compiles in (static). A feature no row uses is left out: its cost and its compilation."""
    sample: bool = False      # some row samples (temperature > 0)
    top_k: bool = False       # ... with top-k
    top_p: bool = False       # ... with top-p
    mtp: bool = False         # some row drafts with the MTP head


def row_sampling(settings, features):
    """The rows' Sampling, each part a traced per-row value where some row uses it, else the off value."""
    return Sampling(settings.temperature if features.sample else 0.0, settings.top_k if features.top_k else 0,
                    settings.top_p if features.top_p else 1.0)


# ----------------------------------------------------------------------------------------------------------------
# One row: forward, decide, commit (the conformance adapter's verbs too)

def forward_row(params, cfg, state, tokens, valid, pick, K, strategy):
    """One row's pass over tokens (T,) of which `valid` count -> logits (K+1, V) at positions `pick` (K+1,),
    hidden (T, D), the state after the valid tokens, and what `strategy` keeps for the first K+1 positions."""
    hidden, after, tapes = forward_hidden(params, cfg, tokens, state, valid)
    tapes = [None if t is None else Tape(*(x[:K + 1] for x in t)) for t in tapes]
    kept = rollback.keep_per_position(state, tapes) if strategy == "per-position" and K else tapes
    return lm_head(params, hidden[pick]), hidden, after, kept


def decide_row(drafts, m, q, logits, sampling, u, stop, features):
    """Accept the first m drafts (K,) against logits (K+1, V): greedy, or speculative sampling with uniforms u (K+1,)
    (u[K] draws the target's token) -> (accepted, the target's token, committed tokens (K+1,), how many: the
    accepted drafts and the token, ending at the first stop id; whether a stop id ended them)."""
    accepted, token = accept_greedy(drafts, m, logits)
    if features.sample:
        sampled = accept_speculative(drafts, m, q, probabilities(logits, sampling), u)
        accepted, token = (jnp.where(sampling.temperature > 0, s, g) for s, g in zip(sampled, (accepted, token)))
    positions = jnp.arange(len(drafts) + 1)
    new = jnp.where(positions < accepted, jnp.append(drafts, 0), token)
    stops = jnp.isin(new, stop) & (positions <= accepted)
    return accepted, token, new, jnp.where(stops.any(), jnp.argmax(stops) + 1, accepted + 1), stops.any()


def commit_row(strategy, before, after, kept, n, K):
    """The state after the first n positions of a pass: the pass's own state when it consumed exactly n (a prefill
    chunk, a full accept, an idle row's n = 0), else rollback.commit from the first K+1 positions' kept states. With
    K = 0 every row keeps what it consumed (one token, a prefill chunk, nothing)."""
    if K == 0:
        return after
    rebuilt = rollback.commit(strategy, before, after, kept, jnp.clip(n, 1, K + 1))
    whole = n == after.length - before.length
    return jax.tree.map(lambda a, r: jnp.where(whole, a, r), after, rebuilt)


# ----------------------------------------------------------------------------------------------------------------
# One slot's part of a serving step

def uniforms_for(key, K, own_k):
    """The accept uniforms of a round of the row's own K (own_k) drawn as (K+1,): u[:own_k] decide the drafts and
    u[K] (accept_speculative's) is the row's u[own_k]."""
    u = jax.random.uniform(key, (K + 1,))
    return jnp.where(jnp.arange(K + 1) == K, u[own_k], u)


def propose_row(params, cfg, s, K, sampling, key, features):
    """The row's drafts (K,), their distributions q (K, V) and how many count: prompt lookup or the MTP head (only
    computed where some row drafts with it), at most the row's own K and the tokens left."""
    st = s.settings
    drafts, m = prompt_lookup(s.buf, s.ntok, K, want=st.draft_len)
    q = jax.nn.one_hot(drafts, cfg.vocab_size, dtype=f32)
    if features.mtp:
        mtp_drafts, mtp_q, _ = mtp_propose(params, cfg, s.mtp, s.buf, s.ntok, K, sampling, key)
        use = st.drafter == MTP
        drafts, q, m = jnp.where(use, mtp_drafts, drafts), jnp.where(use, mtp_q, q), jnp.where(use, st.draft_len, m)
    m = jnp.where(st.drafter == NONE, 0, m)
    return drafts, q, jnp.minimum(m, st.limit - (s.ntok - st.prompt_len) - 1)


def slot_step(params, cfg, s, *, T, K, strategy, features):
    """One slot's part of a step (vmapped over the slots by `step`): s is one row of Slots."""
    st, c = s.settings, s.state.length
    prefilling, decoding = s.phase == PREFILL, s.phase == DECODE
    sampling = row_sampling(st, features)
    plain = st.drafter == NONE
    (key2, draw_key), (key3, draft_key, accept_key) = jax.random.split(s.key), jax.random.split(s.key, 3)

    if K:
        drafts, q, m = propose_row(params, cfg, s, K, sampling, draft_key, features)
    else:
        drafts, q, m = jnp.zeros(0, i32), jnp.zeros((0, cfg.vocab_size), f32), jnp.int32(0)
    verify_tokens = jnp.pad(jnp.concatenate([s.buf[s.ntok - 1][None], drafts]), (0, T - K - 1))
    tokens = jnp.where(prefilling, lax.dynamic_slice_in_dim(s.buf, c, T), verify_tokens)
    valid = jnp.where(prefilling, jnp.clip(s.prefill_to - c, 0, T), jnp.where(decoding, m + 1, 0))
    pick = jnp.where(prefilling, jnp.maximum(valid - 1, 0), jnp.arange(K + 1))
    logits, hidden, after, kept = forward_row(params, cfg, s.state, tokens, valid, pick, K, strategy)

    u = jnp.where(plain, jax.random.uniform(draw_key), uniforms_for(accept_key, K, st.draft_len))
    accepted, _, new, n_decode, stopped = decide_row(drafts, m, q, logits, sampling, u, st.stop, features)
    first, _ = draw(logits[0], sampling, draw_key)       # a prompt's last chunk: the first generated token
    prompt_done = prefilling & (c + valid == st.prompt_len)
    n = jnp.where(decoding, n_decode, jnp.where(prefilling, valid, 0))
    state = commit_row(strategy, s.state, after, kept, n, K)

    buf = jnp.where(decoding, lax.dynamic_update_slice_in_dim(s.buf, new, s.ntok, 0),
                    jnp.where(prompt_done, s.buf.at[s.ntok].set(first), s.buf))
    ntok = s.ntok + jnp.where(decoding, n_decode, prompt_done.astype(i32))
    logprobs = jax.nn.log_softmax(logits.astype(f32), axis=-1)    # beside buf: row i's for the token after it
    logprob = jnp.where(decoding, lax.dynamic_update_slice_in_dim(
        s.logprob, jnp.take_along_axis(logprobs, new[:, None], axis=1)[:, 0], s.ntok, 0),
        jnp.where(prompt_done, s.logprob.at[s.ntok].set(logprobs[0, first]), s.logprob))
    mtp = s.mtp
    if features.mtp:  # the head consumes (hidden at each kept position, the token after it), as mtp_update
        n_mtp = jnp.where(st.drafter == MTP, n, 0)
        out, head = mtp_hidden(params, cfg, lax.dynamic_slice_in_dim(buf, c + 1, T), hidden, s.mtp[0], valid=n_mtp)
        mtp = (head, jnp.where(n_mtp > 0, out[jnp.maximum(n_mtp - 1, 0)], s.mtp[1]))

    stopped = jnp.where(decoding, stopped, jnp.isin(first, st.stop))
    finished = (decoding | prompt_done) & (stopped | (ntok - st.prompt_len >= st.limit))
    paused = prefilling & ~prompt_done & (c + valid == s.prefill_to)
    phase = jnp.where(finished, DONE, jnp.where(prompt_done, DECODE, jnp.where(paused, PAUSED, s.phase)))
    key = s.key
    if features.sample:  # a greedy row never draws with its key: in a step without sampled rows none advances
        key = jnp.where(decoding, jnp.where(plain, key2, key3), jnp.where(prompt_done, key2, s.key))
    stats = count(s.stats, decoding, m, accepted)
    return s._replace(state=state, mtp=mtp, buf=buf, ntok=ntok, phase=phase, key=key, stats=stats, logprob=logprob)


def count(stats, decoding, m, accepted):
    """spec_decode.Stats of a row, after a step in which it verified m drafts (if decoding) and accepted some."""
    on = decoding.astype(i32)
    positions = jnp.arange(stats.proposed_by_position.shape[-1])
    return Stats(stats.target_calls + on, stats.proposed + on * m, stats.accepted + on * accepted,
                 stats.proposed_by_position + on * (positions < m),
                 stats.accepted_by_position + on * (positions < accepted))


# ----------------------------------------------------------------------------------------------------------------
# Steps and the on-device loop over them

def step(params, cfg, slots, *, T, K, strategy, features, mesh=None):
    """Every slot's row one step on: vmapped slot_step (the weights are read once for all rows' tokens)."""
    row = partial(slot_step, params, cfg, T=T, K=K, strategy=strategy, features=features)
    slots = jax.vmap(row)(slots)
    return slots if mesh is None else lax.with_sharding_constraint(slots, slot_shardings(mesh, slots))


def slot_shardings(mesh, slots):
    """The slots' layout on a mesh: the target state split as sharding.state_shardings (after the slot axis), the
    rest replicated. Steps keep it, so that a compiled step always gets the layout it was compiled for."""
    rest = jax.tree.map(lambda _: replicated(mesh), slots._replace(state=None))
    return rest._replace(state=state_shardings(mesh, slots.state, batched=True))


def run_steps(params, cfg, slots, max_steps, stop_when_done, *, T, K, strategy, features, prefill, mesh=None):
    """Steps on device until max_steps, until no row has work, until a row pauses or (stop_when_done) finishes, or,
    in a prefill-width loop (prefill), until no row prefills -> (slots, steps run)."""
    def working(slots):
        return ((slots.phase == PREFILL) | (slots.phase == DECODE)).any() & (
            (slots.phase == PREFILL).any() if prefill else True)

    def cond(carry):
        i, slots, event = carry
        return (i < max_steps) & ~event & working(slots)

    def body(carry):
        i, slots, _ = carry
        new = step(params, cfg, slots, T=T, K=K, strategy=strategy, features=features, mesh=mesh)
        done_now = (new.phase == DONE) & (slots.phase != DONE)
        return i + 1, new, (new.phase == PAUSED).any() | (stop_when_done & done_now.any())
    steps, slots, _ = lax.while_loop(cond, body, (jnp.int32(0), slots, jnp.bool_(False)))
    return slots, steps


# ----------------------------------------------------------------------------------------------------------------
# Slots: allocation, one slot in and out

def empty_slots(cfg, slots, capacity, dtype=f32, mtp=False):
    """B empty slots whose KV buffers and token buffers hold `capacity` positions (FREE, zero state)."""
    def one(_):
        state = empty_state(cfg, capacity, dtype)
        head = (State((empty_kv(cfg, capacity, dtype),), jnp.int32(0)), jnp.zeros(cfg.hidden_size, dtype)) if mtp else None
        zero = jnp.int32(0)
        settings = Settings(f32(0), zero, f32(1), zero, zero, zero, zero, jnp.full(MAX_STOP_IDS, -1, i32))
        stats = Stats(zero, zero, zero, jnp.zeros(MAX_DRAFT_LEN, i32), jnp.zeros(MAX_DRAFT_LEN, i32))
        return Slots(state, head, jnp.zeros(capacity, i32), zero, zero, jnp.int32(FREE), jax.random.key(0), settings,
                     stats, jnp.zeros(capacity, f32))
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
    source = row._replace(state=zero(row.state), mtp=zero(row.mtp)) if restored is None else restored
    row = row._replace(state=source.state, mtp=source.mtp, buf=prompt, ntok=settings.prompt_len,
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


def explicit_step(params, cfg, state, rows, *, T, K, strategy):
    """Every row's pass, decision and commit -> (logits (B, K+1, V): a prefill row's last at [0], accepted (B,),
    committed tokens (B, K+1), kept positions n (B,), the new state)."""
    def row(state, r):
        pick = jnp.where(r.prefill, jnp.maximum(r.valid - 1, 0), jnp.arange(K + 1))
        logits, _, after, kept = forward_row(params, cfg, state, r.tokens, r.valid, pick, K, strategy)
        accepted, _, new, n_decided, _ = decide_row(r.tokens[1:K + 1], jnp.maximum(r.valid - 1, 0), r.q, logits,
                                                    r.sampling, r.u, r.stop, Features(True, True, True))
        n = jnp.where(r.prefill | (r.valid == 0), r.valid, jnp.where(r.keep >= 0, r.keep, n_decided))
        return logits, accepted, new, n, commit_row(strategy, state, after, kept, n, K)
    return jax.vmap(row)(state, rows)
