"""Draft trees against chains in reference.py, side by side in one run: per node budget, tokens per target call and
decode wall time of a chain of K = NODES drafts and of trees of NODES nodes, the share of rounds whose accepted path
reaches each depth, and the cost model's view (bench/costmodel.py) of what those tokens per call buy on this CPU,
an H200 and an M4 Max.

    python -m bench.tree_speed [--models default 30m] [--new-tokens 64] [--budgets 4 8 16] [--out bench/_out] [--jax]

Greedy, fp32, batch 1, replay rollback, one BLAS thread advised (OPENBLAS_NUM_THREADS=1); every run's tokens are
checked equal to plain decoding's. Drafters: the MTP head (chain: its argmax chain; tree: its top-k at each depth,
--draft mtp --tree) on the trained default model, and the context n-gram lookup (chain: prompt lookup; tree: the
continuations' trie, --draft ngram --tree) on both models (the 30M checkpoint is random: its MTP head drafts nothing
useful). Speedup = plain decode CPU seconds / speculative decode CPU seconds (each run's CPU time less the prefill's:
on the shared 2 cores wall times of one run vary 2-4x, CPU times ~10-20%; the least of 2 runs). Writes tree_speed.json and tree_speed.png
(matplotlib) to --out. --jax adds jax_impl's column for every row (its chains and both tree drafters run on
device): its tokens per call and its speedup over its own plain decoding (jax_impl.generate's decode seconds, compile
apart, the least of 2 runs), its tokens checked equal to plain decoding's too.

The cost model's view (bench/costmodel.py tree_speedup): predicted speedup = tokens per call x decode seconds /
(draft + verify over NODES + 1 tokens + commit), with the tokens per call measured here. Verifying a tree costs what
verifying a chain of as many nodes does; the MTP head drafts DEPTH steps for either. This CPU: the model's own pass
seconds over 1 and NODES + 1 tokens and its MTP head step, measured here (CPU seconds); an H200 and an M4 Max: their
datasheet rooflines on Qwen3.5-27B, bf16, 4096 tokens of context, at batch 1 and (H200) 16 sequences a pass."""

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import reference as R
from bench import costmodel as M
from bench import measure
from bench.checkpoints import checkpoint, model_dir
from bench.spec_speed import PROMPT
from weights.plots import pyplot

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"default": (lambda: model_dir("default"), ("mtp", "ngram")), "30m": (lambda: checkpoint("30m"), ("ngram",))}
PUBLISHED = "27B"
DATASHEET = (("H200 27B", M.Setting(M.H200, M.BF16)), ("H200 27B B=16", M.Setting(M.H200, M.BF16, batch=16)),
             ("M4 Max 27B", M.Setting(M.M4_MAX, M.BF16)))


