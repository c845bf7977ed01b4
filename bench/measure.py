"""The cost model checked on this CPU: measure the machine's roofline and the engines (reference.py, jax_impl) on the
benchmark checkpoints, predict the same figures with bench/costmodel.py, and compare.

Every measurement runs in a child process pinned to one core (BLAS single-threaded) and counts its CPU seconds, the
median of --repeats runs: on this machine's 2 cores, shared with other jobs, wall times of the same call vary 2-4x
while CPU times repeat within ~20%. CPU seconds of a process on one core are its wall seconds on an idle machine.

What is measured, per engine and checkpoint:
  decode     seconds of one forward over 1 token after a 64-token prompt
  verify(K)  seconds of one forward over K+1 tokens (the replay design's verify: the tape comes free) / decode
  spec       plain decode seconds / speculative decode seconds (each: generating N tokens less generating 1),
             n-gram drafter, K=4, replay rollback, greedy, a prompt that invites copying
What the model is given: the machine roofline (below); the engine's fixed costs per forward, per rollback call and per
speculative round, measured on a micro twin of the checkpoint (same layer pattern, every width 16-32: its roofline
time is microseconds, so its run time is interpreter and dispatch cost; measured before and after the checkpoint,
and averaged); and, for spec, the acceptance the run achieved (per round: drafts proposed, positions kept) and for
reference.py its drafter's measured seconds. It predicts everything else.
Machine roofline: GEMV bandwidth (1 activation row) and peak GEMM FLOP/s, and the weight-streaming rate of a matmul
with 2-64 rows, each over weights 3x the L3 cache, per library (numpy, XLA). `pure` predictions use the first two
only (a textbook roofline); `library` predictions add the measured curve.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import reference as R
from bench import costmodel as M
from bench.checkpoints import CACHE, copy_prompt, model_dir
from weights.make_tiny import write_random_checkpoint

ROOT = Path(__file__).resolve().parent.parent

ENGINES = ("reference", "jax")
LIBRARIES = {"reference": "numpy", "jax": "xla"}
VERIFY_KS = (1, 4, 8, 16)
SPEC_K = 4
VERIFY_KEEPS = "replay"       # the rollback strategy the verify timings run with: it keeps the tapes the pass makes anyway
PROMPT_LEN = 64
ROWS = (1, 2, 4, 8, 16, 32, 64)
MICRO = dict(hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
             vocab_size=272, max_position_embeddings=4096, mtp_num_hidden_layers=0)


def log(message):
    print(message, file=sys.stderr, flush=True)


def micro_twin(name):
    """A random checkpoint with `name`'s layer pattern and every width 16-32 (written once into the bench cache)."""
    path = CACHE / f"{name}-micro"
    if not (path / "model.safetensors").exists():
        raw = R.read_json(model_dir(name) / "config.json")
        changes = {k: v for k, v in raw.items() if k in ("num_hidden_layers", "layer_types", "full_attention_interval",
                                                           "linear_conv_kernel_dim", "tie_word_embeddings")}
        write_random_checkpoint(path, {**changes, **MICRO}, seed=0, dtype=np.float32)
    return path


def cpu_seconds(fn, repeats, budget_s=0.3):
    """Median CPU seconds of fn() after one warm-up run, over `repeats` runs, or more for a fast fn (as many as fit
    in budget_s, at most 200). CPU time of this process, pinned to one core: wall time on an idle machine, without
    the time the scheduler gives the other jobs on the 2 shared cores."""
    fn()
    runs = []
    while len(runs) < repeats or sum(runs) < budget_s and len(runs) < 200:
        start = time.process_time()
        fn()
        runs.append(time.process_time() - start)
    return float(np.median(runs))


def decode_cpu_seconds(generate, new_tokens, repeats):
    """CPU seconds of the decode loop: generate(new_tokens) less generate(1), which is the prefill and the first
    token (the engines' own phase timers count wall seconds)."""
    return cpu_seconds(lambda: generate(new_tokens), repeats) - cpu_seconds(lambda: generate(1), repeats)


