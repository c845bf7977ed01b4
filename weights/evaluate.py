"""The model card's measured figures for a trained checkpoint, on held-out text (the files train.py holds out):

    python -m weights.evaluate weights/default [--prompts 24] [--new-tokens 96] [--json out.json]

For each held-out file a prompt is cut (its first --prompt-len tokens) and continued greedily with jax_impl:
plain decoding, the MTP head (K = 1, 2, 3), n-gram copying (K = 4), and n-gram copying backed by the seed's "free
drafts" (an offline table of the model's own greedy continuations of training-file prompts). It prints acceptance
per draft position, tokens per target call and checks that every speculative run gives plain decoding's tokens;
then three greedy continuations of fixed prompts for the card. The chance baseline of a draft is 1 / vocabulary size.
"""

import itertools
import json
import sys
from pathlib import Path

import numpy as np

import reference as R

try:             # JAX and optax (train.py, whose corpus this reads, trains with it) are the `jax` extra
    import jax_impl
    from weights.train import corpus
except ModuleNotFoundError as e:
    missing_jax = R.missing_extra(e, "jax", "python -m weights.evaluate")
else:
    missing_jax = None

CARD_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ", '    """Return the number of ']
# (drafter, K, with the free-draft table)
SETTINGS_EVALUATED = [("mtp", 1, False), ("mtp", 2, False), ("mtp", 3, False), ("ngram", 4, False), ("ngram", 4, True)]
TABLE_PROMPTS = 96


def prompts_of(texts, tokenizer, count, length):
    """The first `length` tokens of the first `count` texts long enough for them."""
    prompts = (tokenizer.encode(text).ids[:length] for text in texts)
    return list(itertools.islice((p for p in prompts if len(p) == length), count))


def free_draft_table(params, cfg, prompts, new_tokens):
    """reference.build_ngram_table over the model's greedy continuations of (training-file) prompts."""
    return R.build_ngram_table([p + jax_impl.generate(params, cfg, p, new_tokens)[0] for p in prompts])


def evaluate(model_dir, prompts, table_prompts, new_tokens):
    cfg, params = jax_impl.load(model_dir)
    cfg = R.replace(cfg, eos_token_id=())          # measure full-length continuations
    plain = [jax_impl.generate(params, cfg, p, new_tokens)[0] for p in prompts]
    table = free_draft_table(params, cfg, table_prompts, new_tokens)
    results = {}
    for draft, K, with_table in SETTINGS_EVALUATED:
        label = f"{draft}{' + free-draft table' if with_table else ''} K={K}"
        totals = {"proposed": 0, "accepted": 0, "target_calls": 0, "new_tokens": 0,
                  "accepted_by_position": np.zeros(K), "proposed_by_position": np.zeros(K), "exact": True}
        for prompt, expected in zip(prompts, plain):
            tokens, stats = jax_impl.generate(params, cfg, prompt, new_tokens, draft=draft, draft_len=K,
                                              ngram_table=table if with_table else None)
            totals["exact"] &= tokens == expected
            for key in ("proposed", "accepted", "target_calls"):
                totals[key] += stats[key]
            totals["new_tokens"] += len(tokens) - 1                   # the first token comes from the prefill
            totals["accepted_by_position"] += stats["accepted_by_position"]
            totals["proposed_by_position"] += stats["proposed_by_position"]
        by_position = totals["accepted_by_position"] / np.maximum(totals["proposed_by_position"], 1)
        results[label] = {"acceptance": totals["accepted"] / max(totals["proposed"], 1),
                                     "acceptance_by_position": by_position.round(4).tolist(),
                                     "tokens_per_call": totals["new_tokens"] / totals["target_calls"],
                                     "exact": bool(totals["exact"])}
        r = results[label]
        print(f"{label}: acceptance {r['acceptance']:.1%}, by position "
              f"{' '.join(f'{a:.0%}' for a in by_position)}, {r['tokens_per_call']:.2f} tokens per target call, "
              f"same tokens as plain decoding: {r['exact']}", flush=True)
    return results


def continuations(model_dir, tokenizer, new_tokens=48):
    cfg, params = jax_impl.load(model_dir)
    out = {}
    for text in CARD_PROMPTS:
        tokens, _ = jax_impl.generate(params, cfg, tokenizer.encode(text).ids, new_tokens)
        out[text] = tokenizer.decode(tokens)
        print(f"--- {text!r}\n{text}{out[text]}\n", flush=True)
    return out


def parse_args(argv):
    ap = R.OneLineParser(prog="python -m weights.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="a trained checkpoint directory with its tokenizer.json, e.g. "
                    "weights/default")
    ap.add_argument("--prompts", type=int, default=24, help="held-out files to cut a prompt from (default 24)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64)")
    ap.add_argument("--new-tokens", type=int, default=96, help="greedy tokens generated per prompt (default 96)")
    ap.add_argument("--json", type=Path, metavar="PATH.json", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    for flag, value in (("--prompts", args.prompts), ("--prompt-len", args.prompt_len),
                        ("--new-tokens", args.new_tokens)):
        if value < 1:
            raise R.UserError(f"{flag} {value}: must be >= 1")
    return args


def run(args):
    tokenizer = R.load_tokenizer(args.model)
    if tokenizer is None:
        raise R.UserError(f"{args.model}: no tokenizer.json (the prompts are cut from text)")
    cfg = R.load_config(args.model)
    train, held_out, _ = corpus()
    prompts = prompts_of(held_out, tokenizer, args.prompts, args.prompt_len)
    print(f"{len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each, greedy; "
          f"chance acceptance 1/{cfg.vocab_size} = {1 / cfg.vocab_size:.2%}", flush=True)
    table_prompts = prompts_of(train, tokenizer, TABLE_PROMPTS, args.prompt_len)
    results = {"speculative": evaluate(args.model, prompts, table_prompts, args.new_tokens),
               "continuations": continuations(args.model, tokenizer)}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def main(argv=None):
    def check_and_run():
        if missing_jax:
            raise missing_jax
        run(parse_args(argv))
    return R.exit_code(check_and_run)


if __name__ == "__main__":
    sys.exit(main())
