"""Command line: generate, list, run (see conformance/__init__.py)."""

import argparse
import sys
from pathlib import Path

from .engines import UnknownEngine
from .format import CASES_DIR, GoldenError, case_dirs, read_manifest


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
    args = ap.parse_args(argv)
    try:
        if args.command == "generate" and args.check:
            from .generate import check
            stale = check(args.out)
            print("\n".join(stale) if stale else f"{args.out}: fresh (regenerating changes float32 rounding only)")
            return 1 if stale else 0
        elif args.command == "generate":
            from .generate import generate
            generate(args.out)
        elif args.command == "list":
            import re
            for folder in case_dirs():
                if not args.cases or re.search(args.cases, folder.name):
                    meta = read_manifest(folder)
                    print(f"{meta['name']:<52} {meta['kind']:<16} {' '.join(meta['features'])}")
        else:
            from .runner import run as run_cases
            return run_cases(args.engine, args.cases, args.report, args.dir)[1]
    except (GoldenError, UnknownEngine) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
