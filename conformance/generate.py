"""The only writer of conformance/cases/: every expected tensor is computed here by reference.py.

Inputs are drawn from a generator seeded by the case name, so a case does not change when others are added.
Where an engine's rounding could flip a discrete outcome, the generator keeps the outcome away from the edge:
uniforms sit in the middle of the interval that decides them, and greedy steps whose top-2 logits are within the
logits tolerance list both tokens (`ties`). Cases whose drafts or routing would sit on such an edge are refused.
"""

import shutil
import sys
import zlib
from functools import lru_cache

import numpy as np

import reference as R
from conformance.format import MANIFEST, TOLERANCES, Case, Output, checkpoint_dir, state_tensors, write_case

CHECKPOINTS = ("default", "tiny-mtp", "tiny-dense", "tiny-moe", "tiny-moe-per-expert-mtp", "tiny-odd", "tiny-multimodal",
               "tiny-draft")
TEXT = ('def decode(model, state, tokens):\n    """Three layers of Gated DeltaNet for every layer of attention: '
        'one token after another, the state carried along."""\n    for token in tokens:\n'
        '        logits, state = model.step(state, token)\n    return logits, state\n')
DRAFT_LEN = 4                     # K
GREEDY = R.Sampling(0.0, 0, 1.0)


def rng_for(name):
    return np.random.default_rng(zlib.crc32(name.encode()))


def f32(x):
    return np.asarray(x, dtype=np.float32)


def i64(x):
    return np.asarray(x, dtype=np.int64)


@lru_cache(maxsize=None)
def model(checkpoint):
    return R.load_model(checkpoint_dir(checkpoint))


@lru_cache(maxsize=None)
def checkpoint_features(checkpoint):
    """The checkpoint properties (format.FEATURES) that differ from the default model's."""
    folder = checkpoint_dir(checkpoint)
    cfg, names, raw = model(checkpoint)[0], R.read_checkpoint_files(folder), R.read_json(folder / "config.json")
    ratio = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    tags = [("moe", cfg.is_moe), ("untied_embeddings", not cfg.tie_word_embeddings),
            (f"gva_ratio_{ratio}", ratio != 2),
            ("unequal_head_dims", cfg.linear_key_head_dim != cfg.linear_value_head_dim),
            (f"conv_kernel_{cfg.linear_conv_kernel_dim}", cfg.linear_conv_kernel_dim != 4),
            (f"partial_rotary_{cfg.partial_rotary_factor:g}", cfg.partial_rotary_factor != 0.25),
            ("multimodal_layout", "text_config" in raw),
            ("per_expert_weights", any(R.EXPERT_TENSOR.match(n) for n in names)),
            ("mtp_weights", any(n.startswith("mtp.") for n in names))]
    return tuple(tag for tag, present in tags if present)


def prompt(checkpoint, n):
    ids = R.load_tokenizer(checkpoint_dir(checkpoint)).encode(TEXT).ids
    assert len(ids) >= n, f"TEXT has {len(ids)} tokens, {n} wanted"
    return i64(ids[:n])


def tie_margin(a, b):
    """Two logits closer than this may swap order in a conforming engine: each may be off by the logits tolerance."""
    tol = TOLERANCES["logits"]
    return 2 * (tol["atol"] + tol["rtol"] * max(abs(a), abs(b)))


def runner_up(row):
    """(argmax, second token, whether the two are within tolerance of each other) for one row of logits."""
    first, second = np.argsort(-row, kind="stable")[:2]
    return int(first), int(second), bool(row[first] - row[second] <= tie_margin(row[first], row[second]))


def state_outputs(state):
    return {name: Output("exact" if name == "state.length" else "state", value, requires="state_export")
            for name, value in state_tensors(state).items()}


def middle_of(cdf, j):
    """A uniform in the middle of token j's interval of the (unnormalised) CDF: the draw that picks j with the most
    room on both sides."""
    low = cdf[j - 1] if j else 0.0
    return (low + cdf[j]) / 2 / cdf[-1]


# ----------------------------------------------------------------------------------------------------------------
# Primitives and the gated delta rule: inputs drawn at realistic scales.

def op_case(name, kind, spec, description, inputs, outputs, attrs=None):
    return Case(name, kind, spec, description, (kind,), attrs or {}, inputs,
                {n: Output(tol, f32(v)) for n, (tol, v) in outputs.items()})


