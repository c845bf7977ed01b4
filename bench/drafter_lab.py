"""The drafter lab: the self-speculative drafters of the seed experiments (partial MLP, block skips, token-mixer and
residual reuse, a vocabulary-shortlist MTP head) beside the MTP head, n-gram copying and the first-N-layers drafter,
on the trained default model over held-out prompts, measured side by side in one run.

    python -m bench.drafter_lab [--prompts 8] [--new-tokens 32] [--out bench/results/cpu] [--plot docs/drafter_lab.png]

Per drafter and setting (docs/self-speculative.md defines each and says how to read the figures):
  teacher forced   at each position of the target's greedy continuation, the drafter's next-token distribution at
                   T = 1 from the target's exact state after the true prefix, against the target's: Jensen-Shannon
                   divergence (nats), top-1 agreement, top-20 overlap, retained mass (the target's probability on
                   the drafter's top 20 over its probability on its own top 20), and 1 - TV, the chance speculative
                   sampling accepts a draft from there
  the seed's gap   greedy, 8 tokens from each prompt: top-1 agreement teacher forced against the drafter chaining
                   its own 8 drafts (aligned matches, all 8 right, exact prefix)
  speculation      exact speculative sampling at T = 1, K = 1..4 (reference.generate_speculative): acceptance and
                   tokens per target call, and the speedup over plain sampling, CPU seconds per generated token
  cost             the estimated share of a decode step's multiply-adds a draft token takes (bench/costmodel.py's
                   counting) and its measured share of a decode step (CPU seconds, one draft token against one target
                   step at the same position, interleaved)
The plot puts each drafter's acceptance against its draft cost with the break-even curves from the cost model: this
CPU (reference.py's verify/decode ratios, measured here), an H200 and an M4 Max (Qwen3.5-4B, bf16, 4K context).
Timings are CPU seconds of this process: run it with one BLAS thread (OPENBLAS_NUM_THREADS=1) on a quiet machine;
every timed figure is a ratio of runs interleaved in one loop.
"""

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

import reference as R
from bench import costmodel as M
from weights.plots import pyplot

ROOT = Path(__file__).resolve().parent.parent
KS = (1, 2, 3, 4)
TOP = 20
GAP_TOKENS = 8
SEED_FIGURES = {  # the seed's figures on Qwen3.5-4B / 9B (docs/self-speculative.md quotes where each comes from)
    "partial-mlp 25%": "top-1 75%, top-20 overlap 13.42/20, retained 94.9%, estimated cost 62.5%",
    "partial-mlp 75% (interior)": "expected acceptance 79.2% at T = 0.7; 7.6 tok/s vs 12.8 plain (0.60x), the draft "
                                  "62% of the time",
    "mixer reuse, layers 9-16": "top-1 24/24 prompts, JS 0.0055",
    "alternating mixer reuse": "teacher forced 81.2% vs free running 53.1%, all 8 right 29.2%, exact prefix 3.79/8",
    "residual reuse, matched": "top-1 33.3-37.5% (8 of 32 layers skipped)",
    "n-gram table": "24.3% of phrase tokens used, yet faster than plain decoding",
}


def log(message):
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# The target along a prompt's greedy continuation

class TargetRun(NamedTuple):
    prompt: list
    tokens: list         # the target's greedy continuation (C,)
    states: list         # states[j]: after consuming prompt + tokens[:j]
    hidden: np.ndarray   # (P + C - 1, D) the final-normed hidden state of every consumed position
    logits: np.ndarray   # (C, V) the target's logits for tokens[j]


def target_run(params, cfg, prompt, length):
    """Plain greedy decoding of `length` tokens, keeping the state and hidden state after every position."""
    logits, hidden, state, _ = R.forward(params, cfg, prompt, R.empty_state(cfg))
    tokens, states, rows, next_logits = [], [state], [hidden], [logits[-1]]
    while len(tokens) < length:
        tokens.append(int(np.argmax(next_logits[-1])))
        if len(tokens) < length:
            logits, hidden, state, _ = R.forward(params, cfg, tokens[-1:], state)
            states.append(state)
            rows.append(hidden)
            next_logits.append(logits[-1])
    return TargetRun(list(prompt), tokens, states, np.concatenate(rows), np.stack(next_logits))


