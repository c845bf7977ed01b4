"""The kernel pack: op-level cases at the published Qwen3.5 layer geometry, in the calling conventions production
kernels use (varlen packing by cu_seqlens, per-sequence initial states, raw or l2-normalised q/k, either state layout).

    qwen35-conformance kernels --engine numpy [--cases REGEX] [--dtype float32|bfloat16]

Nothing but the recipe ships: each case's inputs are drawn from its seed on the user's machine, reference.py computes
the expected outputs in float64 there, and a stored fingerprint (conformance/kernel_pack.json: sums, norms and
sampled values of the float64 result) makes a drifted oracle fail loudly before any engine is judged. INTERPRETING.md
section "The kernel pack" states the conventions; docs/published-configs.md the geometry.
"""

import importlib
import json
import re
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import reference as R
from .published import COMMON, PUBLISHED, to_bf16_bits

HERE = Path(__file__).resolve().parent
PACK_FILE = HERE / "kernel_pack.json"
EXPECTATIONS_FILE = HERE / "expectations" / "kernels.json"   # the shipped peers' recorded results

LENGTHS = (1, 2, 5, 63, 64, 65, 127, 129, 300)  # around the chunk size 64, packed into one varlen batch
VERIFY_LENGTH = 4                               # a verify block of K = 3 drafts + 1
VERIFY_SEQUENCES = 3
ACCEPTED = (0, 1, 2, 3, 4, 2)                   # conv update: accepted count per sequence, 0..K+1
HK, DK, DV, WIDTH = (COMMON[k] for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
                                          "linear_conv_kernel_dim"))
KINDS = ("gdr-chunked", "gdr-recurrent", "gdr-verify-states", "conv-varlen", "conv-update")
LAYOUTS = ("HKV", "HVK")  # a state per value head as (key dim, value dim) or (value dim, key dim)
HEAD_DIM = COMMON["head_dim"]                                       # 256
ROTARY_DIM = int(HEAD_DIM * COMMON["rope_parameters"]["partial_rotary_factor"])   # 64
ROPE_THETA = COMMON["rope_parameters"]["rope_theta"]
EPS = COMMON["rms_norm_eps"]
NORM_TOKENS = 65
ROPE_POSITIONS = np.concatenate([np.arange(70), 4093 + np.arange(6), 65533 + np.arange(6),
                                 262144 - 1 - np.arange(6)])       # up to max_position_embeddings - 1
ATTENTION_SEQUENCES = ((1, 0), (1, 300), (4, 37), (65, 0), (129, 64), (2, 127))   # (query tokens, cached before)
ROUTER_TOKENS = 48


def geometries():
    """Value head count -> the published models with it (key heads 16, head dims 128, conv width 4 in all)."""
    out = {}
    for name, model in PUBLISHED.items():
        out.setdefault(model.fields["linear_num_value_heads"], []).append(name)
    return dict(sorted(out.items()))


def attention_geometries():
    """(query heads, key/value heads) -> the published models with it (head dim 256, rotary dim 64 in all)."""
    out = {}
    for name, model in PUBLISHED.items():
        out.setdefault((model.fields["num_attention_heads"], model.fields["num_key_value_heads"]), []).append(name)
    return dict(sorted(out.items()))


def router_geometries():
    """(experts, experts per token) -> the published MoE models with it."""
    out = {}
    for name, model in PUBLISHED.items():
        if "num_experts" in model.fields:
            out.setdefault((model.fields["num_experts"], model.fields["num_experts_per_tok"]), []).append(name)
    return dict(sorted(out.items()))


class Case(NamedTuple):
    name: str
    kind: str
    value_heads: int      # gdr, conv, rmsnorm-gated; 0 for the others
    qk_normalized: bool   # q and k given already l2-normalised (else the kernel normalises them)
    seed: int
    dims: tuple = ()      # attention, rope: (query heads, key/value heads); router: (experts, top k)


def pack_cases():
    cases = []
    for Hv in geometries():
        for kind in KINDS:
            for normalized in ((False, True) if kind.startswith("gdr") else (False,)):
                suffix = ("-qk-l2" if normalized else "-qk-raw") if kind.startswith("gdr") else ""
                cases.append(Case(f"{kind}-Hv{Hv}{suffix}", kind, Hv, normalized, 1000 * Hv + len(cases)))
    for Hv in geometries():
        cases.append(Case(f"rmsnorm-gated-Hv{Hv}", "rmsnorm-gated", Hv, False, 31 * Hv))
    for Hq in sorted({Hq for Hq, _ in attention_geometries()}):
        cases.append(Case(f"rope-H{Hq}", "rope", 0, False, 37 * Hq, (Hq, 0)))
    for Hq, Hkv in attention_geometries():
        cases.append(Case(f"attention-Hq{Hq}-Hkv{Hkv}", "attention", 0, False, 41 * Hq + Hkv, (Hq, Hkv)))
    for E, k in router_geometries():
        cases.append(Case(f"router-E{E}-k{k}", "router", 0, False, 43 * E + k, (E, k)))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Inputs, drawn from the case's seed (the same draws for the raw and normalised variants of a case: seed from Hv)

