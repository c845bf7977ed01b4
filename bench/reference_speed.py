"""reference.py decode speed next to transformers', measured side by side in one run, plus the Qwen3.5-0.8B-shaped
random checkpoint (prefill 128, decode 16) on this machine.

    python -m bench.reference_speed [--skip-0.8b]

Each measurement runs in its own process (so peak memory is its own), batch 1, fp32, greedy, EOS ignored.
"""

import argparse
import json
import resource
import subprocess
import sys

import reference as R
from bench.checkpoints import checkpoint, copy_prompt, model_dir
from bench.timing import time_column

COLUMNS = ("reference", "transformers")


def child(engine, model_dir, prompt_len, new_tokens):
    """Run in a fresh process: one engine -> {prefill_s, decode_tok_s, peak_rss_gib, tokens}."""
    prompt = copy_prompt(prompt_len, min(R.load_config(model_dir).vocab_size, 256))
    run = time_column(engine, model_dir, prompt, new_tokens)
    return {"prefill_s": run.prefill_s, "decode_tok_s": run.decode_tok_s, "tokens": run.tokens,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def measure(engine, model_dir, prompt_len, new_tokens):
    code = (f"import json; from bench.reference_speed import child; "
            f"print(json.dumps(child({engine!r}, {str(model_dir)!r}, {prompt_len}, {new_tokens})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(label, model_dir, prompt_len, new_tokens):
    print(f"\n{label}: prompt {prompt_len}, {new_tokens} new tokens", flush=True)
    print(f"  {'engine':<14}{'prefill s':>10}{'decode tok/s':>14}{'peak RSS GiB':>14}")
    results = {}
    for engine in COLUMNS:
        print(f"  {engine:<14}...", end="\r", flush=True)
        r = results[engine] = measure(engine, model_dir, prompt_len, new_tokens)
        print(f"  {engine:<14}{r['prefill_s']:>10.3f}{r['decode_tok_s']:>14.1f}{r['peak_rss_gib']:>14.2f}", flush=True)
    ref, hf = results["reference"], results["transformers"]
    print(f"  reference / transformers decode speed: {ref['decode_tok_s'] / hf['decode_tok_s']:.2f}x; "
          f"same greedy tokens: {ref['tokens'] == hf['tokens']}")
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-0.8b", dest="skip_large", action="store_true", help="only the embedded default model")
    args = ap.parse_args()
    compare("embedded default model (weights/default)", model_dir("default"), 64, 128)
    if not args.skip_large:
        compare("Qwen3.5-0.8B-shaped random checkpoint (fp32, 3.2 GB)", checkpoint("0.8b"), 128, 16)


if __name__ == "__main__":
    main()