# ----------------------------------------------------------------------------------------------------------------
# The machine (child process)

def library_ops(library):
    """(stream, gemm, thunk) for `library`: stream(xs, ws) multiplies each x by its w transposed, gemm(a) = a @ a,
    thunk(fn, *args) a call to time (XLA's results are waited for)."""
    if library == "xla":
        import jax
        stream = jax.jit(lambda xs, ws: [x @ w.T for x, w in zip(xs, ws)])
        return stream, jax.jit(lambda a: a @ a), lambda fn, *args: lambda: jax.block_until_ready(fn(*args))
    return (lambda xs, ws: [x @ w.T for x, w in zip(xs, ws)]), (lambda a: a @ a), lambda fn, *args: lambda: fn(*args)


def stream_rate(library, weights, rows, repeats):
    """Weight bytes per CPU second as `library` multiplies `rows` activation rows by each of `weights` in turn."""
    stream, _, thunk = library_ops(library)
    xs = [np.ones((rows, w.shape[1]), np.float32) for w in weights]
    return sum(w.size * 4 for w in weights) / cpu_seconds(thunk(stream, xs, weights), repeats)


def calibrate(library, repeats):
    """Roofline of this CPU as `library` multiplies fp32 matrices: GEMV bandwidth, peak GEMM FLOP/s, and the
    weight-streaming rate for each row count in ROWS, over 12 weight matrices of 2048 x 1024 (8 MiB; 3x the L3)."""
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((2048, 1024), dtype=np.float32) for _ in range(12)]
    square = rng.standard_normal((1024, 1024), dtype=np.float32)
    if library == "xla":
        import jax.numpy as jnp
        weights, square = [jnp.asarray(w) for w in weights], jnp.asarray(square)
    rates = []
    for rows in ROWS:
        rates.append((rows, stream_rate(library, weights, rows, repeats)))
        log(f"  {library}: {rows:2d} rows {rates[-1][1] / 1e9:6.2f} GB/s")
    _, gemm, thunk = library_ops(library)
    flops = 2 * 1024 ** 3 / cpu_seconds(thunk(gemm, square), repeats)
    return {"flops": flops, "bandwidth": rates[0][1], "matmul_rates": rates}


def weight_matrices(params):
    """The checkpoint's weight matrices a decode step multiplies by (lm_head once, no embedding table, no MTP)."""
    def leaves(tree):
        if isinstance(tree, dict):
            return [x for value in tree.values() for x in leaves(value)]
        return [x for value in tree for x in leaves(value)] if isinstance(tree, list) else [tree]
    return [w for w in leaves(params["layers"]) if w.ndim == 2 and min(w.shape) > 1] + [params["lm_head"]]


def machine(library, calibration, pure):
    rates = () if pure else tuple(tuple(r) for r in calibration["matmul_rates"])
    return M.Hardware(f"this CPU ({library})", calibration["flops"], calibration["bandwidth"],
                      "measured (bench/measure.py)", rates)


# ----------------------------------------------------------------------------------------------------------------
# The engines (child process). Each returns decode, verify {K: s}, verify_extra {design: s}, commit {design: {n: s}}
# at K = SPEC_K, and a speculative run against plain decoding; reference.py's checkpoint run also the numpy GEMV rate
# over the checkpoint's own matrices (a diagnostic of the calibration's shape).

