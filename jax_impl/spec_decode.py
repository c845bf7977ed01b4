"""Sampling, acceptance, drafters and generation, all on device: the whole loop (draft, verify, accept, roll back,
append) is one lax.while_loop over fixed shapes (static K, a token buffer of static size), so nothing recompiles
per step and no token crosses to the host until the end. Mirrors reference.py's section of the same name.

A round always verifies K+1 tokens; a drafter that found only m < K tokens pads the rest, and acceptance stops
at m, so the kept prefix (and the state rolled back to it) is the reference's. Randomness is jax.random: the
same distributions as the reference, not its numpy stream.
"""

import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import matvec, reference
from .matvec import matmul
from .model import decoder_layer, empty_kv, empty_state, forward_hidden, lm_head, rms_norm, verify_forward
from .rollback import commit
from .sharding import constrain_state, fetch, put, replicated

Sampling, State = reference.Sampling, reference.State  # the spec's types

f32 = jnp.float32


# ----------------------------------------------------------------------------------------------------------------
# Sampling and acceptance

def is_off(setting, off_value):
    """A Python setting equal to its off value costs nothing; a traced one (a batch row's own setting) is computed
    and selected."""
    return isinstance(setting, (int, float)) and setting == off_value


def probabilities(logits, sampling):  # (..., V) -> (..., V)
    """Temperature, then top-k, then top-p, as reference.probabilities. Temperature 0 is a one-hot argmax.
    `sampling`'s fields are Python numbers, or traced scalars where each row of a batch has its own (batch.py)."""
    temperature, top_k, top_p = sampling
    if is_off(temperature, 0):
        return one_hot_argmax(logits)
    traced = not isinstance(temperature, (int, float))
    p = jax.nn.softmax(logits / (jnp.where(temperature == 0, 1, temperature) if traced else f32(temperature)), axis=-1)
    if not is_off(top_k, 0):
        if isinstance(top_k, int):
            kth_largest = jnp.sort(p, axis=-1)[..., -min(top_k, p.shape[-1]), None]
        else:
            rank = p.shape[-1] - jnp.clip(top_k, 1, p.shape[-1])
            kth_largest = jnp.take(jnp.sort(p, axis=-1), rank, axis=-1)[..., None]
        kept = jnp.where(p >= kth_largest, p, 0)
        p = select(top_k > 0, kept / kept.sum(axis=-1, keepdims=True), p)
    if not is_off(top_p, 1):  # keep the smallest top set whose mass reaches top_p
        order = jnp.argsort(-p, axis=-1, stable=True)
        sorted_p = jnp.take_along_axis(p, order, axis=-1)
        keep_sorted = jnp.cumsum(sorted_p, axis=-1) - sorted_p < top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        kept = jnp.where(keep, p, 0)
        p = select(top_p < 1, kept / kept.sum(axis=-1, keepdims=True), p)
    return jnp.where(temperature == 0, one_hot_argmax(logits), p) if traced else p


