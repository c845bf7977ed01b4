"""Command line: list, run, sample, serve, check-server, where, generate, checkpoint, shaped, kernels (see conformance/__init__.py)."""

import argparse
import re
import sys
from pathlib import Path

from . import KIT, published, reference as R, shaped
from .runner import OUT_DIR
from .engines import EngineError, known_engines
from .format import CASES_DIR, HERE, ROOT, SUITE_VERSION, GoldenError, case_dirs, read_manifest



def engine_help():
    return (f"a shipped adapter or one an installed package registers ({', '.join(known_engines())}), "
            "package.module:Class (an Engine subclass), or exec:\"COMMAND ARGS\" (a process speaking the engine "
            "protocol, INTERPRETING.md section 8)")


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
        mode.add_argument("--engine", required=True, help=engine_help())
        mode.add_argument("--cases", type=regex, metavar="REGEX", help="only case names matching this regular "
                          "expression")
        mode.add_argument("--expectations", type=Path, metavar="FILE.json",
                          help="the engine's unsupported features and known failures (INTERPRETING.md section 7; "
                               "default: the engine's own file, for a shipped adapter "
                               "conformance/expectations/<name>.json)")
        mode.add_argument("--report", type=Path, metavar="PATH.json", help="write the results as JSON")
        mode.add_argument("--dir", type=Path, default=CASES_DIR, help="cases folder (default: the suite's cases)")
        mode.add_argument("--out-dir", type=Path, metavar="DIR", help="where outputs of failing cases go "
                          f"(default: ./{OUT_DIR}, under the current directory)")
        mode.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                          help="an exec: engine's limit for answering one request (default 600)")
    run.add_argument("--no-diagnosis", action="store_true", help="do not recompute a failing case under the "
                     "catalogued mistakes to name the one the engine's outputs match (INTERPRETING.md section 9)")
    sample.add_argument("--seed", type=int, default=0, help="seeds the engine's draws, one stream per case "
                        "(default 0); each case fails a correct engine with the false-alarm rate its manifest states")
    serve = sub.add_parser("serve", help="serve a Python adapter over the engine protocol on stdin/stdout")
    serve.add_argument("--engine", required=True, help="a shipped or registered adapter, or package.module:Class")
    serve.add_argument("--tensors", choices=("inline", "files"), default="inline",
                       help="how tensors travel: base64 in the JSON lines, or safetensors files")
    serve.add_argument("--batched-traces", action="store_true",
                       help="take whole serving traces in one request (run_trace) instead of step by step")
    check = sub.add_parser("check-server", help="send scenario requests to a running server and hold every returned "
                           "token to the spec (INTERPRETING.md, \"Checking a running server\")")
    check.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    check.add_argument("--model", required=True, type=Path, metavar="DIR", help="the checkpoint the server loaded")
    check.add_argument("--scenarios", type=regex, metavar="REGEX", help="only scenario names matching this")
    check.add_argument("--concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    check.add_argument("--report", type=Path, metavar="PATH.json", help="write the results as JSON")
    check.add_argument("--dialect", default="jax_impl", help="the server's API: jax_impl, vllm, vllm-logprobs, "
                       "sglang, llama-server, llama-server-logprobs, mlx-lm, text (server_dialects.py; default "
                       "jax_impl)")
    check.add_argument("--precision", default="float32", help="the server's: float32 or bfloat16 (the near-tie "
                       "margin, tolerances.json \"server\")")
    check.add_argument("--draft", help="jax_impl dialect: every request's drafter (none, ngram, mtp; default: each "
                       "scenario request's own)")
    check.add_argument("--tree", metavar="N[:D[:B]]", help="jax_impl dialect: a draft tree budget for every request "
                       "that drafts with ngram or mtp (its server verifies trees; an unpinned one)")
    check.add_argument("--served-model-name", help="the \"model\" field sent (default: the checkpoint folder's name)")
    check.add_argument("--context", type=int, help="the server's context limit, where it is below the checkpoint's "
                       "max_position_embeddings (\"context\" scenario lengths fill it)")
    check.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per request (default 600)")
    sub.add_parser("where", help="where the kit is: its package, cases, expectations, examples, and its version")
    gen = sub.add_parser("generate", help="rebuild the cases from reference.py (in a clone of the repository)")
    gen.add_argument("--out", type=Path, default=CASES_DIR, help="folder to write (default: conformance/cases)")
    gen.add_argument("--check", action="store_true", help="write nothing: regenerate into a temporary folder and "
                     "report what differs from --out beyond float32 rounding (exit 1 if anything does)")
    ckpt = sub.add_parser("checkpoint", help="write a random checkpoint with a published model's exact layer "
                          "geometry at reduced depth (conformance/published.py)")
    published.add_arguments(ckpt)
    shaped_parser = sub.add_parser("shaped", help="model-level goldens on a production-shaped checkpoint, generated "
                                   "here from a recipe and checked against stored digests (conformance/shaped.py)")
    shaped.add_arguments(shaped_parser)
    kern = sub.add_parser("kernels", help="the kernel pack: op-level cases at the published layer geometry against "
                          "an engine's kernel ops (conformance/kernels.py)")
    kern.add_argument("--engine", required=True, help="numpy, numpy:HVK, jax, transformers, or package.module:Class "
                      "(a conformance.kernels.KernelEngine subclass)")
    kern.add_argument("--cases", type=regex, metavar="REGEX", help="only case names matching this regular expression")
    kern.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="input dtype (states fp32)")
    args = ap.parse_args(argv)
    if getattr(args, "timeout", None) is not None and not args.timeout > 0:
        ap.error(f"--timeout {args.timeout}: must be > 0")
    return args


