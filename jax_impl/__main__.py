"""python -m jax_impl: reference.py's command line (same flags, same JSON) on the JAX engine, plus
    --dtype {float32,bfloat16}   weights and activations (the DeltaNet state stays fp32)
    --devices N                  tensor-parallel over N devices (a "tp" mesh)
    --matvec {auto,xla}          decode's and verify's products on a CPU: the threaded kernel (matvec.py) or XLA's dot
    --coordinator HOST:PORT --num-processes N --process-id I   join a multi-host run (jax.distributed)
The whole generate loop runs on device, so text comes out at the end, not streamed. --draft takes none, ngram or
mtp (skip:N and model:DIR are reference.py only: exit 2). Compile time is reported apart from run time.
"""

import contextlib
import json
import os
import sys

from . import reference

try:                # JAX is the `jax` extra: without it main() says so in one line
    import jax
    import numpy as np

    from . import matvec
    from .model import empty_state, prefill
    from .sharding import initialize_distributed, make_mesh
    from .spec_decode import generate
    from .weights import DTYPES, load
except ModuleNotFoundError as e:
    missing_jax = reference.missing_extra(e, "jax", "python -m jax_impl")
else:
    missing_jax = None


def parse_args(argv):
    ours = reference.OneLineParser(prog="python -m jax_impl", add_help=False,
                                   description="JAX engine flags; every reference.py flag is accepted too.")
    ours.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations")
    ours.add_argument("--devices", type=int, default=1, help="tensor-parallel devices (1: no mesh)")
    ours.add_argument("--matvec", choices=matvec.MODES, default=matvec.mode,
                      help="decode's and verify's products on a CPU: auto (the threaded kernel) or xla (XLA's dot)")
    ours.add_argument("--coordinator", help="multi-host: address of process 0, HOST:PORT")
    ours.add_argument("--num-processes", type=int)
    ours.add_argument("--process-id", type=int)
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        ours.print_help()
        print()
    args, rest = ours.parse_known_args(argv)
    return {**vars(reference.parse_args(rest)), **vars(args)}


def summary(stats):
    s, n = stats["seconds"], stats["new_tokens"]
    line = (f"{n} tokens in {s['total']:.3f} s ({n / s['total'] if s['total'] else 0:.1f} tok/s; prefill "
            f"{s['prefill']:.3f} s, decode {s['decode']:.3f} s); compile {s['compile']:.1f} s; target calls "
            f"{stats['target_calls']}, {stats['tokens_per_call']:.2f} tokens/call")
    if "proposed" in stats:
        line += (f"; accepted {stats['accepted']}/{stats['proposed']} drafts, by position "
                 f"{stats['accepted_by_position']}/{stats['proposed_by_position']} ({stats['rollback']})")
    return line


def run(args):
    if args["coordinator"]:
        initialize_distributed(args["coordinator"], args["num_processes"], args["process_id"])
    matvec.set_mode(args["matvec"])
    mesh = make_mesh(args["devices"]) if args["devices"] != 1 else None
    cfg, params = load(args["model"], args["dtype"], mesh)
    tokenizer = reference.load_tokenizer(args["model"])
    if args["prompt"] is not None and tokenizer is None:
        raise reference.UserError(f"{args['model']}: no tokenizer.json, use --prompt-ids")
    prompt = reference.parse_ids(args["prompt_ids"]) if args["prompt"] is None else tokenizer.encode(args["prompt"]).ids
    main_process = jax.process_index() == 0
    if args["dump_logits"]:
        reference.check_prompt(cfg, prompt)
        logits = prefill(params, cfg, np.asarray(prompt, np.int32), empty_state(cfg, len(prompt), params["norm"].dtype))[0]
        try:
            if main_process:
                np.save(args["dump_logits"], np.asarray(logits, np.float32))
        except OSError as e:
            raise reference.UserError(f"--dump-logits {args['dump_logits']}: {e}") from None
        return
    table = reference.read_ngram_table(args["ngram_table"], cfg.vocab_size) if args["ngram_table"] else None
    sampling = reference.Sampling(args["temperature"], args["top_k"], args["top_p"])
    tokens, stats = generate(params, cfg, prompt, args["max_new_tokens"], sampling, args["seed"], args["draft"],
                             args["draft_len"], args["rollback"], mesh, table)
    if not main_process:
        return
    if args["json"]:
        text = tokenizer.decode(tokens) if tokenizer else ""
        print(json.dumps({"prompt_ids": prompt, "tokens": tokens, "text": text, "stats": stats}))
    else:
        on_tokens, finish = reference.text_stream(tokenizer, sys.stdout)
        on_tokens(tokens)
        finish()
    print(summary(stats), file=sys.stderr)


@contextlib.contextmanager
def native_stdout_to_stderr(active):
    """On a multi-process run gloo (XLA:CPU's cross-process collectives) prints "[Gloo] Rank 0 is connected to ..."
    on the C++ stdout whenever it connects devices, which would break --json: meanwhile fd 1 goes to stderr and
    Python's sys.stdout, ours, to the real stdout."""
    if not active:
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


def main(argv=None):
    try:
        if missing_jax:
            raise missing_jax
        args = parse_args(argv)
        with native_stdout_to_stderr(args["coordinator"]):
            run(args)
    except reference.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