def measure_reference(path, repeats, checkpoint, new_tokens):
    cfg, params = R.load_model(path)
    cfg = replace(cfg, eos_token_id=())                    # random weights: never stop early
    prompt = copy_prompt(PROMPT_LEN, cfg.vocab_size)
    _, _, state, _ = R.forward(params, cfg, prompt, R.empty_state(cfg))
    drafts = prompt[:max(VERIFY_KS) + 1]
    out = {"decode": cpu_seconds(lambda: R.forward(params, cfg, drafts[:1], state), repeats),
           "verify": {K: cpu_seconds(lambda: R.forward(params, cfg, drafts[:K + 1], state), repeats)
                      for K in VERIFY_KS}}
    _, _, after, tapes = R.forward(params, cfg, drafts[:SPEC_K + 1], state)
    out["verify_extra"], out["commit"] = {}, {}
    for design, strategy in R.ROLLBACK.items():                              # the verify timings keep the tapes
        if design != VERIFY_KEEPS:
            out["verify_extra"][design] = cpu_seconds(lambda: strategy.keep(state, tapes), repeats)
        kept = strategy.keep(state, tapes)
        out["commit"][design] = {n: cpu_seconds(lambda: strategy.commit(state, after, kept, n), repeats)
                                 for n in range(1, SPEC_K + 1)}
    if checkpoint:
        out["own_gemv"] = stream_rate("numpy", weight_matrices(params), 1, repeats)

    def generate(n, drafter=None):
        rng = np.random.default_rng(0)
        if drafter is None:
            return R.generate(params, cfg, prompt, n, R.Sampling(), rng)
        return R.generate_speculative(params, cfg, prompt, n, R.Sampling(), rng, drafter, SPEC_K, "replay")
    drafter = R.make_drafter("ngram", params, cfg)
    out["spec"] = {"plain_s": decode_cpu_seconds(generate, new_tokens, repeats),
                   "spec_s": decode_cpu_seconds(lambda n: generate(n, drafter), new_tokens, repeats),
                   "new_tokens": new_tokens, **reference_rounds(params, cfg, prompt, new_tokens, drafter)}
    return out


def reference_rounds(params, cfg, prompt, new_tokens, drafter):
    """One speculative run, logged: its rounds [drafts proposed, positions kept] and the drafter's CPU seconds."""
    drafted, kept, spent = [], [], []

    def propose(*args):
        start = time.process_time()
        proposal = drafter.propose(*args)
        spent.append(time.process_time() - start)
        drafted.append(len(proposal[0]))
        return proposal
    R.generate_speculative(params, cfg, prompt, new_tokens, R.Sampling(), np.random.default_rng(0),
                           drafter._replace(propose=propose), SPEC_K, "replay",
                           on_tokens=lambda new: kept.append(len(new)))
    return {"rounds": [list(r) for r in zip(drafted, kept[1:])], "draft_s": sum(spent)}   # kept[0]: after prefill


def measure_jax(path, repeats, checkpoint, new_tokens):
    import jax
    import jax_impl
    cfg, params = jax_impl.load(path)
    cfg = replace(cfg, eos_token_id=())
    prompt = copy_prompt(PROMPT_LEN, cfg.vocab_size)
    state = jax_impl.empty_state(cfg, PROMPT_LEN + max(VERIFY_KS) + 1 + 256)   # room for 200 chained decodes
    _, _, state, _ = jax_impl.prefill(params, cfg, np.asarray(prompt, np.int32), state)
    drafts = np.asarray(prompt[:max(VERIFY_KS) + 1], np.int32)
    decode_state = [jax.tree.map(lambda x: x.copy(), state)]

    def decode():  # decode donates its state: chain it
        decode_state[0] = jax.block_until_ready(jax_impl.decode(params, cfg, drafts[0], decode_state[0]))[2]

    def verify(K, design=VERIFY_KEEPS):
        return lambda: jax.block_until_ready(jax_impl.verify(params, cfg, drafts[:K + 1], state, design))
    out = {"decode": cpu_seconds(decode, repeats),
           "verify": {K: cpu_seconds(verify(K), repeats) for K in VERIFY_KS}, "verify_extra": {}, "commit": {}}
    for design in R.ROLLBACK_STRATEGIES:
        _, _, after, kept = verify(SPEC_K, design)()
        if design != VERIFY_KEEPS:                                           # what it keeps beyond the tapes
            out["verify_extra"][design] = max(cpu_seconds(verify(SPEC_K, design), repeats) - out["verify"][SPEC_K], 0)
        out["commit"][design] = {n: cpu_seconds(
            lambda: jax.block_until_ready(jax_impl.commit(design, state, after, kept, np.int32(n))), repeats)
            for n in range(1, SPEC_K + 1)}
    def generate(n, **kw):
        return jax_impl.generate(params, cfg, prompt, n, **kw)[1]
    speculative = dict(draft="ngram", draft_len=SPEC_K, rollback="replay")
    stats = generate(new_tokens, **speculative)
    at_least = [stats["target_calls"]] + stats["accepted_by_position"] + [0]      # rounds accepting >= i drafts
    out["spec"] = {"plain_s": decode_cpu_seconds(generate, new_tokens, repeats),
                   "spec_s": decode_cpu_seconds(lambda n: generate(n, **speculative), new_tokens, repeats),
                   "rounds": [[SPEC_K, i + 1] for i in range(SPEC_K + 1)           # every round verifies K+1
                              for _ in range(at_least[i] - at_least[i + 1])],
                   "draft_s": 0.0, "new_tokens": new_tokens}                      # drafting is inside the loop
    return out


