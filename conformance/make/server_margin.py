"""The measurement behind tolerances.json "server" (check-server's near-tie margin and logprob tolerance):

    python -m conformance.make.server_margin [--write] [--new N]

For each shipped checkpoint and precision (MEASURED: float32 on tiny-mtp, tiny-odd and default; bfloat16 on the
trained default model, the only one whose bf16 logits a margin can separate: logits.bf16_random) it takes every
distinct greedy request of server_scenarios.json (prompt and max_tokens, capped at `--new` tokens and the context),
continues it greedily with jax_impl in that precision one token at a time (jax_impl.model.decode, as a server
decodes), then holds jax_impl's logits over the whole sequence, read three ways (that token-by-token pass, 16-token
chunks and one padded pass, as a server decodes and prefills), to reference.py's float32 logits at every position:

  * `argmax_deviation`: the largest |engine - spec| at the spec's argmax and at the engine's argmax (the two logits a
    greedy decision compares), over every position;
  * `logit_deviation`, `logprob_deviation`: the largest |engine - spec| over all tokens (logits, log-softmax);
  * `flips`: positions where the engine's argmax is not the spec's, and `flip_gap`: the largest spec top-1 minus the
    spec's logit for the engine's token there (what check-server's greedy rule holds to the margin).

A flip needs a gap of at most the two logits' moves, so at most 2 * argmax_deviation. The declared margin must be at
least SAFETY times the larger of that and the largest flip gap seen (other servers round otherwise: other kernels,
accumulation orders, bf16 outputs), and logprob_atol SAFETY times the log-probability deviation; the figures and
this command go into tolerances.json "server" "measured" (`--write`), and tests/test_server_margin.py holds the
declared values to them. A figure above the declared value raises the value, never the other way round.
"""

import argparse
import json
import math
import time

import jax.numpy as jnp
import numpy as np

from .. import reference as R, sibling
from ..check_server import expand, load_scenarios, log_softmax, Spec
from ..format import HERE

MEASURED = {"bfloat16": ("default",), "float32": ("tiny-mtp", "tiny-odd", "default")}
SAFETY = 2.0
NEW = 1000           # generated tokens per request at most (long-generations' 1,000 where the context allows)
CHUNK = 16           # a server's prefill chunk
BUCKET = 128         # the one padded pass: length rounded up to this (few compilations)
COMMAND = "python -m conformance.make.server_margin --write"
TOLERANCES_PATH = HERE / "tolerances.json"


def greedy_requests(spec, new):
    """Every distinct greedy request of the scenarios -> [(prompt, tokens to generate)]."""
    out, context = {}, spec.cfg.max_position_embeddings
    for scenario in load_scenarios():
        for raw, r in expand(scenario, spec, context, "none"):
            if r.temperature == 0:
                n = max(1, min(r.max_tokens, new, context - len(r.prompt) - 1))
                key = tuple(r.prompt)
                out[key] = max(out.get(key, 0), n)
    return sorted(out.items(), key=lambda item: (len(item[0]), item[0]))


