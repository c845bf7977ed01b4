"""jax_impl's speed, measured side by side in one run on the embedded default model and the ~30M-parameter random
checkpoint (bench/checkpoints.py), batch 1, greedy, a 64-token prompt that invites copying, 128 new tokens:

    python -m bench.jax_speed [--models default 30m] [--repeats 3] [--dtype float32] [--engines ...]

1. plain decode: tok/s of reference.py, jax_impl, jax_impl with XLA's dot for every product (jax-xla-dot: without
   the CPU matvec kernel), llama.cpp and transformers, and the memory-bandwidth roofline (weight bytes read per
   token / this machine's measured GEMV bandwidth);
2. speculative decoding in jax_impl per drafter and rollback: wall-clock speedup over its own plain decode (decode
   phase: prefill excluded from both), tokens per target call, exactness;
3. rollback: a replay or per-position commit as a share of one verify step, both timed on device.
Every figure is the best of --repeats runs (the reference's and transformers' of one), all in this one process.
On a GPU (jax's default backend), jax_impl and transformers run there in --dtype (bf16: bf16 weights and
activations, fp32 DeltaNet state); reference.py and llama.cpp stay fp32 on the CPU. The roofline's bandwidth is
numpy's fp32 GEMV on a CPU, else XLA's.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_impl
import reference as R
from bench.checkpoints import copy_prompt, label, model_dir
from bench.timing import COLUMNS, TAKES_DTYPE, adapter, best_of, time_column
from jax_impl.model import verify_forward
from jax_impl.rollback import commit
from jax_impl.weights import DTYPES

SLOW = {"reference", "transformers"}    # measured once: they take seconds per run


def log(message):
    print(message, file=sys.stderr, flush=True)


def wall_seconds(run):
    """Seconds run() takes (it waits for its results)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def gemv_bandwidth(dtype, repeats=20):
    """Bytes per second of a matrix-vector product streaming a 256 MiB matrix of `dtype`: numpy's for fp32 on a CPU
    (all cores), else XLA's (numpy has no fast bf16)."""
    n = int((2**28 / jnp.dtype(dtype).itemsize) ** 0.5)
    if jax.default_backend() == "cpu" and dtype == "float32":
        W, x = np.ones((n, n), dtype), np.ones(n, dtype)
        product = lambda: W @ x  # noqa: E731
    else:
        W, x = jnp.ones((n, n), dtype), jnp.ones(n, dtype)
        gemv = jax.jit(jnp.matmul)
        product = lambda: jax.block_until_ready(gemv(W, x))  # noqa: E731
    product()
    return W.nbytes / min(wall_seconds(product) for _ in range(repeats))


def weight_bytes_per_token(cfg, dtype):
    """Every matrix is read once per decoded token; of the embedding only one row, but a tied lm_head reads it all."""
    shapes = R.checkpoint_shapes(cfg, with_mtp=False)
    return jnp.dtype(dtype).itemsize * sum(int(np.prod(s)) for name, s in shapes.items()
                                           if name != "model.embed_tokens.weight")


def agreement(tokens, expected, name):
    """'same tokens as NAME', or where they part (bf16 rounding can flip a near-tie argmax)."""
    if tokens == expected:
        return f"same tokens as {name}"
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
    return f"TOKENS DIFFER from {name} at token {first} of {len(expected)}"


