"""The trained DFlash drafter against the MTP head and n-gram copying, side by side in reference.py: tokens per target
call and acceptance by draft position at blocks of 4, 8 and 16 (K = 3, 7, 15 drafts), greedy and sampled, and the
wall-clock speedup over plain decoding measured in the same run.

    python -m bench.dflash_speed [--prompts 8] [--new-tokens 64] [--temperature 0.8] [--out bench/_out]
        [--engine reference|jax_impl|both]

Prompts: the first --prompt-len tokens of the held-out files of weights/default's corpus (weights.evaluate's), none
of which the drafter was trained on. fp32, batch 1, replay rollback. Greedy runs are checked equal to plain
decoding's tokens. Sampled runs use each run's own seed for plain and speculative decoding (their tokens differ: the
same distribution, other draws). Speedup = plain decode seconds / speculative decode seconds over all prompts,
prefill excluded. Writes dflash_speed.json and, with matplotlib, dflash_speed.png. --engine jax_impl (or both) gives the
greedy table in jax_impl (fp32, one request, jax_impl.generate's decode seconds: compilation and the prefill
excluded), its rows marked "engine": "jax_impl".
"""

import argparse
import json
from pathlib import Path

import numpy as np

import reference as R
from weights.evaluate import prompts_of
from weights.plots import pyplot
from weights.train import corpus

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFTER = ROOT / "weights" / "default", ROOT / "weights" / "default-dflash"
BLOCKS = (4, 8, 16)                 # block = the last committed token + K drafts


def drafters(dflash_dir, temperature):
    """(label, --draft spec) compared at each K; under sampling, DFlash both ways (argmax with a one-hot q, and each
    slot drawn from the drafter's distribution)."""
    specs = [("dflash", f"dflash:{dflash_dir}"), ("mtp", "mtp"), ("ngram", "ngram")]
    return specs + ([("dflash-sampled", f"dflash-sampled:{dflash_dir}")] if temperature else [])


def decode_seconds(stats):
    return stats["seconds"]["total"] - stats["seconds"]["prefill"]


def run_all(params, cfg, prompts, new_tokens, sampling, drafter=None, K=0):
    """Every prompt once (seed = its index) -> (token lists, summed stats)."""
    outputs, total = [], {"target_calls": 0, "new_tokens": 0, "accepted": 0, "proposed": 0, "seconds": 0.0,
                          "accepted_by_position": np.zeros(K), "proposed_by_position": np.zeros(K)}
    for i, prompt in enumerate(prompts):
        rng = np.random.default_rng(i)
        if drafter is None:
            tokens, stats = R.generate(params, cfg, prompt, new_tokens, sampling, rng)
        else:
            tokens, stats = R.generate_speculative(params, cfg, prompt, new_tokens, sampling, rng, drafter, K, "replay")
            for key in ("accepted", "proposed", "accepted_by_position", "proposed_by_position"):
                total[key] += np.asarray(stats[key]) if "position" in key else stats[key]
        outputs.append(tokens)
        total["target_calls"] += stats["target_calls"]
        total["new_tokens"] += len(tokens) - 1          # the first token comes from the prefill
        total["seconds"] += decode_seconds(stats)
    return outputs, total


def bench(prompts, new_tokens, temperature, dflash_dir=DRAFTER):
    cfg, params = R.load_model(TARGET)
    cfg = R.replace(cfg, eos_token_id=())            # full-length runs: never stop early
    rows = []
    for mode, sampling in (("greedy", R.Sampling()), (f"T={temperature:g}", R.Sampling(temperature))):
        plain, plain_total = run_all(params, cfg, prompts, new_tokens, sampling)
        print(f"\n{mode}: {len(prompts)} prompts x {new_tokens} tokens; plain decode "
              f"{plain_total['new_tokens'] / plain_total['seconds']:.1f} tok/s", flush=True)
        print(f"  {'drafter':<16}{'block':>6}{'tok/call':>10}{'accept':>8}{'speedup':>9}  exact  by position")
        for label, spec in drafters(dflash_dir, sampling.temperature):
            drafter = R.make_drafter(spec, params, cfg)
            for block in BLOCKS:
                tokens, total = run_all(params, cfg, prompts, new_tokens, sampling, drafter, block - 1)
                by_position = total["accepted_by_position"] / np.maximum(total["proposed_by_position"], 1)
                row = {"mode": mode, "temperature": sampling.temperature, "drafter": label, "block": block,
                       "K": block - 1, "tokens_per_call": total["new_tokens"] / total["target_calls"],
                       "acceptance": total["accepted"] / max(total["proposed"], 1),
                       "accepted_by_position": by_position.round(4).tolist(),
                       "speedup": plain_total["seconds"] / total["seconds"],
                       "exact": tokens == plain if not sampling.temperature else None}
                rows.append(row)
                print(f"  {label:<16}{block:>6}{row['tokens_per_call']:>10.2f}{row['acceptance']:>8.0%}"
                      f"{row['speedup']:>8.2f}x  {str(row['exact']):<5}  "
                      f"{' '.join(f'{a:.0%}' for a in by_position[:8])}{' ...' if len(by_position) > 8 else ''}",
                      flush=True)
    return rows