TINY_ROW = np.array([1, 1, 1e-3, 1, 10])    # per-row scales: at 1e-3 the mean square is about eps = 1e-6


def primitive_cases():
    rng = rng_for("rms_norm")
    x, w = f32(rng.normal(0, 3, (5, 64)) * TINY_ROW[:, None]), f32(rng.normal(0, 0.2, 64))
    yield op_case("op-rms_norm", "rms_norm", "reference.rms_norm",
                  "RMSNorm with scale (1 + w); a row at scale 1e-3 makes eps matter",
                  {"x": x, "weight": w}, {"y": ("activations", R.rms_norm(x, w, 1e-6))}, {"eps": 1e-6})

    rng = rng_for("rms_norm_gated")
    x = f32(rng.normal(0, 1, (5, 4, 16)) * TINY_ROW[:, None, None])
    z, w = f32(rng.normal(0, 2, (5, 4, 16))), f32(1 + rng.normal(0, 0.2, 16))
    yield op_case("op-rms_norm_gated", "rms_norm_gated", "reference.rms_norm_gated",
                  "per-head norm with plain weight, then SiLU(z) gate; a row at scale 1e-3 makes eps matter", {"x": x, "z": z, "weight": w},
                  {"y": ("activations", R.rms_norm_gated(x, z, w, 1e-6))}, {"eps": 1e-6})

    rng = rng_for("l2norm")
    x = f32(rng.normal(0, 1, (5, 2, 16)) * TINY_ROW[:, None, None])
    yield op_case("op-l2norm", "l2norm", "reference.l2norm",
                  "a row at scale 1e-3 makes eps matter: sqrt(sum x^2 + eps), not sqrt(sum x^2) + eps",
                  {"x": x}, {"y": ("activations", R.l2norm(x, 1e-6))}, {"eps": 1e-6})

    for head_dim, factor, theta, start in ((16, 0.25, 1e4, 0), (20, 0.5, 1e6, 300)):
        name = f"op-rope-Dh{head_dim}-partial{factor:g}"
        rng = rng_for(name)
        x, positions = f32(rng.normal(0, 1, (6, 4, head_dim))), i64(start + np.arange(6) * 37)
        yield op_case(name, "rope", "reference.rope", f"NeoX rotation of the first {factor:g} of each head",
                      {"x": x, "positions": positions},
                      {"y": ("activations", R.rope(x, positions, theta, int(head_dim * factor)))},
                      {"rope_theta": theta, "partial_rotary_factor": factor})

    for T, W in ((7, 4), (2, 4), (1, 3)):
        name = f"op-causal_conv1d-T{T}-W{W}"
        rng = rng_for(name)
        x, window, w = f32(rng.normal(0, 1, (T, 40))), f32(rng.normal(0, 1, (W - 1, 40))), f32(rng.normal(0, 0.5, (40, W)))
        y, new_window = R.causal_conv1d(x, window, w)
        yield op_case(name, "causal_conv1d", "reference.causal_conv1d",
                      "depthwise causal conv from a carried window; returns the window ending at the last input",
                      {"x": x, "window": window, "weight": w},
                      {"y": ("activations", y), "window": ("state", new_window)})