def plain_decode(model_dir, prompt, new_tokens, repeats, bandwidth, dtype, engines):
    cfg = R.load_config(model_dir)
    weight_bytes = weight_bytes_per_token(cfg, dtype)
    roofline = bandwidth / weight_bytes
    print(f"\n== plain decode ({weight_bytes / 2**20:.0f} MiB of {dtype} weights per token; "
          f"roofline {roofline:.0f} tok/s at {bandwidth / 1e9:.1f} GB/s)")
    runs = {}
    for name in engines:
        log(f"  {name} ...")
        options = dict(dtype=dtype) if name in TAKES_DTYPE else {}
        try:
            runs[name] = time_column(name, model_dir, prompt, new_tokens, repeats=1 if name in SLOW else repeats,
                                     **options)
        except Exception as e:  # a peer that cannot run this checkpoint loses its column, not the benchmark
            if name == "jax":
                raise
            print(f"{name:>14}: failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            continue
        r = runs[name]
        same = agreement(r.tokens, runs["reference"].tokens, "reference") if "reference" in runs else ""
        compile_s = f", compile {r.compile_s:.1f} s" if r.compile_s else ""
        print(f"{name:>14}: {r.decode_tok_s:8.1f} tok/s ({r.decode_tok_s / roofline:4.0%} of roofline), prefill "
              f"{r.prefill_s * 1e3:7.1f} ms{compile_s}; {same}", flush=True)
    for peer in ("reference", "jax-xla-dot", "llama.cpp", "transformers"):
        if peer in runs:
            print(f"{'jax / ' + peer:>24}: {runs['jax'].decode_tok_s / runs[peer].decode_tok_s:.2f}x")
    return runs["jax"]


def speculative(model_dir, prompt, new_tokens, repeats, plain, draft_len, dtype):
    print(f"\n== speculative decoding in jax_impl (greedy, K={draft_len}), speedup over its plain decode")
    engine = adapter("jax", dtype)
    model = engine.load(model_dir)
    for draft in ("ngram", "mtp"):
        for rollback in R.ROLLBACK_STRATEGIES:
            log(f"  {draft} / {rollback} ...")
            spec = dict(draft=draft, draft_len=draft_len, rollback=rollback)
            r = best_of(repeats, lambda: engine.timed_greedy(model, prompt, new_tokens, **spec))
            stats = r.stats
            print(f"{draft:>6} {rollback:>12}: {plain.decode_s / r.decode_s:5.2f}x ({r.decode_tok_s:7.1f} tok/s; "
                  f"accepted {stats['accepted']}/{stats['proposed']}, {stats['tokens_per_call']:.2f} tokens/call); "
                  f"{'exact' if r.tokens == plain.tokens else agreement(r.tokens, plain.tokens, 'plain')}", flush=True)


def device_loop(step, steps):
    """step(i, carry, *args) -> carry chained `steps` times in one jit-compiled on-device loop (carry, *args) -> carry:
    the host's dispatch per step, which the on-device generate loop never pays, is left out."""
    return jax.jit(lambda carry, *args: lax.fori_loop(0, steps, lambda i, c: step(i, c, *args), carry))


def device_seconds(step, carry, *args, steps=50, repeats=3):
    """Seconds of one step(i, carry, *args) -> carry: best of `repeats` runs of device_loop, after a compiling one."""
    loop = device_loop(step, steps)
    run = lambda: jax.block_until_ready(loop(carry, *args))  # noqa: E731
    run()
    return min(wall_seconds(run) for _ in range(repeats)) / steps


def rollback_costs(model_dir, prompt, K, repeats, dtype):
    """Seconds of a verify step (K+1 tokens) and of each rollback strategy's commit, each timed on device in a loop
    whose inputs change every step (the tokens; the kept count n = 1..K), so nothing is hoisted out of it."""
    cfg, params = jax_impl.load(model_dir, dtype)
    state = jax_impl.empty_state(cfg, len(prompt) + 2 * (K + 1), params["embed_tokens"].dtype)
    _, _, state, _ = jax_impl.prefill(params, cfg, jnp.asarray(prompt), state)
    tokens = jnp.asarray(prompt[:K + 1])
    print(f"\n== rollback (K={K}, keep n = 1..{K} of {K + 1} verified positions; on device, dispatch left out)")
    for strategy in R.ROLLBACK_STRATEGIES:
        def verify_step(i, carry, params):  # carries the last outputs too, so none of them is dead code
            before, _ = carry
            logits, hidden, after, kept = verify_forward(params, cfg, (tokens + i) % cfg.vocab_size, before, strategy)
            return after._replace(length=before.length), (logits, hidden, kept)

        def rollback_step(i, before, after, kept):
            return commit(strategy, before, after, kept, 1 + i % K)._replace(length=before.length)
        logits, hidden, after, kept = jax_impl.verify(params, cfg, tokens, state, strategy)
        verify_s = device_seconds(verify_step, (state, (logits, hidden, kept)), params, repeats=repeats)
        rollback_s = device_seconds(rollback_step, state, after, kept, repeats=repeats)
        print(f"{strategy:>14}: verify {verify_s * 1e3:6.2f} ms, rollback {rollback_s * 1e3:6.3f} ms "
              f"= {rollback_s / verify_s:5.1%} of verify", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "30m"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="jax_impl's and transformers'")
    ap.add_argument("--engines", nargs="+", choices=COLUMNS, default=list(COLUMNS),
                    help="plain-decode columns (jax always runs: the speculative figures are relative to it)")
    args = ap.parse_args()
    engines = [name for name in COLUMNS if name in {*args.engines, "jax"}]
    bandwidth = gemv_bandwidth(args.dtype)
    for name in args.models:
        path = model_dir(name)
        cfg = R.load_config(path)
        prompt = copy_prompt(args.prompt_len, cfg.vocab_size)
        print(f"\n#### {name} ({label(name)}): {jax.devices()[0].device_kind}, prompt {len(prompt)} tokens, "
              f"{args.new_tokens} new, greedy, {args.dtype}, batch 1")
        plain = plain_decode(path, prompt, args.new_tokens, args.repeats, bandwidth, args.dtype, engines)
        speculative(path, prompt, args.new_tokens, args.repeats, plain, args.draft_len, args.dtype)
        rollback_costs(path, prompt, args.draft_len, args.repeats, args.dtype)


if __name__ == "__main__":
    main()
