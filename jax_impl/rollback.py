"""Rollback after a verify pass, as in reference.py's section of the same name, all traceable so that the generate
loop runs it on device. A verify pass runs the target over [last committed token, K drafts]; acceptance keeps the
first n of those K+1 positions, and the state must become the state after them. Attention only moves the length
(model.py's KV buffers hide positions past it). A DeltaNet layer has absorbed all K+1 positions, so one of two exact
strategies rebuilds it:
    per-position   at verify time keep the conv window and S after every position; commit is an index.
    replay         keep the verify pass's Tape (qkv, k, g, delta); commit replays the n kept steps from the
                   pre-verify state (decays and rank-1 updates, no forward). A full accept keeps the verify state.
Tape (reference.Tape): qkv (T, C), k (T, Hk, Dk), g (T, Hv), delta (T, Hv, Dv). STRATEGIES is the table: a new
strategy is an entry there (and in reference.ROLLBACK).
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import reference

DeltaState, KeptStates, State = reference.DeltaState, reference.KeptStates, reference.State  # the spec's types


def conv_window(window, qkv, n):  # (W-1, C), (T, C), traced n -> (W-1, C): the conv window after n of the T steps
    return lax.dynamic_slice_in_dim(jnp.concatenate([window, qkv]), n, window.shape[0])


def conv_windows(window, qkv):  # (W-1, C), (T, C) -> (T, W-1, C): the window after each step
    return jax.vmap(lambda n: conv_window(window, qkv, n))(jnp.arange(1, len(qkv) + 1))


def delta_states(S0, tape):  # (Hv, Dk, Dv), Tape of T steps -> (T, Hv, Dk, Dv)
    """The state after each step, closed form: S_t = e^gamma_t S_0 + sum_{j<=t} e^(gamma_t - gamma_j) k_j delta_j^T."""
    T, Hv = tape.g.shape
    k = jnp.repeat(tape.k, Hv // tape.k.shape[1], axis=1)                                    # (T, Hv, Dk)
    gamma = jnp.cumsum(tape.g, axis=0)                                                       # (T, Hv)
    lower = jnp.tril(jnp.ones((T, T), bool))[..., None]
    decay = jnp.exp(jnp.where(lower, gamma[:, None] - gamma[None, :], -jnp.inf))            # (T, T, Hv)
    return jnp.exp(gamma)[..., None, None] * S0 + jnp.einsum("tjh,jhk,jhv->thkv", decay, k, tape.delta)


def replay(S0, tape, n):  # (Hv, Dk, Dv), Tape of T steps, traced steps n <= T -> (Hv, Dk, Dv)
    """Rebuild the state after n steps: reference.replay's loop of decays and rank-1 updates, summed in closed form
    (as delta_states, at t = n only) and masked by j < n. One contraction, no loop: a loop costs an iteration per
    step (on a GPU, a round trip to the host): as a scan, replay took 49% of a verify pass on an H200."""
    k = jnp.repeat(tape.k, tape.g.shape[1] // tape.k.shape[1], axis=1)                      # (T, Hv, Dk)
    gamma = jnp.concatenate([jnp.zeros_like(tape.g[:1]), jnp.cumsum(tape.g, axis=0)])      # (T+1, Hv) after t steps
    live = (jnp.arange(len(k)) < n)[:, None]                                                # (T, 1)
    decay = jnp.exp(jnp.where(live, gamma[n] - gamma[1:], -jnp.inf))                        # (T, Hv) step j to n
    return jnp.exp(gamma[n])[:, None, None] * S0 + jnp.einsum("jh,jhk,jhv->hkv", decay, k, tape.delta)


def keep_per_position(before, tapes):
    """Per-position strategy, at verify time: every DeltaNet layer's KeptStates (None for attention layers)."""
    return [None if tape is None else KeptStates(conv_windows(layer.conv, tape.qkv), delta_states(layer.S, tape))
            for layer, tape in zip(before.layers, tapes)]


def commit_per_position(before, after, kept, n):
    """Keep the first n verified positions: an index into the kept states; attention just moves the length."""
    layers = tuple(a if k is None else DeltaState(k.conv[n - 1], k.S[n - 1]) for a, k in zip(after.layers, kept))
    return State(layers, before.length + n)


def commit_replay(before, after, tapes, n):
    """Keep the first n verified positions: replay the tape from the pre-verify state, skipped on full accept."""
    def rebuilt():
        layers = tuple(a if t is None else DeltaState(conv_window(b.conv, t.qkv, n), replay(b.S, t, n))
                       for b, a, t in zip(before.layers, after.layers, tapes))
        return State(layers, before.length + n)
    verified = after.length - before.length
    return lax.cond(n == verified, lambda: after, rebuilt)


class Strategy(NamedTuple):
    """A rollback strategy: what a verify pass keeps, and how commit rebuilds the state from it."""
    keep: Callable       # (state before the pass, its per-layer Tapes) -> what the pass keeps
    commit: Callable     # (before, after, kept, n) -> the State after the first n verified positions


STRATEGIES = {"per-position": Strategy(keep_per_position, commit_per_position),
              "replay": Strategy(lambda before, tapes: tapes, commit_replay)}
assert tuple(STRATEGIES) == reference.ROLLBACK_STRATEGIES


def commit(strategy, before, after, kept, n):
    """The state after the first n verified positions; `kept`: what verify kept for `strategy` (model.verify_forward)."""
    return STRATEGIES[strategy].commit(before, after, kept, n)