def gated_delta_rule_cases():
    shapes = {"": (2, 4, 16, 16), "-gva3": (2, 6, 12, 20)}     # Hk, Hv, Dk, Dv
    runs = [("recurrent", 1, ""), ("recurrent", 63, ""), ("recurrent", 65, ""), ("chunked", 1, ""),
            ("chunked", 63, ""), ("chunked", 64, ""), ("chunked", 65, ""), ("chunked", 130, ""),
            ("recurrent", 65, "-gva3"), ("chunked", 65, "-gva3")]
    for form, T, suffix in runs:
        name = f"gdr-{form}-T{T}{suffix}"
        rng = rng_for(name)
        Hk, Hv, Dk, Dv = shapes[suffix]
        q, k = (f32(R.l2norm(rng.normal(0, 1, (T, Hk, Dk)))) for _ in range(2))
        v = f32(rng.normal(0, 1, (T, Hv, Dv)))
        g = f32(-rng.uniform(0.5, 8, Hv) * R.softplus(rng.normal(0, 1, (T, Hv))))     # -exp(A_log) softplus(a + dt)
        beta = f32(R.sigmoid(rng.normal(0, 1, (T, Hv))))
        S0 = f32(rng.normal(0, 0.3, (Hv, Dk, Dv)))
        rule = R.gated_delta_chunked if form == "chunked" else R.gated_delta_recurrent
        o, S, _ = rule(q, k, v, g, beta, S0)
        yield op_case(name, "gated_delta_rule", f"reference.gated_delta_{form}",
                      f"{T} tokens from a non-zero state, Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}"
                      + (" (one step)" if T == 1 and form == "recurrent" else ""),
                      {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": S0},
                      {"o": ("activations", o), "final_state": ("state", S)}, {"form": form})


# ----------------------------------------------------------------------------------------------------------------
# One layer of a checkpoint on given inputs; the layer's weights travel in inputs.safetensors under their names.

def layer_weights(checkpoint, prefix, part):
    """The checkpoint's tensors of one layer part (linear_attn, self_attn, mlp), canonical `model.` names."""
    tensors = R.canonical_names(R.read_checkpoint_files(checkpoint_dir(checkpoint)))
    return {n: f32(a) for n, a in tensors.items() if n.startswith(prefix + part + ".")}


def layer_case(checkpoint, layer, kind, part, attrs, inputs, run, description):
    cfg, params = model(checkpoint)
    prefix = f"model.layers.{layer}."
    name = f"layer-{kind.removesuffix('_layer')}-{checkpoint}-L{layer}-T{len(inputs['x'])}"
    outputs = run(cfg, params["layers"][layer][part])
    return Case(name, kind, f"reference.{run.__name__}", description, (kind,) + checkpoint_features(checkpoint),
                {"prefix": prefix, "layer": layer, "checkpoint": checkpoint,
                 **{k: getattr(cfg, k) for k in attrs}},
                {**inputs, **layer_weights(checkpoint, prefix, part)},
                {n: Output("state" if n.startswith("state.") else "activations", f32(v)) for n, v in outputs.items()})


DELTANET_ATTRS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", "rms_norm_eps")
ATTENTION_ATTRS = ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                   "partial_rotary_factor")
MOE_ATTRS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def layer_cases():
    for checkpoint, layer, T in (("tiny-mtp", 0, 1), ("tiny-mtp", 0, 70), ("tiny-odd", 1, 9)):
        cfg = model(checkpoint)[0]
        rng = rng_for(f"deltanet-{checkpoint}-{layer}-{T}")
        inputs = {"x": f32(rng.normal(0, 1, (T, cfg.hidden_size))),
                  "state.conv": f32(rng.normal(0, 1, (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim))),
                  "state.S": f32(rng.normal(0, 0.3, (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                     cfg.linear_value_head_dim)))}

        def gated_deltanet(cfg, weights, inputs=inputs):
            y, state, _ = R.gated_deltanet(inputs["x"], R.DeltaState(inputs["state.conv"], inputs["state.S"]), cfg,
                                           **weights)
            return {"y": y, "state.conv": state.conv, "state.S": state.S}
        yield layer_case(checkpoint, layer, "deltanet_layer", "linear_attn", DELTANET_ATTRS, inputs, gated_deltanet,
                         "DeltaNet mixer (after input_layernorm) from a non-zero conv window and state")

    for checkpoint, layer in (("tiny-mtp", 3), ("tiny-odd", 3)):
        cfg = model(checkpoint)[0]
        rng = rng_for(f"attention-{checkpoint}-{layer}")
        past, T, kv = 10, 6, (cfg.num_key_value_heads, cfg.head_dim)
        inputs = {"x": f32(rng.normal(0, 1, (T, cfg.hidden_size))), "positions": i64(past + np.arange(T)),
                  "state.k": f32(rng.normal(0, 1, (past, *kv))), "state.v": f32(rng.normal(0, 1, (past, *kv)))}

        def gated_attention(cfg, weights, inputs=inputs):
            y, state = R.gated_attention(inputs["x"], R.AttnState(inputs["state.k"], inputs["state.v"]),
                                         inputs["positions"], cfg, **weights)
            return {"y": y, "state.k": state.k, "state.v": state.v}
        yield layer_case(checkpoint, layer, "attention_layer", "self_attn", ATTENTION_ATTRS, inputs, gated_attention,
                         f"gated attention: {T} new tokens after {past} cached keys (k after k_norm and RoPE)")

    rng = rng_for("mlp-tiny-mtp")
    inputs = {"x": f32(rng.normal(0, 1, (7, model("tiny-mtp")[0].hidden_size)))}

    def mlp(cfg, weights):
        return {"y": R.mlp(inputs["x"], **weights)}
    yield layer_case("tiny-mtp", 0, "mlp_layer", "mlp", (), inputs, mlp, "SwiGLU feed-forward")

    cfg = model("tiny-moe")[0]
    rng = rng_for("moe-tiny-moe")
    moe_inputs = {"x": f32(rng.normal(0, 1, (9, cfg.hidden_size)))}

    def sparse_moe(cfg, weights):
        router = np.sort(R.softmax(moe_inputs["x"] @ weights["gate"].T), axis=-1)[:, ::-1]
        margin = (router[:, cfg.num_experts_per_tok - 1] - router[:, cfg.num_experts_per_tok]).min()
        assert margin > 1e-3, f"moe case: routing within {margin} of a tie; change its inputs"
        return {"y": R.sparse_moe(moe_inputs["x"], cfg, **weights)}
    yield layer_case("tiny-moe", 0, "moe_layer", "mlp", MOE_ATTRS, moe_inputs, sparse_moe,
                     "softmax top-k routing, renormalised weights, plus the sigmoid-gated shared expert")


