"""Where a jax_impl decode step's time goes: the CPU matvec kernel against the rest of XLA's ops, from a JAX profiler
trace of greedy decode steps run on device (embedded default model and the ~30M random checkpoint):

    python -m bench.jax_profile [--models default 30m] [--steps 50] [--top 12] [--matvec auto|xla]

Per model: the step's wall time (untraced, best of 3), then from two traced runs the kernel's calls, time and the
bandwidth it streams the weights at, the other XLA ops (count, time, the most expensive kinds), and the time no op
accounts for (the executor between ops). Tracing slows a step (by up to a quarter on 30M, up to two thirds on the
small default model, whose step is mostly small ops), so read the traced figures as shares, not as times.
"""

import argparse
import collections
import gzip
import json
import re
import tempfile
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

import jax_impl
from jax_impl import matvec
from bench.checkpoints import copy_prompt, model_dir
from bench.jax_speed import device_loop, wall_seconds, weight_bytes_per_token
from jax_impl.model import forward_hidden, lm_head

KERNEL = "ffi_call"                                  # XLA's name for the matvec kernel's custom calls
# Events that are not ops: Python frames ("$..."), the executor and the while loop around the ops, JAX's dispatch
RUNTIME = ("$", "Thunk", "while", "PjitFunction", "end:", "CommonPjRt", "ParseArguments", "Handle inputs")


def greedy_step(cfg):
    """One decode step fed the previous step's argmax, for device_loop: (i, (token, state), params) -> carry."""
    def step(i, carry, params):
        token, state = carry
        hidden, state, _ = forward_hidden(params, cfg, token, state)
        return jnp.argmax(lm_head(params, hidden), -1).astype(jnp.int32), state
    return step


def op_times(trace_dir):
    """(microseconds, count) per op kind ("fusion.3" and "fusion.7" are one kind) in the trace under trace_dir."""
    files = sorted(Path(trace_dir).glob("**/*.trace.json.gz"))
    if not files:
        raise SystemExit(f"jax_profile: no *.trace.json.gz under {trace_dir}: this jax's profiler wrote no trace")
    events = json.load(gzip.open(files[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    micros, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(RUNTIME):
            kind = re.sub(r"\.\d+$", "", e["name"])
            micros[kind] += e.get("dur", 0)
            counts[kind] += 1
    return micros, counts


class Breakdown(NamedTuple):
    """One decode step, in ms: untraced wall time, traced wall time, and the traced time by op kind."""
    untraced_ms: float
    traced_ms: float
    kernel_calls: float
    kernel_ms: float
    other_ops: float                # XLA ops that are not the kernel, a step
    ms_by_kind: dict                # kind -> ms a step, the kernel left out
    count_by_kind: dict             # kind -> ops a step

    @property
    def other_ms(self):
        return sum(self.ms_by_kind.values())


def breakdown(cfg, params, steps):
    """Time `steps` greedy decode steps after a 64-token prompt untraced (best of 3), then trace two more runs."""
    state = jax_impl.empty_state(cfg, 64 + steps + 1)
    _, _, state, _ = jax_impl.prefill(params, cfg, jnp.asarray(copy_prompt(64, cfg.vocab_size)), state)
    loop = device_loop(greedy_step(cfg), steps)
    run = lambda: jax.block_until_ready(loop((jnp.zeros(1, jnp.int32), state), params))  # noqa: E731
    run()
    run_ms = lambda: wall_seconds(run) / steps * 1e3  # noqa: E731
    untraced = min(run_ms() for _ in range(3))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        traced = [run_ms() for _ in range(2)]        # two runs, so one-off tracer costs spread thin
        jax.profiler.stop_trace()
        micros, counts = op_times(trace_dir)
    n = steps * len(traced)
    ms_by_kind = {kind: us / n / 1e3 for kind, us in micros.items()}
    count_by_kind = {kind: c / n for kind, c in counts.items()}
    kernel_ms, kernel_calls = ms_by_kind.pop(KERNEL, 0.0), count_by_kind.pop(KERNEL, 0.0)
    return Breakdown(untraced, sum(traced) / len(traced), kernel_calls, kernel_ms, sum(count_by_kind.values()),
                     ms_by_kind, count_by_kind)


def report(name, b, weight_bytes, steps, top):
    share = lambda ms: f"{ms:.3f} ms ({ms / b.traced_ms:4.0%})"  # noqa: E731
    bandwidth = f"{weight_bytes / b.kernel_ms / 1e6:.1f} GB/s" if b.kernel_ms else "(XLA's dot reads them)"
    print(f"\n#### {name}: decode step {b.untraced_ms:.3f} ms untraced (best of 3 runs of {steps} steps), "
          f"{b.traced_ms:.3f} ms traced")
    print(f"  matvec kernel: {b.kernel_calls:5.1f} calls, {share(b.kernel_ms)}; "
          f"{weight_bytes / 2**20:.0f} MiB of weights at {bandwidth}")
    print(f"  other XLA ops: {b.other_ops:5.1f} ops,   {share(b.other_ms)}")
    print(f"  between ops:                {share(b.traced_ms - b.kernel_ms - b.other_ms)}")
    for kind, ms in sorted(b.ms_by_kind.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {ms * 1e3:7.1f} us  x{b.count_by_kind[kind]:5.1f}  {kind}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "30m"])
    ap.add_argument("--steps", type=int, default=50, help="decode steps per run")
    ap.add_argument("--top", type=int, default=12, help="op kinds listed per model")
    ap.add_argument("--matvec", choices=matvec.MODES, default=matvec.mode, help="as python -m jax_impl --matvec")
    args = ap.parse_args()
    matvec.set_mode(args.matvec)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, fp32, batch 1, greedy, 64-token prompt")
    for name in args.models:
        cfg, params = jax_impl.load(model_dir(name))
        report(name, breakdown(cfg, params, args.steps), weight_bytes_per_token(cfg, "float32"), args.steps, args.top)


if __name__ == "__main__":
    main()
