"""reference.py decode speed next to transformers', measured side by side in one run, plus the Qwen3.5-0.8B-shaped
random checkpoint (prefill 128, decode 16) on this machine.

    python bench/reference_speed.py [--skip-0.8b]

Each measurement runs in its own process (so peak memory is its own), batch 1, fp32, greedy, EOS ignored.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import reference as R  # noqa: E402
from bench.checkpoints import checkpoint  # noqa: E402


def peak_rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_reference(model_dir, prompt, new_tokens):
    cfg, params = R.load_model(model_dir)
    cfg = R.replace(cfg, eos_token_id=())
    tokens, stats = R.generate(params, cfg, prompt, new_tokens, R.Sampling(), np.random.default_rng(0))
    return tokens, stats["seconds"]["prefill"], stats["seconds"]["decode"]


def run_transformers(model_dir, prompt, new_tokens):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        start = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        prefill_done = time.perf_counter()
        while len(tokens) < new_tokens:
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        end = time.perf_counter()
    return tokens, prefill_done - start, end - prefill_done


ENGINES = {"reference": run_reference, "transformers": run_transformers}


def measure(engine, model_dir, prompt_len, new_tokens):
    """One engine in a fresh process -> {prefill_s, decode_s, decode_tok_s, peak_rss_gib, tokens}."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from bench.reference_speed import child; "
            f"print(json.dumps(child({engine!r}, {str(model_dir)!r}, {prompt_len}, {new_tokens})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(engine, model_dir, prompt_len, new_tokens):
    vocab = R.load_config(model_dir).vocab_size
    prompt = np.random.default_rng(0).integers(0, min(vocab, 256), prompt_len).tolist()
    tokens, prefill_s, decode_s = ENGINES[engine](model_dir, prompt, new_tokens)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_tok_s": (len(tokens) - 1) / decode_s,
            "peak_rss_gib": peak_rss_gib(), "tokens": tokens}


def compare(label, model_dir, prompt_len, new_tokens):
    print(f"\n{label}: prompt {prompt_len}, {new_tokens} new tokens", flush=True)
    print(f"  {'engine':<14}{'prefill s':>10}{'decode tok/s':>14}{'peak RSS GiB':>14}")
    results = {}
    for engine in ENGINES:
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
    compare("embedded default model (weights/default)", ROOT / "weights" / "default", 64, 128)
    if not args.skip_large:
        compare("Qwen3.5-0.8B-shaped random checkpoint (fp32, 3.2 GB)", checkpoint("0.8b"), 128, 16)


if __name__ == "__main__":
    main()