# ----------------------------------------------------------------------------------------------------------------
# Whole model: prefill, decode, extend and greedy on every checkpoint.

def forward_case(checkpoint, label, chunks, with_state):
    cfg, params = model(checkpoint)
    tokens, state, logits, start = prompt(checkpoint, sum(chunks)), R.empty_state(cfg), [], 0
    for size in chunks:
        chunk_logits, _, state, _ = R.forward(params, cfg, tokens[start:start + size], state)
        logits.append(chunk_logits)
        start += size
    later = chunks[1:]
    features = ("prefill",) + ("decode",) * any(c == 1 for c in later) + ("extend",) * any(c > 1 for c in later)
    outputs = {"logits": Output("logits", np.concatenate(logits)), **(state_outputs(state) if with_state else {})}
    return Case(f"model-{checkpoint}-{label}", "forward", "reference.forward",
                f"calls of {chunks} tokens from an empty state; logits of every position"
                + ("; then the state" if with_state else ""),
                features + checkpoint_features(checkpoint), {"chunks": list(chunks)}, {"tokens": tokens}, outputs,
                checkpoint)


def greedy_case(checkpoint, prompt_len=12, n=16):
    cfg, params = model(checkpoint)
    tokens, ties = prompt(checkpoint, prompt_len), {}
    logits, _, state, _ = R.forward(params, cfg, tokens, R.empty_state(cfg))
    out = []
    while len(out) < n:
        first, second, tied = runner_up(logits[-1])
        if tied:
            ties[len(out)] = [first, second]
        out.append(first)
        logits, _, state, _ = R.forward(params, cfg, [first], state)
    return Case(f"model-{checkpoint}-greedy", "greedy", "reference.forward, argmax per step",
                f"{n} greedy tokens after a {prompt_len}-token prompt, no stop at EOS",
                ("prefill", "decode", "greedy") + checkpoint_features(checkpoint), {"n": n}, {"prompt": tokens},
                {"tokens": Output("decision", i64(out), ties=ties or None)}, checkpoint)


def model_cases():
    for checkpoint in CHECKPOINTS:
        yield forward_case(checkpoint, "prefill-T70", (70,), with_state=False)
        yield forward_case(checkpoint, "decode", (20,) + (1,) * 8, with_state=True)
        yield greedy_case(checkpoint)
    for checkpoint in ("tiny-mtp", "tiny-odd"):  # prefill shorter than the conv window, then a chunk-crossing extend
        yield forward_case(checkpoint, "extend", (2, 66, 1), with_state=True)


# ----------------------------------------------------------------------------------------------------------------
# Sampling with supplied uniforms.

SAMPLING_CASES = {
    "sampling-t1": (R.Sampling(1.0, 0, 1.0), "normal"),
    "sampling-t0.6-topk20": (R.Sampling(0.6, 20, 1.0), "normal"),
    "sampling-topp0.8": (R.Sampling(1.0, 0, 0.8), "normal"),
    "sampling-t1.3-topk50-topp0.9": (R.Sampling(1.3, 50, 0.9), "normal"),
    "sampling-greedy": (GREEDY, "normal"),
    "sampling-topk10-ties": (R.Sampling(1.0, 10, 1.0), "ties"),
    "sampling-topp0.5-ties": (R.Sampling(1.0, 0, 0.5), "ties"),
}


