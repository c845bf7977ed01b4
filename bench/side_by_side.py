"""jax_impl's speed in two source trees, measured interleaved in one run: the single-request loop
(jax_impl.generate) and the batched server at B requests (jax_impl.Server), per drafter, on one checkpoint:

    python -m bench.side_by_side BASE_TREE OURS_TREE [--model default] [--batches 1 4] [--new-tokens 64]
                                 [--repeats 5] [--drafts none ngram mtp]

Each tree runs in its own worker process (PYTHONPATH = the tree), which loads the model and compiles every probe
first; then the probes run alternately, one tree then the other (the order swapped every repeat), so that a machine
whose speed drifts between minutes (a shared one) slows both alike. A probe: greedy requests of a --prompt-len prompt
that invites copying (bench/checkpoints.py copy_prompt, one seed a request), --new-tokens each, EOS ignored, K =
--draft-len, replay rollback; tokens/s = generated tokens / wall seconds of the call (prefill included, compilation
not). Printed: each probe's median tokens/s in either tree and their ratio (ours / base), and whether the two trees
gave the same tokens. Use it before landing a change to jax_impl's loop: base = a checkout of main.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def probes(args):
    names = [f"single:{draft}" for draft in args.drafts]
    return names + [f"server{B}:{draft}" for B in args.batches for draft in args.drafts]


# ----------------------------------------------------------------------------------------------------------------
# The worker: runs in a tree, answers probe names on stdin with a JSON line each

def worker(args):
    import time
    from dataclasses import replace

    import jax_impl
    from bench.checkpoints import copy_prompt, model_dir
    from jax_impl import batch

    cfg, params = jax_impl.load(model_dir(args.model))
    cfg = replace(cfg, eos_token_id=())

    def requests(B, draft):
        return [dict(prompt=copy_prompt(args.prompt_len, cfg.vocab_size, seed=i), max_new_tokens=args.new_tokens,
                     draft=draft, draft_len=args.draft_len if draft != "none" else 0) for i in range(B)]

    servers = {}

    def run(name):  # -> (seconds, tokens of every request)
        kind, draft = name.split(":")
        if kind == "single":
            r = requests(1, draft)[0]
            start = time.perf_counter()
            tokens, _ = jax_impl.generate(params, cfg, r["prompt"], r["max_new_tokens"], draft=draft,
                                          draft_len=r["draft_len"])
            return time.perf_counter() - start, [tokens]
        B = int(kind[len("server"):])
        if name not in servers:
            K = args.draft_len if draft != "none" else 0
            servers[name] = jax_impl.Server(params, cfg, B, context=args.prompt_len + args.new_tokens,
                                            steps_per_sync=args.steps_per_sync, max_draft_len=K,
                                            features=batch.Features(mtp=draft == "mtp"))
        start = time.perf_counter()
        results = servers[name].generate(requests(B, draft))
        return time.perf_counter() - start, [tokens for tokens, _ in results]

    for name in probes(args):  # compile
        run(name)
    print(json.dumps({"ready": jax_impl.__file__}), flush=True)
    for line in sys.stdin:
        seconds, tokens = run(line.strip())
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# The parent

class Worker:
    def __init__(self, tree, argv):
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.process = subprocess.Popen([sys.executable, __file__, "--worker", *argv], cwd=tree, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(self.process.stdout.readline() or "{}")
        if "ready" not in ready:
            raise SystemExit(f"the worker in {tree} did not start")
        self.module = ready["ready"]

    def ask(self, probe):
        self.process.stdin.write(probe + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", help="BASE_TREE OURS_TREE")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--drafts", nargs="+", choices=("none", "ngram", "mtp"), default=["none", "ngram", "mtp"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--steps-per-sync", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.worker:  # this script's folder off the path: the tree's modules are the ones imported
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
        return worker(args)
    if len(args.trees) != 2 or not all((Path(t) / "jax_impl").is_dir() for t in args.trees):
        ap.error("give two source trees (each with a jax_impl/ folder): BASE_TREE OURS_TREE")
    argv = [a for a in sys.argv[1:] if a not in args.trees]
    workers = []
    for tree in args.trees:
        print(f"compiling in {tree} ...", file=sys.stderr, flush=True)
        workers.append(Worker(Path(tree).resolve(), argv))
    seconds = {(w, p): [] for w in range(2) for p in probes(args)}
    tokens = {}
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
        for probe in probes(args):
            for w in (0, 1) if repeat % 2 == 0 else (1, 0):
                out = workers[w].ask(probe)
                seconds[w, probe].append(out["seconds"])
                tokens[w, probe] = out["tokens"]
    for w in workers:
        w.close()
    print(f"tokens/s, median of {args.repeats} interleaved runs; {args.model}, prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new, greedy, K={args.draft_len}, replay, steps_per_sync={args.steps_per_sync}")
    print(f"base: {args.trees[0]}\nours: {args.trees[1]}")
    print(f"{'probe':<16} {'base':>9} {'ours':>9} {'ours/base':>10}  tokens")
    for probe in probes(args):
        B = 1 if probe.startswith("single") else int(probe.split(":")[0][len("server"):])
        rate = [B * args.new_tokens / statistics.median(seconds[w, probe]) for w in range(2)]
        same = "same" if tokens[0, probe] == tokens[1, probe] else "DIFFER"
        print(f"{probe:<16} {rate[0]:9.1f} {rate[1]:9.1f} {rate[1] / rate[0]:10.3f}  {same}")


if __name__ == "__main__":
    main()
