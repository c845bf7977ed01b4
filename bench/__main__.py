"""python -m bench: the hybrid verification cost model's command line.

    python -m bench report --out DIR [--measure [--models default 30m 0.8b] [--repeats 3] | --measured FILE]
    python -m bench predict 9B [--hardware M4-Max|this-CPU] [--acceptance 0.8] [--drafter mtp] [--context 8192]
"""

import argparse
import json
import shlex
import sys
from pathlib import Path

from bench import costmodel as M

HARDWARE = {hw.name.replace(" ", "-"): hw for hw in M.DATASHEET}
THIS_CPU = "this-CPU"
PRECISIONS = {p.name: p for p in (M.BF16, M.Q4, M.FP32)}


def report(args):
    from bench import report as report_module
    measured = None
    if args.measure or args.measured:
        from bench import measure
        if args.measured:   # predictions again from saved measurements
            saved = json.loads(args.measured.read_text())
            raw, command = measure.keyed(saved["raw"]), saved["command"]
        else:
            raw = measure.measure_all(args.models, args.repeats, args.new_tokens)
            command = "python -m bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        measured = (measure.compare(raw), raw, command)
    print(f"wrote {report_module.write(args.out, measured)}")


def hardware(name, recalibrate):
    """A datasheet roofline, or this CPU's as numpy multiplies (measured once, cached)."""
    if name != THIS_CPU:
        return HARDWARE[name]
    from bench import measure
    return measure.machine("numpy", measure.calibration("numpy", fresh=recalibrate), pure=False)


def predict(args):
    cfg = M.published_config(args.model)
    hw = hardware(args.hardware, args.recalibrate)
    s = M.Setting(hw, PRECISIONS[args.precision], args.context, args.batch, args.drafter)
    print(f"Qwen3.5-{args.model} on {args.hardware}, {args.precision}, context {args.context}, batch {args.batch}, "
          f"{args.drafter} drafter, a = {args.acceptance}: decode {1 / M.decode_seconds(cfg, s):.0f} tok/s "
          f"(roofline bound)")
    for design in M.DESIGNS:
        K, x = M.best_k(cfg, args.acceptance, design, s)
        held = sum(M.rollback_memory(cfg, K, design, s.p, s.batch).values())
        ratio = M.verify_seconds(cfg, K, design, s) / M.decode_seconds(cfg, s)
        print(f"  {design:<13} best K {K:2d}: {x:5.2f}x, verify/decode {ratio:5.2f}, rollback memory "
              f"{held / 2**20:8.1f} MiB")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench", description="The hybrid verification cost model.")
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="write report.md and PNG plots to a folder")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--measure", action="store_true", help="also measure this CPU and compare (minutes)")
    r.add_argument("--models", nargs="+", default=["default", "30m"], choices=["default", "30m", "0.8b"],
                   help="checkpoints to measure (0.8b: a 3 GB fp32 checkpoint, a few minutes more)")
    r.add_argument("--repeats", type=int, default=3, help="runs per figure (the median is kept)")
    r.add_argument("--new-tokens", type=int, default=32, help="tokens per speculative run")
    r.add_argument("--measured", type=Path, metavar="measured.json",
                   help="instead of --measure: compare the measurements a previous --measure saved")
    r.set_defaults(run=report)
    p = sub.add_parser("predict", help="best K and speedup per rollback design for one published model")
    p.add_argument("model", choices=list(M.PUBLISHED))
    p.add_argument("--hardware", choices=[*HARDWARE, THIS_CPU], default="H200")
    p.add_argument("--recalibrate", action="store_true", help="with this-CPU: measure its roofline again")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    p.add_argument("--acceptance", type=float, default=0.8)
    p.add_argument("--drafter", choices=["free", "mtp"], default="free")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.set_defaults(run=predict)
    args = ap.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