class Call(NamedTuple):
    """One propose call as generate_speculative makes it (observe included): pure, so it can be made again."""
    draft_state: object
    context: list
    new_hidden: np.ndarray


def teacher_forced_calls(drafter, run, positions):
    """Drive a drafter along the target's run: before drafting tokens[j] (j = 1 .. positions) the target has consumed
    prompt + tokens[:j-1] and verified one position since the previous call. -> the Call at each j, and the draft
    state after it at k = 1 (so the next call sees what a drafter sees one round later)."""
    P, state, calls, seen = len(run.prompt), drafter.initial_state, [], 0
    for j in range(1, positions + 1):
        if drafter.observe:
            state = drafter.observe(state, run.states[j - 1])
        call = Call(state, run.prompt + run.tokens[:j], run.hidden[seen:P + j - 1])
        seen = P + j - 1
        calls.append(call)
        state = drafter.propose(*call, 1, R.Sampling(1.0), np.random.default_rng(j))[2]
    return calls


def propose(drafter, call, k, sampling, seed=0):
    return drafter.propose(*call, k, sampling, np.random.default_rng(seed))


# ----------------------------------------------------------------------------------------------------------------
# Quality: the drafter's distribution against the target's

def distribution_metrics(p, q, top=TOP):  # (V,) target, (V,) drafter, both at T = 1 -> dict
    m = (p + q) / 2

    def kl(a):
        return float(np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1) / np.where(m > 0, m, 1)), 0)))
    top_p, top_q = np.argsort(-p, kind="stable")[:top], np.argsort(-q, kind="stable")[:top]
    return {"js": (kl(p) + kl(q)) / 2, "top1": float(top_p[0] == top_q[0]),
            "overlap": float(len(set(top_p) & set(top_q))), "retained": float(p[top_q].sum() / p[top_p].sum()),
            "accept": float(np.minimum(p, q).sum())}


def quality(drafter, runs, positions, calls=None):
    """Teacher-forced metrics averaged over every position of every run; None for a drafter without a distribution
    (n-gram copying proposes without one: its q is one-hot where it proposes at all). calls: each run's
    teacher_forced_calls, when they are at hand."""
    if drafter.name == "ngram":
        return None
    rows = []
    for run, run_calls in zip(runs, calls or [teacher_forced_calls(drafter, run, positions) for run in runs]):
        for j, call in enumerate(run_calls[:positions], start=1):
            q = propose(drafter, call, 1, R.Sampling(1.0), j)[1][0]
            rows.append(distribution_metrics(R.softmax(run.logits[j].astype(np.float64)), q.astype(np.float64)))
    return {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}


def free_running_gap(drafter, runs, length=GAP_TOKENS, calls=None):
    """The seed's gap, greedy: top-1 agreement with the target's continuation teacher forced (each draft from the
    true prefix) against the drafter's own chain of `length` drafts from the prompt (aligned matches; all right;
    the exact prefix's length)."""
    forced, free, all_right, prefix = [], [], [], []
    for run, run_calls in zip(runs, calls or [teacher_forced_calls(drafter, run, length) for run in runs]):
        truth = run.tokens[1:length + 1]
        forced += [propose(drafter, call, 1, R.Sampling())[0][:1] == truth[i:i + 1]
                   for i, call in enumerate(run_calls[:length])]
        chain = list(propose(drafter, run_calls[0], length, R.Sampling())[0]) + [None] * length
        matches = [a == b for a, b in zip(chain, truth)]
        free += matches
        all_right.append(all(matches))
        prefix.append(next((i for i, ok in enumerate(matches) if not ok), length))
    return {"teacher_forced": float(np.mean(forced)), "free_running": float(np.mean(free)),
            "all_right": float(np.mean(all_right)), "exact_prefix": float(np.mean(prefix))}


# ----------------------------------------------------------------------------------------------------------------
# Cost: multiply-adds estimated, a decode step's share measured

