"""The slots engine: serving traces run the way production engines lay out memory, in NumPy. It is the worked example
of serving a hybrid model correctly, and the engine that conformance/make/mutants.py breaks one line at a time.

Its math is reference.py's, one row at a time; its memory and bookkeeping are an engine's:
* B slots (attrs.slots) of fixed-size arrays per layer: DeltaNet S (B, Hv, Dk, Dv) and conv windows (B, W-1, C),
  attention K/V (B, capacity, Hkv, Dh) with one length per slot; a free list (lowest slot first), a request -> slot
  map, and a prefix cache of state copies keyed by name.
* A verify pass updates the slot's state in place to the state after all its positions, as a fused kernel does; what
  the commit needs is kept beside it. per-position (vLLM, SGLang): the state after each position, in columns
  (B, K+1, ...), and a LAZY commit: the slot's committed column, which the next forward of the slot reads its state
  from. replay (dflash-mlx): the pre-verify state and the pass's tape per slot; the commit replays the kept steps.
  SLOT_ROLLBACK is the table of the two (a new strategy is an entry there, as in reference.ROLLBACK).
Everything else (single requests, layers, sampling) is the reference adapter's.
"""

from typing import Callable, NamedTuple

import numpy as np

from .. import reference as R
from . import register_engine
from ..format import HERE
from .reference import Reference, state_tensors

NONE = -1                         # no committed column: the slot's state is in its base arrays
ROWS = ("prefill", "verify")      # the steps that run the model; the others are bookkeeping


class DeltaSlots(NamedTuple):     # one DeltaNet layer's memory for B slots; K+1 = the widest verify
    S: np.ndarray                 # (B, Hv, Dk, Dv)       the state after the slot's last forward
    conv: np.ndarray              # (B, W-1, C)
    S_cols: np.ndarray            # (B, K+1, Hv, Dk, Dv)  per-position: the state after each verified position
    conv_cols: np.ndarray         # (B, K+1, W-1, C)
    S_before: np.ndarray          # (B, Hv, Dk, Dv)       replay: the state the verify pass started from
    conv_before: np.ndarray       # (B, W-1, C)
    tape: R.Tape                  # replay: qkv (B, K+1, C), k (B, K+1, Hk, Dk), g (B, K+1, Hv), delta (B, K+1, Hv, Dv)


class AttnSlots(NamedTuple):      # one attention layer's KV cache for B slots
    k: np.ndarray                 # (B, capacity, Hkv, Dh); positions from the slot's length on are garbage
    v: np.ndarray


def layer_slots(cfg, kind, slots, width):
    def zeros(*shape):
        return np.zeros(shape, np.float32)
    B, W1, C = slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    if kind != "linear_attention":          # capacity: the model's context length (vLLM's max_model_len)
        kv = (B, cfg.max_position_embeddings, cfg.num_key_value_heads, cfg.head_dim)
        return AttnSlots(zeros(*kv), zeros(*kv))
    return DeltaSlots(zeros(B, Hv, Dk, Dv), zeros(B, W1, C), zeros(B, width, Hv, Dk, Dv), zeros(B, width, W1, C),
                      zeros(B, Hv, Dk, Dv), zeros(B, W1, C),
                      R.Tape(zeros(B, width, C), zeros(B, width, Hk, Dk), zeros(B, width, Hv), zeros(B, width, Hv, Dv)))


def copied(state):
    """A State that no later write to the slots can change (a prefix-cache entry)."""
    return R.State(tuple(type(layer)(*(a.copy() for a in layer)) for layer in state.layers), state.length)