def tree_budgets(nodes):
    """The trees compared with the chain of K = nodes: the same node budget, as deep as the chain or shallower."""
    shapes = [(nodes, nodes, 2), (nodes, nodes, 4), (nodes, max(nodes // 2, 1), 2), (nodes, max(nodes // 4, 1), 4)]
    return [R.TreeBudget(*shape) for shape in dict.fromkeys(shapes)]


def reached(depths, most):
    """Share of rounds whose accepted path reached depth d, d = 1 .. most."""
    return [sum(a >= d for a in depths) / max(len(depths), 1) for d in range(1, most + 1)]


def chain_depths(stats):
    """A greedy chain's accepted depth of every round is its accepted prefix: reached(d) from accepted_by_position."""
    rounds = stats["target_calls"]
    return [a / max(rounds, 1) for a in stats["accepted_by_position"]]


def chain_widths(stats):
    """Drafts of every round of a chain run (a drafter may propose fewer than K: prompt lookup without a match
    proposes none), from proposed_by_position: the rounds that proposed at least i + 1 drafts."""
    at_least = [stats["target_calls"], *stats["proposed_by_position"], 0]
    return [w for w in range(len(at_least) - 1) for _ in range(at_least[w] - at_least[w + 1])]


REPEATS = 2                       # runs of each configuration; the least CPU time counts


def cpu_timed(generate):
    """(tokens, stats, CPU seconds) of a run: the least of REPEATS (the tokens are the same every time)."""
    times = []
    for _ in range(REPEATS):
        start = time.process_time()
        tokens, stats = generate()
        times.append(time.process_time() - start)
    return tokens, stats, min(times)


def run_plain(params, cfg, prompt, n):
    return cpu_timed(lambda: R.generate(params, cfg, prompt, n, R.Sampling(), np.random.default_rng(0)))


def run_chain(params, cfg, prompt, n, drafter, K):
    tokens, stats, seconds = cpu_timed(lambda: R.generate_speculative(
        params, cfg, prompt, n, R.Sampling(), np.random.default_rng(0), R.make_drafter(drafter, params, cfg), K,
        "replay"))
    return tokens, {**stats, "drafted_nodes": chain_widths(stats)}, seconds, chain_depths(stats)


def run_tree(params, cfg, prompt, n, drafter, budget):
    tokens, stats, seconds = cpu_timed(lambda: R.generate_tree_speculative(
        params, cfg, prompt, n, R.Sampling(), np.random.default_rng(0), R.TREE_DRAFTERS[drafter](params, cfg), budget,
        "replay"))
    return tokens, stats, seconds, reached(stats["accepted_depths"], budget.depth)


def jax_decode_seconds(generate):
    """(tokens, stats, decode seconds) of a jax_impl.generate run, the least of REPEATS (compile apart)."""
    runs = [generate() for _ in range(REPEATS)]
    return runs[0][0], runs[0][1], min(stats["seconds"]["decode"] for _, stats in runs)


def jax_columns(folder, cfg, prompt, new_tokens, rows):
    """jax_impl's tokens per call and speedup for every row (chain: draft_len = NODES; tree: tree=budget)."""
    import jax_impl
    _, params = jax_impl.load(folder)
    plain, _, plain_s = jax_decode_seconds(lambda: jax_impl.generate(params, cfg, prompt, new_tokens))
    for row in rows:
        tree = None if row["kind"] == "chain" else R.TreeBudget(row["nodes"], row["depth"], row["branch"])
        tokens, stats, seconds = jax_decode_seconds(lambda: jax_impl.generate(
            params, cfg, prompt, new_tokens, draft=row["drafter"], draft_len=row["nodes"], tree=tree))
        row.update(jax_tokens_per_call=stats["tokens_per_call"], jax_speedup=plain_s / seconds,
                   jax_exact=tokens == plain)
        shape = f"chain K={row['nodes']}" if tree is None else f"tree {tree.nodes}:{tree.depth}:{tree.branch}"
        print(f"  jax_impl {row['drafter']:<6}{shape:<18}{row['jax_tokens_per_call']:>10.2f}"
              f"{row['jax_speedup']:>8.2f}x  {row['jax_exact']}", flush=True)


def pass_costs(params, cfg, prompt, budgets):
    """This CPU's seconds of a target pass over T = 1 .. max NODES + 1 tokens after the prompt, and of one MTP head step
    (CPU seconds, median of a few runs): what the cost model's round arithmetic takes for this machine."""
    _, hidden, state, _ = R.forward(params, cfg, prompt, R.empty_state(cfg))
    forward = tuple((T, measure.cpu_seconds(lambda T=T: R.forward(params, cfg, prompt[:T], state), 3))
                    for T in range(1, max(budgets) + 2))
    head = R.mtp_drafter(params, cfg).initial_state
    _, _, head = R.mtp_forward(params, cfg, prompt[1:], hidden[:-1], head)
    step = measure.cpu_seconds(lambda: R.mtp_forward(params, cfg, prompt[-1:], hidden[-1:], head), 3)
    return forward, step


def bench_model(name, new_tokens, budgets, with_jax=False):
    folder, drafters = MODELS[name]
    folder = folder()
    cfg, params = R.load_model(folder)
    cfg = R.replace(cfg, eos_token_id=())            # full-length runs: never stop early
    prompt = R.load_tokenizer(folder).encode(PROMPT).ids
    prefill_s = run_plain(params, cfg, prompt, 1)[2]            # the prompt's pass and the first token
    plain, _, plain_s = run_plain(params, cfg, prompt, new_tokens)
    plain_s -= prefill_s
    costs = pass_costs(params, cfg, prompt, budgets)
    print(f"\n{name}: prompt {len(prompt)} tokens, {new_tokens} new; plain decode {len(plain) / plain_s:.1f} tok/s "
          f"(CPU time); pass over T tokens: " + ", ".join(f"T={T} {s * 1e3:.1f} ms" for T, s in costs[0]
                                                          if T in (1, *(n + 1 for n in budgets)))
          + f"; MTP head step {costs[1] * 1e3:.1f} ms")
    print(f"  {'drafter':<8}{'shape':<18}{'nodes':>6}{'tok/call':>10}{'speedup':>9}  exact  reached depth 1, 2, ...")
    rows = []
    for drafter in drafters:
        for nodes in budgets:
            runs = [("chain", R.TreeBudget(nodes, nodes, 1), run_chain(params, cfg, prompt, new_tokens, drafter, nodes))]
            runs += [("tree", b, run_tree(params, cfg, prompt, new_tokens, drafter, b)) for b in tree_budgets(nodes)]
            for kind, budget, (tokens, stats, seconds, depths) in runs:
                row = {"model": name, "drafter": drafter, "kind": kind, "nodes": budget.nodes, "depth": budget.depth,
                       "branch": budget.branch, "tokens_per_call": stats["tokens_per_call"],
                       "target_calls": stats["target_calls"], "drafted_nodes": stats["drafted_nodes"],
                       "speedup": plain_s / (seconds - prefill_s),
                       "reached": depths, "exact": tokens == plain}
                rows.append(row)
                shape = f"chain K={nodes}" if kind == "chain" else f"tree {budget.nodes}:{budget.depth}:{budget.branch}"
                print(f"  {drafter:<8}{shape:<18}{nodes:>6}{row['tokens_per_call']:>10.2f}{row['speedup']:>8.2f}x  "
                      f"{str(row['exact']):<5}  {', '.join(f'{r:.2f}' for r in depths[:8])}", flush=True)
    if with_jax:
        jax_columns(folder, cfg, prompt, new_tokens, rows)
    return rows, cfg, costs


def predicted(rows, cfgs, costs):
    """The cost model's speedup for each measured row, from its tokens per call, node budget and drafter: this CPU
    (the row's own model: measured pass and head-step seconds as the cost model's fixed costs, no roofline) and the
    datasheet hardware (Qwen3.5-27B, bf16)."""
    out = []
    for row in rows:
        depth = row["nodes"] if row["kind"] == "chain" else row["depth"]
        forward, step = costs[row["model"]]
        mtp = row["drafter"] == "mtp"
        cpu = M.Setting(measure.NO_ROOFLINE, M.FP32, overhead=M.Overhead(forward=forward, round=depth * step * mtp))
        where = [("this CPU", cfgs[row["model"]], cpu)]
        where += [(label, M.published_config(PUBLISHED), replace(s, drafter="mtp" if mtp else "free"))
                  for label, s in DATASHEET]
        out.append({**row, "predicted": {label: round_speedup(cfg, row, depth, s) for label, cfg, s in where}})
    return out


def round_speedup(cfg, row, depth, s):
    """tree_speedup over the run's rounds as they were: each verified its own number of drafted nodes (a drafter
    may draft fewer than the budget), the MTP head drafting DEPTH steps in every one."""
    cycles = [M.tree_cycle_seconds(cfg, nodes, depth, row["tokens_per_call"], "replay", s)
              for nodes in row["drafted_nodes"]]
    return row["tokens_per_call"] * M.decode_seconds(cfg, s) / float(np.mean(cycles))


def print_predictions(rows):
    labels = list(rows[0]["predicted"])
    print("\npredicted speedup (cost model, measured tokens per call):")
    print(f"  {'model':<8}{'drafter':<8}{'shape':<16}" + "".join(f"{label:>16}" for label in labels))
    for r in rows:
        shape = f"chain K={r['nodes']}" if r["kind"] == "chain" else f"tree {r['nodes']}:{r['depth']}:{r['branch']}"
        print(f"  {r['model']:<8}{r['drafter']:<8}{shape:<16}" + "".join(f"{r['predicted'][label]:>15.2f}x"
                                                                          for label in labels))


def best(rows, model, drafter, kind, key):
    group = [r for r in rows if r["model"] == model and r["drafter"] == drafter and r["kind"] == kind]
    return max(group, key=key) if group else None


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    groups = list(dict.fromkeys((r["model"], r["drafter"]) for r in rows))
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 3.6 * len(groups)), squeeze=False)
    for (model, drafter), (tpc, speed, depth) in zip(groups, axes):
        group = [r for r in rows if r["model"] == model and r["drafter"] == drafter]
        labels = [f"K={r['nodes']}" if r["kind"] == "chain" else f"{r['nodes']}:{r['depth']}:{r['branch']}"
                  for r in group]
        colors = ["tab:gray" if r["kind"] == "chain" else "tab:blue" for r in group]
        tpc.bar(labels, [r["tokens_per_call"] for r in group], color=colors)
        tpc.set_ylabel("tokens per target call")
        speed.bar(labels, [r["speedup"] for r in group], color=colors, label="measured (this CPU)")
        for label, marker in (("this CPU", "o"), ("H200 27B", "^"), ("H200 27B B=16", "v"), ("M4 Max 27B", "s")):
            speed.plot(labels, [r["predicted"][label] for r in group], marker, color="black", ms=4,
                       label=f"predicted, {label}", fillstyle="none")
        speed.axhline(1.0, color="gray", lw=1)
        speed.set_ylabel("speedup over plain decoding")
        for axis in (tpc, speed):
            axis.tick_params(axis="x", labelsize=7, rotation=60)
            axis.set_title(f"{model}, {drafter} (gray: chains K = nodes, blue: trees nodes:depth:branch)", fontsize=8)
        speed.legend(fontsize=6)
        for kind, style in (("chain", "--"), ("tree", "-")):
            r = best(rows, model, drafter, kind, key=lambda r: r["tokens_per_call"])
            if r:
                name = f"chain K={r['nodes']}" if kind == "chain" else f"tree {r['nodes']}:{r['depth']}:{r['branch']}"
                depth.plot(range(1, len(r["reached"]) + 1), r["reached"], style, marker="o", ms=3, label=name)
        depth.set_xlabel("depth")
        depth.set_ylabel("share of rounds reaching it")
        depth.set_title(f"{model}, {drafter}: acceptance by depth (the most tokens per call)", fontsize=8)
        depth.legend(fontsize=7)
    fig.suptitle("reference.py: draft trees vs chains at the same node budget (greedy, fp32, replay rollback)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budgets", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "_out")
    ap.add_argument("--jax", action="store_true", help="add jax_impl's column for every row")
    args = ap.parse_args()
    rows, cfgs, costs = [], {}, {}
    for name in args.models:
        model_rows, cfgs[name], costs[name] = bench_model(name, args.new_tokens, args.budgets, args.jax)
        rows += model_rows
    rows = predicted(rows, cfgs, costs)
    print_predictions(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tree_speed.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "tree_speed.png")
    if not all(r["exact"] and r.get("jax_exact", True) for r in rows):
        raise SystemExit("a speculative run's tokens differ from plain decoding's")


if __name__ == "__main__":
    main()