MEASURE = {"reference": measure_reference, "jax": measure_jax}


def child(task):
    """Entry point of a measuring child process (task: a dict; the result is printed as one JSON line). An engine
    task measures the micro twin, the machine roofline, the checkpoint and the micro twin again, back to back, so
    that the overhead (the mean of the two micro runs) and the roofline see the contention the checkpoint saw."""
    if task["kind"] == "calibrate":
        return calibrate(task["library"], task["repeats"])
    measure, repeats, new_tokens = MEASURE[task["engine"]], task["repeats"], task["new_tokens"]
    before = measure(micro_twin(task["model"]), repeats, False, new_tokens)
    out = {"calibration": calibrate(LIBRARIES[task["engine"]], repeats),
           "checkpoint": measure(model_dir(task["model"]), repeats, True, new_tokens)}
    return {**out, "micro": mean(before, measure(micro_twin(task["model"]), repeats, False, new_tokens))}


def mean(a, b):
    """Leaf by leaf mean of the seconds of two measurements of one model (its other leaves, the same in both, kept)."""
    if isinstance(a, dict):
        return {k: mean(a[k], b[k]) for k in a}
    return (a + b) / 2 if isinstance(a, float) else a


def run_child(task):
    """child(task) in a fresh process pinned to one core, its BLAS single-threaded: its CPU seconds are then the
    engine's seconds. (XLA keeps its own threads, sharing that core: its single-thread flags deadlock jax_impl's
    0.8b prefill.)"""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    core = max(os.sched_getaffinity(0))
    code = "import json, sys; from bench.measure import child; print(json.dumps(child(json.loads(sys.argv[1]))))"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(task)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         text=True, check=True, preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    return keyed(json.loads(out.stdout.strip().splitlines()[-1]))


def calibration(library, repeats=3, fresh=False):
    """The machine roofline for `library`, measured once and cached in the bench cache folder (for predictions on
    this CPU; the measured check calibrates afresh next to each engine run)."""
    path = CACHE / f"machine-{library}.json"
    if fresh or not path.exists():
        log(f"calibrating {library} ...")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run_child({"kind": "calibrate", "library": library, "repeats": repeats})))
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------------------
# Predictions and the comparison

def keyed(table):
    """JSON turned int keys into strings: back to ints, recursively."""
    if isinstance(table, dict):
        return {int(k) if str(k).isdigit() else k: keyed(v) for k, v in table.items()}
    return table