def make_cases(args):  # the `generate` command: the goldens
    try:
        from .make import build
    except ModuleNotFoundError as e:   # conformance/make/, the generator, is a tool of a clone: not in the kit
        if e.name == f"{__package__}.make":
            raise R.UserError("generate rebuilds the goldens of a clone of the repository (conformance/make/ is not "
                              "part of the installed kit): run `python -m conformance generate` in a clone") from None
        raise
    if not args.check:
        build.build_cases(args.out)
        return 0
    stale = build.check(args.out)
    print("\n".join(stale) if stale else f"{args.out}: fresh (regenerating changes float32 rounding only)")
    return 1 if stale else 0


def kit_version():
    """The installed distribution's version, or None in a clone run without an install."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("qwen35-reference")
    except PackageNotFoundError:
        return None


def where():
    """The kit's paths and version, for a reader of an installed kit (the files live in site-packages)."""
    version = kit_version()
    rows = [("version", f"{version or '(not installed)'}, suite version {SUITE_VERSION}"),
            ("layout", "installed kit (qwen35.conformance)" if KIT else "clone of the repository (conformance/)"),
            ("package", HERE), ("cases", CASES_DIR), ("expectations", HERE / "expectations"),
            ("examples", HERE / "examples"), ("interpreting", HERE / "INTERPRETING.md"),
            ("checkpoints", ROOT / "weights"), ("failing outputs", f"{OUT_DIR.resolve()} (by default: ./{OUT_DIR})")]
    for name, value in rows:
        print(f"{name + ':':<17}{value}")


def list_cases(pattern):
    """A row per case, then the one count of them (runner.counted): the cases `run` runs and the statistical pack."""
    from .runner import counted, select_cases
    for folder in case_dirs():
        if not pattern or re.search(pattern, folder.name):
            meta = read_manifest(folder)
            print(f"{meta['name']:<52} {meta['kind']:<16} {' '.join(meta['features'])}")
    print(f"{counted(select_cases(CASES_DIR, pattern))} for `run`, and {counted(select_cases(CASES_DIR, pattern, True))}"
          " in the statistical pack for `sample`")


def main(argv=None):
    from .runner import ExpectationsError, run
    try:
        args = parse_args(argv)
        if args.command == "generate":
            return make_cases(args)
        if args.command == "checkpoint":
            return published.checkpoint_command(args)
        if args.command == "shaped":
            return shaped.shaped_command(args)
        if args.command == "kernels":
            from .kernels import SHIPPED_ENGINES, kernel_engine, run_pack, weigh
            engine = kernel_engine(args.engine)
            results = run_pack(engine, args.cases, args.dtype)
            counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
            weighed = weigh(engine.name if args.engine in SHIPPED_ENGINES else None, results, args.dtype)
            known = [r for r, want in weighed if r.status == want == "FAIL"]
            surprises = [(r, want) for r, want in weighed if r.status != want and "SKIP" not in (r.status, want)]
            for r, want in surprises:
                print(f"{r.case}: {r.status}, but expectations/kernels.json records {want}")
            print(", ".join(f"{n} {s}" for s, n in counts.items())
                  + (f" ({len(known)} failures as recorded in expectations/kernels.json)" if known else ""))
            return 1 if surprises else 0
        if args.command == "check-server":
            from .check_server import ServerError, check_server
            try:
                return check_server(args.url, args.model, args.scenarios, args.concurrency, args.report,
                                    args.dialect, args.precision, args.draft, args.served_model_name, args.timeout,
                                    context=args.context, tree=args.tree)[1]
            except ServerError as e:
                raise R.UserError(str(e)) from None
        if args.command == "list":
            list_cases(args.cases)
        elif args.command == "where":
            where()
        elif args.command == "serve":
            from .adapter_server import serve
            return serve(args.engine, args.tensors, args.batched_traces)
        else:
            return run(args.engine, args.cases, args.report, args.dir, args.expectations,
                       out_dir=args.out_dir or OUT_DIR, timeout=args.timeout, statistical=args.command == "sample",
                       seed=getattr(args, "seed", 0), diagnose=not getattr(args, "no_diagnosis", False))[1]
    except (R.UserError, GoldenError, EngineError, ExpectationsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