def argmax(logits):  # (..., V) -> (...,) int32
    """jnp.argmax (the first largest value; the first NaN if any) as two plain reductions: XLA:CPU's fused
    (value, index) reduction took 3x as long over a vocabulary, twice per step of a batch."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where((logits == top) | jnp.isnan(logits), index, logits.shape[-1]), axis=-1)


def one_hot_argmax(logits):
    return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=f32)


def select(condition, on, off):
    """`on` where a setting is on: a Python condition picks one statically, a traced one selects."""
    if isinstance(condition, bool):
        return on if condition else off
    return jnp.where(condition, on, off)


def sample(p, u):  # (V,), uniform in [0, 1) -> token id
    """Inverse-CDF sampling: the token whose cumulative-probability interval contains u."""
    cdf = jnp.cumsum(p)
    return jnp.minimum(jnp.searchsorted(cdf, u * cdf[-1], side="right"), len(p) - 1).astype(jnp.int32)


def draw(logits, sampling, key):  # (V,) -> token, its distribution (V,)
    p = probabilities(logits, sampling)
    top = argmax(logits)
    if is_off(sampling.temperature, 0):  # the argmax, which sample() would find in the one-hot, without its search
        return top, p
    return select(sampling.temperature > 0, sample(p, jax.random.uniform(key)), top), p


def accept_greedy(draft, m, logits):  # (K,), valid drafts m, (K+1, V) -> (accepted drafts, next token)
    """Longest prefix of the first m drafts equal to the target's argmax, then the target's own next token."""
    target = argmax(logits)
    ok = (draft == target[:-1]) & (jnp.arange(len(draft)) < m)
    n = jnp.sum(jnp.cumprod(ok))
    return n, target[n]


def accept_speculative(draft, m, q, p, u):  # (K,), m, (K, V), (K+1, V), (K+1,) uniforms -> (accepted, next token)
    """Leviathan et al. Algorithm 1 over the first m drafts: accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
    at the first rejection sample normalize(max(0, p_i - q_i)); after m acceptances sample the bonus from p_m."""
    K = len(draft)
    p_x = jnp.take_along_axis(p[:K], draft[:, None], axis=1)[:, 0]
    q_x = jnp.take_along_axis(q, draft[:, None], axis=1)[:, 0]
    ok = (u[:K] < jnp.minimum(1, p_x / q_x)) & (jnp.arange(K) < m)
    n = jnp.sum(jnp.cumprod(ok))
    residual = jnp.maximum(p[n] - jnp.concatenate([q, jnp.zeros((1, p.shape[-1]), q.dtype)])[n], 0)
    use_residual = (n < m) & (residual.sum() > 0)
    return n, sample(jnp.where(use_residual, residual, p[n]), u[K])


def is_eos(tokens, cfg):
    return jnp.isin(tokens, jnp.array(cfg.eos_token_id or (-1,), jnp.int32))


# ----------------------------------------------------------------------------------------------------------------
# Drafters. reference.Drafter is one propose function that sees the whole context and returns a variable number of
# drafts; inside the on-device loop shapes are fixed, so a DeviceDrafter is three pure functions over its own state
# pytree, always proposing K drafts of which the first m are valid:
#   init(params, cfg, buf, prompt_len, hidden, table) -> draft_state   after prefill (hidden: the padded prompt's)
#   propose(params, cfg, draft_state, buf, ntok, K, sampling, key) -> drafts (K,), q (K, V), valid count m
#   update(params, cfg, draft_state, new, hidden, n) -> draft_state    after a round kept n verified positions
# `buf[:ntok]` is the context; `new` (K+1,) holds the tokens after each verified position, `hidden` (K+1, D) the
# target's final-normed hidden states there; `table` is an offline n-gram table as arrays (or None).

class DeviceDrafter(NamedTuple):
    init: Callable
    propose: Callable
    update: Callable


def prompt_lookup(buf, length, K, max_ngram=3, want=None):  # (L,), context length -> drafts (K,), count
    """Copy from buf[:length]: the longest suffix (<= max_ngram) that occurred before; what followed its latest
    occurrence followed by `want` (default K) tokens, else its earliest occurrence (followed by the most), as the
    reference with k = want. K is the static width of the result; a batch row asks for its own want <= K."""
    want = K if want is None else want
    starts = jnp.arange(len(buf))
    found, copy_from = jnp.bool_(False), jnp.int32(0)
    for n in range(max_ngram, 0, -1):
        suffix = lax.dynamic_slice_in_dim(buf, jnp.maximum(length - n, 0), n)
        match = starts <= length - n - 1                     # an earlier occurrence, followed by a token
        for j in range(n):
            match &= jnp.roll(buf, -j) == suffix[j]
        full = match & (starts <= length - n - want)         # ... followed by `want` tokens
        start = jnp.where(full.any(), jnp.max(jnp.where(full, starts, -1)), jnp.min(jnp.where(match, starts, len(buf))))
        hit = ~found & (n <= length - 1) & match.any()
        copy_from = jnp.where(hit, start + n, copy_from)
        found |= hit
    return lax.dynamic_slice_in_dim(buf, copy_from, K), jnp.where(found, jnp.minimum(want, length - copy_from), 0)


def table_arrays(table, K):
    """reference.build_ngram_table's {"n", "table"} -> (keys (M, n), phrases cut to K (M, K), lengths (M,)), or None."""
    items = [([int(t) for t in key.split()], phrase[:K]) for key, phrase in table["table"].items()] if table else []
    if not items:
        return None
    phrases = np.zeros((len(items), K), np.int32)
    for row, (_, phrase) in enumerate(items):
        phrases[row, :len(phrase)] = phrase
    keys = np.array([key for key, _ in items], np.int32).reshape(len(items), table["n"])
    return keys, phrases, np.array([len(p) for _, p in items], np.int32)