def layer_flops(cfg, context):
    """[(mixer FLOPs, FFN FLOPs)] per layer of one decode step, and the lm_head's (bench/costmodel.py's kernels)."""
    p, layers = M.FP32, []
    for kind in cfg.layer_types:
        mixer = (M.deltanet_kernels(cfg, 1, p, 1) if kind == "linear_attention" else
                 M.attention_kernels(cfg, 1, context, p, 1))
        layers.append((sum(k.flops for k in mixer), sum(k.flops for k in M.ffn_kernels(cfg, 1, p, 1))))
    return layers, sum(k.flops for k in M.head_kernels(cfg, 1, p, 1))


def mac_share(spec, cfg, context):
    """Estimated multiply-adds of one draft token as a share of one decode step's. The mixer-reuse figure counts
    the draft step only (an engine whose verify keeps the window's last two mixer outputs; reference.py's shadow
    recomputes them, which the measured share includes)."""
    layers, head = layer_flops(cfg, context)
    decode = sum(a + b for a, b in layers) + head
    name, _, args = spec.partition(":")
    if name in ("ngram", "none"):
        return 0.0
    if name in ("mtp", "mtp-shortlist"):
        kernels = M.mtp_step_kernels(cfg, context, M.FP32)
        shortlist = len(R.read_shortlist(args, cfg.vocab_size)) if name == "mtp-shortlist" else cfg.vocab_size
        return sum(k.flops * (shortlist / cfg.vocab_size if k.layer == "lm_head" else 1) for k in kernels) / decode
    every = range(cfg.num_hidden_layers)
    run = {"skip": lambda: range(int(args)), "residual-reuse": lambda: range(int(args), cfg.num_hidden_layers),
           "skip-blocks": lambda: set(every) - set(R.parse_layers(spec, args, cfg))}.get(name, lambda: every)()
    mixers = set(every) - set(R.parse_layers(spec, args, cfg)) if name == "mixer-reuse" else set(every)
    ffn = dict.fromkeys(every, 1.0)
    if name == "partial-mlp":
        fraction, has_layers, which = args.partition(":")
        width = cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size
        for i in (R.parse_layers(spec, which, cfg) if has_layers else every):
            ffn[i] = max(1, round(float(fraction) * width)) / width
    return (sum(layers[i][0] * (i in mixers) + layers[i][1] * ffn[i] for i in run) + head) / decode


def cpu_seconds(fn):
    start = time.process_time()
    fn()
    return time.process_time() - start


def interleaved_medians(fns, repeats):
    """Median CPU seconds of each fn, the fns run in turn in every repeat (a warm-up round first)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            t.append(cpu_seconds(fn))
    return [float(np.median(t)) for t in times]


def measured_shares(params, cfg, drafters, run, repeats):
    """One draft token (a propose call at k = 1, at the middle of the run, teacher forced) per drafter and one target
    decode step at the same position, all interleaved -> {name: draft seconds / decode seconds}, decode seconds."""
    j = len(run.tokens) // 2
    calls = {d.name: teacher_forced_calls(d, run, j)[-1] for d in drafters}
    step = (lambda: R.forward(params, cfg, run.tokens[j - 1:j], run.states[j - 1]))
    fns = [step] + [(lambda d=d: propose(d, calls[d.name], 1, R.Sampling(1.0))) for d in drafters]
    decode, *drafts = interleaved_medians(fns, repeats)
    return {d.name: t / decode for d, t in zip(drafters, drafts)}, decode


def verify_ratios(params, cfg, run, repeats, ks=KS):
    """reference.py's verify pass over K+1 tokens (with the replay tape) over a decode step, K in ks, interleaved."""
    state, tokens = run.states[0], run.tokens
    fns = [lambda: R.forward(params, cfg, tokens[:1], state)] + [
        (lambda K=K: R.verify(params, cfg, state, tokens[:K + 1], "replay")) for K in ks]
    decode, *verify = interleaved_medians(fns, repeats)
    return {K: v / decode for K, v in zip(ks, verify)}


# ----------------------------------------------------------------------------------------------------------------
# Speculation: exact speculative sampling, acceptance and speed

