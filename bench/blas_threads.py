"""reference.py's decode speed with one OpenBLAS thread next to one per core, in alternating runs (so that a machine
whose load changes during the run weighs on both columns alike).

    python -m bench.blas_threads [--rounds 5] [--new-tokens 128]

Each run is `python reference.py --prompt-ids ... --max-new-tokens N --json` in a fresh process on the embedded
default model, with OPENBLAS_NUM_THREADS and OMP_NUM_THREADS set to the column's count; decode tok/s is the JSON
stats' new tokens after the first over their decode seconds. Prints each round's pair, then the medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_IDS = ",".join(str(i) for i in range(1, 65))       # 64 tokens


def decode_tok_s(threads, new_tokens):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    run = subprocess.run([sys.executable, str(ROOT / "reference.py"), "--prompt-ids", PROMPT_IDS, "--max-new-tokens",
                          str(new_tokens), "--json"], env=env, capture_output=True, text=True, check=True)
    stats = json.loads(run.stdout)["stats"]
    return (stats["new_tokens"] - 1) / stats["seconds"]["decode"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating pairs of runs (default 5)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per run (default 128)")
    args = ap.parse_args()
    columns = (1, os.cpu_count())
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load average {load:.2f} at the start; decode tok/s, 64-token prompt, "
          f"{args.new_tokens} new tokens")
    print(f"{'round':<7}" + "".join(f"{f'{n} thread(s)':>14}" for n in columns), flush=True)
    results = {n: [] for n in columns}
    for r in range(args.rounds):
        for n in columns if r % 2 == 0 else columns[::-1]:   # alternate which column runs first
            results[n].append(decode_tok_s(n, args.new_tokens))
        print(f"{r + 1:<7}" + "".join(f"{results[n][-1]:>14.1f}" for n in columns), flush=True)
    print(f"{'median':<7}" + "".join(f"{statistics.median(results[n]):>14.1f}" for n in columns))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
