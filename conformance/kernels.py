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

LENGTHS = (1, 2, 5, 63, 64, 65, 127, 129, 300)  # around the chunk size 64, packed into one varlen batch
VERIFY_LENGTH = 4                               # a verify block of K = 3 drafts + 1
VERIFY_SEQUENCES = 3
ACCEPTED = (0, 1, 2, 3, 4, 2)                   # conv update: accepted count per sequence, 0..K+1
HK, DK, DV, WIDTH = (COMMON[k] for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
                                          "linear_conv_kernel_dim"))
KINDS = ("gdr-chunked", "gdr-recurrent", "gdr-verify-states", "conv-varlen", "conv-update")
LAYOUTS = ("HKV", "HVK")  # a state per value head as (key dim, value dim) or (value dim, key dim)


def geometries():
    """Value head count -> the published models with it (key heads 16, head dims 128, conv width 4 in all)."""
    out = {}
    for name, model in PUBLISHED.items():
        out.setdefault(model.fields["linear_num_value_heads"], []).append(name)
    return dict(sorted(out.items()))


class Case(NamedTuple):
    name: str
    kind: str
    value_heads: int
    qk_normalized: bool   # q and k given already l2-normalised (else the kernel normalises them)
    seed: int


def pack_cases():
    cases = []
    for Hv in geometries():
        for kind in KINDS:
            for normalized in ((False, True) if kind.startswith("gdr") else (False,)):
                suffix = ("-qk-l2" if normalized else "-qk-raw") if kind.startswith("gdr") else ""
                cases.append(Case(f"{kind}-Hv{Hv}{suffix}", kind, Hv, normalized, 1000 * Hv + len(cases)))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Inputs, drawn from the case's seed (the same draws for the raw and normalised variants of a case: seed from Hv)

def bf16_round(x):
    return (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


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


def case_inputs(case, dtype):
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


def expected(case, inputs):
    f64 = {n: a.astype(np.float64) for n, a in inputs.items() if a.dtype.kind == "f"}
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


_PREPARED = {}


def prepared(case, dtype):
    """(inputs, expected) of a case; the chunked and recurrent cases share theirs (one float64 computation)."""
    key = (case.kind.replace("recurrent", "chunked"), case.value_heads, case.qk_normalized, dtype)
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


def within(got, want, tol):  # -> (ok, max abs error, the error bound's worst ratio)
    err = np.abs(got.astype(np.float64) - want)
    bound = tol["atol"] + tol["rtol"] * np.abs(want)
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
        return (bf16_round(o) if dtype == "bfloat16" else o), self._out(np.stack(finals))

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
        return (bf16_round(o) if dtype == "bfloat16" else o), self._out(np.stack(states))

    def conv_varlen(self, x, weight, windows, cu_seqlens, dtype):
        ys, outs = [], []
        spans = sequences(cu_seqlens)
        for i, s in enumerate(spans):
            window = windows[(i + 1) % len(spans)] if "conv-wrong-window" in self.bugs else windows[i]
            y, w = R.causal_conv1d(x[s], window, weight)
            ys.append(y)
            outs.append(w)
        y = np.concatenate(ys)
        return (bf16_round(y) if dtype == "bfloat16" else y), np.stack(outs)

    def conv_update(self, x, weight, windows, accepted, dtype):
        ys, outs = [], []
        for xi, window, n in zip(x, windows, accepted):
            ys.append(R.causal_conv1d(xi, window, weight)[0])
            n = min(int(n) + 1, len(xi)) if "accepted-off-by-one" in self.bugs else int(n)
            outs.append(R.conv_window(window, xi, n))
        y = np.stack(ys)
        return (bf16_round(y) if dtype == "bfloat16" else y), np.stack(outs)


def kernel_engine(spec):
    """numpy, numpy:HVK (the same engine declaring the other state layout), jax, transformers, or
    package.module:Class (a KernelEngine subclass)."""
    if spec in ("numpy", "numpy:HVK"):
        return NumpyKernels(state_layout="HVK" if spec.endswith("HVK") else "HKV")
    if spec in ("jax", "transformers"):
        from .engines import kernel_peers
        return kernel_peers.make(spec)
    module, _, attr = spec.partition(":")
    if not attr:
        raise R.UserError(f"--engine {spec!r}: not numpy, numpy:HVK, jax, transformers or package.module:Class")
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
    else:
        y, windows = engine.conv_update(**inputs, dtype=dtype)
    return {"y": y, "windows": windows}


def tolerance_of(pack, case, output, dtype):
    family = "conv" if case.kind.startswith("conv") else "gdr"
    return pack["tolerances"][family][dtype][output if output in ("o", "y") else "states"]


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
            ok, err, ratio = within(g, w, tolerance_of(pack, case, output, dtype))
            if not ok:
                failures.append(f"{output}: max |error| {err:.3g} ({ratio:.3g}x the bound)")
        status = "FAIL" if failures else "PASS"
        results.append(Result(case.name, status, "; ".join(failures) or f"{time.perf_counter() - start:.2f} s"))
        log(f"{status:<5} {case.name:<36} {results[-1].detail}")
    return results
