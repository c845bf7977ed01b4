"""jax_impl's speed, measured side by side in one run on the embedded default model and the ~30M-parameter random
checkpoint (bench/checkpoints.py), batch 1, fp32, greedy, a 64-token prompt that invites copying, 128 new tokens:

    python bench/jax_speed.py [--models default 30m] [--repeats 3]

1. plain decode: tok/s of reference.py, jax_impl, llama.cpp and transformers, and the memory-bandwidth roofline
   (weight bytes read per token / this machine's measured GEMV bandwidth);
2. speculative decoding in jax_impl per drafter and rollback: wall-clock speedup over its own plain decode (decode
   phase: prefill excluded from both), tokens per target call, exactness;
3. rollback: a replay or per-position commit as a share of one verify step.
Every figure is the best of --repeats runs (the reference's and transformers' of one), all in this one process.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_impl  # noqa: E402
import reference as R  # noqa: E402
from bench.checkpoints import checkpoint, copy_prompt  # noqa: E402
from bench.engines import ENGINES, jax_engine  # noqa: E402

SLOW = {"reference", "transformers"}    # measured once: they take seconds per run


def log(message):
    print(message, file=sys.stderr, flush=True)


def best_of(repeats, run):
    return min((run() for _ in range(repeats)), key=lambda r: r.decode_s)


def gemv_bandwidth(repeats=20):
    """Bytes per second of an fp32 matrix-vector product streaming a 256 MiB matrix (numpy, all cores)."""
    W, x = np.ones((8192, 8192), np.float32), np.ones(8192, np.float32)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        W @ x
        seconds.append(time.perf_counter() - start)
    return W.nbytes / min(seconds)


def weight_bytes_per_token(cfg):
    """Every matrix is read once per decoded token; of the embedding only one row, but a tied lm_head reads it all."""
    shapes = R.checkpoint_shapes(cfg, with_mtp=False)
    return 4 * sum(int(np.prod(s)) for name, s in shapes.items() if name != "model.embed_tokens.weight")


def plain_decode(model_dir, prompt, new_tokens, repeats, bandwidth):
    cfg = R.load_config(model_dir)
    roofline = bandwidth / weight_bytes_per_token(cfg)
    print(f"\n== plain decode ({weight_bytes_per_token(cfg) / 2**20:.0f} MiB of weights per token; "
          f"roofline {roofline:.0f} tok/s at {bandwidth / 1e9:.1f} GB/s)")
    runs = {}
    for name, engine in ENGINES.items():
        log(f"  {name} ...")
        try:
            runs[name] = best_of(1 if name in SLOW else repeats, lambda: engine(model_dir, prompt, new_tokens))
        except Exception as e:  # a peer that cannot run this checkpoint loses its column, not the benchmark
            print(f"{name:>14}: failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            continue
        r = runs[name]
        same = "same tokens as reference" if r.tokens == runs["reference"].tokens else "TOKENS DIFFER from reference"
        compile_s = f", compile {r.compile_s:.1f} s" if r.compile_s else ""
        print(f"{name:>14}: {r.decode_tok_s:8.1f} tok/s ({r.decode_tok_s / roofline:4.0%} of roofline), prefill "
              f"{r.prefill_s * 1e3:7.1f} ms{compile_s}; {same}", flush=True)
    for peer in ("reference", "llama.cpp", "transformers"):
        if peer in runs:
            print(f"{'jax / ' + peer:>24}: {runs['jax'].decode_tok_s / runs[peer].decode_tok_s:.2f}x")
    return runs["jax"]


def speculative(model_dir, prompt, new_tokens, repeats, plain, draft_len):
    print(f"\n== speculative decoding in jax_impl (greedy, K={draft_len}), speedup over its plain decode")
    for draft in ("ngram", "mtp"):
        for rollback in R.ROLLBACK_STRATEGIES:
            log(f"  {draft} / {rollback} ...")
            spec = dict(draft=draft, draft_len=draft_len, rollback=rollback)
            r = best_of(repeats, lambda: jax_engine(model_dir, prompt, new_tokens, **spec))
            stats = r.stats
            print(f"{draft:>6} {rollback:>12}: {plain.decode_s / r.decode_s:5.2f}x ({r.decode_tok_s:7.1f} tok/s; "
                  f"accepted {stats['accepted']}/{stats['proposed']}, {stats['tokens_per_call']:.2f} tokens/call); "
                  f"{'exact' if r.tokens == plain.tokens else 'TOKENS DIFFER from plain'}", flush=True)


def rollback_costs(model_dir, prompt, K, repeats):
    """Seconds of a verify step (K+1 tokens) and of each rollback strategy, jit-compiled apart; keep n = K // 2 + 1."""
    cfg, params = jax_impl.load(model_dir)
    state = jax_impl.empty_state(cfg, len(prompt) + 2 * (K + 1))
    _, _, state, _ = jax_impl.prefill(params, cfg, jnp.asarray(prompt), state)
    tokens, n = jnp.asarray(prompt[:K + 1]), jnp.int32(K // 2 + 1)

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        seconds = []
        for _ in range(repeats * 10):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            seconds.append(time.perf_counter() - start)
        return min(seconds)
    print(f"\n== rollback (K={K}, keep {K // 2 + 1} of {K + 1} verified positions)")
    for strategy in R.ROLLBACK_STRATEGIES:
        verified = jax_impl.verify(params, cfg, tokens, state, strategy)
        verify_s = timed(jax_impl.verify, params, cfg, tokens, state, strategy)
        rollback_s = timed(jax_impl.rollback, strategy, state, verified[2], verified[3], n)
        print(f"{strategy:>14}: verify {verify_s * 1e3:6.2f} ms, rollback {rollback_s * 1e3:6.3f} ms "
              f"= {rollback_s / verify_s:5.1%} of verify", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "30m"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    bandwidth = gemv_bandwidth()
    for name in args.models:
        model_dir = ROOT / "weights" / "default" if name == "default" else checkpoint(name)
        cfg = R.load_config(model_dir)
        prompt = copy_prompt(args.prompt_len, cfg.vocab_size)
        print(f"\n#### {name} ({model_dir}): {jax.devices()[0].device_kind}, prompt {len(prompt)} tokens, "
              f"{args.new_tokens} new, greedy, fp32, batch 1")
        plain = plain_decode(model_dir, prompt, args.new_tokens, args.repeats, bandwidth)
        speculative(model_dir, prompt, args.new_tokens, args.repeats, plain, args.draft_len)
        rollback_costs(model_dir, prompt, args.draft_len, args.repeats)


if __name__ == "__main__":
    main()