def speculation(params, cfg, drafters, prompts, new_tokens, prefill_s, ks=KS, seed=0, on_progress=lambda m: None):
    """Every drafter at every K on every prompt at T = 1, with plain sampling of the same prompt before each drafter's
    runs: -> {name: {K: {acceptance, tokens_per_call, speedup, by_position}}}. Speedup: plain CPU seconds per
    generated token over speculative (prefill, measured apart per prompt, taken off both)."""
    sampling = R.Sampling(1.0)
    totals = {d.name: {K: dict(proposed=0, accepted=0, calls=0, tokens=0, seconds=0.0, plain_seconds=0.0,
                               plain_tokens=0, by_position=np.zeros(K), reached=np.zeros(K)) for K in ks}
              for d in drafters}
    for n, (prompt, prefill) in enumerate(zip(prompts, prefill_s)):
        for d in drafters:
            plain = []
            s = cpu_seconds(lambda: plain.extend(R.generate(params, cfg, prompt, new_tokens, sampling,
                                                            np.random.default_rng(seed + n))[0]))
            for K in ks:
                out = []
                spec_s = cpu_seconds(lambda: out.extend(R.generate_speculative(
                    params, cfg, prompt, new_tokens, sampling, np.random.default_rng(seed + n), d, K)))
                tokens, stats = out
                t = totals[d.name][K]
                t["proposed"] += stats["proposed"]
                t["accepted"] += stats["accepted"]
                t["calls"] += stats["target_calls"]
                t["tokens"] += len(tokens) - 1
                t["seconds"] += spec_s - prefill
                t["plain_seconds"] += s - prefill
                t["plain_tokens"] += len(plain) - 1
                t["by_position"] += stats["accepted_by_position"]
                t["reached"] += stats["proposed_by_position"]
        on_progress(f"  speculation: prompt {n + 1}/{len(prompts)} done")
    out = {}
    for name, by_k in totals.items():
        out[name] = {K: {"acceptance": t["accepted"] / max(t["proposed"], 1),
                         "tokens_per_call": t["tokens"] / t["calls"],
                         "speedup": (t["plain_seconds"] / t["plain_tokens"]) / (t["seconds"] / t["tokens"]),
                         "by_position": (t["by_position"] / np.maximum(t["reached"], 1)).round(4).tolist()}
                     for K, t in by_k.items()}
    return out


def jax_speedups(params, cfg, rows, prompts, new_tokens, repeats, seed=0, on_progress=lambda m: None):
    """jax_impl's measured speedup for each row whose drafter it runs on device (jax_impl.DRAFTERS), at the K
    reference.py's speculation found best: its on-device loop's decode seconds per generated token, exact
    speculative sampling at T = 1, over plain sampling of the same prompts, each run interleaved with the others
    (after one compiling run each) -> {spec: speedup}."""
    import jax_impl
    ported = [spec for spec in rows if spec.partition(":")[0] in jax_impl.DRAFTERS]
    if not ported:
        return {}
    jparams = jax_impl.to_jax(params)
    runs = [("none", 0)] + [(spec, int(best_k(rows[spec]))) for spec in ported]
    sampling = R.Sampling(1.0)

    def run(spec, K, n):  # -> (decode seconds, tokens after the first)
        tokens, stats = jax_impl.generate(jparams, cfg, prompts[n], new_tokens, sampling, seed + n, spec, K)
        return stats["seconds"]["decode"], len(tokens) - 1
    for spec, K in runs:
        run(spec, K, 0)
    on_progress(f"  jax_impl: {len(runs)} loops compiled")
    totals = {run_: [0.0, 0] for run_ in runs}
    for _ in range(repeats):
        for n in range(len(prompts)):
            for run_ in runs:
                seconds, tokens = run(*run_, n)
                totals[run_][0] += seconds
                totals[run_][1] += tokens
    plain = totals["none", 0][0] / totals["none", 0][1]
    return {spec: plain / (totals[spec, K][0] / totals[spec, K][1]) for spec, K in runs[1:]}


# ----------------------------------------------------------------------------------------------------------------
# Break-even: the acceptance a drafter of a given cost needs

def breakeven_acceptance(cost, cycle_share, ks=KS):
    """The smallest acceptance a (per draft, independent) at which some K in ks breaks even:
    expected_tokens(a, K) = K * cost + cycle_share(K, a), with cycle_share the verify and commit seconds of a round
    over a decode step's. None if no a <= 1 does."""
    best = None
    for K in ks:
        def gain(a):
            return M.expected_tokens(a, K) - K * cost - cycle_share(K, a)
        if gain(1.0) < 0:
            continue
        low, high = 0.0, 1.0
        if gain(low) >= 0:
            return 0.0
        for _ in range(50):
            mid = (low + high) / 2
            low, high = (mid, high) if gain(mid) < 0 else (low, mid)
        best = high if best is None else min(best, high)
    return best