def sampling_attrs(sampling):
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def sampling_cases(N=6, V=272):
    for name, (sampling, logits_kind) in SAMPLING_CASES.items():
        rng = rng_for(name)
        # "ties": logits on a grid of 0.5, so many tokens tie exactly (top-k keeps every tie of the k-th; top-p
        # breaks ties by the lower token id)
        logits = f32(rng.integers(-8, 8, (N, V)) / 2 if logits_kind == "ties" else rng.normal(0, 2.5, (N, V)))
        p = R.probabilities(logits, sampling)
        if sampling.temperature == 0:
            assert not any(runner_up(row)[2] for row in logits), f"{name}: argmax within tolerance of a tie"
        tokens = i64([rng.choice(V, p=row / row.sum()) for row in p.astype(np.float64)])
        uniforms = f32([middle_of(np.cumsum(row), j) for row, j in zip(p, tokens)])
        assert [R.sample(row, u) for row, u in zip(p, uniforms)] == list(tokens)
        yield Case(name, "sampling", "reference.probabilities, reference.sample",
                   "temperature, then top-k, then top-p; token = first index whose CDF exceeds u * total",
                   ("sampling",), sampling_attrs(sampling), {"logits": logits, "uniforms": uniforms},
                   {"probabilities": Output("probabilities", f32(p)), "tokens": Output("exact", tokens)})


# ----------------------------------------------------------------------------------------------------------------
# Speculative decoding: one verify round after a prefill, committed under each rollback strategy.

def spec_case(checkpoint, label, prompt_ids, state, verify_tokens, q, uniforms, sampling, expect_accepted, rollback):
    cfg, params = model(checkpoint)
    logits, _, after, tapes = R.forward(params, cfg, verify_tokens, state)
    draft = [int(t) for t in verify_tokens[1:]]
    if sampling.temperature == 0:
        accepted, token = R.accept_greedy(draft, logits)
    else:
        accepted, token = R.accept_speculative(draft, q, R.probabilities(logits, sampling), uniforms)
    assert accepted == expect_accepted, f"{checkpoint} {label}: accepted {accepted}, wanted {expect_accepted}"
    n = accepted + 1
    committed = (R.commit_per_position(state, after, R.keep_per_position(state, tapes), n)
                 if rollback == "per-position" else R.commit_replay(state, after, tapes, n))
    next_logits = R.forward(params, cfg, [token], committed)[0]
    mode = "greedy" if sampling.temperature == 0 else "sampling"
    inputs = {"prompt": prompt_ids, "verify_tokens": i64(verify_tokens)}
    if mode == "sampling":
        inputs.update(q=f32(q), uniforms=f32(uniforms))
    return Case(f"spec-{checkpoint}-{label}-{rollback}", "speculative",
                f"reference.accept_{'greedy' if mode == 'greedy' else 'speculative'}, reference.commit_"
                + ("per_position" if rollback == "per-position" else "replay"),
                f"prefill the prompt, verify [last token + {len(draft)} drafts], accept {accepted}, commit {n} "
                f"positions by {rollback}, then decode the new token",
                ("prefill", "decode", "speculative", f"rollback:{rollback}", f"accept:{mode}")
                + checkpoint_features(checkpoint),
                {"rollback": rollback, **sampling_attrs(sampling)}, inputs,
                {"verify_logits": Output("logits", logits), "accepted": Output("decision", i64([accepted])),
                 "committed": Output("decision", i64(draft[:accepted] + [token])), **state_outputs(committed),
                 "next_logits": Output("logits", next_logits)},
                checkpoint)


def prefilled(checkpoint, prompt_len=24):
    cfg, params = model(checkpoint)
    prompt_ids = prompt(checkpoint, prompt_len)
    logits, _, state, _ = R.forward(params, cfg, prompt_ids, R.empty_state(cfg))
    return prompt_ids, state, int(np.argmax(logits[-1]))


def untied_greedy_path(checkpoint, steps):
    """The first prompt (24 tokens or more) whose next `steps` greedy steps are all clear of ties: (prompt, state after
    it, its greedy token, the greedy tokens after that, the runner-up token at each step)."""
    cfg, params = model(checkpoint)
    for prompt_len in range(24, 48):
        prompt_ids, state, last = prefilled(checkpoint, prompt_len)
        path, runners_up = [last], []
        for _ in range(steps):
            first, second, tied = runner_up(R.forward(params, cfg, path, state)[0][-1])
            if tied:
                break
            path.append(first)
            runners_up.append(second)
        else:
            return prompt_ids, state, last, path[1:], runners_up
    raise AssertionError(f"{checkpoint}: every prompt tried has a near-tie in its first {steps} greedy steps")