def table_lookup(table, buf, length, K):  # -> drafts (K,), count: the phrase stored for the last n tokens
    keys, phrases, lengths = table
    n = keys.shape[1]
    hit = jnp.all(keys == lax.dynamic_slice_in_dim(buf, jnp.maximum(length - n, 0), n), axis=1) & (length >= n)
    row = jnp.argmax(hit)
    return phrases[row, :K], jnp.where(hit.any(), jnp.minimum(lengths[row], K), 0)


def ngram_propose(params, cfg, table, buf, ntok, K, sampling, key):
    """Copy from the context (prompt lookup); else the offline table. q is one-hot."""
    drafts, m = prompt_lookup(buf, ntok, K)
    if table is not None:
        table_drafts, table_m = table_lookup(table, buf, ntok, K)
        drafts, m = jnp.where(m > 0, drafts, table_drafts), jnp.where(m > 0, m, table_m)
    return drafts, jax.nn.one_hot(drafts, cfg.vocab_size, dtype=f32), m


NGRAM = DeviceDrafter(init=lambda params, cfg, buf, prompt_len, hidden, table: table, propose=ngram_propose,
                update=lambda params, cfg, table, *args: table)


def mtp_hidden(params, cfg, tokens, hidden, state, valid=None):  # (T,), (T, D) -> hidden (T, D), State
    """reference.mtp_forward up to mtp.norm (the shared lm_head is applied by the caller to the rows it needs)."""
    m, valid = params["mtp"], tokens.shape[0] if valid is None else valid
    e = rms_norm(params["embed_tokens"][tokens], m["pre_fc_norm_embedding"], cfg.rms_norm_eps)
    h = rms_norm(hidden, m["pre_fc_norm_hidden"], cfg.rms_norm_eps)
    x = matmul(jnp.concatenate([e, h], axis=-1), m["fc"])                                  # (T, D)
    positions = state.length + jnp.arange(len(x), dtype=jnp.int32)
    x, layer_state, _ = decoder_layer(x, "full_attention", m["layers"][0], state.layers[0], positions, valid, cfg)
    return rms_norm(x, m["norm"], cfg.rms_norm_eps), State((layer_state,), state.length + valid)


def mtp_init(params, cfg, buf, prompt_len, hidden, table):
    """Catch the MTP head up on the prompt: pairs (hidden of position i, token i+1). Its state: (State, last hidden)."""
    empty = State((empty_kv(cfg, len(buf), hidden.dtype),), jnp.int32(0))
    return mtp_update(params, cfg, (empty, None), buf[1:len(hidden) + 1], hidden, prompt_len)


def mtp_propose(params, cfg, draft_state, buf, ntok, K, sampling, key):
    """Chain the head K times on its own output hidden state and drafted token; the chain's KV is dropped (the kept
    state covers committed pairs only; later writes overwrite it). The K-th forward is unused, a fixed-shape cost.
    The chain is unrolled: K is small and static, and a loop iteration costs a round trip to the host on a GPU."""
    def step(carry, key):
        h, state = carry
        token, q = draw(lm_head(params, h), sampling, key)
        return mtp_step(params, cfg, token, h, state), (token, q)
    state, h = draft_state
    _, (drafts, q) = lax.scan(step, (h, state), jax.random.split(key, K), unroll=True)
    return drafts, q, K


