"""python -m jax_impl: reference.py's command line on the JAX engine (reference.main with a jax Backend: the same
flags, JSON, summary and one-line errors), plus
    --dtype {float32,bfloat16}   weights and activations (the DeltaNet state stays fp32)
    --devices N                  tensor-parallel over N devices (a "tp" mesh)
    --matvec {auto,xla}          decode's and verify's products on a CPU: the threaded kernel (matvec.py) or XLA's dot
    --coordinator HOST:PORT --num-processes N --process-id I   join a multi-host run (jax.distributed)
The whole generate loop runs on device, so text comes out at the end, not streamed. --draft takes none, ngram, mtp,
partial-mlp:F[:LAYERS], mtp-shortlist:PATH, dflash:DIR or dflash-sampled:DIR (skip:N, model:DIR and the other
self-speculative drafters are reference.py only: exit 2); --tree NODES[:DEPTH[:BRANCH]] with --draft ngram (the
context's continuations as a trie; no --ngram-table) or --draft mtp (the MTP head's top-k). Compile time is reported
apart from run time.
"""

import contextlib
import os
import sys

from . import reference

try:                # JAX is the `jax` extra: without it main() says so in one line
    import jax
    import numpy as np

    from . import matvec
    from .model import empty_state, prefill
    from .sharding import initialize_distributed, make_mesh
    from .spec_decode import ENGINE_DRAFTERS, TREE_DRAFTERS, generate
    from .weights import DTYPES, load
except ModuleNotFoundError as e:
    missing_jax = reference.missing_extra(e, "jax", "python -m jax_impl")
else:
    missing_jax = None


def add_flags(parser):
    ours = parser.add_argument_group("jax_impl")
    ours.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations")
    ours.add_argument("--devices", type=int, default=1, help="tensor-parallel devices (1: no mesh)")
    ours.add_argument("--matvec", choices=matvec.MODES, default=matvec.mode,
                      help="decode's and verify's products on a CPU: auto (the threaded kernel) or xla (XLA's dot)")
    ours.add_argument("--coordinator", help="multi-host: address of process 0, HOST:PORT")
    ours.add_argument("--num-processes", type=int)
    ours.add_argument("--process-id", type=int)
    reference.add_tree_flag(ours)


def load_on_devices(args):
    if args.coordinator:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    matvec.set_mode(args.matvec)
    args.mesh = make_mesh(args.devices) if args.devices != 1 else None
    return load(args.model, args.dtype, args.mesh)


def prompt_logits(params, cfg, prompt):
    return prefill(params, cfg, np.asarray(prompt, np.int32), empty_state(cfg, len(prompt), params["norm"].dtype))[0]


def generate_on_device(params, cfg, prompt, args, on_tokens):
    """jax_impl.generate; its tokens reach on_tokens at the end (the loop runs on device)."""
    table = reference.read_ngram_table(args.ngram_table, cfg.vocab_size) if args.ngram_table else None
    sampling = reference.Sampling(args.temperature, args.top_k, args.top_p)
    tree = reference.parse_tree_budget(args.tree) if args.tree else None
    if tree is not None and (args.draft not in TREE_DRAFTERS or table):
        raise reference.UserError("--tree drafts with the context n-gram lookup or the MTP head's top-k in jax_impl: "
                                  "give it with --draft ngram (no table) or --draft mtp")
    tokens, stats = generate(params, cfg, prompt, args.max_new_tokens, sampling, args.seed, args.draft,
                             args.draft_len, args.rollback, args.mesh, table, tree)
    on_tokens(tokens)
    return tokens, stats


def summary(stats):
    s, n = stats["seconds"], stats["new_tokens"]
    line = (f"{n} tokens in {s['total']:.3f} s ({n / s['total'] if s['total'] else 0:.1f} tok/s; prefill "
            f"{s['prefill']:.3f} s, decode {s['decode']:.3f} s); compile {s['compile']:.1f} s; target calls "
            f"{stats['target_calls']}, {stats['tokens_per_call']:.2f} tokens/call")
    if "proposed" in stats:
        line += (f"; accepted {stats['accepted']}/{stats['proposed']} drafts, by position "
                 f"{stats['accepted_by_position']}/{stats['proposed_by_position']} ({stats['rollback']})")
    return line


@contextlib.contextmanager
def native_stdout_to_stderr(args):
    """On a multi-process run gloo (XLA:CPU's cross-process collectives) prints "[Gloo] Rank 0 is connected to ..."
    on the C++ stdout whenever it connects devices, which would break --json: meanwhile fd 1 goes to stderr and
    Python's sys.stdout, ours, to the real stdout."""
    if not args.coordinator:
        yield
        return
    ours = sys.stdout
    ours.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(real, "w", encoding=ours.encoding, errors=ours.errors, closefd=False)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = ours
        os.dup2(real, 1)
        os.close(real)


JAX = reference.Backend(
    "python -m jax_impl", "The Qwen3.5 hybrid model and exact speculative decoding on JAX, on device.",
    "none, ngram, mtp, partial-mlp:F[:LAYERS], mtp-shortlist:PATH, dflash:DIR or dflash-sampled:DIR (skip:N, "
    "model:DIR and the other self-speculative drafters are reference.py's only)", add_flags,
    native_stdout_to_stderr, load_on_devices, prompt_logits, generate_on_device, summary,
    main_process=lambda: jax.process_index() == 0, engine_drafters=None if missing_jax else ENGINE_DRAFTERS)


def main(argv=None):
    if missing_jax:
        print(f"error: {missing_jax}", file=sys.stderr)
        return 2
    return reference.main(argv, JAX)


if __name__ == "__main__":
    sys.exit(main())