def bf16_round(x):
    return (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def output_in(y, dtype):  # what a kernel returns for the case's dtype: bf16 outputs are rounded to bf16
    return bf16_round(y) if dtype == "bfloat16" else y


def gdr_inputs(Hv, lengths, dtype, seed):
    """q, k (T, Hk, Dk) raw; v (T, Hv, Dv); g, beta (T, Hv); initial states (N, Hv, Dk, Dv), zero for even sequences;
    cu_seqlens (N+1,). bfloat16: q, k, v, beta rounded to bf16; g and the states stay float32."""
    rng = np.random.default_rng(seed)
    T, N = sum(lengths), len(lengths)
    q, k = (rng.standard_normal((T, HK, DK)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((T, Hv, DV)).astype(np.float32)
    g = (-np.exp(rng.uniform(-4.0, 0.5, (T, Hv)))).astype(np.float32)    # decays exp(g) in about (0.19, 0.98)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, Hv))))).astype(np.float32)
    S0 = (0.5 * rng.standard_normal((N, Hv, DK, DV))).astype(np.float32)
    S0[0::2] = 0
    if dtype == "bfloat16":
        q, k, v, beta = (bf16_round(x) for x in (q, k, v, beta))
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_states=S0,
                cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def conv_inputs(Hv, lengths, dtype, seed):
    """x (T, C) packed, weight (C, W), windows (N, W-1, C): zero for even sequences."""
    rng = np.random.default_rng(seed)
    C, N = 2 * HK * DK + Hv * DV, len(lengths)
    x = rng.standard_normal((sum(lengths), C)).astype(np.float32)
    weight = (rng.standard_normal((C, WIDTH)) * WIDTH ** -0.5).astype(np.float32)
    windows = rng.standard_normal((N, WIDTH - 1, C)).astype(np.float32)
    windows[0::2] = 0
    if dtype == "bfloat16":
        x, weight, windows = (bf16_round(a) for a in (x, weight, windows))
    return dict(x=x, weight=weight, windows=windows,
                cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def norm_inputs(Hv, dtype, seed):
    """x (T, Hv, Dv) the delta rule's output, z (T, Hv, Dv) the gate, weight (Dv,) around 1; bf16: all three."""
    rng = np.random.default_rng(seed)
    x, z = (rng.standard_normal((NORM_TOKENS, Hv, DV)).astype(np.float32) for _ in range(2))
    x *= rng.uniform(0.01, 3.0, (NORM_TOKENS, Hv, 1)).astype(np.float32)    # rows of very different scales
    weight = (1 + 0.2 * rng.standard_normal(DV)).astype(np.float32)
    if dtype == "bfloat16":
        x, z, weight = (bf16_round(a) for a in (x, z, weight))
    return dict(x=x, z=z, weight=weight)


def rope_inputs(H, dtype, seed):
    """x (T, H, 256) at positions (T,) from 0 to 262143; bf16: x."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(ROPE_POSITIONS), H, HEAD_DIM)).astype(np.float32)
    return dict(x=bf16_round(x) if dtype == "bfloat16" else x, positions=ROPE_POSITIONS.astype(np.int64))


def attention_inputs(Hq, Hkv, dtype, seed):
    """Varlen: q, gate (Tq, Hq, 256); k, v (Tk, Hkv, 256), each sequence's keys = its cached ones, then its own
    queries' (cu_seqlens_q, cu_seqlens_k); bf16: all four."""
    rng = np.random.default_rng(seed)
    q_lens = [n for n, _ in ATTENTION_SEQUENCES]
    k_lens = [n + cached for n, cached in ATTENTION_SEQUENCES]
    q, gate = (rng.standard_normal((sum(q_lens), Hq, HEAD_DIM)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((sum(k_lens), Hkv, HEAD_DIM)).astype(np.float32) for _ in range(2))
    k *= 2  # sharper softmax rows
    if dtype == "bfloat16":
        q, k, v, gate = (bf16_round(a) for a in (q, k, v, gate))
    cu = lambda lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return dict(q=q, k=k, v=v, gate=gate, cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens))


def router_inputs(E, dtype, seed):
    """logits (T, E): tokens with coarse logits (ties everywhere, at the top-k boundary too), tokens whose logits
    are all equal, tokens with distinct logits; bf16: rounded."""
    rng = np.random.default_rng(seed)
    T = ROUTER_TOKENS
    logits = rng.standard_normal((T, E)).astype(np.float32)
    coarse = T // 2
    logits[:coarse] = np.round(logits[:coarse] * 2) / 2                 # 0.5 steps: ties among the top experts
    logits[coarse:coarse + 2] = 0.75
    return dict(logits=bf16_round(logits) if dtype == "bfloat16" else logits)


def case_inputs(case, dtype):
    if case.kind == "rmsnorm-gated":
        return norm_inputs(case.value_heads, dtype, case.seed)
    if case.kind == "rope":
        return rope_inputs(case.dims[0], dtype, case.seed)
    if case.kind == "attention":
        return attention_inputs(*case.dims, dtype, case.seed)
    if case.kind == "router":
        return router_inputs(case.dims[0], dtype, case.seed)
    seed = case.value_heads * 7919 + ("gdr-verify" in case.kind) * 13 + (case.kind == "conv-update") * 17
    if case.kind.startswith("gdr"):
        lengths = (VERIFY_LENGTH,) * VERIFY_SEQUENCES if case.kind == "gdr-verify-states" else LENGTHS
        inputs = gdr_inputs(case.value_heads, lengths, dtype, seed)
        if case.qk_normalized:
            inputs["q"], inputs["k"] = R.l2norm(inputs["q"]), R.l2norm(inputs["k"])
        return inputs
    if case.kind == "conv-varlen":
        return conv_inputs(case.value_heads, LENGTHS, dtype, seed)
    inputs = conv_inputs(case.value_heads, (VERIFY_LENGTH,) * len(ACCEPTED), dtype, seed)
    N = len(ACCEPTED)
    return dict(x=inputs["x"].reshape(N, VERIFY_LENGTH, -1), weight=inputs["weight"], windows=inputs["windows"],
                accepted=np.array(ACCEPTED, np.int64))


# ----------------------------------------------------------------------------------------------------------------
# The expected outputs: reference.py per sequence, in float64

def sequences(cu_seqlens):
    return [slice(int(a), int(b)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]


def causal_visible(q_len, k_len):  # (q_len, k_len) bool: query j, at position k_len - q_len + j, sees keys up to it
    return np.arange(k_len)[None, :] <= (k_len - q_len + np.arange(q_len))[:, None]


def expected(case, inputs):
    f64 = {n: a.astype(np.float64) for n, a in inputs.items() if a.dtype.kind == "f"}
    if case.kind == "rmsnorm-gated":
        return {"y": R.rms_norm_gated(f64["x"], f64["z"], f64["weight"], EPS)}
    if case.kind == "rope":
        return {"y": R.rope(f64["x"], inputs["positions"], ROPE_THETA, ROTARY_DIM)}
    if case.kind == "attention":
        outs = []
        for sq, sk in zip(sequences(inputs["cu_seqlens_q"]), sequences(inputs["cu_seqlens_k"])):
            visible = causal_visible(sq.stop - sq.start, sk.stop - sk.start)
            outs.append(R.gqa_attention(f64["q"][sq], f64["k"][sk], f64["v"][sk], visible) * R.sigmoid(f64["gate"][sq]))
        return {"o": np.concatenate(outs)}
    if case.kind == "router":
        ids, weights = R.route(f64["logits"], case.dims[1])
        return by_expert_id(ids, weights)
    if case.kind.startswith("gdr"):
        q, k = R.l2norm(f64["q"]), R.l2norm(f64["k"])
        outs, finals, states = [], [], []
        for i, s in enumerate(sequences(inputs["cu_seqlens"])):
            if case.kind == "gdr-verify-states":
                qs, ks = R.value_head_queries_keys(q[s], k[s], case.value_heads)
                S = f64["initial_states"][i]
                for t in range(s.stop - s.start):
                    o, S, _ = R.gated_delta_step(S, qs[t], ks[t], f64["v"][s][t], f64["g"][s][t], f64["beta"][s][t])
                    outs.append(o[None])
                    states.append(S)
            else:
                o, S, _ = R.gated_delta_chunked(q[s], k[s], f64["v"][s], f64["g"][s], f64["beta"][s],
                                                f64["initial_states"][i])
                outs.append(o)
                finals.append(S)
        result = {"o": np.concatenate(outs)}
        result.update({"states": np.stack(states)} if states else {"final_states": np.stack(finals)})
        return result
    if case.kind == "conv-varlen":
        ys, windows = [], []
        for i, s in enumerate(sequences(inputs["cu_seqlens"])):
            y, window = R.causal_conv1d(f64["x"][s], f64["windows"][i], f64["weight"])
            ys.append(y)
            windows.append(window)
        return {"y": np.concatenate(ys), "windows": np.stack(windows)}
    ys, windows = [], []
    for x, window, n in zip(f64["x"], f64["windows"], inputs["accepted"]):
        ys.append(R.causal_conv1d(x, window, f64["weight"])[0])
        windows.append(R.conv_window(window, x, int(n)))
    return {"y": np.stack(ys), "windows": np.stack(windows)}


def by_expert_id(ids, weights):  # -> {"ids", "weights"}, each row in increasing expert id (the order is free)
    order = np.argsort(ids, axis=-1, kind="stable")
    return {"ids": np.take_along_axis(np.asarray(ids), order, -1).astype(np.int64),
            "weights": np.take_along_axis(np.asarray(weights), order, -1)}


_PREPARED = {}


def prepared(case, dtype):
    """(inputs, expected) of a case; the chunked and recurrent cases share theirs (one float64 computation)."""
    key = (case.kind.replace("recurrent", "chunked"), case.value_heads, case.qk_normalized, case.dims, dtype)
    if key not in _PREPARED:
        _PREPARED.clear()
        inputs = case_inputs(case, dtype)
        _PREPARED[key] = inputs, expected(case, inputs)
    return _PREPARED[key]


def fingerprint(result):
    """Sums, norms and 8 values at fixed places of each float64 output: pins the oracle within 1e-9, not to bytes."""
    out = {}
    for name, a in sorted(result.items()):
        flat = a.reshape(-1)
        picks = np.linspace(0, flat.size - 1, 8).astype(np.int64)
        out[name] = {"shape": list(a.shape), "sum": float(flat.sum()), "norm": float(np.linalg.norm(flat)),
                     "values": [float(x) for x in flat[picks]]}
    return out


def fingerprint_drift(stored, computed):  # -> a description of the first difference, or None
    for name, want in stored.items():
        got = computed.get(name)
        if got is None or got["shape"] != want["shape"]:
            return f"{name}: shape {None if got is None else got['shape']}, pinned {want['shape']}"
        scale = max(want["norm"], 1.0)
        for field in ("sum", "norm"):
            if abs(got[field] - want[field]) > 1e-9 * scale:
                return f"{name}: {field} {got[field]!r}, pinned {want[field]!r}"
        if not np.allclose(got["values"], want["values"], rtol=1e-9, atol=1e-12 * scale):
            return f"{name}: sampled values differ from the pinned ones"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Tolerances per kernel family and input dtype (kernel_pack.json's "tolerances", with how they were measured)

def load_pack():
    return json.loads(PACK_FILE.read_text())


def within(got, want, tol, extra=0.0):  # -> (ok, max abs error, the error bound's worst ratio)
    err = np.abs(got.astype(np.float64) - want)
    bound = tol["atol"] + tol["rtol"] * np.abs(want) + extra
    return bool(np.all(err <= bound)), float(err.max(initial=0.0)), float((err / bound).max(initial=0.0))


# ----------------------------------------------------------------------------------------------------------------
# Engines: what an engine's kernel ops take and return (INTERPRETING.md, "The kernel pack")

class KernelEngine:
    """Override the ops an engine has. States are (N, Hv, Dk, Dv) for layout HKV, (N, Hv, Dv, Dk) for HVK; the kit
    transposes the initial states in and the returned states back. Inputs are float32 arrays; for dtype bfloat16
    they hold bf16 values, which the engine may cast to bf16 exactly."""
    name = "engine"
    state_layout = "HKV"
    forms = ("chunked", "recurrent")

    def gated_delta_rule(self, form, q, k, v, g, beta, initial_states, cu_seqlens, qk_normalized, dtype):
        """-> o (T, Hv, Dv), final states (N, Hv, ., .). q is scaled by Dk^-0.5 inside; raw q/k: l2-normalise."""
        raise NotImplementedError

    def gated_delta_states(self, q, k, v, g, beta, initial_states, cu_seqlens, qk_normalized, dtype):
        """-> o (T, Hv, Dv), the state after every position (T, Hv, ., .)."""
        raise NotImplementedError

    def conv_varlen(self, x, weight, windows, cu_seqlens, dtype):
        """-> y (T, C) (no activation), each sequence's last W-1 inputs (N, W-1, C)."""
        raise NotImplementedError

    def conv_update(self, x, weight, windows, accepted, dtype):
        """x (N, T, C) -> y (N, T, C), each window after its first accepted[i] of the T inputs (N, W-1, C)."""
        raise NotImplementedError

    def rms_norm_gated(self, x, z, weight, eps, dtype):
        """x, z (T, Hv, Dv), weight (Dv,) -> x / sqrt(mean(x^2) + eps) * weight * silu(z) (plain weight, no +1)."""
        raise NotImplementedError

    def rope(self, x, positions, theta, rotary_dim, dtype):
        """x (T, H, Dh), positions (T,) -> x with dims [0, rotary_dim) rotated NeoX-style (pairs i, i + R/2) by
        angles float32(position * inv_freq_i), inv_freq_i = float32(theta^(-2i/R)); dims [R, Dh) unchanged."""
        raise NotImplementedError

    def gated_attention(self, q, k, v, gate, cu_seqlens_q, cu_seqlens_k, dtype):
        """Varlen causal GQA softmax attention (scale Dh^-0.5; query head h reads key/value head h // (Hq / Hkv);
        a sequence's queries are its last keys' positions) times sigmoid(gate) -> o (Tq, Hq, Dh)."""
        raise NotImplementedError

    def moe_route(self, logits, top_k, dtype):
        """logits (T, E) -> ids (T, k), weights (T, k): softmax over all E, the k most probable (ties: the lower
        expert id), weights renormalised to sum 1. The order within a row is free."""
        raise NotImplementedError


KERNEL_BUGS = {
    "modulo-heads": "value head j reads key head j % Hk instead of j // (Hv / Hk)",
    "tail-decay": "the last chunk of a sequence shorter than 64 drops its last token's decay",
    "carry-state": "each packed sequence after the first starts from the previous one's final state",
    "initial-ignored": "the initial states are ignored (every sequence starts from zero)",
    "bf16-state": "the state is kept in bf16 between chunks (and between tokens of the recurrent form)",
    "states-shifted": "the per-position states are those before each token instead of after it",
    "conv-wrong-window": "a packed sequence's conv starts from the next sequence's initial window",
    "accepted-off-by-one": "the conv window after an update keeps one input more than accepted",
    "no-qk-norm": "raw q and k are used without l2 normalisation",
    "gate-before-norm": "gated RMSNorm gates first and normalises x * silu(z) (fla's norm_before_gate=False)",
    "norm-one-plus-weight": "gated RMSNorm scales by (1 + weight), as the zero-centred RMSNorms elsewhere do",
    "rope-interleaved": "RoPE rotates adjacent pairs (2i, 2i+1) (GPT-J style) instead of (i, i + R/2)",
    "rope-full-dim": "RoPE rotates all 256 dims instead of the first 64 (rotary dim from head_dim alone)",
    "rope-bf16-angles": "RoPE's angles are computed in bf16 (the model dtype), wrong at long positions",
    "kv-heads-modulo": "query head h reads key/value head h % Hkv instead of h // (Hq / Hkv)",
    "causal-top-left": "the causal mask is aligned top-left (query j sees keys 0..j) instead of after the cache",
    "attention-gate-ignored": "the attention output is not multiplied by sigmoid(gate)",
    "router-ties-higher-id": "tied router probabilities go to the higher expert id",
    "router-not-renormalised": "the top-k weights are not renormalised to sum 1 (norm_topk_prob off)",
}


class NumpyKernels(KernelEngine):
    """A float32 NumPy engine built from reference.py's forms, one sequence at a time; `bugs` (KERNEL_BUGS keys)
    inject the catalogue's mistakes, which the pack must catch."""
    name = "numpy"

    def __init__(self, bugs=(), state_layout="HKV"):
        unknown = set(bugs) - set(KERNEL_BUGS)
        if unknown:
            raise R.UserError(f"unknown kernel bugs {sorted(unknown)} (known: {', '.join(KERNEL_BUGS)})")
        self.bugs, self.state_layout = frozenset(bugs), state_layout

    def _heads(self, q, k, Hv):  # -> q, k at Hv heads (then reference.py's repeat factor is 1)
        if "modulo-heads" in self.bugs:
            return np.tile(q, (1, Hv // q.shape[1], 1)), np.tile(k, (1, Hv // k.shape[1], 1))
        return R.gva_heads(q, Hv), R.gva_heads(k, Hv)

    def _prepare(self, q, k, v, initial_states, qk_normalized):
        if not qk_normalized and "no-qk-norm" not in self.bugs:
            q, k = R.l2norm(q), R.l2norm(k)
        S0 = initial_states if self.state_layout == "HKV" else initial_states.swapaxes(-1, -2)
        if "initial-ignored" in self.bugs:
            S0 = np.zeros_like(S0)
        return (*self._heads(q, k, v.shape[1]), S0)

    def _sequence(self, form, q, k, v, g, beta, S):
        keep = bf16_round if "bf16-state" in self.bugs else (lambda x: x)
        if form == "recurrent":
            q, k = R.value_head_queries_keys(q, k, v.shape[1])
            outs = []
            for t in range(len(v)):
                o, S, _ = R.gated_delta_step(S, q[t], k[t], v[t], g[t], beta[t])
                S = keep(S)
                outs.append(o)
            return np.stack(outs), S
        outs = []
        for start in range(0, len(v), 64):
            c = slice(start, start + 64)
            gc = g[c].copy()
            if "tail-decay" in self.bugs and len(gc) < 64:
                gc[-1] = 0
            o, S, _ = R.gated_delta_chunked(q[c], k[c], v[c], gc, beta[c], S)
            S = keep(S)
            outs.append(o)
        return np.concatenate(outs), S

    def _out(self, S):
        return S if self.state_layout == "HKV" else S.swapaxes(-1, -2)

    def gated_delta_rule(self, form, q, k, v, g, beta, initial_states, cu_seqlens, qk_normalized, dtype):
        q, k, S0 = self._prepare(q, k, v, initial_states, qk_normalized)
        outs, finals = [], []
        for i, s in enumerate(sequences(cu_seqlens)):
            start = finals[-1] if finals and "carry-state" in self.bugs else S0[i]
            o, S = self._sequence(form, q[s], k[s], v[s], g[s], beta[s], start)
            outs.append(o)
            finals.append(S)
        o = np.concatenate(outs)
        return output_in(o, dtype), self._out(np.stack(finals))

    def gated_delta_states(self, q, k, v, g, beta, initial_states, cu_seqlens, qk_normalized, dtype):
        q, k, S0 = self._prepare(q, k, v, initial_states, qk_normalized)
        outs, states = [], []
        for i, s in enumerate(sequences(cu_seqlens)):
            S = S0[i]
            qs, ks = R.value_head_queries_keys(q[s], k[s], v.shape[1])
            for t in range(s.stop - s.start):
                before = S
                o, S, _ = R.gated_delta_step(S, qs[t], ks[t], v[s][t], g[s][t], beta[s][t])
                outs.append(o)
                states.append(before if "states-shifted" in self.bugs else S)
        o = np.stack(outs)
        return output_in(o, dtype), self._out(np.stack(states))

    def conv_varlen(self, x, weight, windows, cu_seqlens, dtype):
        ys, outs = [], []
        spans = sequences(cu_seqlens)
        for i, s in enumerate(spans):
            window = windows[(i + 1) % len(spans)] if "conv-wrong-window" in self.bugs else windows[i]
            y, w = R.causal_conv1d(x[s], window, weight)
            ys.append(y)
            outs.append(w)
        y = np.concatenate(ys)
        return output_in(y, dtype), np.stack(outs)

    def conv_update(self, x, weight, windows, accepted, dtype):
        ys, outs = [], []
        for xi, window, n in zip(x, windows, accepted):
            ys.append(R.causal_conv1d(xi, window, weight)[0])
            n = min(int(n) + 1, len(xi)) if "accepted-off-by-one" in self.bugs else int(n)
            outs.append(R.conv_window(window, xi, n))
        y = np.stack(ys)
        return output_in(y, dtype), np.stack(outs)


    def rms_norm_gated(self, x, z, weight, eps, dtype):
        if "gate-before-norm" in self.bugs:
            x = x * R.silu(z)
            y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight
        else:
            y = R.rms_norm_gated(x, z, (1 + weight) if "norm-one-plus-weight" in self.bugs else weight, eps)
        return output_in(y, dtype)

    def rope(self, x, positions, theta, rotary_dim, dtype):
        rotary_dim = x.shape[-1] if "rope-full-dim" in self.bugs else rotary_dim
        if "rope-bf16-angles" in self.bugs:
            inv_freq = np.float32(theta) ** -(np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))
            angles = bf16_round(bf16_round(positions.astype(np.float32))[:, None] * bf16_round(inv_freq))
            cos, sin = (np.concatenate([f(angles)] * 2, -1)[:, None, :] for f in (np.cos, np.sin))
            x_rot = x[..., :rotary_dim]
            half = np.concatenate([-x_rot[..., rotary_dim // 2:], x_rot[..., :rotary_dim // 2]], axis=-1)
            y = np.concatenate([x_rot * cos + half * sin, x[..., rotary_dim:]], axis=-1)
        elif "rope-interleaved" in self.bugs:  # NeoX on dims permuted so that adjacent pairs become (i, i + R/2)
            R_ = rotary_dim
            perm = np.concatenate([np.arange(0, R_, 2), np.arange(1, R_, 2), np.arange(R_, x.shape[-1])])
            y = np.empty_like(x)
            y[..., perm] = R.rope(x[..., perm], positions, theta, rotary_dim)
        else:
            y = R.rope(x, positions, theta, rotary_dim)
        return output_in(y, dtype)

    def gated_attention(self, q, k, v, gate, cu_seqlens_q, cu_seqlens_k, dtype):
        Hq, Hkv = q.shape[1], k.shape[1]
        outs = []
        for sq, sk in zip(sequences(cu_seqlens_q), sequences(cu_seqlens_k)):
            qs, ks, vs = q[sq], k[sk], v[sk]
            if "kv-heads-modulo" in self.bugs:  # reorder the query heads so that groups read h % Hkv
                order = np.arange(Hq).reshape(Hq // Hkv, Hkv).T.reshape(-1)   # kv head j's group: j, j+Hkv, ...
                o = np.empty_like(qs)
                o[:, order] = R.gqa_attention(qs[:, order], ks, vs, self._visible(sq, sk))
            else:
                o = R.gqa_attention(qs, ks, vs, self._visible(sq, sk))
            outs.append(o if "attention-gate-ignored" in self.bugs else o * R.sigmoid(gate[sq]))
        o = np.concatenate(outs)
        return output_in(o, dtype)

    def _visible(self, sq, sk):
        q_len, k_len = sq.stop - sq.start, sk.stop - sk.start
        if "causal-top-left" in self.bugs:
            return np.arange(k_len)[None, :] <= np.arange(q_len)[:, None]
        return causal_visible(q_len, k_len)

    def moe_route(self, logits, top_k, dtype):
        if "router-ties-higher-id" in self.bugs:  # the reference's choice on the experts in reverse order
            ids, weights = R.route(logits[:, ::-1], top_k)
            ids = logits.shape[1] - 1 - ids
        else:
            ids, weights = R.route(logits, top_k)
        if "router-not-renormalised" in self.bugs:
            weights = np.take_along_axis(R.softmax(logits), ids, -1)
        return ids, weights


SHIPPED_ENGINES = ("numpy", "numpy:HVK", "jax", "transformers", "transformers-varlen", "fla")


def kernel_engine(spec):
    """numpy, numpy:HVK (the same engine declaring the other state layout), jax, transformers, transformers-varlen,
    fla (conformance/engines/kernel_peers.py), or package.module:Class (a KernelEngine subclass)."""
    if spec in ("numpy", "numpy:HVK"):
        return NumpyKernels(state_layout="HVK" if spec.endswith("HVK") else "HKV")
    if spec in SHIPPED_ENGINES:
        from .engines import kernel_peers
        return kernel_peers.make(spec)
    module, _, attr = spec.partition(":")
    if not attr:
        raise R.UserError(f"--engine {spec!r}: not {', '.join(SHIPPED_ENGINES)} or package.module:Class")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise R.UserError(f"--engine {spec!r}: cannot load it ({e})") from None
    return cls()


# ----------------------------------------------------------------------------------------------------------------
# Running the pack

class Result(NamedTuple):
    case: str
    status: str           # PASS, FAIL, SKIP
    detail: str


def engine_outputs(engine, case, inputs, dtype):
    """Calls the engine's op for the case; states converted to layout HKV."""
    to_hkv = (lambda S: S) if engine.state_layout == "HKV" else (lambda S: S.swapaxes(-1, -2))
    from_hkv = to_hkv
    if case.kind.startswith("gdr"):
        args = dict(inputs, initial_states=from_hkv(inputs["initial_states"]), qk_normalized=case.qk_normalized,
                    dtype=dtype)
        if case.kind == "gdr-verify-states":
            o, states = engine.gated_delta_states(**args)
            return {"o": o, "states": to_hkv(states)}
        o, finals = engine.gated_delta_rule(case.kind.split("-")[1], **args)
        return {"o": o, "final_states": to_hkv(finals)}
    if case.kind == "conv-varlen":
        y, windows = engine.conv_varlen(**inputs, dtype=dtype)
        return {"y": y, "windows": windows}
    if case.kind == "conv-update":
        y, windows = engine.conv_update(**inputs, dtype=dtype)
        return {"y": y, "windows": windows}
    if case.kind == "rmsnorm-gated":
        return {"y": engine.rms_norm_gated(**inputs, eps=EPS, dtype=dtype)}
    if case.kind == "rope":
        return {"y": engine.rope(**inputs, theta=ROPE_THETA, rotary_dim=ROTARY_DIM, dtype=dtype)}
    if case.kind == "attention":
        return {"o": engine.gated_attention(**inputs, dtype=dtype)}
    ids, weights = engine.moe_route(inputs["logits"], case.dims[1], dtype)
    return by_expert_id(ids, weights)


def family(case):  # the tolerance table's key: gdr, conv, rmsnorm-gated, rope, attention, router
    return case.kind.split("-")[0] if case.kind.startswith(("gdr", "conv")) else case.kind


ANGLE_RTOL = 2.0 ** -21  # float32 RoPE angles: inv_freq and the product each within an ulp or two (see rope_bound)


def rope_bound(inputs):
    """(T, H, Dh): what float32 angles leave open. inv_freq = theta^(-2i/R) in float32 differs by an ulp between
    correct implementations (numpy's pow, XLA's, torch's 1 / theta^x), and so does position * inv_freq: an angle
    error up to a few 2^-24 relative, which rotates the pair (i, i + R/2) by that much, 0.016 rad at position
    262143. Bound: ANGLE_RTOL * angle * the pair's radius, on the rotary dims (0 on the others)."""
    x = inputs["x"].astype(np.float64)
    half = ROTARY_DIM // 2
    angles = inputs["positions"][:, None] * ROPE_THETA ** -(np.arange(0, ROTARY_DIM, 2) / ROTARY_DIM)   # (T, R/2)
    term = ANGLE_RTOL * angles[:, None, :] * np.hypot(x[..., :half], x[..., half:ROTARY_DIM])            # (T, H, R/2)
    return np.concatenate([term, term, np.zeros_like(x[..., ROTARY_DIM:])], axis=-1)


def tolerance_of(pack, case, output, dtype):  # None: compared exactly (the router's expert ids)
    if output == "ids":
        return None
    return pack["tolerances"][family(case)][dtype][output if output in ("o", "y", "weights") else "states"]


def run_pack(engine, cases=None, dtype="float32", log=print):
    """-> [Result]; an oracle that drifted from its fingerprint raises R.UserError before judging anything."""
    pack = load_pack()
    results = []
    for case in pack_cases():
        if cases and not re.search(cases, case.name):
            continue
        form = case.kind.split("-")[1] if case.kind in ("gdr-chunked", "gdr-recurrent") else None
        if form and form not in engine.forms:
            results.append(Result(case.name, "SKIP", f"the engine has no {form} form"))
            continue
        inputs, want = prepared(case, dtype)
        drift = fingerprint_drift(pack["fingerprints"][dtype][case.name], fingerprint(want))
        if drift:
            raise R.UserError(f"{case.name}: the reference's float64 result drifted from the pinned fingerprint "
                              f"({drift}): the oracle changed")
        start = time.perf_counter()
        try:
            got = engine_outputs(engine, case, inputs, dtype)
        except NotImplementedError:
            results.append(Result(case.name, "SKIP", "the engine does not implement this op"))
            continue
        except Exception as e:  # an engine that raises on a case fails it
            results.append(Result(case.name, "FAIL", f"the engine raised {type(e).__name__}: {e}"))
            log(f"FAIL  {case.name:<36} {results[-1].detail}")
            continue
        failures = []
        for output, w in want.items():
            g = np.asarray(got[output])
            if g.shape != w.shape:
                failures.append(f"{output}: shape {g.shape}, expected {w.shape}")
                continue
            tol = tolerance_of(pack, case, output, dtype)
            if tol is None:
                wrong = np.argwhere(g != w)
                if len(wrong):
                    failures.append(f"{output}: {len(wrong)} differ, first at {tuple(int(i) for i in wrong[0])}: "
                                    f"{int(g[tuple(wrong[0])])}, expected {int(w[tuple(wrong[0])])}")
                continue
            ok, err, ratio = within(g, w, tol, rope_bound(inputs) if case.kind == "rope" else 0.0)
            if not ok:
                failures.append(f"{output}: max |error| {err:.3g} ({ratio:.3g}x the bound)")
        status = "FAIL" if failures else "PASS"
        results.append(Result(case.name, status, "; ".join(failures) or f"{time.perf_counter() - start:.2f} s"))
        log(f"{status:<5} {case.name:<36} {results[-1].detail}")
    return results


def weigh(engine_name, results, dtype):
    """-> [(Result, the status recorded for it)]: expectations/kernels.json's known failures and skipped ops of a
    shipped peer; PASS for everything else (and for every engine the file does not name)."""
    book = json.loads(EXPECTATIONS_FILE.read_text())["engines"].get(engine_name, {})
    weighed = []
    for r in results:
        known = book.get("known_failures", {}).get(r.case)
        if known and dtype in known["dtypes"]:
            weighed.append((r, known["expected"]))
        elif r.case.startswith(tuple(book.get("skips", {}))):
            weighed.append((r, "SKIP"))
        else:
            weighed.append((r, "PASS"))
    return weighed