def mtp_step(params, cfg, token, h, state):  # (), (D,) -> the head's output hidden (D,), State
    """One step of the chain: the head fed its own output hidden state and the token drafted from it."""
    out, state = mtp_hidden(params, cfg, token[None], h[None], state)
    return out[0], state


def mtp_update(params, cfg, draft_state, new, hidden, n):
    out, state = mtp_hidden(params, cfg, new, hidden, draft_state[0], valid=n)
    return state, out[n - 1]


MTP = DeviceDrafter(mtp_init, mtp_propose, mtp_update)
DRAFTERS = {"ngram": NGRAM, "mtp": MTP}


# ----------------------------------------------------------------------------------------------------------------
# Generation on device

class Stats(NamedTuple):
    target_calls: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    proposed_by_position: jax.Array     # (K,)
    accepted_by_position: jax.Array     # (K,)


class Loop(NamedTuple):
    buf: jax.Array        # (L,) prompt, then generated tokens
    ntok: jax.Array       # tokens in buf; the target state has consumed all but the last
    state: State
    draft_state: object
    key: jax.Array
    done: jax.Array       # an EOS was emitted
    stats: Stats


class Prefilled(NamedTuple):
    state: State
    first: jax.Array      # the first generated token
    hidden: jax.Array     # (P, D) the padded prompt's final-normed hidden states (the MTP head reads them)
    key: jax.Array


def prefill_device(params, cfg, prompt, prompt_len, key, *, sampling, capacity, mesh=None):
    """Prefill the padded prompt (P,) of which prompt_len tokens are real, and draw the first token."""
    state = constrain_state(empty_state(cfg, capacity, params["embed_tokens"].dtype), mesh)
    hidden, state, _ = forward_hidden(params, cfg, prompt, state, valid=prompt_len)
    key, sub = jax.random.split(key)
    first, _ = draw(lm_head(params, hidden[prompt_len - 1]), sampling, sub)
    return Prefilled(constrain_state(state, mesh), first, hidden, key)


def decode_device(params, cfg, buf, prompt_len, limit, pre, table=None, *, sampling, draft, K, rollback, mesh=None):
    """Generate up to `limit` tokens after the prompt in buf[:prompt_len] -> (buf, token count, Stats)."""
    buf = buf.at[prompt_len].set(pre.first)
    zero = jnp.int32(0)
    start = Loop(buf, prompt_len + 1, pre.state, (), pre.key, is_eos(pre.first, cfg),
                 Stats(zero, zero, zero, jnp.zeros(K, jnp.int32), jnp.zeros(K, jnp.int32)))
    if draft != "none":
        start = start._replace(draft_state=DRAFTERS[draft].init(params, cfg, buf, prompt_len, pre.hidden, table))

    def running(c):
        return ~c.done & (c.ntok - prompt_len < limit)

    def plain_step(c):
        key, sub = jax.random.split(c.key)
        hidden, state, _ = forward_hidden(params, cfg, c.buf[c.ntok - 1][None], c.state)
        token, _ = draw(lm_head(params, hidden[0]), sampling, sub)
        return c._replace(buf=c.buf.at[c.ntok].set(token), ntok=c.ntok + 1, state=constrain_state(state, mesh),
                          key=key, done=is_eos(token, cfg),
                          stats=c.stats._replace(target_calls=c.stats.target_calls + 1))

    def speculative_round(c):
        drafter, (key, k_draft, k_accept) = DRAFTERS[draft], jax.random.split(c.key, 3)
        drafts, q, m = drafter.propose(params, cfg, c.draft_state, c.buf, c.ntok, K, sampling, k_draft)
        m = jnp.minimum(m, limit - (c.ntok - prompt_len) - 1)          # room for the target's own token
        tokens = jnp.concatenate([c.buf[c.ntok - 1][None], drafts])     # (K+1,)
        logits, hidden, after, kept = verify_forward(params, cfg, tokens, c.state, rollback)
        if sampling.temperature == 0:
            accepted, token = accept_greedy(drafts, m, logits)
        else:
            u = jax.random.uniform(k_accept, (K + 1,))
            accepted, token = accept_speculative(drafts, m, q, probabilities(logits, sampling), u)
        n = accepted + 1                                                # verified positions kept
        state = constrain_state(commit(rollback, c.state, after, kept, n), mesh)
        positions = jnp.arange(K + 1)
        new = jnp.where(positions < accepted, jnp.append(drafts, 0), token)  # (K+1,) kept drafts, target's token
        eos = is_eos(new, cfg) & (positions < n)
        s = c.stats
        stats = Stats(s.target_calls + 1, s.proposed + m, s.accepted + accepted,
                      s.proposed_by_position + (positions[:K] < m), s.accepted_by_position + (positions[:K] < accepted))
        return Loop(lax.dynamic_update_slice_in_dim(c.buf, new, c.ntok, 0),
                    c.ntok + jnp.where(eos.any(), jnp.argmax(eos) + 1, n), state,
                    drafter.update(params, cfg, c.draft_state, new, hidden, n), key, eos.any(), stats)

    end = lax.while_loop(running, plain_step if draft == "none" else speculative_round, start)
    return end.buf, end.ntok, end.stats


