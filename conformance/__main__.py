"""Command line: generate, list, run, sample (see conformance/__init__.py)."""

import argparse
import sys
from pathlib import Path

from conformance.engines import UnknownEngine
from conformance.format import CASES_DIR, GoldenError, case_dirs, read_manifest


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="rebuild the cases from reference.py")
    gen.add_argument("--out", type=Path, default=CASES_DIR, help="folder to write (default: conformance/cases)")
    gen.add_argument("--check", action="store_true", help="write nothing: regenerate into a temporary folder and "
                     "report what differs from --out beyond float32 rounding (exit 1 if anything does)")
    lst = sub.add_parser("list", help="list the cases")
    lst.add_argument("--cases", metavar="REGEX", help="only case names matching this regular expression")
    run = sub.add_parser("run", help="run the cases against an engine")
    run.add_argument("--engine", required=True, help="reference, transformers, or another registered adapter")
    run.add_argument("--cases", metavar="REGEX", help="only case names matching this regular expression")
    run.add_argument("--report", type=Path, metavar="PATH.json", help="write the results as JSON")
    run.add_argument("--dir", type=Path, default=CASES_DIR, help="cases folder (default: conformance/cases)")
    sample = sub.add_parser("sample", help="the statistical pack: the engine draws with its own random numbers, and a "
                            "chi-square test compares the counts with the exact distribution")
    sample.add_argument("--engine", required=True, help="an adapter with the draws / accept:draws features")
    sample.add_argument("--cases", metavar="REGEX", help="only case names matching this regular expression")
    sample.add_argument("--report", type=Path, metavar="PATH.json", help="write the results as JSON")
    sample.add_argument("--dir", type=Path, default=CASES_DIR, help="cases folder (default: conformance/cases)")
    sample.add_argument("--seed", type=int, default=0, help="seeds the engine's draws, one stream per case "
                        "(default 0); each case fails a correct engine with the false-alarm rate its manifest states")
    args = ap.parse_args(argv)
    try:
        if args.command == "generate" and args.check:
            from conformance.generate import check
            stale = check(args.out)
            print("\n".join(stale) if stale else f"{args.out}: fresh (regenerating changes float32 rounding only)")
            return 1 if stale else 0
        elif args.command == "generate":
            from conformance.generate import generate
            generate(args.out)
        elif args.command == "list":
            import re
            for folder in case_dirs():
                if not args.cases or re.search(args.cases, folder.name):
                    meta = read_manifest(folder)
                    print(f"{meta['name']:<52} {meta['kind']:<16} {' '.join(meta['features'])}")
        else:
            from conformance.runner import run as run_cases
            return run_cases(args.engine, args.cases, args.report, args.dir, statistical=args.command == "sample",
                             seed=getattr(args, "seed", 0))[1]
    except (GoldenError, UnknownEngine) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