def bench_jax(prompts, new_tokens, dflash_dir=DRAFTER):
    """Greedy in jax_impl: tokens per target call and the decode speedup over jax_impl's plain decoding, each drafter
    at each block; every run checked equal to plain decoding's tokens."""
    import jax_impl
    cfg, params = jax_impl.load(TARGET)
    cfg = R.replace(cfg, eos_token_id=())            # full-length runs: never stop early

    def run_all(draft, K):  # -> (token lists, target calls, new tokens, decode seconds) over the prompts
        outputs, calls, new, seconds = [], 0, 0, 0.0
        for i, prompt in enumerate(prompts):
            tokens, stats = jax_impl.generate(params, cfg, prompt, new_tokens, R.Sampling(), i, draft, K)
            outputs.append(tokens)
            calls, new = calls + stats["target_calls"], new + len(tokens) - 1
            seconds += stats["seconds"]["decode"]
        return outputs, calls, new, seconds
    plain, _, plain_new, plain_seconds = run_all("none", 0)
    print(f"\njax_impl, greedy: plain decode {plain_new / plain_seconds:.1f} tok/s", flush=True)
    print(f"  {'drafter':<16}{'block':>6}{'tok/call':>10}{'speedup':>9}  exact")
    rows = []
    for label, spec in drafters(dflash_dir, 0.0):
        for block in BLOCKS:
            tokens, calls, new, seconds = run_all(spec, block - 1)
            row = {"engine": "jax_impl", "mode": "greedy", "temperature": 0.0, "drafter": label, "block": block,
                   "K": block - 1, "tokens_per_call": new / calls, "speedup": plain_seconds / seconds,
                   "exact": tokens == plain}
            rows.append(row)
            print(f"  {label:<16}{block:>6}{row['tokens_per_call']:>10.2f}{row['speedup']:>8.2f}x  {row['exact']}",
                  flush=True)
    return rows


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(15, 4.5))
    for ax, mode in zip(axes, modes):
        for label in dict.fromkeys(r["drafter"] for r in rows if r["mode"] == mode):
            mine = [r for r in rows if r["mode"] == mode and r["drafter"] == label]
            ax.plot([r["block"] for r in mine], [r["tokens_per_call"] for r in mine], marker="o", label=label)
        ax.set_xticks(BLOCKS)
        ax.set_xlabel("block (last token + K drafts)")
        ax.set_ylabel("tokens per target call")
        ax.set_title(mode)
        ax.legend(fontsize=8)
    ax = axes[-1]
    greedy = [r for r in rows if r["mode"] == modes[0]]
    labels = list(dict.fromkeys(r["drafter"] for r in greedy))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        mine = [r for r in greedy if r["drafter"] == label]
        ax.bar(np.arange(len(mine)) + i * width, [r["speedup"] for r in mine], width, label=label)
    ax.set_xticks(np.arange(len(BLOCKS)) + width * (len(labels) - 1) / 2, [f"block {b}" for b in BLOCKS])
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_ylabel("wall speedup over plain decoding (x)")
    ax.set_title(f"{modes[0]}, reference.py (NumPy, fp32)")
    ax.legend(fontsize=8)
    fig.suptitle("weights/default-dflash vs the MTP head and n-gram copying on held-out prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--drafter", type=Path, default=DRAFTER, help="the DFlash drafter (default weights/default-dflash)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "_out")
    ap.add_argument("--engine", choices=("reference", "jax_impl", "both"), default="reference",
                    help="where to measure (jax_impl: greedy only)")
    args = ap.parse_args()
    _, held_out, _ = corpus()
    prompts = prompts_of(held_out, R.load_tokenizer(TARGET), args.prompts, args.prompt_len)
    rows = [] if args.engine == "jax_impl" else bench(prompts, args.new_tokens, args.temperature, args.drafter)
    if args.engine != "reference":
        rows += bench_jax(prompts, args.new_tokens, args.drafter)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "drafter")}      # no machine paths
    (args.out / "dflash_speed.json").write_text(json.dumps({"args": settings, "rows": rows}, indent=1) + "\n")
    if args.engine != "jax_impl":
        plot([r for r in rows if "engine" not in r], args.out / "dflash_speed.png")


if __name__ == "__main__":
    main()