class Memory:
    """The engine's memory and bookkeeping for `slots` requests at once, verify rows of up to `width` tokens."""

    def __init__(self, cfg, slots, width):
        self.width = width                                # K+1: the most positions a verify row holds
        self.layers = [layer_slots(cfg, kind, slots, width) for kind in cfg.layer_types]
        self.length = np.zeros(slots, np.int64)          # tokens consumed (committed) per slot
        self.column = np.full(slots, NONE)                # per-position: the committed column per slot
        self.free = list(range(slots))
        self.slot_of = {}                                 # request -> slot
        self.cache = {}                                   # prefix-cache key -> State (copies)

    def deltas(self, state=None):
        """(layer memory, that layer's entry of `state` or None) for the DeltaNet layers."""
        entries = state.layers if state is not None else [None] * len(self.layers)
        return [(mem, entry) for mem, entry in zip(self.layers, entries) if isinstance(mem, DeltaSlots)]

    def admit(self, request):
        """A new request takes the lowest free slot, cleared: it must not see the state of the slot's last user."""
        slot = min(self.free)
        self.free.remove(slot)
        self.slot_of[request] = slot
        for mem, _ in self.deltas():
            mem.S[slot] = 0
            mem.conv[slot] = 0
        self.length[slot], self.column[slot] = 0, NONE
        return slot

    def release(self, request):
        self.free.append(self.slot_of.pop(request))

    def read(self, slot, column):
        """The state a forward of the slot starts from (views, not copies): the committed column when a verify left
        one, else the base arrays. A slot's attention positions are those below its length."""
        layers, length = [], self.length[slot]
        for mem in self.layers:
            if isinstance(mem, AttnSlots):
                layers.append(R.AttnState(mem.k[slot, :length], mem.v[slot, :length]))
            elif column != NONE:
                layers.append(R.DeltaState(mem.conv_cols[slot, column], mem.S_cols[slot, column]))
            else:
                layers.append(R.DeltaState(mem.conv[slot], mem.S[slot]))
        return R.State(tuple(layers), int(length))

    def current(self, slot):
        return self.read(slot, self.column[slot])

    def write(self, slot, state, since):
        """State -> the slot's base arrays, with the attention positions from `since` on (the ones not cached yet)."""
        for mem, layer in zip(self.layers, state.layers):
            if isinstance(mem, AttnSlots):
                mem.k[slot, since:state.length] = layer.k[since:]
                mem.v[slot, since:state.length] = layer.v[since:]
            else:
                mem.S[slot], mem.conv[slot] = layer.S, layer.conv
        self.length[slot] = state.length
        self.column[slot] = NONE

    def write_verified(self, slot, start, after, tapes, rollback):
        """A verify pass: the state after all its positions, in place (its length is set by the commit), and what
        the rollback strategy (SLOT_ROLLBACK) needs to commit any prefix."""
        SLOT_ROLLBACK[rollback].keep(self, slot, start, after, tapes)
        self.write(slot, after, since=start.length)
        self.length[slot] = start.length         # committed positions only: the commit adds the kept ones

    def commit(self, slot, n, verified, rollback):
        """Keep the first n of the `verified` positions of the slot's last verify pass."""
        self.length[slot] += n
        SLOT_ROLLBACK[rollback].commit(self, slot, n, verified)

    def snapshot(self, request, key):
        self.cache[key] = copied(self.current(self.slot_of[request]))

    def restore(self, request, key):
        """A new request from a prefix-cache entry: copied into its slot, every attention position included."""
        self.write(self.admit(request), self.cache[key], since=0)


# The rollback strategies in slot memory, one entry each (reference.ROLLBACK's names): what a verify pass keeps beside
# the slot, and how the commit rebuilds the slot's state from it.

def keep_columns(memory, slot, start, after, tapes):
    """per-position: the state after each verified position, into the slot's columns."""
    kept = [k for k in R.keep_per_position(start, tapes) if k is not None]
    for (mem, _), k in zip(memory.deltas(), kept):
        mem.S_cols[slot, :len(k.S)], mem.conv_cols[slot, :len(k.S)] = k.S, k.conv


def commit_column(memory, slot, n, verified):
    """per-position: the kept positions' column becomes the slot's committed column."""
    memory.column[slot] = n - 1              # lazy: the next forward of the slot reads this column


def keep_tape(memory, slot, start, after, tapes):
    """replay: the pre-verify state and the pass's tape, per slot."""
    for (mem, before), tape in zip(memory.deltas(start), [t for t in tapes if t is not None]):
        mem.S_before[slot], mem.conv_before[slot] = before.S, before.conv
        for buffer, field in zip(mem.tape, tape):
            buffer[slot, :len(tape.g)] = field


def commit_tape(memory, slot, n, verified):
    """replay: the kept steps replayed from the pre-verify state."""
    if n < verified:                         # when all are kept, the pass left the right state
        for mem, _ in memory.deltas():
            tape = R.Tape(*(buffer[slot, :verified] for buffer in mem.tape))
            mem.S[slot] = R.replay(mem.S_before[slot], tape, n)
            mem.conv[slot] = R.conv_window(mem.conv_before[slot], tape.qkv, n)


class SlotRollback(NamedTuple):
    keep: Callable       # (memory, slot, the states before and after the pass, its per-layer Tapes): stores what
                         # the commit needs
    commit: Callable     # (memory, slot, n, verified): the slot's state after the first n of `verified` positions