class Engine:
    """jax_impl in one precision: greedy decoding and teacher-forced logits, each of fixed shapes."""

    def __init__(self, params, cfg, dtype, capacity):
        self.model = sibling("jax_impl.model")
        self.params, self.cfg, self.capacity = sibling("jax_impl.weights").to_jax(params, dtype), cfg, capacity
        self.dtype = self.params["norm"].dtype

    def empty(self):
        return self.model.empty_state(self.cfg, self.capacity, self.dtype)

    def decode(self, prompt, new):
        """Greedy continuation, one token per call: (sequence, logits (len(sequence), V) of every decode step)."""
        state, seq, rows = self.empty(), list(prompt), []
        for i in range(len(prompt) + new):
            logits, _, state = self.model.decode(self.params, self.cfg, jnp.asarray(seq[i], jnp.int32), state)
            rows.append(np.asarray(logits, np.float32))
            if i >= len(prompt) - 1 and len(seq) < len(prompt) + new:
                seq.append(int(np.argmax(rows[-1])))
        return seq, np.stack(rows)

    def chunked(self, seq, chunk):
        """Logits over `seq` in `chunk`-token prefill calls (the last padded; padding is not counted)."""
        state, rows = self.empty(), []
        for start in range(0, len(seq), chunk):
            part = seq[start:start + chunk]
            tokens = jnp.asarray(part + [0] * (chunk - len(part)), jnp.int32)
            logits, _, state, _ = self.model.prefill(self.params, self.cfg, tokens, state, jnp.int32(len(part)))
            rows.append(np.asarray(logits, np.float32)[:len(part)])
        return np.concatenate(rows)

    def whole(self, seq):
        return self.chunked(seq, -(-len(seq) // BUCKET) * BUCKET)


def compare(got, want):
    """One read of the engine against the spec over a sequence -> figures (dict)."""
    a, b = want.argmax(-1), got.argmax(-1)
    rows = np.arange(len(want))
    moves = np.maximum(np.abs(got[rows, a] - want[rows, a]), np.abs(got[rows, b] - want[rows, b]))
    flipped = want[rows, a] > want[rows, b]
    gaps = want[rows, a] - want[rows, b]
    lp = max(float(np.abs(log_softmax(g) - log_softmax(w)).max()) for g, w in zip(got, want))
    return {"positions": len(want), "argmax_deviation": float(moves.max()),
            "logit_deviation": float(np.abs(got - want).max()), "logprob_deviation": lp,
            "flips": int(flipped.sum()), "flip_gap": float(gaps[flipped].max()) if flipped.any() else 0.0}


def up(x, digits=4):
    """x rounded up to `digits` significant figures: a recorded figure is never below the measured one."""
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - digits + 1
    return round(math.ceil(round(x / 10.0**e, 6)) * 10.0**e, max(0, -e))


def merge(total, part):
    if not total:
        return dict(part)
    return {k: total[k] + part[k] if k in ("positions", "flips") else max(total[k], part[k]) for k in total}


def measure(name, dtype, new=NEW, log=print):
    """One checkpoint at one precision -> its figures over every greedy request."""
    spec = Spec(R.DEFAULT_MODEL.parent / name)
    requests = greedy_requests(spec, new)
    longest = max(len(p) + n for p, n in requests)
    engine = Engine(spec.params, spec.cfg, dtype, -(-longest // BUCKET) * BUCKET + CHUNK)
    total, start = {}, time.monotonic()
    for prompt, n in requests:
        seq, decoded = engine.decode(prompt, n)
        want = spec.logits(seq)
        for got in (decoded, engine.chunked(seq, CHUNK), engine.whole(seq)):
            total = merge(total, compare(got, want))
    figures = {"requests": len(requests), "tokens": sum(len(p) + n for p, n in requests), **total}
    figures = {k: up(v) if isinstance(v, float) else v for k, v in figures.items()}
    log(f"{name:<9} {dtype:<9} {json.dumps(figures)} ({time.monotonic() - start:.0f} s)")
    return figures


def required(figures):
    """The least margin and logprob tolerance the figures allow: SAFETY x (the larger of twice the argmax deviation
    and the largest flip gap), SAFETY x the log-probability deviation; each the worst over the checkpoints."""
    return (SAFETY * max(max(2 * f["argmax_deviation"], f["flip_gap"]) for f in figures.values()),
            SAFETY * max(f["logprob_deviation"] for f in figures.values()))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m conformance.make.server_margin")
    ap.add_argument("--write", action="store_true", help='record the figures in tolerances.json "server" "measured"')
    ap.add_argument("--new", type=int, default=NEW, help="generated tokens per request at most")
    args = ap.parse_args(argv)
    measured = {dtype: {name: measure(name, dtype, args.new) for name in names} for dtype, names in MEASURED.items()}
    tolerances = json.loads(TOLERANCES_PATH.read_text())
    for dtype, figures in measured.items():
        margin, atol = required(figures)
        print(f"{dtype}: margin needs >= {margin:.4g} (declared {tolerances['server']['greedy_margin'][dtype]}), "
              f"logprob_atol >= {atol:.4g} (declared {tolerances['server']['logprob_atol'][dtype]})")
    if args.write:
        tolerances["server"]["measured"] = {"command": COMMAND + ("" if args.new == NEW else f" --new {args.new}"),
                                            "date": time.strftime("%Y-%m-%d", time.gmtime()), "safety": SAFETY,
                                            "figures": measured}
        TOLERANCES_PATH.write_text(json.dumps(tolerances, indent=1) + "\n")


if __name__ == "__main__":
    main()