def generate_device(params, cfg, prompt, prompt_len, limit, key, table=None, *, sampling, draft, K, rollback,
                    capacity, mesh=None):
    """prefill_device then decode_device in one traceable function (vmap it over keys to sample many runs)."""
    pre = prefill_device(params, cfg, prompt, prompt_len, key, sampling=sampling, capacity=capacity, mesh=mesh)
    buf = jnp.zeros(capacity, jnp.int32).at[:len(prompt)].set(prompt)
    return decode_device(params, cfg, buf, prompt_len, limit, pre, table, sampling=sampling, draft=draft, K=K,
                         rollback=rollback, mesh=mesh)


# ----------------------------------------------------------------------------------------------------------------
# Host entry point: pad to buckets, compile ahead of time (timed apart), run, unpack.

def round_up(n, multiple):
    return -(-n // multiple) * multiple


def buffer_sizes(prompt_len, limit, K):
    """(padded prompt length, token buffer = KV capacity). The buffer has room for a last round's K+1 tokens and
    the MTP chain's K slots past the committed length, so no write is ever clamped."""
    P = round_up(prompt_len, 16)
    return P, round_up(P + limit + 2 * (K + 1), 64)


def round_draft_len(draft, draft_len, limit):
    """The static K of a round: draft_len, but no more than the tokens left after the prefill's (the reference
    limits each round's drafts the same way), so a long draft_len and few new tokens compile a small round."""
    return min(draft_len, max(limit - 1, 0)) if draft != "none" else 0


_compiled = {}


def aval_key(x):
    """What a compiled program's argument must match: shape, dtype and weak type (read off the array: jnp.result_type
    over a server's 165 leaves took 1.5 ms, a tenth of a 16-step sync on the default model)."""
    return np.shape(x), x.dtype, getattr(x, "weak_type", False)


def compiled(fn, donate, cfg, statics, *args):
    """fn(params, cfg, *rest, **statics) jit-compiled for cfg, the statics, the argument shapes and the matvec mode
    -> (executable taking the arguments but cfg, whether it was compiled now)."""
    key = (fn, cfg, matvec.mode, tuple(statics.items()), jax.tree.structure(args),
           tuple(map(aval_key, jax.tree.leaves(args))))
    fresh = key not in _compiled
    if fresh:
        jitted = jax.jit(lambda params, *rest: fn(params, cfg, *rest, **statics), donate_argnums=donate)
        _compiled[key] = jitted.lower(*args).compile()
    return _compiled[key], fresh


def prefill_seeded(params, cfg, prompt, prompt_len, seed, **statics):
    return prefill_device(params, cfg, prompt, prompt_len, jax.random.key(seed), **statics)


def generate(params, cfg, prompt, max_new_tokens, sampling=Sampling(), seed=0, draft="none", draft_len=4,
             rollback="replay", mesh=None, ngram_table=None):
    """reference.generate / generate_speculative on device -> (tokens, stats). draft: "none", "ngram" (with an
    optional offline table, reference.build_ngram_table's format) or "mtp".
    stats["seconds"] has compile, prefill, decode and total (total leaves compile out)."""
    check_settings(params, cfg, dict(max_new_tokens=max_new_tokens, **sampling._asdict(), seed=seed, draft=draft,
                                     draft_len=draft_len, rollback=rollback))
    limit = reference.token_limit(cfg, list(prompt), max_new_tokens)
    K = round_draft_len(draft, draft_len, limit)
    P, capacity = buffer_sizes(len(prompt), limit, K)
    seconds = dict.fromkeys(("compile", "prefill", "decode"), 0.0)
    tokens, counts = [], {"target_calls": 0, "proposed": 0, "accepted": 0, "proposed_by_position": [],
                          "accepted_by_position": []}
    if limit > 0:
        host = replicated(mesh)
        prompt = np.asarray(prompt, np.int32)
        padded = put(np.pad(prompt, (0, P - len(prompt))), host)
        prompt_len, seed = put(np.int32(len(prompt)), host), put(np.uint32(seed), host)
        table = table_arrays(ngram_table, K) if draft == "ngram" else None
        table = None if table is None else tuple(put(x, host) for x in table)
        statics = dict(sampling=sampling, draft=draft, K=K, rollback=rollback, mesh=mesh)

        def run(limit):  # -> (buf, ntok, Stats), timing prefill and decode; decode_device donates the buffer
            buf, limit = put(np.pad(prompt, (0, capacity - len(prompt))), host), put(np.int32(limit), host)
            lap = time.perf_counter()
            pre = jax.block_until_ready(run_prefill(params, padded, prompt_len, seed))
            seconds["prefill"], lap = time.perf_counter() - lap, time.perf_counter()
            out = jax.block_until_ready(run_decode(params, buf, prompt_len, limit, pre, table))
            seconds["decode"] = time.perf_counter() - lap
            return out

        start = time.perf_counter()
        run_prefill, fresh = compiled(prefill_seeded, (), cfg, dict(sampling=sampling, capacity=capacity, mesh=mesh),
                                      params, padded, prompt_len, seed)
        shapes = (jax.ShapeDtypeStruct((capacity,), jnp.int32), prompt_len, prompt_len,
                  run_prefill.out_info, table)
        run_decode, fresh_loop = compiled(decode_device, (1,), cfg, statics, params, *shapes)
        if fresh or fresh_loop:  # the first run sets the executables up (lazily initialised kernels): compile time
            run(min(limit, 2))
        seconds["compile"] = time.perf_counter() - start
        buf, ntok, device_stats = run(limit)
        tokens = [int(t) for t in fetch(buf)[len(prompt):int(fetch(ntok))]]
        counts = {name: fetch(value).tolist() for name, value in device_stats._asdict().items()}
    seconds["total"] = seconds["prefill"] + seconds["decode"]
    return tokens, reference.generation_stats(len(prompt), len(tokens), counts["target_calls"], seconds,
                                              None if draft == "none" else counts, draft_len, rollback)


ENGINE_DRAFTERS = ("jax_impl", ("none", *DRAFTERS))  # what reference.check_settings lets through to this engine


def check_settings(params, cfg, settings, label=str):
    """reference.check_settings for this engine (its drafters), and the MTP drafter's needs (weights, one layer)."""
    reference.check_settings(settings, label, ENGINE_DRAFTERS)
    if settings.get("draft") == "mtp":
        reference.mtp_drafter(params, cfg)  # the reference's checks: MTP weights present, one MTP layer