def datasheet_cycle_share(hw, model="4B"):
    """(K, a) -> a round's verify and commit seconds over a decode step's, from the cost model (bf16, 4K, replay)."""
    cfg = M.published_config(model)
    s = M.Setting(hw, M.BF16, 4096)
    decode = M.decode_seconds(cfg, s)
    return lambda K, a: M.cycle_seconds(cfg, K, a, "replay", s) / decode


def measured_cycle_share(ratios):
    return lambda K, a: ratios[K]


def predicted_speedup(figures, cost, cycle_share):
    """(K, speedup) at the best K for a machine: the measured tokens per target call over K draft tokens at `cost`
    (a share of a decode step) and a round's verify and commit there. -> (K, speedup)"""
    return max(((K, f["tokens_per_call"] / (K * cost + cycle_share(K, f["acceptance"])))
                for K, f in figures.items()), key=lambda r: r[1])


# ----------------------------------------------------------------------------------------------------------------
# The run

def drafter_specs(cfg, shortlists, skip_pair):
    """The settings the lab compares (the default model's 8 layers: 0-2 and 4-6 DeltaNet, 3 and 7 attention):
    skip_pair, the two least damaging single blocks (block_scan), is skipped first alone (the less damaging) and
    then together. skip-blocks:0-1 is residual-reuse:2's control: the same layers left out, nothing reused."""
    last = cfg.num_hidden_layers - 1
    return (["ngram", "mtp"] + [f"mtp-shortlist:{path}" for path in shortlists]
            + ["partial-mlp:0.25", "partial-mlp:0.5", "partial-mlp:0.75", f"partial-mlp:0.25:1-{last - 1}",
               f"skip-blocks:{skip_pair[0]}", f"skip-blocks:{min(skip_pair)},{max(skip_pair)}",
               f"mixer-reuse:2-{last - 3}", f"mixer-reuse:1-{last - 1}", "residual-reuse:2", "skip-blocks:0-1",
               f"residual-reuse:{cfg.num_hidden_layers // 2}", f"skip:{cfg.num_hidden_layers // 2}"])


def block_scan(params, cfg, runs, positions):
    """Each block skipped alone, teacher forced on discovery prompts: {layer: mean JS}, the least damaging first."""
    scores = {i: quality(R.make_drafter(f"skip-blocks:{i}", params, cfg), runs, positions)["js"]
              for i in range(cfg.num_hidden_layers)}
    return dict(sorted(scores.items(), key=lambda item: item[1]))


def shown(spec):  # the spec as the results name it: a shortlist file's path relative to the repository
    return spec.replace(f"{ROOT}/", "")


def label(spec):
    name, _, args = spec.partition(":")
    if name == "mtp-shortlist":
        return f"mtp-shortlist:{Path(args).stem.split('-')[-1]}"
    return spec


