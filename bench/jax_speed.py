"""JAX engine speed, measured side by side in one run on a ~30M-parameter random checkpoint it writes itself:

    python bench/jax_speed.py [--new-tokens 128] [--prompt-len 64] [--draft-len 4] [--out DIR]

1. plain decode, batch 1: tok/s of each engine in ENGINES (reference.py and jax_impl; add a column by adding an
   engine function there),
2. speculative decoding in jax_impl, greedy: wall-clock speedup over its own plain decode, per drafter,
3. rollback: the cost of replay and per-position rollback as a share of a verify step.
Timings on a shared machine are noisy: every figure is the best of --repeats runs, all taken in this one process.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "weights")]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_impl  # noqa: E402
import make_tiny  # noqa: E402  (random tensors drawn as for the committed tiny checkpoints)
import reference  # noqa: E402

CHANGES = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              max_position_embeddings=4096, mtp_num_hidden_layers=1)


def log(message):
    print(message, file=sys.stderr, flush=True)


def write_checkpoint(out_dir):
    """The bench model (make_tiny's BASE with CHANGES: tied embeddings, an MTP head), unless already there."""
    if not (out_dir / "model.safetensors").exists():
        make_tiny.write_random_checkpoint(out_dir, CHANGES, seed=30, options={"mtp": True}, dtype=np.float32)
    return out_dir


def copy_prompt(length, vocab, seed=0):
    """A prompt that invites copying: one random phrase of 16 tokens, repeated."""
    phrase = np.random.default_rng(seed).integers(0, vocab, 16)
    return [int(t) for t in np.resize(phrase, length)]


def best_of(repeats, fn):
    """min over runs of fn() -> (seconds, result)"""
    runs = [fn() for _ in range(repeats)]
    return min(runs, key=lambda r: r[0])


# Plain-decode engines: fn(model_dir, prompt, new_tokens, repeats) -> {"tokens", "prefill_s", "decode_s", ...}
def bench_reference(model_dir, prompt, new_tokens, repeats):
    cfg, params = reference.load_model(model_dir)

    def once():
        tokens, stats = reference.generate(params, cfg, prompt, new_tokens, reference.Sampling(), np.random.default_rng(0))
        return stats["seconds"]["decode"], (tokens, stats)
    decode_s, (tokens, stats) = best_of(max(1, repeats // 3), once)
    return {"tokens": tokens, "prefill_s": stats["seconds"]["prefill"], "decode_s": decode_s}


def bench_jax(model_dir, prompt, new_tokens, repeats, **spec):
    cfg, params = jax_impl.load(model_dir)

    def once():
        tokens, stats = jax_impl.generate(params, cfg, prompt, new_tokens, **spec)
        return stats["seconds"]["decode"], (tokens, stats)
    compile_s = once()[1][1]["seconds"]["compile"]
    decode_s, (tokens, stats) = best_of(repeats, once)
    return {"tokens": tokens, "prefill_s": stats["seconds"]["prefill"], "decode_s": decode_s, "compile_s": compile_s,
            "stats": stats}


ENGINES = {"reference": bench_reference, "jax": bench_jax}


def rollback_costs(model_dir, prompt, K, repeats):
    """Seconds of a verify step (K+1 tokens) and of each rollback strategy, jit-compiled apart; n = K // 2 + 1."""
    cfg, params = jax_impl.load(model_dir)
    state = jax_impl.empty_state(cfg, len(prompt) + 2 * (K + 1))
    _, _, state, _ = jax_impl.prefill(params, cfg, jnp.asarray(prompt), state)
    tokens, n = jnp.asarray(prompt[:K + 1]), jnp.int32(K // 2 + 1)

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        return min(_time(fn, *args) for _ in range(repeats * 10))
    out = {}
    for strategy in reference.ROLLBACK_STRATEGIES:
        verified = jax_impl.verify(params, cfg, tokens, state, strategy)
        out[strategy] = {"verify_s": timed(jax_impl.verify, params, cfg, tokens, state, strategy),
                         "rollback_s": timed(jax_impl.rollback, strategy, state, verified[2], verified[3], n)}
    return out


def _time(fn, *args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/qwen35-bench-30m"))
    args = ap.parse_args()
    log(f"writing / reusing the bench checkpoint in {args.out} ...")
    model_dir = write_checkpoint(args.out)
    cfg = reference.load_config(model_dir)
    n_params = sum(int(np.prod(s)) for name, s in reference.checkpoint_shapes(cfg, with_mtp=False).items()
                   if name != "lm_head.weight")
    prompt = copy_prompt(args.prompt_len, cfg.vocab_size)
    log(f"model: {n_params / 1e6:.1f}M parameters (tied embeddings, no MTP), {jax.devices()[0].device_kind}, "
        f"prompt {len(prompt)} tokens, {args.new_tokens} new, greedy, fp32, batch 1")

    print("\n== plain decode")
    plain = {}
    for name, engine in ENGINES.items():
        log(f"  {name} ...")
        plain[name] = engine(model_dir, prompt, args.new_tokens, args.repeats)
    for name, r in plain.items():
        same = "" if r["tokens"] == plain["reference"]["tokens"] else "  (tokens differ from reference!)"
        compile_s = f", compile {r['compile_s']:.1f} s" if "compile_s" in r else ""
        print(f"{name:>12}: {len(r['tokens']) / r['decode_s']:8.1f} tok/s decode, prefill {r['prefill_s'] * 1e3:7.1f} ms"
              f"{compile_s}{same}")
    ratio = plain["reference"]["decode_s"] / plain["jax"]["decode_s"]
    print(f"{'jax / reference':>12}: {ratio:.1f}x")

    print(f"\n== speculative decoding in jax (greedy, K={args.draft_len}), speedup over jax plain decode")
    base = plain["jax"]["decode_s"] + plain["jax"]["prefill_s"]
    for draft in ("ngram", "mtp"):
        for strategy in reference.ROLLBACK_STRATEGIES:
            log(f"  {draft} / {strategy} ...")
            r = bench_jax(model_dir, prompt, args.new_tokens, args.repeats, draft=draft, draft_len=args.draft_len,
                          rollback=strategy)
            s = r["stats"]
            same = "" if r["tokens"] == plain["jax"]["tokens"] else "  (tokens differ from plain!)"
            print(f"{draft:>6} {strategy:>12}: {base / (r['decode_s'] + r['prefill_s']):5.2f}x  "
                  f"({len(r['tokens']) / r['decode_s']:7.1f} tok/s, accepted {s['accepted']}/{s['proposed']}, "
                  f"{s['tokens_per_call']:.2f} tokens/call){same}")

    print(f"\n== rollback (K={args.draft_len}, keep {args.draft_len // 2 + 1} of {args.draft_len + 1} verified positions): "
          "a verify step keeping what the strategy needs, then the rollback step")
    log("  verify and rollback steps ...")
    costs = rollback_costs(model_dir, prompt, args.draft_len, args.repeats)
    for strategy, c in costs.items():
        print(f"{strategy:>12}: verify {c['verify_s'] * 1e3:6.2f} ms, rollback {c['rollback_s'] * 1e3:6.3f} ms "
              f"= {100 * c['rollback_s'] / c['verify_s']:4.1f}% of verify")


if __name__ == "__main__":
    main()
