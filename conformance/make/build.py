"""The only writer of conformance/cases/: every expected tensor is computed here by reference.py.

Everything is computed in float64 (the checkpoints' weights and the stored float32 inputs upcast exactly) and
rounded once to float32 when written, so regenerating on another CPU, BLAS or thread count moves a golden by float32
rounding only (INTERPRETING.md, "Regenerating"; `differences` below is that promise as a check).
Inputs are drawn from a generator seeded by the case name, so a case does not change when others are added.
Where an engine's rounding could flip a discrete outcome, the generator keeps the outcome away from the edge:
uniforms sit in the middle of the interval that decides them, and greedy steps whose top-2 logits are within the
logits tolerance list both tokens (`ties`). Cases whose drafts or routing would sit on such an edge are refused.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from .. import reference as R
from ..format import (EXPECTED, INPUTS, MANIFEST, TOLERANCES, Case, Output, case_dirs, checkpoint_dir,
                      checkpoint_entry, read_tensors, write_case)
from .golden import (DRAFT_LEN, GREEDY, checkpoint_features, discriminating_rows, f32, f64, i64, model,
                                rng_for, runner_up, sampled_drafts, sampling_attrs, state_outputs, undiscriminated)
from .draws import draws_cases
from .traces import trace_cases
from .trees import tree_cases

CHECKPOINTS = ("default", "tiny-mtp", "tiny-dense", "tiny-moe", "tiny-moe-per-expert-mtp", "tiny-odd", "tiny-multimodal",
               "tiny-draft")
TEXT = ('def decode(model, state, tokens):\n    """Three layers of Gated DeltaNet for every layer of attention: '
        'one token after another, the state carried along."""\n    for token in tokens:\n'
        '        logits, state = model.step(state, token)\n    return logits, state\n')