def lab(params, cfg, prompts, discovery, shortlists, new_tokens, positions, repeats, jax=True):
    """Everything but the plot -> the results dict (bench/results/cpu/drafter_lab.json's layout); jax: measure the
    jax_impl column (else None in each row)."""
    context = len(prompts[0]) + new_tokens // 2
    log(f"target runs: {len(prompts)} held-out and {len(discovery)} discovery prompts ...")
    runs = [target_run(params, cfg, p, max(positions, GAP_TOKENS) + 1) for p in prompts]
    discovery_runs = [target_run(params, cfg, p, positions + 1) for p in discovery]
    scan = block_scan(params, cfg, discovery_runs, positions)
    log("single-block skips (discovery prompts, mean JS): " + ", ".join(f"{i}: {js:.3f}" for i, js in scan.items()))
    specs = drafter_specs(cfg, shortlists, list(scan)[:2])
    drafters = [R.make_drafter(spec, params, cfg) for spec in specs]
    rows = {}
    for spec, d in zip(specs, drafters):
        start = time.perf_counter()
        calls = [teacher_forced_calls(d, run, positions) for run in runs]
        rows[shown(spec)] = {"label": label(spec), "mac_share": mac_share(spec, cfg, context),
                             "quality": quality(d, runs, positions, calls),
                             "gap": free_running_gap(d, runs, calls=calls) if d.name != "ngram" else None}
        log(f"  {label(spec)}: teacher forced and free running in {time.perf_counter() - start:.1f} s")
    log("measuring one draft token against one decode step (interleaved) ...")
    shares, decode_s = measured_shares(params, cfg, drafters, runs[0], repeats)
    ratios = verify_ratios(params, cfg, runs[0], repeats)
    for spec, d in zip(specs, drafters):
        rows[shown(spec)]["measured_share"] = shares[d.name]
    log(f"  decode step {decode_s * 1e3:.2f} ms; verify / decode " + ", ".join(f"K={K}: {r:.2f}"
                                                                           for K, r in ratios.items()))
    prefill_s = [interleaved_medians([lambda p=p: R.forward(params, cfg, p, R.empty_state(cfg))], 3)[0]
                 for p in prompts]
    log(f"exact speculative sampling at T = 1, K = {KS[0]}..{KS[-1]}, {len(prompts)} prompts x {new_tokens} tokens, "
        f"plain sampling interleaved ...")
    spec_figures = speculation(params, cfg, drafters, prompts, new_tokens, prefill_s, on_progress=log)
    for spec, d in zip(specs, drafters):
        row = rows[shown(spec)]
        row["speculation"] = spec_figures[d.name]
        row["predicted_h200"] = predicted_speedup(row["speculation"], row["mac_share"], datasheet_cycle_share(M.H200))
    if jax:
        log("jax_impl: the ported drafters at their best K, plain sampling interleaved ...")
    jax_column(params, cfg, rows, specs if jax else [], prompts, new_tokens, repeats)
    return {"model": "weights/default", "prompts": len(prompts), "prompt_tokens": len(prompts[0]),
            "new_tokens": new_tokens, "positions": positions, "block_scan": scan, "decode_ms": decode_s * 1e3,
            "verify_ratios": ratios, "rows": rows}