SLOT_ROLLBACK = {"per-position": SlotRollback(keep_columns, commit_column),
                 "replay": SlotRollback(keep_tape, commit_tape)}
assert tuple(SLOT_ROLLBACK) == R.ROLLBACK_STRATEGIES

def decide(step, logits):
    """A verify row's commit rule -> (accepted, committed, positions to keep); accepted and committed are None when
    the trace forces the kept positions. reference.speculative_round's rule."""
    rule, tokens = step["commit"], list(step["tokens"])
    if "keep" in rule:
        return None, None, rule["keep"]
    accepted, token = R.accept(tokens[1:], rule.get("q"), logits, R.sampling_of(rule), rule.get("uniforms"))
    committed = R.until_stop(tokens[1:accepted + 1] + [token], rule.get("stop", ()))
    return accepted, committed, len(committed)


def run_rows(memory, model, rows, rollback):
    """A batch's rows, {step index: outputs}: each row's state gathered from its slot, the forwards, each result
    written back to its row's slot, then each verify row decided and committed."""
    cfg, params = model
    for _, step in rows:
        if step["request"] not in memory.slot_of:        # a new request's first prompt chunk
            memory.admit(step["request"])
    slots = [memory.slot_of[step["request"]] for _, step in rows]
    # rows with drafts keep what their commit needs: told by the op, not by the shape (vllm#49918)
    speculative = [step["op"] == "verify" and len(step["tokens"]) > 1 for _, step in rows]
    # every row starts where the slot's last commit left it, with drafts or without (vllm#52942)
    columns = [memory.column[slot] for slot in slots]
    starts = [memory.read(slot, column) for slot, column in zip(slots, columns)]
    passes = [R.forward(params, cfg, step["tokens"], start) for (_, step), start in zip(rows, starts)]
    for slot, (_, step), start, (_, _, after, tapes), spec in zip(slots, rows, starts, passes, speculative):
        if spec:
            memory.write_verified(slot, start, after, tapes, rollback)
        else:
            memory.write(slot, after, since=start.length)
    outputs = {}
    for slot, (s, step), (logits, *_), spec in zip(slots, rows, passes, speculative):
        if step["op"] == "prefill":
            outputs[s] = {"logits": logits[-1:]}
            continue
        accepted, committed, n = decide(step, logits)
        if spec:
            memory.commit(slot, n, len(step["tokens"]), rollback)
        decisions = {} if committed is None else {"accepted": accepted, "committed": committed,
                                                  "finished": R.finished(committed, step["commit"].get("stop", ()))}
        outputs[s] = {"logits": logits, **decisions, **state_tensors(memory.current(slot))}
    return outputs


def run_step(memory, step):
    """A snapshot, restore or release step -> its outputs."""
    if step["op"] == "snapshot":
        memory.snapshot(step["request"], step["key"])
    elif step["op"] == "restore":
        memory.restore(step["request"], step["key"])
        return state_tensors(memory.current(memory.slot_of[step["request"]]))
    elif step["op"] == "release":
        memory.release(step["request"])
    else:
        raise ValueError(f"unknown trace op {step['op']!r}")
    return {}


@register_engine("slots")
class Slots(Reference):
    """The reference adapter with a serving engine's batched path for the traces (chain and plain rows: its slot
    memory has no tree rows, so the traces with them are SKIP)."""
    features = Reference.features - {"trace:tree"}
    expectations = HERE / "expectations" / "slots.json"     # the mutants (make/mutants.py) read it too

    def run_trace(self, model, batches, rollback, slots):
        """Each batch: its bookkeeping steps before the rows, the rows together, the bookkeeping steps after them."""
        steps = [step for batch in batches for step in batch]
        width = max((len(step["tokens"]) for step in steps if step["op"] == "verify"), default=1)
        memory = Memory(model[0], slots, width)
        rollback = rollback or "replay"          # a trace without drafts names no strategy: its rows keep nothing
        for b, batch in enumerate(batches):
            rows = [(s, step) for s, step in enumerate(batch) if step["op"] in ROWS]
            outputs = {}
            for s, step in enumerate(batch):
                if step["op"] not in ROWS:
                    outputs[s] = run_step(memory, step)
                elif s == rows[0][0]:
                    outputs.update(run_rows(memory, model, rows, rollback))
            for s in range(len(batch)):
                yield b, s, outputs[s]
