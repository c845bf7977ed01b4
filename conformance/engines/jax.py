"""jax_impl (the JAX implementation, on whatever device JAX has) as an engine, in float32; jax_bf16.py runs the same
adapter with bf16 weights and activations.

Whole-model cases go through jax_impl's jit-compiled entry points (prefill, decode, verify, commit), which compile
once per checkpoint and token count; greedy (and the benchmarks' timed_greedy) runs jax_impl.generate, its on-device
generation loop; serving traces run through jax_impl.batch, its batched path (Jax.run_trace: tree rows in the same
step as chain rows). Primitive and layer cases call jax_impl.model's functions with the
case's weights, transposed to (in, out) by jax_impl.to_jax as the model stores them; the DFlash drafter through
jax_impl.dflash. Every feature is supported.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference as R, sibling
from . import Engine, Timed, layer_config, layer_params, moe_config, register_engine
from ..format import FEATURES, state_tensors

jax_impl, M, jax_impl_dflash = sibling("jax_impl"), sibling("jax_impl.model"), sibling("jax_impl.dflash")

# Layers and the delta rule compiled, as the model runs them (primitives run op by op)
jit = partial(jax.jit, static_argnames="cfg")
deltanet, attention, moe = jit(M.gated_deltanet), jit(M.gated_attention), jit(M.sparse_moe)
mlp = jax.jit(M.mlp)
mtp_update = jax.jit(jax_impl.mtp_update, static_argnums=(1, 5))
mtp_step = jax.jit(jax_impl.mtp_step, static_argnums=1)
forward_tapped = jax.jit(M.forward_tapped, static_argnames=("cfg", "taps"))
dflash_round = jax.jit(jax_impl_dflash.round_logits, static_argnames="k")
rules = {"recurrent": jax.jit(jax_impl.gated_delta_recurrent), "chunked": jax.jit(jax_impl.gated_delta_chunked)}
PAD_TO = 128                      # multi-token calls are padded to a multiple of this (Jax.decode)
TREE_PAD_TO = 16                  # a draft tree's nodes are padded to a multiple of this (Jax.verify_tree)
accept_tree_greedy = jax.jit(jax_impl.accept_tree_greedy)
accept_tree_speculative = jax.jit(jax_impl.accept_tree_speculative)
accept_tree_rounds = jax.jit(jax.vmap(jax_impl.accept_tree_speculative, (None, None, None, None, None, 0)))


def deltanet_layer(i, attrs, weights):
    cfg = layer_config(attrs, i["x"].shape[-1])
    y, state, _ = deltanet(i["x"], R.DeltaState(i["state.conv"], i["state.S"]), len(i["x"]), cfg,
                           **weights["linear_attn"])
    return {"y": y, "state.conv": state.conv, "state.S": state.S}


def attention_layer(i, attrs, weights):
    """jax_impl writes new keys into a preallocated cache at their positions: give it room for them (in jax_impl's
    KV layout, handed back in the reference's)."""
    cfg = layer_config(attrs, i["x"].shape[-1], layer_types=("full_attention",))
    room = jnp.zeros((len(i["x"]), *i["state.k"].shape[1:]), i["state.k"].dtype)
    cache = R.AttnState(jnp.concatenate([i["state.k"], room]), jnp.concatenate([i["state.v"], room]))
    y, cache = attention(i["x"], jax_impl.kv_from_reference(cache), i["positions"], cfg, **weights["self_attn"])
    cache = jax_impl.kv_to_reference(cache, cache.k.shape[1])  # every position, the room included
    return {"y": y, "state.k": cache.k, "state.v": cache.v}


def moe_layer(i, attrs, weights):
    return {"y": moe(i["x"], moe_config(attrs, i["x"].shape[-1]), **weights["mlp"])}


def gated_delta_rule(i, attrs, weights):
    o, S, _ = rules[attrs["form"]](*(i[n] for n in ("q", "k", "v", "g", "beta", "initial_state")))
    return {"o": o, "final_state": S}


OPS = {  # kind -> (inputs as jax arrays, attrs, the layer's weights as jax_impl stores them) -> outputs
    "rms_norm": lambda i, a, w: {"y": M.rms_norm(i["x"], i["weight"], a["eps"])},
    "rms_norm_gated": lambda i, a, w: {"y": M.rms_norm_gated(i["x"], i["z"], i["weight"], a["eps"])},
    "l2norm": lambda i, a, w: {"y": M.l2norm(i["x"], a["eps"])},
    "rope": lambda i, a, w: {"y": M.rope(i["x"], i["positions"], a["rope_theta"],
                                         int(i["x"].shape[-1] * a["partial_rotary_factor"]))},
    "causal_conv1d": lambda i, a, w: dict(zip(("y", "window"),
                                              M.causal_conv1d(i["x"], i["window"], i["weight"], len(i["x"])))),
    "gated_delta_rule": gated_delta_rule,
    "deltanet_layer": deltanet_layer,
    "attention_layer": attention_layer,
    "mlp_layer": lambda i, a, w: {"y": mlp(i["x"], **w["mlp"])},
    "moe_layer": moe_layer,
}

# Inputs jax_impl keeps in float32 whatever the model dtype: the delta rule, its state and its output (model.py)
FLOAT32_INPUTS = {"l2norm": {"x"}, "gated_delta_rule": {"q", "k", "v", "g", "beta", "initial_state"},
                  "rms_norm_gated": {"x"}, "deltanet_layer": {"state.S"}}


MAX_CONTEXT = 4096   # positions the KV buffers hold at most: the shipped checkpoints' longest context (the default
                     # model's); a production-shaped checkpoint's 262,144 would make the 0.8B geometry's buffers 1 GiB


def context(cfg):
    return min(cfg.max_position_embeddings, MAX_CONTEXT)


def padded_rows(x, free):
    """x's rows padded to a multiple of PAD_TO, or by the `free` slots left after them if fewer: multi-token calls
    then compile once per checkpoint."""
    return np.pad(x, [(0, min(-len(x) % PAD_TO, free))] + [(0, 0)] * (np.ndim(x) - 1))


def host(x):
    return np.asarray(x, np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x, np.int64)


@register_engine("jax")
class Jax(Engine):
    features = frozenset(FEATURES)
    dtype = "float32"                 # of weights and activations (jax_impl.weights.DTYPES)

    def load(self, checkpoint_dir):
        return jax_impl.load(checkpoint_dir, self.dtype)

    def prefill(self, model, tokens):
        return self.decode(model, self.empty_state(model), tokens)

    def empty_state(self, model):
        """The KV buffers hold the model's whole context (at most MAX_CONTEXT), so no case outgrows them and every
        call of a checkpoint compiles for the same state shapes."""
        cfg, params = model
        return jax_impl.empty_state(cfg, context(cfg), params["embed_tokens"].dtype)

    def decode(self, model, state, tokens):
        logits, _, state = self.forward(model, state, tokens)
        return logits, state

    def forward(self, model, state, tokens):
        """-> logits (T, V) and final-normed hidden states (T, D) on the host, new state. Several tokens are padded to
        a multiple of PAD_TO (jax_impl's `valid` says how many are real): the suite's multi-token calls then compile
        one prefill per checkpoint."""
        cfg, params = model
        room = context(cfg) - int(state.length)
        if len(tokens) > room:
            raise ValueError(f"{len(tokens)} tokens do not fit the {room} free slots of the KV buffers")
        if len(tokens) == 1:
            logits, hidden, state = jax_impl.decode(params, cfg, jnp.int32(tokens[0]), state)
            return host(logits)[None], host(hidden)[None], state
        padded = padded_rows(tokens, room - len(tokens))
        logits, hidden, state, _ = jax_impl.prefill(params, cfg, jnp.asarray(padded, jnp.int32), state,
                                                    jnp.int32(len(tokens)))
        return host(logits[:len(tokens)]), host(hidden[:len(tokens)]), state

    def mtp_hidden(self, model, state, tokens):
        return self.forward(model, self.empty_state(model) if state is None else state, tokens)[1:]

    def mtp_draft(self, model, mtp_state, tokens, hidden, chain):
        """jax_impl's MTP drafter: mtp_update takes the new pairs (as after a verify round), then the chain's steps are
        mtp_propose's, fed the given tokens."""
        cfg, params = model
        dtype = params["embed_tokens"].dtype
        if mtp_state is None:
            mtp_state = R.State((jax_impl.empty_kv(cfg, context(cfg), dtype),), jnp.int32(0))
        mtp_state, h = mtp_update(params, cfg, (mtp_state, jnp.zeros(cfg.hidden_size, dtype)),
                                  jnp.asarray(tokens, jnp.int32), jnp.asarray(hidden, dtype), len(tokens))
        state, depth_hidden = mtp_state, [h]
        for token in chain:
            h, state = mtp_step(params, cfg, jnp.int32(token), h, state)
            depth_hidden.append(h)
        depth_hidden = jnp.stack(depth_hidden)
        return host(jax_impl.lm_head(params, depth_hidden)), host(depth_hidden), mtp_state

    def load_dflash(self, model, drafter_dir):
        """jax_impl's DFlash drafter (jax_impl.dflash.Weights: reference.load_dflash's checks, jax_impl's layout)."""
        cfg, params = model
        return jax_impl_dflash.load(params, cfg, f"dflash:{drafter_dir}")

    def dflash_features(self, model, drafter, state, tokens):
        """The target's pass as the generate loop runs it (jax_impl.forward_tapped with the drafter's taps), padded
        like Jax.forward."""
        cfg, params = model
        state = self.empty_state(model) if state is None else state
        padded = padded_rows(tokens, context(cfg) - int(state.length) - len(tokens))
        _, state, _, tapped = forward_tapped(params, cfg, jnp.asarray(padded, jnp.int32), state,
                                             jnp.int32(len(tokens)), tuple(drafter.dcfg.target_layer_ids))
        return host(tapped[:len(tokens)]), state

    def dflash_draft(self, model, drafter, dflash_state, features, last_token, k):
        """jax_impl.dflash's round: the features appended to the drafter's cache (sized for the model's whole
        context), then the block; jax arrays are values, so the given state is unchanged."""
        cfg, params = model
        if dflash_state is None:
            dflash_state = jax_impl_dflash.empty(drafter.dcfg, context(cfg), params["embed_tokens"].dtype)
        room = context(cfg) - int(dflash_state.length) - len(features)
        padded = padded_rows(features, room)
        logits, dflash_state = dflash_round(params, drafter, dflash_state, jnp.asarray(padded), jnp.int32(len(features)),
                                            jnp.int32(last_token), k)
        return host(logits), dflash_state

    def export_dflash_state(self, model, drafter, dflash_state):
        n = int(dflash_state.length)
        return state_tensors(R.DFlashState(tuple(jax.tree.map(host, jax_impl.kv_to_reference(layer, n))
                                                 for layer in dflash_state.layers), n))

    def export_state(self, model, state):
        """Only the live part of the KV buffers, the first state.length slots, in the reference's layout."""
        n = int(state.length)
        live = [jax_impl.kv_to_reference(layer, n) if isinstance(layer, R.AttnState) else layer
                for layer in state.layers]
        return state_tensors(R.State(jax.tree.map(host, live), n))

    def timed_greedy(self, model, prompt, n, draft="none", draft_len=4, rollback="replay"):
        """jax_impl.generate, its on-device loop (speculative with a drafter), EOS ignored. Compile time is apart:
        a fresh shape compiles and runs once before the timed run."""
        cfg, params = model
        tokens, stats = jax_impl.generate(params, R.replace(cfg, eos_token_id=()), [int(t) for t in prompt], n,
                                          draft=draft, draft_len=draft_len, rollback=rollback)
        seconds = stats["seconds"]
        return Timed(tokens, seconds["prefill"], seconds["decode"], seconds["compile"], stats)

    def run_op(self, kind, inputs, attrs):
        prefix = attrs.get("prefix")
        keep_float32 = FLOAT32_INPUTS.get(kind, set())
        arrays = {name: jnp.asarray(a, jnp.int32 if a.dtype.kind == "i" else
                                    jnp.float32 if name in keep_float32 else self.dtype)
                  for name, a in inputs.items() if not (prefix and name.startswith(prefix))}
        weights = jax_impl.to_jax(layer_params(inputs, prefix), self.dtype) if prefix else None
        return {name: host(y) for name, y in OPS[kind](arrays, attrs, weights).items()}

    def sample(self, logits, sampling, uniforms):
        p = jax_impl.probabilities(jnp.asarray(logits), R.sampling_of(sampling))
        return host(p), host(jax.vmap(jax_impl.sample)(p, jnp.asarray(uniforms)))

    def draw(self, logits, sampling, n, seed):
        """jax_impl's draw (temperature, top-k, top-p, then a uniform from jax.random), as its generate loop draws."""
        sampling = R.sampling_of(sampling)
        keys = jax.random.split(jax.random.key(seed), (n, len(logits)))
        rows = jax.vmap(jax.vmap(lambda row, key: jax_impl.draw(row, sampling, key)[0]), (None, 0))
        return host(rows(jnp.asarray(logits), keys)).T

    def accept_draws(self, draft, q, logits, sampling, n, seed):
        """jax_impl.accept_speculative with uniforms from jax.random, as its generate loop accepts."""
        p = jax_impl.probabilities(jnp.asarray(logits), R.sampling_of(sampling))
        u = jax.random.uniform(jax.random.key(seed), (n, len(draft) + 1))
        accept = jax.vmap(jax_impl.accept_speculative, (None, None, None, None, 0))
        accepted, tokens = accept(jnp.asarray(draft, jnp.int32), len(draft), jnp.asarray(q), p, u)
        return host(accepted), host(tokens)

    def copy_state(self, model, state):
        return jax.tree.map(jnp.copy, state)     # decode donates its state: a prefix-cache entry needs its own buffers

    def verify(self, model, state, tokens, rollback):
        cfg, params = model
        logits, _, after, kept = jax_impl.verify(params, cfg, jnp.asarray(tokens, jnp.int32), state, rollback)
        return host(logits), (rollback, state, after, kept)

    def commit(self, model, pending, n):
        return jax_impl.commit(*pending, jnp.int32(n))

    def accept(self, draft, q, logits, sampling, uniforms):
        sampling, draft, logits = R.sampling_of(sampling), jnp.asarray(draft, jnp.int32), jnp.asarray(logits)
        if sampling.temperature == 0:
            accepted, token = jax_impl.accept_greedy(draft, len(draft), logits)
        else:
            accepted, token = jax_impl.accept_speculative(draft, len(draft), jnp.asarray(q),
                                                          jax_impl.probabilities(logits, sampling),
                                                          jnp.asarray(uniforms))
        return int(accepted), int(token)

    def verify_tree(self, model, state, tokens, parents, rollback):
        """jax_impl.verify_tree over the tree padded to a multiple of TREE_PAD_TO nodes (children of the root, which
        no real node sees), so that the suite's trees compile one pass per checkpoint (jax_impl.verify_tree)."""
        cfg, params = model
        N = len(tokens)
        if N > context(cfg) - int(state.length):
            raise ValueError(f"a tree of {N} nodes does not fit the free slots of the KV buffers")
        tokens, parents = pad_tree(tokens, parents)
        logits, _, after, kept = jax_impl.verify_tree(params, cfg, tokens, parents, state, rollback)
        return host(logits[:N]), (rollback, state, after, kept, len(tokens))

    def commit_tree(self, model, pending, path):
        rollback, before, after, kept, N = pending
        padded = np.zeros(N, np.int32)
        padded[:len(path)] = path
        return jax_impl.commit_tree(rollback, before, after, kept, jnp.asarray(padded), jnp.int32(len(path)))

    def accept_tree(self, tokens, parents, q, logits, sampling, uniforms):
        sampling, N = R.sampling_of(sampling), len(tokens)
        tokens, parents = pad_tree(tokens, parents)
        logits = jnp.asarray(np.pad(logits, ((0, len(tokens) - N), (0, 0))))
        if sampling.temperature == 0:
            path, n, token = accept_tree_greedy(tokens, parents, N, logits)
        else:
            p = jax_impl.probabilities(logits, sampling)
            path, n, token = accept_tree_speculative(tokens, parents, N, tree_q(q, len(tokens)), p,
                                                     jnp.asarray(tree_uniforms(uniforms, len(tokens))))
        return np.asarray(path)[:int(n)].tolist(), int(token)

    def accept_tree_draws(self, tokens, parents, q, logits, sampling, n, seed):
        """jax_impl.accept_tree_speculative with uniforms from jax.random (u[N-1] draws the final token)."""
        N = len(tokens)
        tokens, parents = pad_tree(tokens, parents)
        p = jax_impl.probabilities(jnp.asarray(np.pad(logits, ((0, len(tokens) - N), (0, 0)))), R.sampling_of(sampling))
        u = jax.random.uniform(jax.random.key(seed), (n, len(tokens)))
        path, length, drawn = accept_tree_rounds(tokens, parents, N, tree_q(q, len(tokens)), p, u)
        return host(jnp.take_along_axis(path, (length - 1)[:, None], axis=1)[:, 0]), host(drawn)

    def run_trace(self, model, batches, rollback, slots):
        """The batched path: `slots` request slots (jax_impl's batch slot axis, released slots reused lowest first),
        each batch's prefill, verify and verify_tree rows in one call of jax_impl.explicit_step (a prefill longer than
        its width goes on in further calls of the rows left; tree rows beside chain rows), every step's outputs read
        back after it. Snapshots are copies of a slot's row."""
        cfg, params = model
        trace = TraceSlots(cfg, params, slots, rollback or "replay", max_drafts(batches))
        for b, batch_steps in enumerate(batches):
            rows = {s: step for s, step in enumerate(batch_steps) if step["op"] in ROW_OPS}
            first_row = min(rows, default=len(batch_steps))
            outputs = {s: trace.apply(step) for s, step in enumerate(batch_steps[:first_row])}
            outputs.update(trace.run_rows(rows))
            outputs.update({s: trace.apply(step) for s, step in enumerate(batch_steps) if s > first_row
                            and s not in rows})
            for s in sorted(outputs):
                out = outputs[s]
                if "state" in out:
                    out.update(self.export_state(model, out.pop("state")))
                yield b, s, out


def pad_tree(tokens, parents):
    """A tree's tokens and parents (N,) -> (N',) int32 on the device, N' a multiple of TREE_PAD_TO: the padding nodes
    are children of the root."""
    N = -(-len(tokens) // TREE_PAD_TO) * TREE_PAD_TO
    tokens, parents = np.asarray(tokens, np.int32), np.asarray(parents, np.int32)
    return (jnp.asarray(np.pad(tokens, (0, N - len(tokens)))), jnp.asarray(np.pad(parents, (0, N - len(parents)))))


def tree_q(q, N):  # (n-1, V) draft distributions -> (N-1, V), zero rows for the padding nodes
    return jnp.asarray(np.pad(np.asarray(q, np.float32), ((0, N - 1 - len(q)), (0, 0))))


def tree_uniforms(u, N):  # (n,): u[n-1] draws the final token -> (N,), where it is u[N-1]
    padded = np.zeros(N, np.float32)
    padded[:len(u) - 1], padded[-1] = u[:-1], u[-1]
    return padded


ROW_OPS = ("prefill", "verify", "verify_tree")    # a trace's steps that are rows of a batched step


def max_drafts(batches):
    return max((len(step["tokens"]) - 1 for steps in batches for step in steps if step["op"] in ROW_OPS[1:]),
               default=0)


class TraceSlots:
    """A serving trace's requests in jax_impl.py's slots: which slot each request holds, and the prefix cache."""
    T = jax_impl.PREFILL_WIDTHS[-1]
    MIN_ROWS = 4

    def __init__(self, cfg, params, slots, rollback, drafts):
        self.cfg, self.params, self.rollback = cfg, params, rollback
        self.K = jax_impl.draft_bucket(drafts)
        capacity = context(cfg) + self.T     # no row's padded write ever clamps
        # at least MIN_ROWS rows, so that traces of 2, 3 and 4 slots share one compiled step; requests take only the
        # first `slots` (the free list), the other rows stay idle
        self.state = jax.vmap(lambda _: jax_impl.empty_state(cfg, capacity, params["embed_tokens"].dtype))(
            jnp.arange(max(slots, self.MIN_ROWS)))
        self.free, self.requests, self.cache = list(range(slots)), {}, {}

    def take_slot(self, name, row=None):
        """The lowest free slot for a new request, holding `row` (a state of one slot) or a zero state."""
        index = self.free.pop(0)
        self.requests[name] = index
        if row is None:
            row = jax.tree.map(jnp.zeros_like, jax_impl.read_slot(self.state, index))
        self.state = jax_impl.write_slot(self.state, index, row)
        return index

    def apply(self, step):
        """A snapshot, restore or release step -> its outputs."""
        name, op = step["request"], step["op"]
        if op == "snapshot":
            self.cache[step["key"]] = jax_impl.read_slot(self.state, self.requests[name])
        elif op == "restore":
            self.take_slot(name, self.cache[step["key"]])
            return {"state": self.cache[step["key"]]}
        elif op == "release":
            self.free = sorted(self.free + [self.requests.pop(name)])
        else:
            raise ValueError(f"trace step: unknown op {op!r}")
        return {}

    def run_rows(self, rows):
        """Prefill and verify rows {step index: step} -> {step index: outputs}."""
        for step in rows.values():
            if step["op"] == "prefill" and step["request"] not in self.requests:
                self.take_slot(step["request"])
        outputs, offsets = {}, dict.fromkeys(rows, 0)
        while offsets:
            inputs = self.rows_input({s: rows[s] for s in offsets}, offsets)
            run, _ = jax_impl.compiled(jax_impl.explicit_step, (1,), self.cfg, dict(T=self.T, K=self.K, rollback=self.rollback),
                              self.params, self.state, inputs)
            logits, accepted, committed, n, self.state, *paths = run(self.params, self.state, inputs)
            logits, accepted, committed, n = (np.asarray(x) for x in (logits, accepted, committed, n))
            for s in list(offsets):
                step, index = rows[s], self.requests[rows[s]["request"]]
                offsets[s] += self.T
                if step["op"] == "prefill" and offsets[s] < len(step["tokens"]):
                    continue
                del offsets[s]
                if step["op"] == "prefill":
                    outputs[s] = {"logits": host(logits[index, :1])}
                    continue
                out = {"logits": host(logits[index, :len(step["tokens"])]),
                       "state": jax_impl.read_slot(self.state, index)}
                if "keep" not in step["commit"] and "path" not in step["commit"]:
                    tokens = committed[index, :n[index]].tolist()
                    decision = ({"accepted": int(accepted[index])} if step["op"] == "verify" else
                                {"path": np.asarray(paths[0][index, :accepted[index] + 1]).tolist()})
                    out.update(decision, committed=tokens, finished=R.finished(tokens, step["commit"].get("stop", ())))
                outputs[s] = out
        return outputs

    def rows_input(self, rows, offsets):
        """jax_impl.Rows for the slots: each given row's tokens (a prefill's chunk at its offset; a tree row's nodes,
        its parents and any forced path), the rest idle. Without tree rows the step compiles no tree pass."""
        B, T, K, V = len(self.state.length), self.T, self.K, self.cfg.vocab_size
        tokens, valid, keep = np.zeros((B, T), np.int32), np.zeros(B, np.int32), np.full(B, -1, np.int32)
        tree, parents, path = np.zeros(B, bool), np.zeros((B, K + 1), np.int32), np.zeros((B, K + 1), np.int32)
        prefill, stop = np.zeros(B, bool), np.full((B, jax_impl.MAX_STOP_IDS), -1, np.int32)
        q, u = np.zeros((B, K, V), np.float32), np.zeros((B, K + 1), np.float32)
        temperature, top_k, top_p = np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32)
        for s, step in rows.items():
            i, chunk = self.requests[step["request"]], step["tokens"][offsets[s]:offsets[s] + T]
            tokens[i, :len(chunk)], valid[i] = chunk, len(chunk)
            prefill[i] = step["op"] == "prefill"
            rule = step.get("commit", {})
            keep[i] = rule.get("keep", len(rule.get("path", ())) or -1)
            if step["op"] == "verify_tree":
                tree[i] = True
                parents[i, :len(step["parents"])] = step["parents"]
                path[i, :len(rule.get("path", ()))] = rule.get("path", ())
            stop[i, :len(rule.get("stop", ()))] = rule.get("stop", ())
            if rule.get("accept") == "sampling":
                k = len(chunk) - 1
                temperature[i], top_k[i], top_p[i] = rule["temperature"], rule["top_k"], rule["top_p"]
                q[i, :k] = rule["q"]
                u[i, :k], u[i, K] = rule["uniforms"][:k], rule["uniforms"][k]
        with_trees = (tree, parents, path) if tree.any() else (None, None, None)
        return jax_impl.Rows(tokens, valid, prefill, keep, q, u, R.Sampling(temperature, top_k, top_p), stop,
                             *with_trees)