def jax_column(params, cfg, rows, specs, prompts, new_tokens, repeats):
    """Each row's jax_impl_speedup (None: a drafter jax_impl does not run)."""
    measured = jax_speedups(params, cfg, {spec: rows[shown(spec)] for spec in specs}, prompts, new_tokens,
                            max(1, repeats // 5), on_progress=log)
    for key, row in rows.items():
        row["jax_impl_speedup"] = {shown(spec): speedup for spec, speedup in measured.items()}.get(key)


# ----------------------------------------------------------------------------------------------------------------
# Table and plot

def best_k(row):
    return max(row["speculation"], key=lambda K: row["speculation"][K]["speedup"])


def pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def table(results):
    header = ["drafter", "JS (nats)", "top-1", "top-20 overlap", "retained", "1 - TV",
              "acceptance K=1/2/3/4", "tokens/call K=1/2/3/4", "MAC share", "measured share",
              "speedup (best K)", "jax_impl speedup", "H200 / M4 Max predicted"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in results["rows"].values():
        q, s = row["quality"], row["speculation"]
        K = best_k(row)
        cells = [row["label"]]
        cells += (["-"] * 5 if q is None else
                  [f"{q['js']:.3f}", pct(q["top1"]), f"{q['overlap']:.1f}", pct(q["retained"]), pct(q["accept"])])
        cells += [" / ".join(pct(s[k]["acceptance"]) for k in s),
                  " / ".join(f"{s[k]['tokens_per_call']:.2f}" for k in s),
                  pct(row["mac_share"]), pct(row["measured_share"]), f"{s[K]['speedup']:.2f}x (K={K})",
                  "not ported" if row["jax_impl_speedup"] is None else f"{row['jax_impl_speedup']:.2f}x",
                  "{1:.2f}x (K={0})".format(*row["predicted_h200"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gap_table(results):
    lines = ["| drafter | teacher forced top-1 | free running (aligned) | all 8 right | exact prefix (of 8) |",
             "|---|---|---|---|---|"]
    for row in results["rows"].values():
        g = row["gap"]
        if g:
            lines.append(f"| {row['label']} | {pct(g['teacher_forced'])} | {pct(g['free_running'])} | "
                         f"{pct(g['all_right'])} | {g['exact_prefix']:.2f} |")
    return "\n".join(lines)


def jax_note(results):
    return f" (measured apart: `{results['jax_command']}`)" if results.get("jax_command") else ""


def report(results, command):
    scan = ", ".join(f"{i}: {js:.3f}" for i, js in results["block_scan"].items())
    ratios = ", ".join(f"K={K}: {r:.2f}" for K, r in results["verify_ratios"].items())
    seed = "\n".join(f"| {k} | {v} |" for k, v in SEED_FIGURES.items())
    return f"""# Drafter lab: {results['model']}

`{command}`

{results['prompts']} held-out prompts of {results['prompt_tokens']} tokens. Teacher-forced figures over the first
{results['positions']} drafted positions of each prompt's greedy continuation, T = 1; speculation: exact speculative
sampling at T = 1 over {results['new_tokens']} new tokens per prompt, plain sampling interleaved. Decode step
{results['decode_ms']:.2f} ms (CPU); reference.py's verify / decode: {ratios}.

{table(results)}

Speedup: measured here, reference.py against plain sampling, CPU seconds per token. jax_impl speedup: its on-device
loop at the same K against its own plain sampling, decode seconds per token, runs interleaved{jax_note(results)}.
H200 / M4 Max predicted: the
measured tokens per target call with each draft token costing its MAC share of a decode step and a verify costing
what the cost model says for Qwen3.5-4B (bf16, 4K context, replay; the two machines give the same ratios, both
bound by weight bytes at batch 1); it assumes a kernel as fast per multiply-add for the cut network as for the whole.
Mixer reuse's measured share includes its shadow of the exact layers (docs/self-speculative.md); its MAC share and
prediction do not. skip-blocks:0-1 is residual-reuse:2's control (the same layers left out, nothing reused).

The seed's teacher-forced vs free-running gap (greedy, {GAP_TOKENS} tokens from each prompt):

{gap_table(results)}

Single-block skips on discovery (training-file) prompts, mean JS, least damaging first: {scan}.

The seed's figures (Qwen3.5-4B and 9B on a GPU):

| experiment | seed |
|---|---|
{seed}
"""


def plot(results, path):
    plt = pyplot()
    if plt is None:
        return None
    plt.rcParams.update({"font.size": 8})
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    costs = np.linspace(0, 1, 101)
    curves = [("this CPU (reference.py, measured verify)", measured_cycle_share(results["verify_ratios"]), "tab:red",
               "-"), ("H200 (cost model, Qwen3.5-4B bf16, 4K)", datasheet_cycle_share(M.H200), "tab:green", "--"),
              ("M4 Max (the same: both bound by weight bytes at batch 1)", datasheet_cycle_share(M.M4_MAX),
               "tab:blue", ":")]
    for name, share, color, style in curves:
        needed = [breakeven_acceptance(c, share) for c in costs]
        xs = [c for c, a in zip(costs, needed) if a is not None]
        ax.plot(xs, [a for a in needed if a is not None], style, color=color, lw=1.5, label=f"break-even: {name}")
    for row in results["rows"].values():
        a = row["speculation"][1]["acceptance"]
        ax.plot([row["mac_share"], row["measured_share"]], [a, a], color="gray", lw=0.6, alpha=0.6)
        ax.plot(row["mac_share"], a, "o", mfc="none", color="black", ms=5)
        ax.plot(row["measured_share"], a, "o", color="black", ms=4)
        ax.annotate(row["label"], (row["measured_share"], a), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.plot([], [], "o", mfc="none", color="black", label="drafter at its estimated MAC share (read against the "
            "H200 and M4 Max curves)")
    ax.plot([], [], "o", color="black", label="drafter at its measured share of a decode step (against this CPU's)")
    ax.set_xlim(-0.02, max(1.0, max(r["measured_share"] for r in results["rows"].values()) + 0.05))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft cost per token (share of a target decode step)")
    ax.set_ylabel("acceptance per draft token (exact speculative sampling, T = 1, K = 1)")
    ax.set_title("Drafters of the default model: acceptance against cost\nabove a curve a drafter pays on that "
                 f"machine (best K <= {KS[-1]}, drafts accepted independently)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------------------
# Command line

def prompts_of(texts, tokenizer, count, length):
    """The first `length` tokens of the first `count` texts long enough for them."""
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text).ids[:length]
        if len(ids) == length:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def write_shortlists(params, cfg, tokenizer, train, sizes, out):
    """mtp-shortlist files: the most frequent tokens of training files' text (the first 200 files), at each size."""
    tokens = [e.ids for e in tokenizer.encode_batch(train[:200])]
    paths = []
    for size in sizes:
        path = out / f"shortlist-{size}.json"
        path.write_text(json.dumps({"ids": R.build_shortlist(tokens, size),
                                    "source": "the most frequent tokens of the first 200 training files"}))
        paths.append(path)
    return paths


def parse_args(argv):
    ap = R.OneLineParser(prog="python -m bench.drafter_lab", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per speculative run (default 32)")
    ap.add_argument("--positions", type=int, default=16, help="teacher-forced positions per prompt (default 16)")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved repeats of the timed steps (default 15)")
    ap.add_argument("--shortlists", type=int, nargs="+", default=[256, 1024], help="shortlist sizes (default 256 1024)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu",
                    help="where drafter_lab.md, drafter_lab.json and the shortlist files go")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "drafter_lab.png")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--jax-only", action="store_true",
                    help="measure only the jax_impl column, into --out's drafter_lab.json and .md (the other columns "
                         "as they were measured)")
    args = ap.parse_args(argv)
    for flag, value in (("--prompts", args.prompts), ("--prompt-len", args.prompt_len),
                        ("--new-tokens", args.new_tokens), ("--positions", args.positions), ("--repeats", args.repeats)):
        if value < 1:
            raise R.UserError(f"{flag} {value}: must be >= 1")
    if args.positions < GAP_TOKENS:
        raise R.UserError(f"--positions {args.positions}: must be >= {GAP_TOKENS} (the seed's gap drafts {GAP_TOKENS})")
    return args


def run(args, argv):
    try:
        from weights.train import corpus    # the held-out split (train.py needs the `jax` extra)
    except ModuleNotFoundError as e:
        raise R.missing_extra(e, "jax", "python -m bench.drafter_lab") from None
    started = time.perf_counter()
    model = ROOT / "weights" / "default"
    cfg, params = R.load_model(model)
    cfg = replace(cfg, eos_token_id=())                 # full-length runs
    tokenizer = R.load_tokenizer(model)
    train, held_out, _ = corpus()
    prompts = prompts_of(held_out, tokenizer, args.prompts, args.prompt_len)
    discovery = prompts_of(train, tokenizer, max(4, args.prompts // 2), args.prompt_len)
    args.out.mkdir(parents=True, exist_ok=True)
    shortlists = write_shortlists(params, cfg, tokenizer, train, args.shortlists, args.out)
    command = ("OPENBLAS_NUM_THREADS=1 python -m bench.drafter_lab " + " ".join(argv)).strip()
    if args.jax_only:
        results = json.loads((args.out / "drafter_lab.json").read_text())
        prompts = prompts_of(held_out, tokenizer, results["prompts"], results["prompt_tokens"])
        specs = [spec.replace("mtp-shortlist:", f"mtp-shortlist:{ROOT}/") if spec.startswith("mtp-shortlist:")
                 else spec for spec in results["rows"]]
        jax_column(params, cfg, results["rows"], specs, prompts, results["new_tokens"], args.repeats)
        results["jax_command"] = command
    else:
        results = lab(params, cfg, prompts, discovery, shortlists, args.new_tokens, args.positions, args.repeats)
        results["command"], results["seconds"] = command, time.perf_counter() - started
    text = report(results, results["command"])
    print(text)
    (args.out / "drafter_lab.md").write_text(text)
    for path in [args.out / "drafter_lab.json"] + ([args.json] if args.json else []):
        path.write_text(json.dumps(results, indent=1) + "\n")
    made = plot(results, args.plot)
    log(f"wrote {args.out / 'drafter_lab.md'}, {args.out / 'drafter_lab.json'}" + (f", {made}" if made else "")
        + f" in {results['seconds']:.0f} s")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return R.exit_code(lambda: run(parse_args(argv), argv))


if __name__ == "__main__":
    sys.exit(main())