def overheads(micro, cfg):
    """The micro twin's measured seconds (its roofline share is a few microseconds) as fixed costs -> (per call,
    inside a generation loop). Per call: per forward, per design at verify and at commit, as the checkpoint's
    decode and verify figures were timed. In a loop, jax_impl pays no Python dispatch per pass (its loop is one
    lax.while_loop): the micro twin's decode call less its in-loop step is taken off every pass and commit. A round
    also costs what the micro twin's speculative run took beyond its passes, commits and measured drafter seconds
    (drafting on device, acceptance, bookkeeping)."""
    calls = M.Overhead(forward=((1, micro["decode"]),) + tuple((K + 1, s) for K, s in micro["verify"].items()),
                       verify=tuple(micro["verify_extra"].items()),
                       commit=tuple((d, n, s) for d, table in micro["commit"].items() for n, s in table.items()))
    spec = micro["spec"]
    dispatch = max(micro["decode"] - spec["plain_s"] / (spec["new_tokens"] - 1), 0.0)
    loop = replace(calls, forward=tuple((T, max(s - dispatch, 0.0)) for T, s in calls.forward),
                   commit=tuple((d, n, max(s - dispatch, 0.0)) for d, n, s in calls.commit))
    rest = spec["spec_s"] - spec_seconds(cfg, M.Setting(NO_ROOFLINE, M.FP32, PROMPT_LEN, overhead=loop), spec)
    return calls, replace(loop, round=max(rest / len(spec["rounds"]), 0.0))


NO_ROOFLINE = M.Hardware("overhead only", float("inf"), float("inf"), "")


def spec_seconds(cfg, s, spec):
    """Predicted seconds of a logged speculative run: its rounds' verify passes, commits and fixed round costs, and
    its drafter's measured seconds."""
    rounds = sum(M.verify_seconds(cfg, j, "replay", s) + M.commit_seconds(cfg, j, n, "replay", s)
                 for j, n in spec["rounds"])
    return rounds + len(spec["rounds"]) * s.overhead.round + spec["draft_s"]


def predict(cfg, hw, calls, loop, measured):
    """The measured figures, predicted: decode s and verify/decode per K (timed as calls), and the speculative run's
    speedup over plain decoding (both loops)."""
    s, in_loop = (M.Setting(hw, M.FP32, context=PROMPT_LEN, overhead=o) for o in (calls, loop))
    decode, spec = M.decode_seconds(cfg, s), measured["spec"]
    return {"decode": decode, "verify": {K: M.verify_seconds(cfg, K, "replay", s) / decode for K in VERIFY_KS},
            "spec": M.decode_seconds(cfg, in_loop) * (spec["new_tokens"] - 1) / spec_seconds(cfg, in_loop, spec)}


def measured_figures(m):
    return {"decode": m["decode"], "verify": {K: s / m["decode"] for K, s in m["verify"].items()},
            "spec": m["spec"]["plain_s"] / m["spec"]["spec_s"]}


def measure_all(models, repeats, new_tokens):
    """{engine/model: {micro, calibration, checkpoint}} measured on this CPU, engine by engine."""
    raw = {}
    for name in models:
        for engine in ENGINES:
            log(f"measuring {engine} on {name}: micro twin, machine roofline, checkpoint, micro twin ...")
            raw[f"{engine}/{name}"] = run_child({"kind": "engine", "engine": engine, "model": name,
                                                 "repeats": repeats, "new_tokens": new_tokens})
    return raw


def compare(raw):
    """Measurements -> rows {engine, model, figure, measured, pure, library}: each figure and its predictions."""
    rows = []
    for key, m in raw.items():
        engine, name = key.split("/")
        calls, loop = overheads(m["micro"], R.load_config(micro_twin(name)))
        guesses = {variant: dict(flatten(predict(R.load_config(model_dir(name)),
                                                 machine(LIBRARIES[engine], m["calibration"], variant == "pure"),
                                                 calls, loop, m["checkpoint"])))
                   for variant in ("pure", "library")}
        for figure, value in flatten(measured_figures(m["checkpoint"])):
            rows.append({"engine": engine, "model": name, "figure": figure, "measured": value,
                         **{variant: guess[figure] for variant, guess in guesses.items()}})
            log(f"  {key:<16} {figure:<14} measured {value:10.4g}  predicted {rows[-1]['library']:10.4g} (library), "
                f"{rows[-1]['pure']:10.4g} (pure)")
    return rows


def flatten(figures):
    """{"decode": s, "verify": {K: r}, "spec": x} -> [("decode s", s), ("verify K=1", r), ..., ("spec speedup", x)]"""
    return ([("decode s", figures["decode"])] + [(f"verify K={K}", r) for K, r in figures["verify"].items()]
            + [("spec speedup", figures["spec"])])
