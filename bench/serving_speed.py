"""jax_impl serving many requests at once (jax_impl.scheduler), measured side by side in one run: tokens/s at batch
B = 1, 4, 16, 64 on the default and the ~30M-parameter checkpoints, plain batched decoding beside speculative
decoding with the n-gram and MTP drafters, and the single-request loop (jax_impl.generate) at B = 1:

    python -m bench.serving_speed [--models default 30m] [--batches 1 4 16 64] [--new-tokens 64] [--repeats 2]
                                  [--steps-per-sync 64] [--dtype float32] [--json OUT.json]

--models takes checkpoints (default, or a bench/checkpoints.py shape written into the bench cache: 30m) and
published shapes (0.8B, 9B, ...: random weights made on the device, bench/checkpoints.random_model; for a GPU).

A figure: B requests submitted at once, one per slot, each its own prompt that invites copying (bench/checkpoints.py
copy_prompt with its own seed, --prompt-len tokens), greedy, K = --draft-len, replay rollback, EOS ignored; tokens/s
= all generated tokens / wall seconds from the first submit to the last token (prefill included; compilation
excluded: a first run of each server shape compiles), best of --repeats. The server reads its results back every
--steps-per-sync steps: by default once for a request's 64 new tokens, as the single-request loop does (a server
that streams tokens, jax_impl.scheduler's default of 16, pays a millisecond or two a sync here). The single-request
column is jax_impl.generate's tokens / wall seconds of the call (after a first, compiling call) for one of the same
requests, best of a run before the batches and one after each B = 1 repeat (interleaved: this machine's speed drifts
between minutes). Decode only: the same figures with the prefill left out (the run's time less that of the same
requests at one new token, its tokens less one a request; the single column: generate's decode seconds), what
batching promises (weights read once for B rows): a batch's prefill is as compute-bound at B=1 as at B=16 on a CPU,
so it gains nothing from batching. Every batched request is checked against its own single run for the first and
last request of each figure (same tokens). Also printed: the step programs each server shape compiled, tokens per
target call, milliseconds per step, and plain decoding's step at B = 1 against the memory roofline (weight bytes per
step / the measured GEMV bandwidth); --json keeps the figures for the plot against the cost model (bench/report.py
serving_plot).
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import jax

import jax_impl
from bench.checkpoints import copy_prompt, label, model_dir, random_model
from bench.costmodel import (BF16, FP32, PUBLISHED, Setting, acceptance_of, compute_bound_batch,
                             serving_tokens_per_second)
from bench.jax_speed import agreement, gemv_bandwidth, weight_bytes_per_token
from jax_impl import batch
from jax_impl.scheduler import Server
from jax_impl.weights import DTYPES

DRAFTS = ("none", "ngram", "mtp")


def log(message):
    print(message, file=sys.stderr, flush=True)


def matmul_rates(dtype, repeats=20):
    """This machine as jax_impl multiplies: weight bytes/s of a product with `rows` activation rows (the CPU kernel up
    to matvec.MAX_ROWS rows, XLA's dot beyond; wall-clock, all cores), over matrices shaped like the 30M checkpoint's
    (12 layers' and its lm_head: 105 MiB in fp32, so that they stream from memory past a 32 MiB L3 as a decode step's
    do), and the peak FLOP/s among them -> costmodel.Hardware."""
    import jax.numpy as jnp
    import numpy as np
    from bench.costmodel import Hardware
    from jax_impl import matvec
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((512, n)), dtype) for n in (1536, 1536, 512) * 12 + (8192,)]
    params = sum(w.size for w in weights)
    product = jax.jit(lambda x, *ws: matvec.matmuls(x, *ws))
    rates = []
    for rows in ROWS:
        x = jnp.asarray(rng.standard_normal((rows, 512)), dtype)
        jax.block_until_ready(product(x, *weights))
        seconds = min(wall(lambda: jax.block_until_ready(product(x, *weights))) for _ in range(repeats))
        rates.append((rows, params * jnp.dtype(dtype).itemsize / seconds, 2 * rows * params / seconds))
    return Hardware(f"{jax.devices()[0].device_kind} (jax_impl, measured)", max(f for _, _, f in rates), rates[0][1],
                    "bench/serving_speed.py", tuple((rows, rate) for rows, rate, _ in rates))


ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 128, 320)


def wall(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def draft_len(args, draft):
    """A figure's K: --draft-len for a drafter, 0 for plain decoding."""
    return args.draft_len if draft != "none" else 0


def requests(cfg, B, prompt_len, new_tokens, draft, K):
    return [dict(prompt=copy_prompt(prompt_len, cfg.vocab_size, seed=i), max_new_tokens=new_tokens, draft=draft,
                 draft_len=K) for i in range(B)]


def served(params, cfg, B, args, draft, alongside=lambda: None):
    """(tokens/s, results, compilations, steps, seconds, decode-only tokens/s) of B requests through one server
    (compiled by a first run); alongside() runs after each repeat (the single-request loop, timed interleaved)."""
    K = draft_len(args, draft)
    batch_requests = requests(cfg, B, args.prompt_len, args.new_tokens, draft, K)
    server = Server(params, cfg, B, context=args.prompt_len + args.new_tokens, steps_per_sync=args.steps_per_sync,
                    max_draft_len=K, features=batch.Features(mtp=draft == "mtp"))
    server.generate(batch_requests[:1])               # compiles the prefill and decoding step programs
    prompts_only = [dict(r, max_new_tokens=1) for r in batch_requests]
    best, prefill = None, float("inf")
    for _ in range(args.repeats):
        start, steps = time.perf_counter(), server.steps
        results = server.generate(batch_requests)
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = seconds, results, server.steps - steps
        start = time.perf_counter()
        server.generate(prompts_only)                 # the prompts and each one's first token: the run's prefill
        prefill = min(prefill, time.perf_counter() - start)
        alongside()
    seconds, results, steps = best
    tokens = sum(len(t) for t, _ in results)
    decode = (tokens - B) / (seconds - prefill) if seconds > prefill else float("nan")
    return tokens / seconds, results, server.compilations, steps, seconds, decode


def alone(params, cfg, request):
    """(tokens, generate's stats, wall seconds of the call) of one request by the single-request loop."""
    start = time.perf_counter()
    tokens, stats = jax_impl.generate(params, cfg, request["prompt"], request["max_new_tokens"],
                                      draft=request["draft"], draft_len=request["draft_len"])
    return tokens, stats, time.perf_counter() - start


def tokens_per_call(results):
    calls = sum(stats["target_calls"] for _, stats in results)
    return sum(len(tokens) - 1 for tokens, _ in results) / calls if calls else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "30m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--drafts", nargs="+", choices=DRAFTS, default=list(DRAFTS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--steps-per-sync", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--plot", help="draw measured against predicted tokens/s here (a .png)")
    args = ap.parse_args()
    device = jax.devices()[0].device_kind
    bandwidth = gemv_bandwidth(args.dtype)
    hw = matmul_rates(args.dtype)
    print(f"{hw.name}: " + ", ".join(f"{rows} rows {rate / 1e9:.1f} GB/s" for rows, rate in hw.matmul_rates)
          + f"; peak {hw.flops / 1e9:.0f} GFLOP/s")
    figures = {"args": vars(args), "device": device, "bandwidth": bandwidth, "models": {},
               "hardware": {"flops": hw.flops, "bandwidth": hw.bandwidth, "matmul_rates": hw.matmul_rates}}
    for name in args.models:
        if name in PUBLISHED:
            cfg, params = random_model(name, args.dtype)
            source = "random weights on the device"
        else:
            cfg, params = jax_impl.load(model_dir(name), args.dtype)
            source = label(name)
        cfg = replace(cfg, eos_token_id=())         # random checkpoints: never stop early
        print(f"\n#### {name} ({source}): {device}, {args.dtype}, prompts of {args.prompt_len} tokens, "
              f"{args.new_tokens} new each, greedy, K={args.draft_len}, replay", flush=True)
        model_figures = figures["models"][name] = {}
        singles = {}                                  # draft -> [alone(...)]: the best of them counts

        def single_request(draft):
            return requests(cfg, 1, args.prompt_len, args.new_tokens, draft, draft_len(args, draft))[0]

        def time_single(draft):
            singles[draft].append(alone(params, cfg, single_request(draft)))
        for draft in args.drafts:
            alone(params, cfg, single_request(draft))  # compiles
            singles[draft] = []
            time_single(draft)
        header = f"{'drafter':>8} {'single':>8} " + " ".join(f"{'B=' + str(B):>9}" for B in args.batches)
        print(f"tokens/s (B requests at once; single: jax_impl.generate, one request)\n{header}")
        rows, single, single_decode = {}, {}, {}
        for draft in args.drafts:
            cells = []
            for B in args.batches:
                log(f"  {draft}, B={B} ...")
                tok_s, results, compilations, steps, seconds, decode = served(
                    params, cfg, B, args, draft, alongside=partial(time_single, draft) if B == 1 else lambda: None)
                batch_requests = requests(cfg, B, args.prompt_len, args.new_tokens, draft, draft_len(args, draft))
                for i in sorted({0, B - 1}):   # in bf16 rounding may part them at a near-tie; in fp32 it must not
                    same = agreement(results[i][0], alone(params, cfg, batch_requests[i])[0], "its single run")
                    if same != "same tokens as its single run":
                        if args.dtype == "float32":
                            raise SystemExit(f"{name} {draft} B={B}: request {i}: {same}")
                        print(f"({name} {draft} B={B}: request {i}: {same})")
                cells.append({"B": B, "tok_s": tok_s, "decode_tok_s": decode,
                              "tokens_per_call": tokens_per_call(results),
                              "compilations": compilations, "steps": steps, "step_ms": 1e3 * seconds / steps})
                log(f"    {tok_s:.1f} tok/s, {cells[-1]['tokens_per_call']:.2f} tokens/call, {steps} steps, "
                    f"{compilations} step programs compiled")
            rows[draft] = cells
            single[draft] = max(len(t) / wall for t, _, wall in singles[draft])
            single_decode[draft] = max((len(t) - 1) / st["seconds"]["decode"] for t, st, _ in singles[draft])
            print(f"{draft:>8} {single[draft]:8.1f} " + " ".join(f"{c['tok_s']:9.1f}" for c in cells), flush=True)
        print("decode only (the prompts' prefill and first tokens left out: the same requests at 1 new token, "
              "timed in the same repeats), tokens/s:")
        for draft, cells in rows.items():
            print(f"{draft:>8} {single_decode[draft]:8.1f} " + " ".join(f"{c['decode_tok_s']:9.1f}" for c in cells))
        print("speculative / plain at the same B: " + "; ".join(
            f"{draft}: " + ", ".join(f"B={c['B']} {c['tok_s'] / p['tok_s']:.2f}x" for c, p in zip(rows[draft],
                                                                                                 rows["none"]))
            for draft in args.drafts if draft != "none" and "none" in rows))
        if "none" in rows:
            b1 = next((c for c in rows["none"] if c["B"] == 1), None)
            print("plain decoding, batched / B=1: " + ", ".join(f"B={c['B']} {c['tok_s'] / b1['tok_s']:.2f}x"
                                                               for c in rows["none"]) if b1 else "")
            print("plain decoding, decode only, batched / B=1: " + ", ".join(
                f"B={c['B']} {c['decode_tok_s'] / b1['decode_tok_s']:.2f}x" for c in rows["none"]) if b1 else "")
            print(f"B=1 batched engine / single-request loop: {b1['tok_s'] / single['none']:.2f}x; decode only "
                  f"{b1['decode_tok_s'] / single_decode['none']:.2f}x" if b1 else "")
        print("tokens per target call: " + "; ".join(
            f"{draft} " + ", ".join(f"{c['tokens_per_call']:.2f}" for c in rows[draft]) for draft in args.drafts))
        print("step programs compiled per server shape: " + "; ".join(
            f"{draft} " + ", ".join(str(c["compilations"]) for c in rows[draft]) for draft in args.drafts))
        print("ms per step (prefill steps included): " + "; ".join(
            f"{draft} " + ", ".join(f"{c['step_ms']:.2f}" for c in rows[draft]) for draft in args.drafts))
        roofline_ms = 1e3 * weight_bytes_per_token(cfg, args.dtype) / bandwidth
        if "none" in rows and rows["none"][0]["B"] == 1:
            step = rows["none"][0]["step_ms"]
            print(f"plain decoding at B=1: {step:.3f} ms a step; the weights' memory roofline {roofline_ms:.3f} ms "
                  f"({weight_bytes_per_token(cfg, args.dtype) / 2**20:.0f} MiB at {bandwidth / 1e9:.0f} GB/s): "
                  f"{roofline_ms / step:.0%} of the roofline")
        model_figures.update(single=single, single_decode=single_decode, batched=rows, roofline_ms=roofline_ms,
                             config={k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str))})
        s = Setting(hw, FP32 if args.dtype == "float32" else BF16, context=args.prompt_len + args.new_tokens // 2)
        for draft, cells in rows.items():
            for c in cells:
                c["predicted"] = predict(cfg, s, c, args, draft)
        print("predicted tokens/s (bench/costmodel.py on this run's matmul rates, at the measured acceptance): "
              + "; ".join(f"{draft} " + ", ".join(f"{c['predicted']:.0f}" for c in rows[draft]) for draft in rows)
              + "; the matmuls turn compute-bound at B = "
              + ", ".join(f"{compute_bound_batch(cfg, T, s)} (T={T})" for T in (1, args.draft_len + 1)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if args.plot:
        from bench.report import serving_plot
        serving_plot(Path(args.plot), figures)


def predict(cfg, s, cell, args, draft):
    """Tokens/s the cost model predicts for a figure, at its measured acceptance."""
    K = draft_len(args, draft)
    a = acceptance_of(cell["tokens_per_call"], K) if K else 0.0
    return serving_tokens_per_second(cfg, replace(s, batch=cell["B"], drafter="mtp" if draft == "mtp" else "free"),
                                     K, a)


if __name__ == "__main__":
    main()