def prompt(checkpoint, n):
    ids = R.load_tokenizer(checkpoint_dir(checkpoint)).encode(TEXT).ids
    assert len(ids) >= n, f"TEXT has {len(ids)} tokens, {n} wanted"
    return i64(ids[:n])


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
                  {"x": x, "weight": w}, {"y": ("activations", R.rms_norm(f64(x), f64(w), 1e-6))}, {"eps": 1e-6})

    rng = rng_for("rms_norm_gated")
    x = f32(rng.normal(0, 1, (5, 4, 16)) * TINY_ROW[:, None, None])
    z, w = f32(rng.normal(0, 2, (5, 4, 16))), f32(1 + rng.normal(0, 0.2, 16))
    yield op_case("op-rms_norm_gated", "rms_norm_gated", "reference.rms_norm_gated",
                  "per-head norm with plain weight, then SiLU(z) gate; a row at scale 1e-3 makes eps matter", {"x": x, "z": z, "weight": w},
                  {"y": ("activations", R.rms_norm_gated(f64(x), f64(z), f64(w), 1e-6))}, {"eps": 1e-6})

    rng = rng_for("l2norm")
    x = f32(rng.normal(0, 1, (5, 2, 16)) * TINY_ROW[:, None, None])
    yield op_case("op-l2norm", "l2norm", "reference.l2norm",
                  "a row at scale 1e-3 makes eps matter: sqrt(sum x^2 + eps), not sqrt(sum x^2) + eps",
                  {"x": x}, {"y": ("activations", R.l2norm(f64(x), 1e-6))}, {"eps": 1e-6})

    for head_dim, factor, theta, start in ((16, 0.25, 1e4, 0), (20, 0.5, 1e6, 300)):
        name = f"op-rope-Dh{head_dim}-partial{factor:g}"
        rng = rng_for(name)
        x, positions = f32(rng.normal(0, 1, (6, 4, head_dim))), i64(start + np.arange(6) * 37)
        yield op_case(name, "rope", "reference.rope", f"NeoX rotation of the first {factor:g} of each head",
                      {"x": x, "positions": positions},
                      {"y": ("activations", R.rope(f64(x), positions, theta, int(head_dim * factor)))},
                      {"rope_theta": theta, "partial_rotary_factor": factor})

    for T, W in ((7, 4), (2, 4), (1, 3)):
        name = f"op-causal_conv1d-T{T}-W{W}"
        rng = rng_for(name)
        x, window, w = f32(rng.normal(0, 1, (T, 40))), f32(rng.normal(0, 1, (W - 1, 40))), f32(rng.normal(0, 0.5, (40, W)))
        y, new_window = R.causal_conv1d(f64(x), f64(window), f64(w))
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
        o, S, _ = rule(*map(f64, (q, k, v, g, beta, S0)))
        yield op_case(name, "gated_delta_rule", f"reference.gated_delta_{form}",
                      f"{T} tokens from a non-zero state, Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}"
                      + (" (one step)" if T == 1 and form == "recurrent" else ""),
                      {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": S0},
                      {"o": ("activations", o), "final_state": ("state", S)}, {"form": form})


# ----------------------------------------------------------------------------------------------------------------
# One layer of a checkpoint on given inputs; the layer's weights travel in inputs.safetensors under their names.

def layer_weights(checkpoint, prefix, part):
    """The checkpoint's tensors of one layer part (linear_attn, self_attn, mlp), canonical `model.` names."""
    tensors = R.read_weights(checkpoint_dir(checkpoint), model(checkpoint)[0])
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
            y, state, _ = R.gated_deltanet(f64(inputs["x"]), R.DeltaState(f64(inputs["state.conv"]),
                                                                           f64(inputs["state.S"])), cfg, **weights)
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
            y, state = R.gated_attention(f64(inputs["x"]), R.AttnState(f64(inputs["state.k"]), f64(inputs["state.v"])),
                                         inputs["positions"], cfg, **weights)
            return {"y": y, "state.k": state.k, "state.v": state.v}
        yield layer_case(checkpoint, layer, "attention_layer", "self_attn", ATTENTION_ATTRS, inputs, gated_attention,
                         f"gated attention: {T} new tokens after {past} cached keys (k after k_norm and RoPE)")

    rng = rng_for("mlp-tiny-mtp")
    inputs = {"x": f32(rng.normal(0, 1, (7, model("tiny-mtp")[0].hidden_size)))}

    def mlp(cfg, weights):
        return {"y": R.mlp(f64(inputs["x"]), **weights)}
    yield layer_case("tiny-mtp", 0, "mlp_layer", "mlp", (), inputs, mlp, "SwiGLU feed-forward")

    cfg = model("tiny-moe")[0]
    rng = rng_for("moe-tiny-moe")
    moe_inputs = {"x": f32(rng.normal(0, 1, (9, cfg.hidden_size)))}

    def sparse_moe(cfg, weights):
        x = f64(moe_inputs["x"])
        router = np.sort(R.softmax(x @ weights["gate"].T), axis=-1)[:, ::-1]
        margin = (router[:, cfg.num_experts_per_tok - 1] - router[:, cfg.num_experts_per_tok]).min()
        assert margin > 1e-3, f"moe case: routing within {margin} of a tie; change its inputs"
        return {"y": R.sparse_moe(x, cfg, **weights)}
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


def sampling_cases(N=6, V=272):
    for name, (sampling, logits_kind) in SAMPLING_CASES.items():
        rng = rng_for(name)
        # "ties": logits on a grid of 0.5, so many tokens tie exactly (top-k keeps every tie of the k-th; top-p
        # breaks ties by the lower token id)
        logits = f32(rng.integers(-8, 8, (N, V)) / 2 if logits_kind == "ties" else rng.normal(0, 2.5, (N, V)))
        p = R.probabilities(f64(logits), sampling)
        if sampling.temperature == 0:
            assert not any(runner_up(row)[2] for row in logits), f"{name}: argmax within tolerance of a tie"
        tokens, uniforms = discriminating_rows(logits, sampling, rng)
        assert [R.sample(row, u) for row, u in zip(f32(p), uniforms)] == list(tokens)
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
    missed = undiscriminated(draft, q, logits, sampling, uniforms)
    assert not missed, f"{checkpoint} {label}: the wrong rules {missed} decide this round as the spec does"
    n = accepted + 1
    strategy = R.ROLLBACK[rollback]
    committed = strategy.commit(state, after, strategy.keep(state, tapes), n)
    next_logits = R.forward(params, cfg, [token], committed)[0]
    mode = "greedy" if sampling.temperature == 0 else "sampling"
    inputs = {"prompt": prompt_ids, "verify_tokens": i64(verify_tokens)}
    if mode == "sampling":
        inputs.update(q=f32(q), uniforms=f32(uniforms))
    return Case(f"spec-{checkpoint}-{label}-{rollback}", "speculative",
                f"reference.accept_{'greedy' if mode == 'greedy' else 'speculative'}, "
                f"reference.{strategy.commit.__name__}",
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


def untied_greedy_path(checkpoint, steps, distinct_last=True):
    """The first prompt (24 tokens or more) whose next `steps` greedy steps are all clear of ties and whose last two
    differ (so that a bonus token taken from the wrong row shows; `distinct_last=False`: may repeat, for a random
    checkpoint with tied embeddings, which mostly predicts its input token again): (prompt, state after it, its
    greedy token, the greedy tokens after that, the runner-up token at each step)."""
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
            if path[-1] != path[-2] or not distinct_last:
                return prompt_ids, state, last, path[1:], runners_up
    raise AssertionError(f"{checkpoint}: every prompt tried has a near-tie in its first {steps} greedy steps, or "
                         "repeats its last token")


def spec_greedy_cases(checkpoint, accept_counts, distinct_last=True):
    """Drafts that follow the greedy path for `a` tokens, then the runner-up token, then noise: every accept count."""
    prompt_ids, state, last, path, runners_up = untied_greedy_path(checkpoint, max(accept_counts) + 1, distinct_last)
    rng = rng_for(f"spec-greedy-{checkpoint}")
    for a in accept_counts:
        draft = path[:a] + ([runners_up[a]] + list(rng.integers(0, 256, DRAFT_LEN - a - 1)) if a < DRAFT_LEN else [])
        for rollback in R.ROLLBACK_STRATEGIES:
            yield spec_case(checkpoint, f"greedy-accept{a}", prompt_ids, state, [last] + draft, None, None, GREEDY,
                            a, rollback)


def spec_sampling_cases(checkpoint, runs):
    """Drafts, q and uniforms chosen so that exactly `a` drafts are accepted, each decision clear of its edge and
    telling the usual wrong rules from the spec's (golden.sampled_drafts)."""
    cfg, params = model(checkpoint)
    prompt_ids, state, last = prefilled(checkpoint)
    for a, sampling, shape, zero_p in runs:
        label = f"sampling-{'' if shape == 'full' else shape + '-'}accept{a}"
        draft, q, uniforms = sampled_drafts(params, cfg, state, last, DRAFT_LEN, a, sampling,
                                            rng_for(f"spec-{label}-{checkpoint}"), shape, zero_p)
        for rollback in R.ROLLBACK_STRATEGIES:
            yield spec_case(checkpoint, label, prompt_ids, state, [last] + draft, q, uniforms, sampling, a, rollback)


# Sampled rounds run on tiny-dense, whose logits spread over many tokens (tiny-mtp's put nearly all the mass on one,
# where every rule draws the same token). q: a draft model's (full), an n-gram's (one-hot), DFlash2's (candidates).
# The rejection of accept2 drafts a token top-k cut, with u = 0.
SAMPLED_ROUNDS = [(0, R.Sampling(1.0, 0, 1.0), "full", False), (2, R.Sampling(0.8, 40, 1.0), "full", True),
                  (4, R.Sampling(0.7, 0, 0.9), "full", False), (1, R.Sampling(0.7, 5, 1.0), "one-hot", False),
                  (2, R.Sampling(1.0, 0, 1.0), "candidates", False)]


def speculative_cases():
    yield from spec_greedy_cases("tiny-mtp", range(DRAFT_LEN + 1))
    yield from spec_sampling_cases("tiny-dense", SAMPLED_ROUNDS)
    for checkpoint in ("tiny-moe", "tiny-odd", "tiny-multimodal", "default"):
        yield from spec_greedy_cases(checkpoint, [2])


# ----------------------------------------------------------------------------------------------------------------
# The MTP head as a drafter, round after round.

MTP_KEEPS = (3, 1, DRAFT_LEN + 1, 2)       # verified positions kept in the rounds after the prompt's


def mtp_case(checkpoint, prompt_len=20):
    """Rounds of drafting with the checkpoint's MTP head. Round 0: the target prefills the prompt; the head takes the
    pairs (final-normed hidden state of position i, token i + 1), the last pairing the target's next token, and is
    chained K - 1 times on its own output hidden state and its greedy drafts. Each later round: the target consumes
    the last token and the first n - 1 drafts (n verified positions kept), and the head takes their n pairs, its
    cache keeping the committed pairs only."""
    cfg, params = model(checkpoint)
    state, mtp_state = R.empty_state(cfg), R.mtp_drafter(params, cfg).initial_state
    tokens, inputs, outputs = list(prompt(checkpoint, prompt_len)), {}, {}
    for r, keep in enumerate((None,) + MTP_KEEPS):
        if keep:
            tokens = [tokens_next[-1]] + drafts[:keep - 1]
        logits, hidden, state, _ = R.forward(params, cfg, tokens, state)
        tokens_next, drafts = tokens[1:] + [int(np.argmax(logits[-1]))], []

        def greedy(depth_logits):
            drafts.append(int(np.argmax(depth_logits)))
            return drafts[-1]
        draft_logits, draft_hidden, mtp_state = R.mtp_chain(params, cfg, mtp_state, tokens_next, hidden, DRAFT_LEN,
                                                            greedy)
        greedy(draft_logits[-1])
        inputs.update({f"r{r}.tokens": i64(tokens), f"r{r}.next": i64(tokens_next), f"r{r}.hidden": hidden,
                       f"r{r}.chain": i64(drafts[:-1])})
        outputs.update({f"r{r}.target_hidden": Output("hidden", hidden),
                        f"r{r}.draft_logits": Output("logits", draft_logits),
                        f"r{r}.draft_hidden": Output("hidden", draft_hidden),
                        **{f"r{r}.mtp_{n}": o for n, o in state_outputs(mtp_state).items()}})
    return Case(f"mtp-{checkpoint}", "mtp", "reference.forward (hidden), reference.mtp_chain",
                f"the MTP head drafting {DRAFT_LEN} tokens a round after a {prompt_len}-token prompt, then after "
                f"rounds keeping {', '.join(map(str, MTP_KEEPS))} verified positions: its input hidden states, logits "
                "and output hidden states at every depth, its cache", ("prefill", "extend", "mtp")
                + checkpoint_features(checkpoint), {"rounds": len(MTP_KEEPS) + 1}, inputs, outputs, checkpoint)


def mtp_cases():
    for checkpoint in ("default", "tiny-mtp", "tiny-moe-per-expert-mtp"):
        yield mtp_case(checkpoint)


# ----------------------------------------------------------------------------------------------------------------
# A DFlash block drafter, round after round.

# (verified positions the round keeps, drafts it asks for) in the rounds after the prompt's: two accepted, none, all
# four, then a shorter block whose two drafts are both kept, then one accepted (so the crop is exercised after a
# partial, a zero and a full accept, and a block length that changes between rounds).
DFLASH_ROUNDS = ((3, DRAFT_LEN), (1, DRAFT_LEN), (DRAFT_LEN + 1, 2), (3, DRAFT_LEN), (2, DRAFT_LEN))


def dflash_case(checkpoint, drafter, prompt_len=20):
    """Rounds of drafting with a DFlash drafter. Round 0: the target prefills the prompt, its tapped layer outputs
    are the drafter's first context; the block [the target's next token, MASK x K] is drafted from them. Each later
    round: the target consumes the last committed token and the first n - 1 drafts (the n verified positions kept);
    their features are appended to the drafter's context (the previous block cropped out), the new block starts
    with the target's next token."""
    cfg, params = model(checkpoint)
    dcfg, dparams = R.load_dflash(checkpoint_dir(drafter), cfg)
    dparams = R.cast(dparams, np.float64)
    taps, state, dstate = R.dflash_taps(dcfg), R.empty_state(cfg), R.dflash_empty_state(dcfg)
    tokens, inputs, outputs, draft_lens = list(prompt(checkpoint, prompt_len)), {}, {}, [DRAFT_LEN]
    for r, (keep, k) in enumerate(((None, DRAFT_LEN),) + DFLASH_ROUNDS):
        if keep:
            tokens = [last] + drafts[:keep - 1]
            draft_lens.append(k)
        logits, features, state, _ = R.forward(params, cfg, tokens, state, taps)
        last = int(np.argmax(logits[-1]))
        block_logits, dstate = R.dflash_round(params, dparams, dcfg, dstate, features, last, k)
        drafts = [int(t) for t in np.argmax(block_logits, axis=-1)]
        inputs.update({f"r{r}.tokens": i64(tokens), f"r{r}.features": features, f"r{r}.last": i64([last])})
        outputs.update({f"r{r}.target_features": Output("hidden", features),
                        f"r{r}.block_logits": Output("logits", block_logits),
                        **{f"r{r}.dflash_{n}": o for n, o in state_outputs(dstate).items()}})
    return Case(f"dflash-{checkpoint}-{drafter}", "dflash",
                "reference.forward (taps), reference.dflash_round",
                f"a DFlash drafter (taps {list(taps)}) drafting a block a round after a {prompt_len}-token prompt, then "
                f"after rounds keeping {', '.join(str(keep) for keep, _ in DFLASH_ROUNDS)} verified positions: the "
                "target's tapped features, the block's logits, the drafter's context cache",
                ("prefill", "extend", "dflash") + checkpoint_features(checkpoint),
                {"rounds": len(DFLASH_ROUNDS) + 1, "draft_lens": draft_lens, "drafter": checkpoint_entry(drafter)},
                inputs, outputs, checkpoint)


def dflash_cases():
    yield dflash_case("tiny-mtp", "tiny-mtp-dflash")


def all_cases():
    yield from primitive_cases()
    yield from gated_delta_rule_cases()
    yield from layer_cases()
    yield from model_cases()
    yield from sampling_cases()
    yield from speculative_cases()
    yield from mtp_cases()
    yield from tree_cases()
    yield from dflash_cases()
    yield from trace_cases()
    yield from draws_cases()


def build_cases(out_dir, progress=None, cases=None):
    """Rewrite every case (or the given ones) under out_dir; case folders there that this run does not write are
    removed."""
    progress = progress or sys.stderr
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        if (old / MANIFEST).exists():
            shutil.rmtree(old)
    count = 0
    for count, case in enumerate(all_cases() if cases is None else cases, 1):
        write_case(out_dir, case)
        print(f"[{count}] {case.name}", file=progress, flush=True)
    print(f"wrote {count} cases to {out_dir}", file=progress)
    return count


# ----------------------------------------------------------------------------------------------------------------
# What regenerating promises (INTERPRETING.md, "Regenerating"): the same cases, manifests, token ids and decisions,
# and float tensors that differ by float32 rounding only.

REGENERATION_BOUND = TOLERANCES["regeneration"]["bound"]


def manifest_differences(name, fresh, committed):
    """Every manifest field but the data files' digests (which hash machine-dependent float32 bytes) must be equal."""
    fresh, committed = ({k: v for k, v in meta.items() if k != "files"} for meta in (fresh, committed))
    return [f"{name}/{MANIFEST}: {key} differs: {fresh.get(key)!r} now, {committed.get(key)!r} committed"
            for key in sorted(set(fresh) | set(committed)) if fresh.get(key) != committed.get(key)]


def tensor_differences(where, fresh, committed, bound=REGENERATION_BOUND):
    """Names, dtypes, shapes and integer values equal; floats within `bound` times the tensor's largest magnitude."""
    lines = [f"{where}: tensor {n} {'added' if n in fresh else 'removed'}" for n in sorted(set(fresh) ^ set(committed))]
    for n in sorted(set(fresh) & set(committed)):
        a, b = fresh[n], committed[n]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            lines.append(f"{where}: {n} is {a.dtype}{list(a.shape)} now, {b.dtype}{list(b.shape)} committed")
        elif a.dtype.kind != "f":
            if not np.array_equal(a, b):
                index = tuple(int(i) for i in np.argwhere(a != b)[0])
                lines.append(f"{where}: {n}{list(index)} is {a[index]} now, {b[index]} committed")
        else:
            err, scale = np.abs(a.astype(np.float64) - b), float(np.abs(b).max(initial=0))
            if not err.max(initial=0) <= bound * scale:          # NaN fails
                lines.append(f"{where}: {n} differs by up to {err.max():.3g}, more than {bound:g} x its largest "
                             f"magnitude {scale:.3g}")
    return lines


def differences(fresh_dir, committed_dir, subset=False):
    """What a regeneration into fresh_dir changed against committed_dir, as lines (none: the goldens are fresh).
    subset: fresh_dir holds only some cases; the others are not compared."""
    fresh, committed = ({p.name for p in case_dirs(d)} for d in (fresh_dir, committed_dir))
    lines = [f"case {n} is new (not committed)" for n in sorted(fresh - committed)]
    lines += [] if subset else [f"case {n} is committed but no longer generated" for n in sorted(committed - fresh)]
    for name in sorted(fresh & committed):
        lines += manifest_differences(name, *(json.loads((d / name / MANIFEST).read_text())
                                              for d in (fresh_dir, committed_dir)))
        for file in (INPUTS, EXPECTED):
            lines += tensor_differences(f"{name}/{file}", *(read_tensors(d / name, file)
                                                            for d in (fresh_dir, committed_dir)))
    return lines


def check(committed_dir, progress=None):
    """Regenerate into a temporary folder and compare with committed_dir -> the difference lines."""
    with tempfile.TemporaryDirectory() as tmp:
        build_cases(Path(tmp), progress)
        return differences(Path(tmp), committed_dir)
