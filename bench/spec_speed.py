"""Speculative decoding in reference.py: tokens per target call, acceptance by draft position and wall-clock speedup
over plain decoding per drafter, and the two rollback strategies (memory held, rollback time), measured side by side.

    python -m bench.spec_speed [--models default 30m] [--new-tokens 96] [--out bench/_out]

Greedy, fp32, batch 1; the speculative tokens are checked equal to plain decoding's. Speedup = plain decode time /
speculative decode time, prefill excluded from both. Writes spec_speed.json and, with matplotlib, spec_speed.png.
"""

import argparse
import json
from pathlib import Path

import numpy as np

import reference as R
from bench.checkpoints import checkpoint, model_dir
from weights.plots import pyplot

ROOT = Path(__file__).resolve().parent.parent

# A prompt that invites copying: code to repeat with an edit.
PROMPT = ("Repeat this code, renaming total to result:\n"
          "def total(values):\n    result = 0\n    for v in values:\n        result += v\n    return result\n\n"
          "def total(values):\n")

MODELS = {  # name -> (checkpoint dir, drafter model dir for model:DIR, or None: no smaller model shares its vocabulary)
    "default": lambda: (model_dir("default"), None),
    "30m": lambda: (checkpoint("30m"), checkpoint("30m-draft")),  # random, written on demand by bench/checkpoints.py
}


def drafter_specs(cfg, draft_dir):
    skip = f"skip:{max(cfg.num_hidden_layers // 4, 1)}"
    return [("ngram", 4), ("mtp", 2), (skip, 4)] + ([(f"model:{draft_dir}", 4)] if draft_dir else [])


def decode_seconds(stats):
    return stats["seconds"]["total"] - stats["seconds"]["prefill"]


def run(params, cfg, prompt, new_tokens, drafter=None, draft_len=0, rollback="replay"):
    rng = np.random.default_rng(0)
    if drafter is None:
        return R.generate(params, cfg, prompt, new_tokens, R.Sampling(), rng)
    return R.generate_speculative(params, cfg, prompt, new_tokens, R.Sampling(), rng, drafter, draft_len, rollback)


def bench_model(name, new_tokens):
    target_dir, draft_dir = MODELS[name]()
    cfg, params = R.load_model(target_dir)
    cfg = R.replace(cfg, eos_token_id=())            # full-length runs: never stop early
    prompt = R.load_tokenizer(target_dir).encode(PROMPT).ids
    plain, plain_stats = run(params, cfg, prompt, new_tokens)
    plain_s = decode_seconds(plain_stats)
    print(f"\n{name}: prompt {len(prompt)} tokens, {new_tokens} new; plain decode {len(plain) / plain_s:.1f} tok/s")
    print(f"  {'drafter':<16}{'K':>3}{'rollback':>14}{'tok/call':>10}{'accept':>8}{'speedup':>9}"
          f"{'rollback % verify':>19}{'MiB held':>10}  exact")
    rows = []
    for spec, K in drafter_specs(cfg, draft_dir) + [("ngram", k) for k in (1, 2, 8)]:
        drafter = R.make_drafter(spec, params, cfg)
        for rollback in R.ROLLBACK_STRATEGIES:
            tokens, stats = run(params, cfg, prompt, new_tokens, drafter, K, rollback)
            s = stats["seconds"]
            row = {"model": name, "drafter": spec.split(":")[0] if spec.startswith("model:") else spec, "K": K,
                   "rollback": rollback, "tokens_per_call": stats["tokens_per_call"],
                   "acceptance": stats["accepted"] / max(stats["proposed"], 1),
                   "accepted_by_position": [a / max(p, 1) for a, p in zip(stats["accepted_by_position"],
                                                                           stats["proposed_by_position"])],
                   "speedup": plain_s / decode_seconds(stats), "rollback_share": s["rollback"] / s["verify"],
                   "rollback_mib": stats["rollback_bytes"] / 2**20, "exact": tokens == plain}
            rows.append(row)
            print(f"  {row['drafter']:<16}{K:>3}{rollback:>14}{row['tokens_per_call']:>10.2f}{row['acceptance']:>8.0%}"
                  f"{row['speedup']:>8.2f}x{row['rollback_share']:>18.1%}{row['rollback_mib']:>10.2f}  "
                  f"{row['exact']}", flush=True)
    return rows


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for model in models:
        main = [r for r in rows if r["model"] == model and r["rollback"] == "replay" and
                (r["drafter"] != "ngram" or r["K"] == 4)]
        axes[0].bar([f"{model}\n{r['drafter']} K={r['K']}" for r in main], [r["speedup"] for r in main])
        for r in main:
            axes[1].plot(range(1, r["K"] + 1), r["accepted_by_position"], marker="o", label=f"{model} {r['drafter']}")
    axes[0].axhline(1.0, color="gray", lw=1)
    axes[0].set_ylabel("speedup over plain decoding (x)")
    axes[0].tick_params(axis="x", labelsize=7)
    axes[1].set_xlabel("draft position")
    axes[1].set_ylabel("acceptance rate (given reached)")
    axes[1].legend(fontsize=7)
    fig.suptitle("reference.py speculative decoding (greedy, fp32, replay rollback)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "_out")
    args = ap.parse_args()
    rows = [row for name in args.models for row in bench_model(name, args.new_tokens)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_speed.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "spec_speed.png")


if __name__ == "__main__":
    main()