def spec_greedy_cases(checkpoint, accept_counts):
    """Drafts that follow the greedy path for `a` tokens, then the runner-up token, then noise: every accept count."""
    prompt_ids, state, last, path, runners_up = untied_greedy_path(checkpoint, max(accept_counts) + 1)
    rng = rng_for(f"spec-greedy-{checkpoint}")
    for a in accept_counts:
        draft = path[:a] + ([runners_up[a]] + list(rng.integers(0, 256, DRAFT_LEN - a - 1)) if a < DRAFT_LEN else [])
        for rollback in R.ROLLBACK_STRATEGIES:
            yield spec_case(checkpoint, f"greedy-accept{a}", prompt_ids, state, [last] + draft, None, None, GREEDY,
                            a, rollback)


def spec_sampling_cases(checkpoint, runs):
    """Drafts and uniforms chosen so that exactly `a` drafts are accepted, each decision with room to spare: an accept
    has u = ratio / 2, a reject u = (1 + ratio) / 2, the final draw sits mid-interval in its CDF."""
    cfg, params = model(checkpoint)
    prompt_ids, state, last = prefilled(checkpoint)
    V = cfg.vocab_size
    for a, sampling in runs:
        rng = rng_for(f"spec-sampling-{checkpoint}-{a}")
        draft, q, uniforms = [], [], []
        for i in range(DRAFT_LEN):
            logits = R.forward(params, cfg, [last] + draft, state)[0][-1]
            p = R.probabilities(logits, sampling).astype(np.float64)
            q_i = R.softmax(logits.astype(np.float64) / max(sampling.temperature, 1.0) + rng.normal(0, 2.0, V))
            ratio = p / q_i
            if i < a:
                pool = ratio >= 0.3
            elif i == a:
                pool = (ratio > 0) & (ratio <= 0.7) if ((ratio > 0) & (ratio <= 0.7)).any() else ratio <= 0.7
            else:
                pool = np.ones(V, bool)
            x = int(rng.choice(V, p=np.where(pool, q_i, 0) / np.where(pool, q_i, 0).sum()))
            r = min(1.0, ratio[x])
            draft.append(x)
            q.append(q_i)
            uniforms.append(r / 2 if i < a else (1 + r) / 2 if i == a else rng.uniform())
        verify_logits = R.forward(params, cfg, [last] + draft, state)[0]
        p = R.probabilities(verify_logits, sampling)
        final = np.maximum(p[a] - f32(q[a]), 0) if a < DRAFT_LEN else p[a]
        final = final if final.sum() > 0 else p[a]
        j = int(rng.choice(V, p=final / final.sum()))
        uniforms.append(middle_of(np.cumsum(final), j))
        for rollback in R.ROLLBACK_STRATEGIES:
            yield spec_case(checkpoint, f"sampling-accept{a}", prompt_ids, state, [last] + draft, f32(q),
                            f32(uniforms), sampling, a, rollback)


def speculative_cases():
    yield from spec_greedy_cases("tiny-mtp", range(DRAFT_LEN + 1))
    yield from spec_sampling_cases("tiny-mtp", [(0, R.Sampling(1.0, 0, 1.0)), (2, R.Sampling(0.8, 40, 1.0)),
                                               (4, R.Sampling(0.7, 0, 0.9))])
    for checkpoint in ("tiny-moe", "tiny-odd", "tiny-multimodal", "default"):
        yield from spec_greedy_cases(checkpoint, [2])


def all_cases():
    yield from primitive_cases()
    yield from gated_delta_rule_cases()
    yield from layer_cases()
    yield from model_cases()
    yield from sampling_cases()
    yield from speculative_cases()


def generate(out_dir, progress=None):
    """Rewrite every case under out_dir (case folders there that this run does not write are removed)."""
    progress = progress or sys.stderr
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        if (old / MANIFEST).exists():
            shutil.rmtree(old)
    count = 0
    for count, case in enumerate(all_cases(), 1):
        write_case(out_dir, case)
        print(f"[{count}] {case.name}", file=progress, flush=True)
    print(f"wrote {count} cases to {out_dir}", file=progress)
    return count
