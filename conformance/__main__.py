"""Command line: list, run, sample, serve, generate, checkpoint (see conformance/__init__.py)."""

import argparse
import re
import sys
from pathlib import Path

from . import KIT, published, reference as R
from .engines import EngineError
from .format import CASES_DIR, GoldenError, case_dirs, read_manifest

ENGINE_HELP = ("a shipped adapter (reference, jax, jax_bf16, transformers, llama_cpp, mlx), one an installed package "
               "registers, package.module:Class (an Engine subclass), or exec:\"COMMAND ARGS\" (a process speaking "
               "the engine protocol, INTERPRETING.md section 8)")


def regex(text):
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression ({e})") from None
    return text


def parse_args(argv):
    ap = R.OneLineParser(prog="qwen35-conformance" if KIT else "python -m conformance", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    lst = sub.add_parser("list", help="list the cases")
    lst.add_argument("--cases", type=regex, metavar="REGEX", help="only case names matching this regular expression")
    run = sub.add_parser("run", help="run the cases against an engine")
    sample = sub.add_parser("sample", help="the statistical pack: the engine draws with its own random numbers, and "
                            "a chi-square test compares the counts with the exact distribution")
    for mode in (run, sample):
        mode.add_argument("--engine", required=True, help=ENGINE_HELP)
        mode.add_argument("--cases", type=regex, metavar="REGEX", help="only case names matching this regular "
                          "expression")
        mode.add_argument("--expectations", type=Path, metavar="FILE.json",
                          help="the engine's unsupported features and known failures (INTERPRETING.md section 7; "
                               "default: the engine's own file, for a shipped adapter "
                               "conformance/expectations/<name>.json)")
        mode.add_argument("--report", type=Path, metavar="PATH.json", help="write the results as JSON")
        mode.add_argument("--dir", type=Path, default=CASES_DIR, help="cases folder (default: the suite's cases)")
        mode.add_argument("--out-dir", type=Path, metavar="DIR", help="where outputs of failing cases go "
                          "(default: conformance/_out beside the suite)")
        mode.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                          help="an exec: engine's limit for answering one request (default 600)")
    sample.add_argument("--seed", type=int, default=0, help="seeds the engine's draws, one stream per case "
                        "(default 0); each case fails a correct engine with the false-alarm rate its manifest states")
    serve = sub.add_parser("serve", help="serve a Python adapter over the engine protocol on stdin/stdout")
    serve.add_argument("--engine", required=True, help="a shipped or registered adapter, or package.module:Class")
    serve.add_argument("--tensors", choices=("inline", "files"), default="inline",
                       help="how tensors travel: base64 in the JSON lines, or safetensors files")
    serve.add_argument("--batched-traces", action="store_true",
                       help="take whole serving traces in one request (run_trace) instead of step by step")
    gen = sub.add_parser("generate", help="rebuild the cases from reference.py (in a clone of the repository)")
    gen.add_argument("--out", type=Path, default=CASES_DIR, help="folder to write (default: conformance/cases)")
    gen.add_argument("--check", action="store_true", help="write nothing: regenerate into a temporary folder and "
                     "report what differs from --out beyond float32 rounding (exit 1 if anything does)")
    ckpt = sub.add_parser("checkpoint", help="write a random checkpoint with a published model's exact layer "
                          "geometry at reduced depth (conformance/published.py)")
    published.add_arguments(ckpt)
    args = ap.parse_args(argv)
    if getattr(args, "timeout", None) is not None and not args.timeout > 0:
        ap.error(f"--timeout {args.timeout}: must be > 0")
    return args


def generate(args):
    try:
        from .make import generate as generator
    except ModuleNotFoundError as e:   # conformance/make/, the generator, is a tool of a clone: not in the kit
        if e.name == f"{__package__}.make":
            raise R.UserError("generate rebuilds the goldens of a clone of the repository (conformance/make/ is not "
                              "part of the installed kit): run `python -m conformance generate` in a clone") from None
        raise
    if not args.check:
        generator.generate(args.out)
        return 0
    stale = generator.check(args.out)
    print("\n".join(stale) if stale else f"{args.out}: fresh (regenerating changes float32 rounding only)")
    return 1 if stale else 0


def main(argv=None):
    from .runner import ExpectationsError, OUT_DIR, run
    try:
        args = parse_args(argv)
        if args.command == "generate":
            return generate(args)
        if args.command == "checkpoint":
            return published.checkpoint_command(args)
        if args.command == "list":
            for folder in case_dirs():
                if not args.cases or re.search(args.cases, folder.name):
                    meta = read_manifest(folder)
                    print(f"{meta['name']:<52} {meta['kind']:<16} {' '.join(meta['features'])}")
        elif args.command == "serve":
            from .adapter_server import serve
            return serve(args.engine, args.tensors, args.batched_traces)
        else:
            return run(args.engine, args.cases, args.report, args.dir, args.expectations,
                       out_dir=args.out_dir or OUT_DIR, timeout=args.timeout, statistical=args.command == "sample",
                       seed=getattr(args, "seed", 0))[1]
    except (R.UserError, GoldenError, EngineError, ExpectationsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
